"""A learner process for the fault tests (test_learner_faults.py): a LearnerSession over a small MLP
(the same as the in-process Island), trained until the syncer's final cut; it then writes its
parameters to --out.

It reports its own work as JSON lines on stdout, each written and flushed at once, so that the
work of an incarnation that is SIGKILLed can still be counted from what it printed:

* ``connected``: a connection generation the syncer assigned (with the steps and tokens so far);
* ``push``: every push, written *before* the push is handed to the sender thread (so a push the
  syncer may have committed was always reported), with its round, attempt, fragment, base
  version, tokens and steps, and this incarnation's cumulative tokens computed at that moment;
* ``progress``: cumulative steps and tokens every few steps;
* ``learner_done``: the totals, once the final cut is installed (or the deadline passed).

    python tests/integration/fault_learner.py --syncer HOST:PORT --key-file F --learner-id N --out P
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from mlp import small_mlp
from safetensors.torch import save_file

from yeto_core.client import PushJob
from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings

TOKENS_PER_STEP = 16


def report(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncer", required=True)
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--learner-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--step-s", type=float, default=0.02, help="wall-clock period of one training step")
    ap.add_argument("--heartbeat-s", type=float, default=2.0)
    ap.add_argument("--peer-timeout-s", type=float, default=30.0)
    ap.add_argument("--deadline-s", type=float, default=90.0)
    ap.add_argument("--progress-every", type=int, default=5)
    args = ap.parse_args()

    torch.set_num_threads(1)
    model, target, opt = small_mlp(args.learner_id)
    config = load_settings(LearnerSettings, syncer=args.syncer, key_file=args.key_file, learner_id=args.learner_id,
                           data_streams=1, sync_interval=8, init_timeout_s=60, final_timeout_s=60,
                           reconnect_max_s=0.5, connect_timeout_s=10, heartbeat_s=args.heartbeat_s,
                           peer_timeout_s=args.peer_timeout_s)
    session = LearnerSession(config, list(model.named_parameters()))
    stats = session.stats

    submit = session.link.submit

    def reported_submit(job: PushJob) -> None:  # runs on this (the training) thread
        report("push", round=job.pull.round, attempt=job.pull.attempt, fragment=job.pull.fragment,
               base_version=job.base_version, tokens=job.tokens, steps=job.steps, generation=session.generation,
               cum_tokens=stats.tokens, cum_steps=stats.steps)
        submit(job)

    session.link.submit = reported_submit  # type: ignore[method-assign]

    seen = 0

    def report_connections() -> None:
        nonlocal seen
        for generation in stats.connected_generations[seen:]:
            report("connected", generation=generation, steps=stats.steps, tokens=stats.tokens)
        seen = len(stats.connected_generations)

    report("started", pid=os.getpid(), learner=args.learner_id)
    started = time.monotonic()
    finished = False
    try:
        session.start()
        report_connections()
        deadline = started + args.deadline_s
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            x = torch.randn(16, 8)
            loss = torch.nn.functional.mse_loss(model(x), x @ target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done = session.step(tokens=TOKENS_PER_STEP)
            report_connections()
            if stats.steps % args.progress_every == 0:
                report("progress", steps=stats.steps, tokens=stats.tokens)
            if done:
                finished = True
                break
            time.sleep(max(0.002, args.step_s - (time.monotonic() - t0)))  # the network threads need the GIL too
        if not finished:
            finished = session.finish()
            report_connections()
    finally:
        session.close()
    save_file({k: v.detach().clone().contiguous() for k, v in model.named_parameters()}, args.out)
    report("learner_done", finished=finished, steps=stats.steps, tokens=stats.tokens, replays=stats.replays,
           pushes=stats.pushes, generations=list(stats.connected_generations),
           seconds=round(time.monotonic() - started, 2))
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
