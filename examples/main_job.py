"""The main job: a local syncer and two HF learners train one small Llama on this machine's CPU.

    python examples/main_job.py [--rounds 48] [--max-steps 400] [--run-dir runs/main-job]

It starts `python -m syncer` on 127.0.0.1 (a free port) and two `examples/hf_tiny_llama.py`
islands, each on its own shard of English text, shows rounds committed and each learner's loss
while they train, and ends with the final global model's held-out loss next to each learner's
first one, after checking that both learners hold bit-identical final weights equal to the
syncer's final checkpoint. Logs and outputs stay in the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
LEARNERS = 2


class Learner:
    def __init__(self, index: int, proc: subprocess.Popen[str], out_dir: Path) -> None:
        self.index = index
        self.proc = proc
        self.out_dir = out_dir
        self.step = 0
        self.loss: float | None = None
        self.first_eval: float | None = None
        self.final_eval: float | None = None
        self.final_cut = False
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self.lines.append(line)
            if not line.startswith("{\""):
                continue
            try:
                ev: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev.get("event") == "train":
                self.step, self.loss = ev["step"], ev["loss"]
            elif ev.get("event") == "eval" and ev.get("phase") == "initial":
                self.first_eval = ev["loss"]
            elif ev.get("event") == "eval" and ev.get("phase") == "final":
                self.final_eval, self.final_cut, self.step = ev["loss"], ev["final_cut"], ev["steps"]

    def status(self) -> str:
        if self.first_eval is None:
            return f"learner {self.index}: starting"
        loss = "   -  " if self.loss is None else f"{self.loss:6.3f}"
        return f"learner {self.index}: step {self.step:4d} loss {loss}"


def committed_rounds(tape: Path) -> int:
    if not tape.exists():
        return 0
    return sum(1 for line in tape.read_text().splitlines() if '"event": "commit"' in line)


def start_syncer(run: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", "0", "--learners", str(LEARNERS),
           "--quorum", str(LEARNERS), "--fragments", "4", "--total-rounds", str(args.rounds),
           "--checkpoint", str(run / "syncer.ckpt"), "--tape", str(run / "tape.jsonl"),
           "--key-file", str(run / "key")]
    log = open(run / "syncer.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("yeto syncer listening on "):
            return proc, line.rsplit(" ", 1)[1].strip()
    proc.kill()
    raise SystemExit(f"the syncer did not start; see {run / 'syncer.log'}")


def start_learner(i: int, run: Path, address: str, args: argparse.Namespace) -> Learner:
    out_dir = run / f"learner{i}"
    env = dict(os.environ, YETO_DILOCO_SYNCER=address, YETO_DILOCO_KEY_FILE=str(run / "key"),
               YETO_DILOCO_LEARNER_ID=str(i), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(ROOT / "examples" / "hf_tiny_llama.py"), "--output-dir", str(out_dir),
           "--max-steps", str(args.max_steps)]
    err = open(run / f"learner{i}.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    return Learner(i, proc, out_dir)


def compare_weights(run: Path, learners: list[Learner]) -> tuple[bool, str]:
    import torch
    from safetensors.torch import load_file

    ckpt = load_file(str(run / "syncer.ckpt"))
    models = [load_file(str(ln.out_dir / "model.safetensors")) for ln in learners]
    names = sorted(models[0])
    numel = 0
    for name in names:
        ref = ckpt.get(f"param/{name}")
        if ref is None:
            return False, f"{name} is not in the syncer checkpoint"
        for ln, model in zip(learners, models, strict=True):
            if name not in model or not torch.equal(model[name], ref):
                return False, f"learner {ln.index}'s {name} differs from the syncer checkpoint"
        numel += ref.numel()
    return True, f"{len(names)} tensors, {numel / 1e6:.2f}M parameters"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=48, help="fragment rounds before the syncer finalizes")
    p.add_argument("--max-steps", type=int, default=400, help="each learner's own step limit")
    p.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "main-job")
    p.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    args = p.parse_args(argv)

    run = args.run_dir.resolve()
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    (run / "key").write_text(secrets.token_hex(32))
    t0 = time.monotonic()
    print(f"yeto main job: a syncer and {LEARNERS} HF learners on this machine (logs in {run})", flush=True)
    procs: list[subprocess.Popen[str]] = []
    try:
        syncer, address = start_syncer(run, args)
        procs.append(syncer)
        print(f"syncer listening on {address}: {args.rounds} fragment rounds, 4 fragments, quorum {LEARNERS}",
              flush=True)
        learners = [start_learner(i, run, address, args) for i in range(LEARNERS)]
        procs += [ln.proc for ln in learners]
        last = ""
        while any(proc.poll() is None for proc in procs):
            elapsed = time.monotonic() - t0
            if elapsed > args.timeout:
                raise SystemExit(f"timed out after {args.timeout:.0f} s")
            line = " | ".join([f"rounds {committed_rounds(run / 'tape.jsonl'):3d}/{args.rounds}",
                               *(ln.status() for ln in learners)])
            if line != last:
                print(f"[{elapsed:5.0f}s] {line}", flush=True)
                last = line
            time.sleep(2.0)
        codes = [proc.returncode for proc in procs]
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    wall = time.monotonic() - t0
    print("\n== result ==")
    if any(codes):
        print(f"exit codes: syncer {codes[0]}, learners {codes[1:]}; see the logs in {run}")
        return 1
    same, detail = compare_weights(run, learners)
    final = learners[0].final_eval
    print("held-out eval loss (bytes of English text, nats/token), first -> final global model:")
    for ln in learners:
        print(f"  learner {ln.index}: first {ln.first_eval:.3f} -> final {ln.final_eval:.3f} "
              f"(steps {ln.step}, final cut installed: {ln.final_cut})")
    print(f"final global model: eval loss {final:.3f}, {committed_rounds(run / 'tape.jsonl')} rounds committed")
    if same and all(ln.final_cut for ln in learners):
        print(f"final weights: learner 0 == learner 1 == syncer checkpoint, bit for bit ({detail})")
    else:
        print(f"final weights DIFFER: {detail}")
        return 1
    print(f"done in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
