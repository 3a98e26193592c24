"""A rank of a Miles island: `miles_loop`'s reproduction of Miles' actor loop around a real megatron-core
island, with yeto attached the way a Miles user attaches it (run by `launch.run_ranks`).

    python miles_worker.py stream SPEC_JSON ROLLOUTS STEPS             # the before-train-step hook only
    python miles_worker.py sweep  SPEC_JSON ROLLOUTS STEPS [no-refresh] # + a sweep between train and update_weights
        [save=DIR save_at=K hang=N | resume=DIR start=K]                  # a crash, and Miles' resume

A crash and Miles' resume: `save_at=K` writes each rank's parameters after rollout K-1 (Miles' checkpoint
of the actor, `DIR/ckpt-rankR.pt`); `hang=N` writes the first N rollouts' records (`DIR/killed-rankR.json`)
and waits to be killed. `resume=DIR start=K` loads those parameters once the actor is built, as Miles'
actor init loads its checkpoint before any training (the optimizer's fp32 masters refreshed from them,
the weight backup taken again), sets `start_rollout_id`, and records the island's global values right
after its join (`joined_digest`).

Settings come from YETO_DILOCO_* (the sweep modes set YETO_DILOCO_RL_MODE). Every rank reports, per
rollout, whether the engine (what the colocated updater sent) equals this rank's parameters and the
island's fp32 masters, and a digest of the island's global values; at the end the same checks
against the final values, plus the island's counters.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from islands import IslandSpec, init_island, rank_info, teardown
from launch import report
from miles_loop import MilesActor, miles_args, named_params, run_driver
from sync_worker import check_rank, moments, share

from yeto_plugins.megatron.store import Slot, shard_of
from yeto_plugins.megatron.sync import MegatronDiLoCoSync
from yeto_plugins.miles import hook

HOOK = "yeto_plugins.miles.hook.before_train_step"


def engine_problems(sync: MegatronDiLoCoSync, actor: MilesActor, values: dict[str, torch.Tensor]) -> list[str]:
    """The engine's copy of each of this rank's synced parameters against the global `values`."""
    by_param = {id(lp.param): lp for lp in sync.store.local}
    problems = []
    for name, param in named_params(actor.model):
        lp = by_param.get(id(param))
        if lp is None:
            continue
        shape, tp_dim, stride = sync.store._shapes[lp.global_name]
        whole = values[lp.global_name].reshape(-1).float()
        mine = shard_of(whole, Slot(lp.global_name, shape, 0, whole.numel(), tp_dim, stride), lp.shard)
        if not torch.equal(actor.engine[name].reshape(-1), mine.to(param.dtype)):
            problems.append(f"engine: {name} differs")
    return problems


def digest(values: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.float().numpy().tobytes()).hexdigest() for k, v in values.items()}


def resume_from(actor: MilesActor, directory: Path, start: int, joined: dict[str, Any]) -> None:
    """What Miles' actor init does with `--load` before any training, then the join's values recorded."""
    saved = torch.load(directory / f"ckpt-rank{os.environ['RANK']}.pt")
    with torch.no_grad():
        for name, param in named_params(actor.model):
            param.copy_(saved[name])
    actor.optimizer.reload_model_params()  # the fp32 masters from the loaded parameters
    actor.weights_backuper.backup("actor")  # actor.py:233-234, after the load
    actor.args.start_rollout_id = start
    real = hook.before_train_step

    def recording(*args: Any) -> None:  # Miles' hook: the first call joins; record what the join installed
        real(*args)
        if not joined:
            joined["joined_digest"] = digest(share(hook.current().sync.read_all()))

    hook.before_train_step = recording  # type: ignore[assignment]  # Miles looks the hook up at every step


def main(mode: str, spec_text: str, rollouts: int, steps: int, refresh: bool, crash: dict[str, str]) -> None:
    island = init_island(IslandSpec(**json.loads(spec_text)))
    args = miles_args(rollouts, steps, island, HOOK)
    actor = MilesActor(args, island)
    joined: dict[str, Any] = {}
    if "resume" in crash:
        resume_from(actor, Path(crash["resume"]), int(crash["start"]), joined)
    per_rollout: list[dict[str, Any]] = []
    kept: list[bool] = []  # per sweep: every Adam moment bit for bit as before it

    def sweep(rollout_id: int) -> None:
        before = moments(island.optimizer)
        hook.current().sweep(rollout_id, actor.weights_backuper if refresh else None)
        after = moments(island.optimizer)
        kept.append(len(before) > 0 and all(torch.equal(x, y) for x, y in zip(before, after, strict=True)))

    def check(rollout_id: int) -> None:
        sync = hook.current().sync
        values = share(sync.read_all())
        per_rollout.append({"rollout": rollout_id, "engine": engine_problems(sync, actor, values),
                            "weights": check_rank(sync, values, f"rollout {rollout_id}"), "digest": digest(values)})
        rank = os.environ["RANK"]
        if int(crash.get("save_at", 0)) == rollout_id + 1:
            torch.save({name: p.detach().clone() for name, p in named_params(actor.model)},
                       Path(crash["save"]) / f"ckpt-rank{rank}.pt")
        if int(crash.get("hang", 0)) == rollout_id + 1:
            (Path(crash["save"]) / f"killed-rank{rank}.json").write_text(json.dumps(per_rollout))
            time.sleep(600)  # the test kills the island here

    run_driver(actor, steps, between=sweep if mode == "sweep" else (lambda rollout_id: None), after=check)
    miles = hook.current()
    values = share(miles.sync.read_all())
    report({"final": miles.final, "per_rollout": per_rollout, "engine": engine_problems(miles.sync, actor, values),
            "problems": check_rank(miles.sync, values, "final"), "digest": digest(values), "losses": actor.losses,
            "pushes": miles.sync.stats.pushes, "installs": miles.sync.stats.installs,
            "steps_accounted": miles.sync.stats.steps, "moments_kept": kept, **joined, **rank_info()})
    miles.close()
    teardown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mode, spec, rollouts, steps, *rest = sys.argv[1:]
    if mode not in ("stream", "sweep"):
        raise SystemExit(f"unknown mode {mode}")
    main(mode, spec, int(rollouts), int(steps), refresh="no-refresh" not in rest,
         crash=dict(item.split("=", 1) for item in rest if "=" in item))
