"""A learner process for the WAN emulation tests: a LearnerSession over a small MLP (the same as the
in-process Island), trained until the syncer's final cut; it then writes its parameters to --out.

    python tests/integration/netns_learner.py --syncer HOST:PORT --key-file F --learner-id N --out P
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from mlp import small_mlp
from safetensors.torch import save_file

from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncer", required=True)
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--learner-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data-streams", type=int, default=2)
    ap.add_argument("--deadline-s", type=float, default=150.0)
    ap.add_argument("--max-steps", type=int, default=100_000)
    args = ap.parse_args()

    torch.set_num_threads(1)
    model, target, opt = small_mlp(args.learner_id)
    config = load_settings(LearnerSettings, syncer=args.syncer, key_file=args.key_file, learner_id=args.learner_id,
                           data_streams=args.data_streams, sync_interval=8, init_timeout_s=60, final_timeout_s=60,
                           reconnect_max_s=1, connect_timeout_s=10)
    session = LearnerSession(config, list(model.named_parameters()))
    started = time.monotonic()
    finished = False
    steps = 0
    try:
        session.start()
        deadline = started + args.deadline_s
        while steps < args.max_steps and time.monotonic() < deadline:
            x = torch.randn(16, 8)
            loss = torch.nn.functional.mse_loss(model(x), x @ target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if session.step(tokens=16):
                finished = True
                break
            time.sleep(0.005)  # the session's network threads need the GIL too
        if not finished:
            finished = session.finish()
    finally:
        session.close()
    save_file({k: v.detach().clone().contiguous() for k, v in model.named_parameters()}, args.out)
    print(json.dumps({"event": "learner_done", "finished": finished, "steps": steps,
                      "generations": list(session.stats.connected_generations),
                      "seconds": round(time.monotonic() - started, 2)}), flush=True)
    return 0 if finished else 1


if __name__ == "__main__":
    sys.exit(main())
