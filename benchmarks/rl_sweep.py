"""Policy sweeps of an RL island against the real syncer, next to raw loopback TCP moving the same bytes.

    python -m benchmarks.rl_sweep [--mib 128] [--fragments 4] [--iterations 6] [--streams 2]

An RL island sweeps at the end of each iteration: every fragment's delta pushed at once, before the
rollout may get weights (DESIGN §3.4). What it waits there is the boundary stall. Each arm starts the
real `python -m syncer` (`--learners 1 --quorum 1 --pipeline P --sync-interval-steps 0`, no checkpoint
between rounds) and one in-process `LearnerSession` over a synthetic f32 model of `--mib` MiB in P
equal fragments; an iteration adds a small update to every weight ("training") and calls `sweep()`:

* **sweep** (`rl_mode=sweep`): every fragment pushed, one streaming at a time while the syncer merges
  the ones before it (all P rounds in flight), and every merge installed before `sweep()` returns;
* **overlap** (`rl_mode=overlap`): `sweep()` returns once every delta is computed and queued on the
  link, which streams them while the next iteration trains; the merges are rebased in at the next
  sweep;
* **raw**: the same push bytes (the whole model) over raw loopback TCP, on the same number of
  streams, in the same run (`benchmarks.loopback.RawLoopback`), right before each arm.

Printed per arm: the median stall of `sweep()` over the iterations after the first, and the rate
of its push bytes. The ratio of an arm is raw time / stall for the same bytes: 1 means the sweep
costs the island what pushing its model over a bare socket costs. The last line is
`ratio sweep/raw_loopback = X` (goal ≥ 0.7). Only ratios from one run mean much: the absolute
figures move with the machine and with whatever else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.loopback import RawLoopback
from benchmarks.procs import stop
from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$")
TOKENS = 4096  # per optimizer step; one step per iteration


@dataclass
class Arm:
    name: str
    stalls: list[float]
    raw_s: float
    nbytes: int
    merge_ms: float  # the syncer's median merge of one fragment (the tape's commit records)

    @property
    def stall(self) -> float:
        return statistics.median(self.stalls[1:] or self.stalls)  # the first sweep also warms the pipeline

    @property
    def ratio(self) -> float:
        return self.raw_s / self.stall


def start_syncer(workdir: Path, key_file: Path, fragments: int, tag: str) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", "0", "--learners", "1",
            "--quorum", "1", "--fragments", str(fragments), "--pipeline", str(fragments),
            "--sync-interval-steps", "0", "--device", "cpu", "--key-file", str(key_file),
            "--checkpoint", str(workdir / f"{tag}.safetensors"), "--checkpoint-every", "1000000",
            "--tape", str(workdir / f"tape-{tag}.jsonl"), "--log-level", "WARNING"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update({"PYTHONUNBUFFERED": "1"})
    out_path = workdir / f"syncer-{tag}.out"
    with out_path.open("wb") as out, (workdir / f"syncer-{tag}.err").open("wb") as err:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = LISTENING.search(out_path.read_text(errors="replace"))
        if m:
            return proc, f"{m.group(1)}:{m.group(2)}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop(proc)
    raise SystemExit(f"the syncer did not start:\n{(workdir / f'syncer-{tag}.err').read_text(errors='replace')}")


def run_arm(mode: str, args: argparse.Namespace, workdir: Path, key_file: Path, raw: RawLoopback) -> Arm:
    numel = args.mib * (1 << 20) // 4 // args.fragments
    tensors = [torch.zeros(numel) for _ in range(args.fragments)]
    nbytes = numel * 4 * args.fragments
    raw_s = statistics.median(raw.transfer(nbytes) for _ in range(3))
    proc, address = start_syncer(workdir, key_file, args.fragments, mode)
    settings = load_settings(LearnerSettings, syncer=address, key_file=key_file, learner_id=0, rl_mode=mode,
                             data_streams=args.streams, consensus_every=0, blocking_timeout_s=300)
    session = LearnerSession(settings, [(f"w{i}", t) for i, t in enumerate(tensors)])
    stalls = []
    try:
        session.start()
        for _ in range(args.iterations):
            # The rollout and the update: untimed. By their end the syncer has asked for every
            # fragment of this iteration's sweep (with overlap, the last merges came back meanwhile).
            deadline = time.monotonic() + 120
            while len(session.pending_pulls()) < args.fragments:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{mode}: the syncer did not ask for every fragment within 120 s")
                session.pump(0.01)
            for t in tensors:
                t.add_(1e-3)  # the iteration's update
            session.step(TOKENS)
            t0 = time.perf_counter()
            session.sweep()
            stalls.append(time.perf_counter() - t0)
        pushes = session.stats.pushes
    finally:
        session.close()
        stop(proc)
    if pushes < args.fragments * (args.iterations - 1):
        raise SystemExit(f"{mode}: only {pushes} pushes in {args.iterations} sweeps of {args.fragments} fragments")
    tape = [json.loads(line) for line in (workdir / f"tape-{mode}.jsonl").read_text().splitlines() if line.strip()]
    merges = [r["merge_ms"] for r in tape if r["event"] == "commit"]
    return Arm(mode, stalls, raw_s, nbytes, statistics.median(merges))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="model size (f32), split into equal fragments")
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--streams", type=int, default=2, help="data streams, for yeto and for the raw baseline")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="yeto-rl-sweep-") as tmp:
        workdir = Path(tmp)
        key_file = workdir / "key"
        key_file.write_text(secrets.token_hex(32))
        key_file.chmod(0o600)
        raw = RawLoopback(args.mib << 20, args.streams)
        try:
            arms = [run_arm(mode, args, workdir, key_file, raw) for mode in ("sweep", "overlap")]
        finally:
            raw.close()
    print(f"{args.mib} MiB f32 model in {args.fragments} fragments, {args.streams} data streams, "
          f"{args.iterations} iterations per arm (medians after the first)")
    print(f"{'arm':<9} {'stall':>9} {'push rate':>11} {'raw loopback':>13} {'ratio':>6} {'syncer merge':>13}")
    for arm in arms:
        print(f"{arm.name:<9} {arm.stall * 1000:7.1f}ms {arm.nbytes / arm.stall / 1e9:7.2f} GB/s "
              f"{arm.nbytes / arm.raw_s / 1e9:9.2f} GB/s {arm.ratio:6.2f} {arm.merge_ms:9.1f} ms/fr")
    sweep, overlap = arms
    print(f"a waiting sweep holds the island for the syncer's {args.fragments} merges "
          f"({args.fragments * sweep.merge_ms:.0f} ms here) and the broadcasts back; overlap only for its own pushes")
    print(f"overlap cuts the boundary stall to {overlap.stall / sweep.stall:.2f} of the waiting sweep's")
    print(f"ratio sweep/raw_loopback = {sweep.ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
