"""One learner process of the chaos harness (`benchmarks/chaos.py`): a `LearnerSession` over a
small torch MLP with SGD, each step paced to a fixed wall time (`--step-s`, the rest of the step
is slept) to stand in for accelerator compute without saturating the CPUs.

    python -m benchmarks.chaos_learner --syncer HOST:PORT --key-file F --learner-id N

Every `--report-every` computed steps it prints one JSON line (flushed)
``{"event": "steps", "learner": N, "steps": S, "t": UNIX}`` with the cumulative count of steps
this process computed, so the harness can count the steps of an incarnation that is later
SIGKILLed. It trains until SIGTERM (or SIGINT, or `--deadline-s`), then asks the syncer for the
final cut (`finish`, at most `--final-timeout-s`), closes the session and prints
``{"event": "learner_done", ...}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from types import FrameType
from typing import Any

import torch

from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings


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
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    stop = False

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed * 1000 + args.learner_id)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    target = torch.randn(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = load_settings(LearnerSettings, syncer=args.syncer, key_file=args.key_file, learner_id=args.learner_id,
                           sync_interval=args.sync_interval, init_timeout_s=60, final_timeout_s=args.final_timeout_s,
                           reconnect_max_s=1, connect_timeout_s=5)
    session = LearnerSession(config, list(model.named_parameters()))
    started = time.monotonic()
    deadline = started + args.deadline_s
    steps = 0
    finished = False

    def report(event: str, **extra: object) -> None:
        print(json.dumps({"event": event, "learner": args.learner_id, "steps": steps, "t": time.time(), **extra}),
              flush=True)

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
        while not stop and time.monotonic() < deadline:
            x = torch.randn(16, 8)
            loss = torch.nn.functional.mse_loss(model(x), x @ target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if steps % args.report_every == 0:
                report("steps")
            if session.step(tokens=16):
                finished = True  # the syncer finalized the run
                break
            if args.trace:
                trace_installs()
            next_at += args.step_s
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                next_at = time.monotonic()  # fell behind (e.g. after SIGSTOP): do not race to catch up
        report("steps")
        if not finished:
            finished = session.finish()
    finally:
        session.close()
    report("learner_done", finished=finished, pushes=session.stats.pushes,
           push_failures=session.stats.push_failures, installs=session.stats.installs,
           generations=list(session.stats.connected_generations), seconds=round(time.monotonic() - started, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
