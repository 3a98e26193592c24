"""One 5x straggler among three islands: decoupled rounds (quorum 2 of 3 + grace) vs lock-step (quorum 3).

    python -m benchmarks.straggler [--seconds 25] [--fast-step-ms 20] [--slowdown 5] [--grace-s 0.2]

Both arms run in one invocation, one after the other, under the same settings:

* **The syncer** is the real `python -m syncer` in a subprocess on loopback (`--learners 3
  --fragments 4 --sync-interval-steps H --device cpu --tape T`), with `--quorum 2 --grace-s G`
  for the decoupled arm and `--quorum 3` for the lock-step arm. No round budget: an arm ends
  after `--seconds`, when the islands close and the syncer is stopped by its pid.
* **Islands** are in-process `yeto_core.learner.LearnerSession`s over a small MLP with real SGD
  steps, one thread each. Every step is paced to a wall-clock period: `--fast-step-ms` for
  learners 0 and 1, `--slowdown` times that for learner 2 (the straggler sleeps; it does not burn
  CPU). The session reports that measured step time to the syncer, as a real learner would.

What is measured, per arm, over the same window (from the initial cut to the end of the arm):

* **rounds/min**: commit records on the syncer's tape in the window, per minute of wall clock;
* **fast steps/s**: inner steps of learners 0 and 1 together, per second (a learner never blocks a
  step on the network, so this stays near 2 / fast period in both arms);
* **fast steps/round**: fast inner steps per committed round (lower = the fast learners' work is
  merged more often, i.e. less of it waits on the straggler);
* how many commits the straggler answered, was carried into, or was not waited for.

The last line is `ratio decoupled/lock-step rounds per minute = X`. Only ratios from one run mean
much: the absolute figures move with the machine and with whatever else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.procs import stop
from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$")
SYNC_INTERVAL = 8
FRAGMENTS = 4


class Island:
    def __init__(self, address: str, key_file: Path, learner_id: int, period_s: float) -> None:
        gen = torch.Generator().manual_seed(learner_id)
        torch.manual_seed(learner_id)
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                         torch.nn.Tanh(), torch.nn.Linear(64, 8))
        self.target = torch.randn(32, 8, generator=gen)
        self.gen = gen
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.02)
        config = load_settings(LearnerSettings, syncer=address, key_file=key_file, learner_id=learner_id,
                               sync_interval=SYNC_INTERVAL, init_timeout_s=30, final_timeout_s=5,
                               reconnect_max_s=1, connect_timeout_s=10)
        self.session = LearnerSession(config, list(self.model.named_parameters()))
        self.period_s = period_s
        self.error: BaseException | None = None

    def run(self, stop: threading.Event) -> None:
        try:
            self.session.start()
            while not stop.is_set():
                t0 = time.monotonic()
                x = torch.randn(32, 32, generator=self.gen)
                loss = torch.nn.functional.mse_loss(self.model(x), x @ self.target)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                if self.session.step(tokens=32):
                    return
                time.sleep(max(0.0005, self.period_s - (time.monotonic() - t0)))
        except BaseException as exc:  # reported by the arm
            self.error = exc


@dataclass
class Arm:
    name: str
    quorum: int
    seconds: float
    rounds: int
    fast_steps: int
    slow_steps: int
    slow_answered: int
    slow_carried: int
    slow_not_waited: int
    grace_ms_mean: float

    @property
    def rounds_per_min(self) -> float:
        return 60.0 * self.rounds / self.seconds

    @property
    def fast_steps_per_s(self) -> float:
        return self.fast_steps / self.seconds


def read_tape(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(raw) for raw in path.read_bytes().split(b"\n")[:-1] if raw.strip()]


def start_syncer(workdir: Path, key_file: Path, quorum: int, grace_s: float,
                 tag: str) -> tuple[subprocess.Popen, str, Path]:
    tape = workdir / f"tape-{tag}.jsonl"
    argv = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", "0", "--learners", "3",
            "--quorum", str(quorum), "--fragments", str(FRAGMENTS), "--sync-interval-steps", str(SYNC_INTERVAL),
            "--grace-s", str(grace_s), "--device", "cpu", "--tape", str(tape), "--key-file", str(key_file),
            "--checkpoint", str(workdir / f"{tag}.safetensors"), "--checkpoint-every", "1000000",
            "--log-level", "WARNING"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    out = (workdir / f"syncer-{tag}.out").open("wb")
    err = (workdir / f"syncer-{tag}.err").open("wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in (workdir / f"syncer-{tag}.out").read_text(errors="replace").splitlines():
            m = LISTENING.match(line)
            if m:
                return proc, f"{m.group(1)}:{m.group(2)}", tape
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop(proc)
    raise SystemExit(f"the syncer did not start:\n{(workdir / f'syncer-{tag}.err').read_text(errors='replace')}")


def stop_islands(halt: threading.Event, threads: list[threading.Thread], islands: list[Island],
                 proc: subprocess.Popen[bytes]) -> None:
    """Stop the islands' stepping threads, close their sessions, then stop the syncer."""
    halt.set()
    for t in threads:
        t.join(10)
    for i in islands:
        i.session.close()
    stop(proc)


def raise_island_error(islands: list[Island]) -> None:
    """An island's stepping thread failed: raise its error here."""
    for i in islands:
        if i.error is not None:
            raise i.error


def run_arm(name: str, quorum: int, args: argparse.Namespace, workdir: Path, key_file: Path) -> Arm:
    proc, address, tape = start_syncer(workdir, key_file, quorum, args.grace_s, name)
    fast = args.fast_step_ms / 1000.0
    islands = [Island(address, key_file, 0, fast), Island(address, key_file, 1, fast),
               Island(address, key_file, 2, fast * args.slowdown)]
    halt = threading.Event()
    threads = [threading.Thread(target=i.run, args=(halt,), daemon=True) for i in islands]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not any(r.get("event") == "init" for r in read_tape(tape)):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"{name}: no initial cut within 60 s")
            time.sleep(0.02)
        t0 = time.monotonic()
        steps0 = [i.session.stats.steps for i in islands]
        time.sleep(args.seconds)
        elapsed = time.monotonic() - t0
        steps1 = [i.session.stats.steps for i in islands]
        window = read_tape(tape)
    finally:
        stop_islands(halt, threads, islands, proc)
    raise_island_error(islands)
    commits = [r for r in window if r.get("event") == "commit"]
    grace = [c["grace_ms"] for c in commits]
    return Arm(name=name, quorum=quorum, seconds=elapsed, rounds=len(commits),
               fast_steps=(steps1[0] - steps0[0]) + (steps1[1] - steps0[1]), slow_steps=steps1[2] - steps0[2],
               slow_answered=sum(2 in c["answered"] for c in commits),
               slow_carried=sum(2 in c["carried"] for c in commits),
               slow_not_waited=sum(2 in c["not_waited_for"] for c in commits),
               grace_ms_mean=sum(grace) / len(grace) if grace else 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=25.0, help="measured wall clock per arm (default 25)")
    p.add_argument("--fast-step-ms", type=float, default=20.0, help="step period of learners 0 and 1 (default 20)")
    p.add_argument("--slowdown", type=float, default=5.0, help="learner 2's step period / the fast one (default 5)")
    p.add_argument("--grace-s", type=float, default=0.2, help="--grace-s of the decoupled arm (default 0.2)")
    p.add_argument("--keep", type=Path, help="keep the syncers' tapes and logs in this directory")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="yeto-straggler-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        key_file = workdir / "syncer.key"
        key_file.write_text(secrets.token_hex(32))
        key_file.chmod(0o600)  # a key file others may read is warned about
        print(f"3 islands, learner 2 steps {args.slowdown:g}x slower ({args.fast_step_ms:g} ms vs "
              f"{args.fast_step_ms * args.slowdown:g} ms); H={SYNC_INTERVAL}, P={FRAGMENTS}; "
              f"{args.seconds:g} s per arm",
              flush=True)
        arms = [run_arm("decoupled", 2, args, workdir, key_file), run_arm("lock-step", 3, args, workdir, key_file)]
    head = (f"{'arm':<10} {'quorum':>6} {'rounds':>6} {'rounds/min':>10} {'fast steps/s':>12} "
            f"{'fast steps/round':>16} {'slow steps':>10} {'slow answered':>13} {'slow carried':>12} "
            f"{'not waited':>10} {'grace ms':>8}")
    print(head)
    for a in arms:
        per_round = a.fast_steps / a.rounds if a.rounds else float("inf")
        print(f"{a.name:<10} {a.quorum:>6} {a.rounds:>6} {a.rounds_per_min:>10.1f} {a.fast_steps_per_s:>12.1f} "
              f"{per_round:>16.2f} {a.slow_steps:>10} {a.slow_answered:>13} {a.slow_carried:>12} "
              f"{a.slow_not_waited:>10} {a.grace_ms_mean:>8.1f}")
    dec, lock = arms
    steps_ratio = dec.fast_steps_per_s / lock.fast_steps_per_s if lock.fast_steps_per_s else float("inf")
    print(f"ratio decoupled/lock-step fast steps per second = {steps_ratio:.2f}")
    ratio = dec.rounds_per_min / lock.rounds_per_min if lock.rounds_per_min else float("inf")
    print(f"ratio decoupled/lock-step rounds per minute = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
