"""`ProcessGroupStore`: an HF island of several processes (DDP replicas or FSDP2 shards).

Every rank holds the model; rank 0 alone runs the learner session (`yeto_core.conductor` makes
the others follow its reads and writes over a gloo group of the island):

* **DDP** — every rank holds the same full parameters. Rank 0 reads its own copy (nothing to
  collect); a write broadcasts the fragment's values and every rank applies the same blend to its
  replica, so the replicas stay bit-identical.
* **FSDP2** (`fully_shard`: parameters are `DTensor`s) — a read is `full_tensor()` on every rank
  (an all-gather), of which rank 0 keeps the values; a write broadcasts the values and each rank
  cuts its own shard out of them (`distribute_tensor(..., src_data_rank=None)` slices locally,
  no communication) and blends it into the *same* parameter objects, so the optimizer's moments,
  keyed by those objects, are kept.
* **DeepSpeed ZeRO** (stages 1–3) — the fp32 masters live in the ZeRO optimizer's partitions. A
  read is DeepSpeed's own `safe_get_full_fp32_param` on every rank; a write sets the master with
  `safe_set_full_fp32_param` and the low-precision parameter the forward pass uses (whole under
  ZeRO-1/2; under ZeRO-3 through `GatheredParameters`, which re-partitions it). Moments are kept.

The consensus probe (DESIGN §8.1) is the conductor's op: every rank runs the same forward pass on
the probe batch, and rank 0 reports its logits.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist

from yeto_core.conductor import FIRST_STORE_OP, ConductedStore
from yeto_core.layout import Fragment, TensorSlot, TensorSpec, specs_from_named_tensors
from yeto_core.moments import OptimizerMoments
from yeto_core.sections import DEFAULT_ISLAND, IslandSettings
from yeto_core.store import blend_into, check_fragment_values, fragment_buffer

GATHER, INSTALL = FIRST_STORE_OP, FIRST_STORE_OP + 1
FIRST_MOMENT_OP = FIRST_STORE_OP + 2  # the shared optimizer moment's ops (`moments.IslandMoments`)


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "device_mesh")


def zero_stage(t: torch.Tensor) -> int:
    """3 for a ZeRO-3 partitioned parameter, 1 for one whose fp32 master a ZeRO-1/2 optimizer
    holds, 0 otherwise."""
    return 3 if hasattr(t, "ds_id") else 1 if hasattr(t, "_hp_mapping") else 0  # None where no part is local


def _collective(t: torch.Tensor) -> bool:
    """Reading the full value of `t` needs every rank."""
    return is_dtensor(t) or zero_stage(t) > 0


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", None) or t.shape)  # a ZeRO-3 parameter is empty locally


def _alpha_bits(alpha: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", alpha))[0])


def _bits_alpha(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


class ProcessGroupStore(ConductedStore):
    """A `CollectiveStore` for a DDP, FSDP2 or ZeRO island: rank 0's session reads and writes
    through it, the other ranks follow (`run`)."""

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], embedding_names: Collection[str] = (),
                 island: IslandSettings = DEFAULT_ISLAND) -> None:
        super().__init__(island)
        self.params: dict[str, torch.Tensor] = dict(named_params)
        self.specs: list[TensorSpec] = [
            TensorSpec(s.name, _shape(self.params[s.name]), s.dtype, s.embedding)  # DTensor: global shape already
            for s in specs_from_named_tensors(named_params, embedding_names)]
        self.sharded = any(_collective(p) for p in self.params.values())
        self.conductor.handlers[GATHER] = self._follow_read
        self.conductor.handlers[INSTALL] = lambda plan, numel, bits: self._write(
            self.conductor.plan_of(plan), torch.empty(numel, dtype=torch.float32), _bits_alpha(bits))

    def moments(self, optimizer: Any) -> OptimizerMoments:
        """The optimizer's first moment of these tensors, read and changed by every rank together
        (DESIGN §3.9); every rank calls it with its own optimizer."""
        from yeto_plugins.torch_dist.moments import IslandMoments

        return IslandMoments(self, optimizer)

    # -- TensorStore (rank 0) ----------------------------------------------------------------
    def _plan(self, fragment: Fragment) -> tuple[int, tuple[TensorSlot, ...]]:
        return self.conductor.plan((fragment.index, fragment.numel, fragment.slots), lambda: fragment.slots)

    def gather(self, fragment: Fragment) -> torch.Tensor:
        if any(_collective(self.params[s.name]) for s in fragment.slots):
            plan, _ = self._plan(fragment)
            self.conductor.announce(GATHER, plan)  # the all-gathers need every rank
        out = self._read(fragment.slots)
        assert out is not None
        return out

    def install(self, fragment: Fragment, values: torch.Tensor, alpha: float) -> None:
        check_fragment_values(fragment, values)  # before the other ranks are told anything
        plan, _ = self._plan(fragment)
        self.conductor.announce(INSTALL, plan, fragment.numel, _alpha_bits(alpha))
        self._write(fragment.slots, values.contiguous(), alpha)

    # -- on every rank ---------------------------------------------------------------------------
    def _follow_read(self, plan: int, _b: int, _c: int) -> None:
        self._read(self.conductor.plan_of(plan))

    def _read(self, slots: Sequence[TensorSlot]) -> torch.Tensor | None:
        parts = []
        with torch.no_grad():
            for slot in slots:
                full = self._full(self.params[slot.name])
                if self.rank == 0:
                    parts.append(full.reshape(-1).float())
        return torch.cat(parts, out=fragment_buffer(sum(p.numel() for p in parts))) if self.rank == 0 else None

    @staticmethod
    def _full(p: torch.Tensor) -> torch.Tensor:
        """The whole value of `p` (fp32 master under ZeRO); a collective for sharded parameters."""
        if zero_stage(p):
            from deepspeed.utils import safe_get_full_fp32_param

            return safe_get_full_fp32_param(p).detach()
        return (p.full_tensor() if is_dtensor(p) else p).detach()  # type: ignore[attr-defined]

    @staticmethod
    def _write_zero(param: torch.Tensor, glob: torch.Tensor, alpha: float) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        if alpha != 0.0:
            glob = ProcessGroupStore._full(param).float().mul_(alpha).add_(glob, alpha=1.0 - alpha)
        safe_set_full_fp32_param(param, glob)
        if zero_stage(param) == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(glob.view(param.shape))  # every rank holds glob; rank 0's is kept
        else:
            param.data.copy_(glob.view(param.shape))  # the low-precision copy the forward pass reads

    def _write(self, slots: Sequence[TensorSlot], values: torch.Tensor, alpha: float) -> None:
        dist.broadcast(values, 0, group=self.conductor.group)
        with torch.no_grad():
            for slot in slots:
                param = self.params[slot.name]
                glob = values[slot.offset : slot.offset + slot.numel].view(slot.shape)
                if zero_stage(param):
                    self._write_zero(param, glob, alpha)
                    continue
                if is_dtensor(param):
                    from torch.distributed.tensor import distribute_tensor

                    glob = distribute_tensor(glob.to(param.dtype if alpha == 0.0 else torch.float32),
                                             param.device_mesh, param.placements,  # type: ignore[attr-defined]
                                             src_data_rank=None)
                blend_into(param, glob, alpha)
