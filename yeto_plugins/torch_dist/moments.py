"""`IslandMoments`: the optimizer's first moment shared by an island of several processes (DESIGN §3.9).

Rank 0's session reads and changes the moment; every rank holds it (`store.ProcessGroupStore`'s
kinds of island), so every rank must take part, in the same order, as it does for the weights:

* **DDP** — every rank holds the same full moment (its gradients are all-reduced). A read is rank
  0's own copy, nothing to collect. A change is broadcast and every rank adds it to its replica,
  so the replicas stay bit-identical and the ranks keep training the same weights.
* **FSDP2** — the moment is a `DTensor` sharded like its parameter. A read is `full_tensor()` on
  every rank (an all-gather) of which rank 0 keeps the values; a change is broadcast and each rank
  cuts its own shard out of it locally (`distribute_tensor(..., src_data_rank=None)`).

DeepSpeed ZeRO keeps its moments in its own flat partitions, not in a torch optimizer's state by
parameter: it is refused with one line naming the setting.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from yeto_core.layout import Fragment, TensorSlot
from yeto_core.moments import MomentError, OptimizerMoments
from yeto_plugins.torch_dist.store import FIRST_MOMENT_OP, ProcessGroupStore, is_dtensor, zero_stage

READ, ADD = FIRST_MOMENT_OP, FIRST_MOMENT_OP + 1


class IslandMoments(OptimizerMoments):
    """Every rank builds one over its own optimizer; rank 0's session drives it, the others follow
    through the store's conductor."""

    def __init__(self, store: ProcessGroupStore, optimizer: Any) -> None:
        zero = [name for name, p in store.params.items() if zero_stage(p)]
        if zero:
            raise MomentError("YETO_DILOCO_SHARE_MOMENTUM: DeepSpeed ZeRO keeps the optimizer's moments in its own "
                              f"partitions ({zero[0]!r}); unset it for a ZeRO island")
        super().__init__(optimizer, list(store.params.items()))
        self.store = store
        conductor = store.conductor
        conductor.handlers[READ] = lambda plan, _b, _c: self._read(conductor.plan_of(plan))
        conductor.handlers[ADD] = lambda plan, numel, _c: self._add(conductor.plan_of(plan),
                                                                    torch.empty(numel, dtype=torch.float32))

    def _plan(self, fragment: Fragment) -> int:
        return self.store.conductor.plan((fragment.index, fragment.numel, fragment.slots), lambda: fragment.slots)[0]

    # -- rank 0 (the session) ----------------------------------------------------------------
    def gather(self, fragment: Fragment, out: torch.Tensor | None = None) -> torch.Tensor | None:
        moments = [self._moment(slot.name) for slot in fragment.slots]
        if any(m is None or _numel(m) != slot.numel for m, slot in zip(moments, fragment.slots, strict=True)):
            return None  # every rank steps together: none of them has one yet either
        if any(is_dtensor(m) for m in moments if m is not None):
            self.store.conductor.announce(READ, self._plan(fragment))  # the all-gathers need every rank
        out = torch.empty(fragment.numel, dtype=torch.float32) if out is None else out
        self._read(fragment.slots, out)
        return out if bool(torch.isfinite(out).all()) else None

    def add(self, fragment: Fragment, change: torch.Tensor) -> None:
        self.store.conductor.announce(ADD, self._plan(fragment), fragment.numel)
        self._add(fragment.slots, change.contiguous())

    # -- on every rank ---------------------------------------------------------------------------
    def _read(self, slots: tuple[TensorSlot, ...], out: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            for slot in slots:
                moment = self._moment(slot.name)
                assert moment is not None, "the island's ranks step their optimizers together"
                whole = moment.full_tensor() if is_dtensor(moment) else moment  # type: ignore[attr-defined]
                if out is not None:
                    out[slot.offset : slot.offset + slot.numel].copy_(whole.detach().reshape(-1))

    def _add(self, slots: tuple[TensorSlot, ...], change: torch.Tensor) -> None:
        dist.broadcast(change, 0, group=self.store.conductor.group)
        with torch.no_grad():
            for slot in slots:
                moment = self._moment(slot.name)
                if moment is None:
                    continue
                part = change[slot.offset : slot.offset + slot.numel].view(slot.shape)
                if is_dtensor(moment):
                    from torch.distributed.tensor import distribute_tensor

                    part = distribute_tensor(part.to(moment.dtype), moment.device_mesh,  # type: ignore[attr-defined]
                                             moment.placements, src_data_rank=None)  # type: ignore[attr-defined]
                moment.add_(part.to(device=moment.device, dtype=moment.dtype))
                self.bound(slot.name, moment)


def _numel(t: torch.Tensor) -> int:
    return int(torch.Size(t.shape).numel())  # a DTensor's shape is the global one
