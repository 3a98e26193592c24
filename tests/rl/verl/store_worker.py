"""One rank of verl's real actor (FSDP2 on gloo) whose parameters yeto's `ProcessGroupStore` reads and writes::

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/rl/verl/store_worker.py \\
        --model DIR --out DIR

After one PPO update (so AdamW holds moments), rank 0 reads every fragment through the store and writes
new values back, the other ranks following, as an island's learner session does. Every rank reports in
`rank{R}.json` what did not hold: reads equal to the FSDP2 module's full parameters, writes landing bit
for bit in every rank's shards, the optimizer's moments untouched, and the engine training on afterwards.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import actor_worker as harness  # first: it registers the CPU platform and rollout before verl needs them
import torch
import torch.distributed as dist

from yeto_core.layout import build_layout
from yeto_plugins.torch_dist.modules import embedding_names, synced_parameters
from yeto_plugins.torch_dist.store import ProcessGroupStore

FRAGMENTS = 3
SHIFT = 0.25  # what the write adds to every value


def moments(optimizer: torch.optim.Optimizer) -> list[str]:
    """Digests of every tensor the optimizer keeps, whole (a collective for DTensor shards)."""
    out = []
    for state in optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                full = value.full_tensor() if hasattr(value, "full_tensor") else value
                out.append(f"{key}:{harness.tensor_digest(full)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    worker = harness.build_worker(args.model, iterations=2)
    engine = harness.actor_engine(worker)
    rank, dp = dist.get_rank(), (engine.get_data_parallel_rank(), engine.get_data_parallel_size())
    harness.run_iteration(worker, harness.synthetic_batch(0, 0, *dp))
    module = engine.module
    store = ProcessGroupStore(synced_parameters(module, "full"), embedding_names(module))
    layout = build_layout(store.specs, FRAGMENTS)
    before_moments, before = moments(engine.optimizer), harness.actor_full_params(worker)
    problems: list[str] = []
    read: dict[int, torch.Tensor] = {}

    def read_then_write() -> bool:  # rank 0, as its learner session would
        for fragment in layout.fragments:
            read[fragment.index] = store.gather(fragment).clone()
        for fragment in layout.fragments:
            store.install(fragment, read[fragment.index] + SHIFT, 0.0)
        return False

    store.run(read_then_write if rank == 0 else None)
    after = harness.actor_full_params(worker)
    for fragment in layout.fragments:
        for slot in fragment.slots:
            if rank == 0 and not torch.equal(read[fragment.index][slot.offset : slot.offset + slot.numel],
                                             before[slot.name].reshape(-1)):
                problems.append(f"read: {slot.name} differs from the module's full parameter")
            if not torch.equal(after[slot.name], before[slot.name] + SHIFT):
                problems.append(f"write: {slot.name} is not what was installed")
    if moments(engine.optimizer) != before_moments:
        problems.append("the optimizer's moments changed")
    harness.run_iteration(worker, harness.synthetic_batch(1, 0, *dp))
    moved = harness.actor_full_params(worker)
    if any(torch.equal(moved[name], after[name]) for name in after):
        problems.append("the engine did not train on from the written values")
    report = {"rank": rank, "tensors": len(store.specs), "fragments": FRAGMENTS, "problems": problems}
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
