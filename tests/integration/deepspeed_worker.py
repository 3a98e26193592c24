"""A rank of a DeepSpeed ZeRO island (CPU, gloo) run by `tests/mcore/launch.run_ranks`.

    python deepspeed_worker.py STAGE     # reads and writes through ProcessGroupStore are exact

Each rank reports `problems` (empty when every check held) through `launch.report`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mcore"))
from launch import end_rank, report

from yeto_core.layout import build_layout
from yeto_plugins.torch_dist.store import ProcessGroupStore


def share(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def main(stage: int) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce kernel at its first use
    # on a machine (a minute or two on CI's cores); gloo alone carries these collectives, and the
    # engine, its ZeRO partitions and its optimizer are the same without the kernel.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())

    def train() -> None:
        x = torch.randn(4, 8, generator=gen)
        engine.backward((engine(x) ** 2).mean())
        engine.step()

    for _ in range(2):
        train()
    named = list(engine.module.named_parameters())
    store = ProcessGroupStore(named)
    fragment = build_layout(store.specs, 1).fragments[0]
    problems: list[str] = []

    def masters() -> dict[str, torch.Tensor]:
        return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in named}

    def moments() -> list[torch.Tensor]:
        keys = ("exp_avg", "exp_avg_sq")
        return [safe_get_full_optimizer_state(p, k).detach().clone() for _, p in named for k in keys]

    def low_precision() -> dict[str, torch.Tensor]:
        if stage < 3:
            return {n: p.detach().clone() for n, p in named}
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            return {n: p.detach().clone() for n, p in named}

    box: dict[str, torch.Tensor] = {}

    def gather() -> bool:
        box["read"] = store.gather(fragment)
        return False

    store.run(gather if store.rank == 0 else None)
    read, before, kept = share(box.get("read")), masters(), moments()
    for slot in fragment.slots:
        if not torch.equal(read[slot.offset : slot.offset + slot.numel].view(slot.shape), before[slot.name]):
            problems.append(f"read: {slot.name} differs from its fp32 master")
    new = torch.randn(fragment.numel, generator=torch.Generator().manual_seed(7))
    for alpha in (0.0, 0.5):
        base = masters()
        store.run((lambda a=alpha: store.install(fragment, new.clone(), a)) if store.rank == 0 else None)  # type: ignore[misc]
        now, lp = masters(), low_precision()
        for slot in fragment.slots:
            glob = new[slot.offset : slot.offset + slot.numel].view(slot.shape)
            want = glob if alpha == 0.0 else base[slot.name].mul(alpha).add(glob, alpha=1.0 - alpha)
            if not torch.equal(now[slot.name].view(slot.shape), want):
                problems.append(f"write alpha={alpha}: the master of {slot.name} is not what was installed")
            if not torch.equal(lp[slot.name].view(slot.shape).float(), want):
                problems.append(f"write alpha={alpha}: the parameter {slot.name} the forward pass uses is stale")
    if not all(torch.equal(a, b) for a, b in zip(moments(), kept, strict=True)):
        problems.append("optimizer moments changed")
    train()  # still trains after the writes
    store.close()
    report({"problems": problems, "stage": stage, "specs": [list(s.shape) for s in store.specs]})


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    end_rank()
