"""Where a learner's synced tensors live: the seam between `LearnerSession` and a trainer.

The session decides *when* to read a fragment (to push θ − anchor) and *when* to write one (a
BCAST or the final cut); a `TensorStore` decides *how*. `LocalStore` covers a single process that
holds every tensor (an HF island). A sharded trainer (Megatron TP/PP/DP/EP) supplies its own store
whose reads and writes are collectives over the island's ranks; the session runs unchanged on the
island's rank 0.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from yeto_core.buffers import BufferPool
from yeto_core.layout import Fragment, TensorSpec, specs_from_named_tensors

FRAGMENT_POOL = BufferPool()  # fragment-sized f32 work buffers, recycled once nothing holds them
# Idle buffers of a size worth keeping after a burst: a push's delta and an overlap rebase's base,
# each round (an RL sweep takes every fragment at once and grows the pool back on its first sweep).
STEADY_FRAGMENT_BUFFERS = 2


def fragment_buffer(numel: int) -> torch.Tensor:
    """An uninitialized f32 tensor of `numel` values for a fragment read or a delta: a recycled buffer
    when one of that size is free. A fresh 32 MiB tensor faults in every page as it is first written,
    which made a fragment read 5x slower than the copy itself here; an RL sweep reads every fragment."""
    return torch.frombuffer(FRAGMENT_POOL.take(numel * 4), dtype=torch.float32) if numel else torch.empty(0)

__all__ = ["LocalStore", "TensorStore", "blend_into", "check_fragment_values", "nonfinite_tensor"]


class TensorStore(Protocol):
    """The synced tensors of one island, in canonical order (`specs`)."""

    specs: list[TensorSpec]

    def gather(self, fragment: Fragment) -> torch.Tensor:
        """The fragment's current values as one new flat f32 tensor of `fragment.numel`."""
        ...

    def install(self, fragment: Fragment, values: torch.Tensor, alpha: float) -> None:
        """θ ← α·θ + (1−α)·values for every tensor of the fragment (α = 0: an exact copy).
        Optimizer state is left alone."""
        ...

    def tick(self) -> None:
        """Called while the session waits (start, finish): a store whose other ranks wait on it
        can tell them it is still alive."""
        ...


def check_fragment_values(fragment: Fragment, values: torch.Tensor) -> None:
    """Refuse values that cannot be a fragment's, before anything is written."""
    if values.dtype != torch.float32 or values.dim() != 1 or values.numel() != fragment.numel:
        raise ValueError(f"fragment {fragment.index}: got {values.dtype} values of shape {tuple(values.shape)}, "
                         f"expected {fragment.numel} float32 values")


def nonfinite_tensor(fragment: Fragment, values: torch.Tensor) -> str | None:
    """The name of the first tensor of `fragment` whose slice of `values` holds NaN or ±Inf, or
    None when all are finite. One read pass when they are: a finite sum proves it (NaN and Inf
    propagate); only a poisoned or overflowing sum looks tensor by tensor."""
    if math.isfinite(values.sum().item()):
        return None
    for slot in fragment.slots:
        if not bool(torch.isfinite(values[slot.offset : slot.offset + slot.numel]).all()):
            return slot.name
    return None


def blend_into(param: torch.Tensor, glob: torch.Tensor, alpha: float) -> None:
    """param ← α·param + (1 − α)·glob, in place (the parameter object and its optimizer state
    stay); α = 0 copies. A lower-precision parameter is blended in f32 and rounded once."""
    if alpha == 0.0:
        param.copy_(glob)
    elif param.dtype == torch.float32:
        param.mul_(alpha).add_(glob, alpha=1.0 - alpha)
    else:
        param.copy_(param.float().mul_(alpha).add_(glob, alpha=1.0 - alpha))


class LocalStore:
    """Every synced tensor lives in this process: reads concatenate, writes copy in place."""

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]], embedding_names: Collection[str] = ()):
        self.params: dict[str, torch.Tensor] = dict(named_params)
        self.specs: list[TensorSpec] = specs_from_named_tensors(named_params, embedding_names)

    def gather(self, fragment: Fragment) -> torch.Tensor:
        with torch.no_grad():
            parts = [self.params[s.name].detach().reshape(-1).float() for s in fragment.slots]
            return torch.cat(parts, out=fragment_buffer(fragment.numel))

    def install(self, fragment: Fragment, values: torch.Tensor, alpha: float) -> None:
        check_fragment_values(fragment, values)
        with torch.no_grad():
            for slot in fragment.slots:
                param = self.params[slot.name]
                blend_into(param, values[slot.offset : slot.offset + slot.numel].view(slot.shape), alpha)

    def tick(self) -> None:
        pass
