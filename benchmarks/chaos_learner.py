"""One learner process of the chaos harness (`benchmarks/chaos.py`): a `LearnerSession` over a
model, each step paced to a fixed wall time (`--step-s`, the rest of the step is slept) to stand
in for accelerator compute without saturating the CPUs.

    python -m benchmarks.chaos_learner --syncer HOST:PORT --key-file F --learner-id N [--steps S ...]

Two kinds of work:

* by default a small torch MLP with SGD on random data, trained until SIGTERM (or SIGINT, or
  `--deadline-s`);
* with `--steps S` the small Llama of `examples/hf_tiny_llama.py` on its byte tokens (shard
  `--learner-id` of `--shards`), AdamW with a linear warm-up, gradient clipping at 1.0, one torch
  thread, the same seeded initial weights on every learner (the inner loop of
  `benchmarks/diloco_arm.py`), until the learner id has taken S optimizer steps over all its
  incarnations: the count lives in `--progress-file` (`benchmarks/chaos_learning.py`), and a
  restarted incarnation goes on from it with a fresh optimizer.

Every `--report-every` computed steps it prints one JSON line (flushed)
``{"event": "steps", "learner": N, "steps": S, "total": T, "t": UNIX}``: S the steps this process
computed (so the harness can count the steps of an incarnation that is later SIGKILLed), T the
id's count over all incarnations. When training ends it asks the syncer for the final cut
(`finish`, at most `--final-timeout-s`), closes the session and prints
``{"event": "learner_done", ...}``; in the learning mode that line also holds a digest of the final
parameters and, from learner 0, `eval_loss`: the held-out loss of the model it ended with.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import signal
import sys
import time
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from benchmarks.chaos_learning import read_progress, write_progress
from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings


class Toy:
    """A small MLP fitting a random linear map with SGD: steps that cost next to nothing."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed * 1000 + args.learner_id)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                         torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.target = torch.randn(8, 4)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.named_params = list(self.model.named_parameters())
        self.embeddings: set[str] = set()

    def step(self) -> int:
        x = torch.randn(16, 8)
        loss = torch.nn.functional.mse_loss(self.model(x), x @ self.target)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return 16


class TinyLlama:
    """The main job's model and data, trained from step `done` of the id's budget on."""

    def __init__(self, args: argparse.Namespace, done: int) -> None:
        from benchmarks import diloco_data
        from benchmarks.diloco_arm import Shape, Trainee, eval_loss
        from yeto_plugins.torch_dist.modules import embedding_names, synced_parameters

        shape = Shape(hidden=args.hidden, layers=args.layers, seq_len=args.seq_len, batch=args.batch,
                      steps=args.steps, lr=args.lr, warmup=args.warmup)
        train = diloco_data.shard(shape.corpus, args.seq_len, args.learner_id, args.shards)
        self.held_out = diloco_data.held_out(shape.corpus, args.seq_len)
        self.model = diloco_data.build_model(shape.family, args.hidden, args.layers, args.seq_len, args.seed)
        # The data order is the id's, whichever incarnation runs it: seeded by the id, fast-forwarded.
        self.trainee = Trainee(self.model, train, args.batch, args.lr, shape,
                               seed=args.seed * 1000 + args.learner_id)
        with warnings.catch_warnings():  # the schedule moves on without optimizer steps: on purpose
            warnings.simplefilter("ignore")
            for _ in range(done):
                next(self.trainee.order)
                self.trainee.sched.step()
        self.named_params = synced_parameters(self.model, "full")
        self.embeddings = embedding_names(self.model)
        self._eval_loss = eval_loss

    def step(self) -> int:
        return self.trainee.step()

    def eval_loss(self) -> float:
        return float(self._eval_loss(self.model, self.held_out))

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, p in sorted(self.model.named_parameters()):
            h.update(name.encode() + p.detach().float().contiguous().numpy().tobytes())
        return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chaos_learner")
    ap.add_argument("--syncer", required=True, help="HOST:PORT of the syncer")
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--learner-id", type=int, required=True)
    ap.add_argument("--sync-interval", type=int, default=24, help="H, inner steps per fragment round trip")
    ap.add_argument("--step-s", type=float, default=0.02, help="wall time of one step (compute + sleep)")
    ap.add_argument("--report-every", type=int, default=1, help="print the step count every N steps")
    ap.add_argument("--deadline-s", type=float, default=600.0, help="stop training after this many seconds")
    ap.add_argument("--final-timeout-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--trace", action="store_true", help="also print a JSON line per push and per install")
    ap.add_argument("--steps", type=int, default=0, help="> 0: train the small Llama this many steps per id")
    ap.add_argument("--progress-file", type=Path, help="the id's step count over its incarnations (with --steps)")
    ap.add_argument("--shards", type=int, default=1, help="learners sharing the training text (with --steps)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args(argv)
    if args.steps > 0 and args.progress_file is None:
        ap.error("--steps needs --progress-file")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    stop = False

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    if args.steps <= 0:  # with a step budget, the harness stops only a learner that went wrong: at once
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    torch.set_num_threads(1)
    total = read_progress(args.progress_file) if args.steps > 0 else 0
    work: Toy | TinyLlama = TinyLlama(args, total) if args.steps > 0 else Toy(args)
    config = load_settings(LearnerSettings, syncer=args.syncer, key_file=args.key_file, learner_id=args.learner_id,
                           sync_interval=args.sync_interval, init_timeout_s=60, final_timeout_s=args.final_timeout_s,
                           reconnect_max_s=1, connect_timeout_s=5)
    session = LearnerSession(config, work.named_params, embedding_names=work.embeddings)
    started = time.monotonic()
    deadline = started + args.deadline_s
    steps = late = 0
    finished = False

    def report(event: str, **extra: object) -> None:
        print(json.dumps({"event": event, "learner": args.learner_id, "steps": steps, "total": total, "t": time.time(),
                          **extra}), flush=True)

    marks: list[tuple[int, int]] = []
    if args.trace:  # diagnostics: every push handed to the client, every fragment install seen after a step
        submit = session.link.submit

        def traced_submit(job: Any) -> Any:
            report("push", round=job.pull.round, attempt=job.pull.attempt, fragment=job.pull.fragment,
                   base_version=job.base_version, push_steps=job.steps)
            return submit(job)

        session.link.submit = traced_submit  # type: ignore[method-assign]

    def trace_installs() -> None:
        now = [(f.version, f.steps_mark) for f in session.fragments]
        for i, (old, new) in enumerate(zip(marks, now, strict=False)):
            if old != new:
                report("install", fragment=i, version=new[0], steps_mark=new[1])
        marks[:] = now

    try:
        session.start()
        report("started")
        next_at = time.monotonic()
        while not stop and time.monotonic() < deadline and (args.steps <= 0 or total < args.steps):
            tokens = work.step()
            steps += 1
            total += 1
            if args.steps > 0:
                write_progress(args.progress_file, total)
            if steps % args.report_every == 0:
                report("steps")
            if session.step(tokens=tokens):
                finished = True  # the syncer finalized the run
                break
            if args.trace:
                trace_installs()
            next_at += args.step_s
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                late += 1
                next_at = time.monotonic()  # fell behind (e.g. after SIGSTOP): do not race to catch up
        report("steps")
        if not finished:
            finished = session.finish()
    finally:
        session.close()
    result: dict[str, object] = {}
    if isinstance(work, TinyLlama):
        result["digest"] = work.digest()
        if args.learner_id == 0:
            result["eval_loss"] = round(work.eval_loss(), 6)
    report("learner_done", finished=finished, pushes=session.stats.pushes, push_failures=session.stats.push_failures,
           installs=session.stats.installs, generations=list(session.stats.connected_generations), late_steps=late,
           seconds=round(time.monotonic() - started, 2), **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
