"""One rank of a verl RL island with yeto attached, run under torchrun::

    python -m torch.distributed.run --standalone --nproc_per_node N tests/rl/verl/island_worker.py \\
        --model DIR --iterations K --out DIR [--seed S]

The harness's iterations (`actor_worker.py`: verl's real `ActorRolloutRefWorker`, PPO updates, the naive
weight sync into the recording CPU rollout), with `YETO_DILOCO_*` in the environment: verl loads yeto's entry
point when it is imported, and the actor becomes `YetoTrainingWorker`. Nothing here calls yeto.

Every rank writes `rank{R}.json`: per iteration the rollout's and the actor's tensor digests and whether the
final cut is in, and at the end the island's counters. Rank 0 also writes `rollout_weights.safetensors` and
`actor_params.safetensors`.

A crash and verl's resume, as its trainer does them (verl/trainer/ppo/v1/trainer_base.py): `--save-at K` saves
verl's checkpoint after global step K (iteration K-1) to `OUT/ckpt/global_step_K/actor`; `--hang-after N`
stops after N iterations, reported, and waits to be killed; `--resume DIR` (a `global_step_K` folder) loads
verl's checkpoint once the worker is built and trains on from iteration K, recording the actor's weights
right after the load as `resumed_digests`.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import actor_worker as harness  # first: it registers the CPU platform and rollout before verl needs them
import torch
import torch.distributed as dist
from safetensors.torch import save_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0, help="selects this island's batches")
    parser.add_argument("--save-at", type=int, default=0, help="save verl's checkpoint after this global step")
    parser.add_argument("--hang-after", type=int, default=0, help="after this many iterations, wait to be killed")
    parser.add_argument("--resume", type=Path, default=None, help="a global_step_K folder of verl's checkpoint")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    shape = harness.DEFAULT_SHAPE
    worker = harness.build_worker(args.model, args.iterations, shape)
    actor = worker.actor
    assert type(actor).__name__ == "YetoTrainingWorker", f"verl built {type(actor).__name__}: yeto did not attach"
    rank = dist.get_rank()
    dp_rank, dp_size = actor.engine.get_data_parallel_rank(), actor.engine.get_data_parallel_size()
    rollout = harness.recording_rollout(worker)
    records: list[dict[str, object]] = []
    report: dict[str, object] = {"rank": rank, "per_iteration": records}
    first = 0
    if args.resume is not None:  # what verl's trainer does after building its workers (_load_checkpoint)
        worker.load_checkpoint(local_path=str(args.resume / "actor"))
        first = int(re.search(r"global_step_(\d+)", args.resume.name).group(1))  # type: ignore[union-attr]
        report["resumed_digests"] = harness.digests(harness.actor_full_params(worker))
        report["resumed_iterations"] = actor.iterations
    try:
        for iteration in range(first, args.iterations):
            batch = harness.synthetic_batch(iteration, args.seed, dp_rank, dp_size, shape)
            tokens = harness.global_token_count(batch)  # the island's, all ranks together (a collective)
            metrics = harness.run_iteration(worker, batch)
            records.append({
                "iteration": iteration, "lr": metrics.get("lr"), "final": actor.final, "tokens": tokens,
                "rollout_digests": harness.digests(rollout.weights),
                "actor_digests": harness.digests(harness.actor_full_params(worker)),
            })
            if iteration + 1 == args.save_at:
                worker.save_checkpoint(local_path=str(args.out / "ckpt" / f"global_step_{args.save_at}" / "actor"),
                                       global_step=args.save_at)
            if iteration + 1 == args.hang_after:
                (args.out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
                time.sleep(600)  # the test kills the island here
        final_actor = harness.actor_full_params(worker)
        if rank == 0:
            save_file(rollout.weights, str(args.out / "rollout_weights.safetensors"))
            save_file(final_actor, str(args.out / "actor_params.safetensors"))
        stats = actor.island.stats
        report.update({"iterations": len(records), "pushes": stats.pushes, "installs": stats.installs,
                       "final_installed": stats.final_installed})
        (args.out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    finally:
        if actor.island is not None:
            actor.island.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
