"""The main job: a local syncer and two HF learners train one small Llama on this machine's CPU.

    python examples/main_job.py [--max-steps 240] [--no-baseline] [--run-dir runs/main-job]
                                [--merge iso --iso-workers 2]

It starts `python -m syncer` on 127.0.0.1 (a free port) and two `examples/hf_tiny_llama.py`
islands, each on its own shard of English text, for `--max-steps` steps each; beside them, one
island alone (`--no-sync`, learner 0's shard, as many steps) is what an island reaches without the
others. It shows rounds committed and each process's loss while they train, and ends with the
final global model's held-out loss next to the lone island's, after checking that both learners
hold bit-identical final weights equal to the syncer's final checkpoint. Logs and outputs stay in
the run directory.
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

from syncer.tools.plot import plot_tape

ROOT = Path(__file__).resolve().parent.parent
LEARNERS = 2
FRAGMENTS = 4


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

    @property
    def name(self) -> str:
        return "alone" if self.index < 0 else f"learner {self.index}"

    def status(self) -> str:
        if self.first_eval is None:
            return f"{self.name}: starting"
        loss = "   -  " if self.loss is None else f"{self.loss:6.3f}"
        return f"{self.name}: step {self.step:4d} loss {loss}"


def committed_rounds(tape: Path) -> int:
    if not tape.exists():
        return 0
    return sum(1 for line in tape.read_text().splitlines() if '"event": "commit"' in line)


def wire_bits(tape: Path) -> tuple[float, float] | None:
    """Bits per parameter each way over the run's commits, per learner: the pushes merged, and the
    broadcasts to one learner (the tape's bytes_in, bytes_out, receivers and numel)."""
    up = down = up_params = down_params = 0
    for line in tape.read_text().splitlines() if tape.exists() else []:
        if '"event": "commit"' not in line:
            continue
        c = json.loads(line)
        up, down = up + c["bytes_in"], down + c["bytes_out"]
        up_params += c["numel"] * len(c["learners"])
        down_params += c["numel"] * c["receivers"]
    return (8 * up / up_params, 8 * down / down_params) if up_params and down_params else None


def start_syncer(run: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str, str]:
    """The syncer, its address and its status page's address."""
    # No round budget: the syncer finalizes once both learners have trained their steps.
    cmd = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", "0", "--learners", str(LEARNERS),
           "--quorum", str(LEARNERS), "--fragments", str(FRAGMENTS), "--checkpoint", str(run / "syncer.ckpt"),
           "--tape", str(run / "tape.jsonl"), "--key-file", str(run / "key"), "--metrics-port", str(args.status_port),
           "--merge", args.merge]
    if args.iso_workers:
        cmd += ["--iso-worker-devices", ",".join(["cpu"] * args.iso_workers)]
    log = open(run / "syncer.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    line, page = "", ""
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        if line.startswith("yeto syncer status page on "):
            page = line.rsplit(" ", 1)[1].strip()
        if line.startswith("yeto syncer listening on "):
            return proc, line.rsplit(" ", 1)[1].strip(), page
    proc.kill()
    raise SystemExit(f"the syncer did not start; see {run / 'syncer.log'}")


def start_learner(i: int, run: Path, address: str | None, args: argparse.Namespace) -> Learner:
    """Learner `i` of the run; with no `address`, the lone island: learner 0's shard, no syncer."""
    name = f"learner{i}" if address else "alone"
    out_dir = run / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_DILOCO_")}
    env.update(YETO_DILOCO_LEARNER_ID=str(i), PYTHONUNBUFFERED="1")
    if address:
        env.update(YETO_DILOCO_SYNCER=address, YETO_DILOCO_KEY_FILE=str(run / "key"))
    cmd = [sys.executable, str(ROOT / "examples" / "hf_tiny_llama.py"), "--output-dir", str(out_dir),
           "--max-steps", str(args.max_steps), "--num-shards", str(LEARNERS), *([] if address else ["--no-sync"])]
    err = open(run / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    return Learner(i if address else -1, proc, out_dir)


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
    p.add_argument("--max-steps", type=int, default=240, help="optimizer steps of each learner and of the lone island")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="train one island alone beside them, for as many steps (default: yes)")
    p.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "main-job")
    p.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    p.add_argument("--status-port", type=int, default=0,
                   help="the syncer's status page and /metrics port on 127.0.0.1 (0: a free one)")
    p.add_argument("--merge", choices=("rda", "iso", "average"), default="rda",
                   help="the syncer's merge (default rda; iso: each matrix's merged update with a flat spectrum)")
    p.add_argument("--iso-workers", type=int, default=0,
                   help="with --merge iso: SVD worker processes on this CPU (default 0: in the syncer)")
    args = p.parse_args(argv)
    if args.iso_workers and args.merge != "iso":
        p.error("--iso-workers needs --merge iso")

    run = args.run_dir.resolve()
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    (run / "key").write_text(secrets.token_hex(32))
    (run / "key").chmod(0o600)  # a key file others may read is warned about
    t0 = time.monotonic()
    alone = " and one island alone" if args.baseline else ""
    print(f"yeto main job: a syncer, {LEARNERS} HF learners{alone} on this machine (logs in {run})", flush=True)
    procs: list[subprocess.Popen[str]] = []
    rounds_each = args.max_steps // (24 // FRAGMENTS)  # a boundary every H/P steps, H = 24
    try:
        syncer, address, page = start_syncer(run, args)
        procs.append(syncer)
        print(f"syncer listening on {address}: {LEARNERS} learners x {args.max_steps} steps, {FRAGMENTS} fragments, "
              f"quorum {LEARNERS}, merge {args.merge}"
              + (f" on {args.iso_workers} CPU workers" if args.iso_workers else ""), flush=True)
        print(f"watch it live: {page} (status page; Prometheus metrics at {page}metrics)", flush=True)
        learners = [start_learner(i, run, address, args) for i in range(LEARNERS)]
        baseline = start_learner(0, run, None, args) if args.baseline else None
        watched = learners + ([baseline] if baseline else [])
        procs += [ln.proc for ln in watched]
        last = ""
        while any(proc.poll() is None for proc in procs):
            elapsed = time.monotonic() - t0
            if elapsed > args.timeout:
                raise SystemExit(f"timed out after {args.timeout:.0f} s")
            line = " | ".join([f"rounds {committed_rounds(run / 'tape.jsonl'):3d}/~{rounds_each}",
                               *(ln.status() for ln in watched)])
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
        print(f"exit codes: syncer {codes[0]}, learners {codes[1:1 + LEARNERS]}"
              f"{f', alone {codes[-1]}' if baseline else ''}; see the logs in {run}")
        return 1
    same, detail = compare_weights(run, learners)
    final = learners[0].final_eval
    assert final is not None
    print("held-out eval loss (bytes of English text, nats/token), first -> final global model:")
    for ln in learners:
        print(f"  learner {ln.index}: first {ln.first_eval:.3f} -> final {ln.final_eval:.3f} "
              f"(steps {ln.step}, final cut installed: {ln.final_cut})")
    print(f"final global model: eval loss {final:.3f}, {committed_rounds(run / 'tape.jsonl')} rounds committed")
    bits = wire_bits(run / "tape.jsonl")
    if bits is not None:
        print(f"the wire, per parameter of a round's fragment: {bits[0]:.2f} bits up (a push), {bits[1]:.2f} bits "
              "down (a broadcast to one learner)")
    if baseline is not None and baseline.final_eval is not None:
        ratio = final / baseline.final_eval
        print(f"one island alone, the same {baseline.step} steps on learner 0's shard: eval loss "
              f"{baseline.final_eval:.3f}")
        print(f"what yeto buys: global model / island alone = {ratio:.3f} "
              f"({baseline.final_eval - final:+.3f} nats/token {'better' if final < baseline.final_eval else 'worse'})")
    if same and all(ln.final_cut for ln in learners):
        print(f"final weights: learner 0 == learner 1 == syncer checkpoint, bit for bit ({detail})")
    else:
        print(f"final weights DIFFER: {detail}")
        return 1
    try:
        plots = plot_tape(run / "tape.jsonl", run / "plots")
        print(f"plots of the run's tape (yeto-plot): {run / 'plots'} ({', '.join(p.name for p in plots)})")
    except ModuleNotFoundError:
        print("no plots: matplotlib is missing (pip install 'yeto[plot]')")
    print(f"done in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
