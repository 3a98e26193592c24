"""`IslandStore`: a Megatron island's fragments, read and written across all of its ranks.

Only the island's rank 0 talks to the syncer (it runs the ordinary `LearnerSession` on this
store). Every other rank must take part in each read and write, so rank 0 leads and the others
follow one op at a time (`yeto_core.conductor`) over a gloo group of the whole island:

* `GATHER plan` — each rank sends rank 0 the master slices it answers for (`masters.py`), in its
  own parameter order; rank 0 puts them where they belong in the global tensors (tensor-parallel
  slices are joined along their split dimension, interleaved by Megatron's partition stride).
* `INSTALL plan` — rank 0 cuts each rank's whole TP-local tensors out of the fragment and sends
  them; every rank writes masters and parameters (`masters.write_parameter`).
The first use of a fragment tells the others its tensors (the conductor's PLAN).

A fragment moves in batches of whole tensors of at most `gather_chunk_mib` (a larger tensor is a
batch of its own), so no rank holds more than one batch of it beyond what the session keeps.
Rank 0 checks a write's size before it announces the write: a bad payload raises on rank 0 and,
through the conductor, on every rank, instead of leaving the others waiting in a transfer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from yeto_core.conductor import FIRST_STORE_OP, ConductedStore, IslandError
from yeto_core.layout import Fragment, TensorSpec
from yeto_core.sections import DEFAULT_ISLAND, IslandSettings
from yeto_core.store import check_fragment_values
from yeto_plugins.megatron.masters import Master, masters, write_parameter
from yeto_plugins.megatron.names import EMBEDDING, LocalParam, canonical_order, local_params

log = logging.getLogger("yeto.megatron")

T = TypeVar("T")
GATHER, INSTALL = FIRST_STORE_OP, FIRST_STORE_OP + 1
__all__ = ["IslandError", "IslandStore", "join_shards", "shard_of"]


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one global tensor (from its catalog)."""

    name: str
    local_numel: int
    shard: tuple[int, int]
    owned: tuple[int, int] | None
    alias: bool


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int  # in the fragment's flat values
    numel: int
    tp_dim: int
    stride: int


def _batches(slots: Sequence[Slot], limit: int) -> list[list[Slot]]:
    """Consecutive slots grouped to at most `limit` elements (a larger slot alone)."""
    out: list[list[Slot]] = []
    size = 0
    for slot in slots:
        if not out or size + slot.numel > limit:
            out.append([])
            size = 0
        out[-1].append(slot)
        size += slot.numel
    return out


def shard_of(values: torch.Tensor, slot: Slot, shard: tuple[int, int]) -> torch.Tensor:
    """The flat TP-local slice `shard` = (t, T) of a global tensor (`values` flat, `slot.numel`).

    Megatron cuts dimension d of the global tensor into stride·T blocks and gives slice t the
    blocks t, T + t, 2T + t, ... (stride 2 for a GLU: [gate_t; up_t])."""
    t, n = shard
    if n == 1:
        return values
    full = values.view(slot.shape)
    size = full.shape[slot.tp_dim] // (n * slot.stride)
    parts = [full.narrow(slot.tp_dim, (k * n + t) * size, size) for k in range(slot.stride)]
    part = parts[0] if len(parts) == 1 else torch.cat(parts, dim=slot.tp_dim)
    return part.reshape(-1)  # a view when the slice is contiguous (d = 0, stride 1)


def join_shards(out: torch.Tensor, slot: Slot, shards: list[torch.Tensor]) -> None:
    """Write the TP-local slices (flat, in TP order) into `out`, the flat global tensor."""
    n = len(shards)
    if n == 1:
        out.copy_(shards[0])
        return
    local_shape = list(slot.shape)
    local_shape[slot.tp_dim] //= n
    blocks = [s.view(local_shape).chunk(slot.stride, dim=slot.tp_dim) for s in shards]
    ordered = [blocks[t][k] for k in range(slot.stride) for t in range(n)]
    torch.cat(ordered, dim=slot.tp_dim, out=out.view(slot.shape))


class IslandStore(ConductedStore):
    """A `CollectiveStore` for a Megatron island: rank 0's session reads and writes through it,
    the other ranks call `run` with the same calls and follow."""

    def __init__(self, chunks: Sequence[torch.nn.Module], optimizer: Any,
                 island: IslandSettings = DEFAULT_ISLAND) -> None:
        super().__init__(island)
        self.group = self.conductor.group
        plan_of = self.conductor.plan_of
        self.conductor.handlers[GATHER] = lambda plan, _b, _c: self._gather_batches(plan_of(plan), None)
        self.conductor.handlers[INSTALL] = lambda plan, _b, _c: self._install_batches(plan_of(plan), None)
        self.chunk_elems = (island.gather_chunk_mib << 20) // 4
        self.local: list[LocalParam] = local_params(chunks)
        self.masters: list[Master] = masters(self.local, optimizer)
        mine = [Piece(lp.global_name, lp.param.numel(), lp.shard, m.owned, lp.alias)
                for lp, m in zip(self.local, self.masters, strict=True)]
        described = [lp.describe() for lp in self.local]
        catalogs: list[Any] = [None] * self.world
        dist.all_gather_object(catalogs, (mine, described), group=self.group)
        self.catalogs: list[list[Piece]] = [c[0] for c in catalogs]
        problem: str | None = None
        specs: list[TensorSpec] = []
        shapes: dict[str, tuple[tuple[int, ...], int, int]] = {}
        try:
            specs, shapes = _global_specs(catalogs)
        except ValueError as exc:
            problem = str(exc)
        if problem is not None:  # every rank saw the same catalogs and reached the same verdict
            raise ValueError(f"this Megatron island cannot be synced: {problem}")
        self.specs: list[TensorSpec] = specs
        self._shapes: dict[str, tuple[tuple[int, ...], int, int]] = shapes  # name -> (shape, tp_dim, stride)
        self._shard_counts = {p.name: p.shard[1] for c in self.catalogs for p in c if not p.alias}

    # -- TensorStore (rank 0) ----------------------------------------------------------------
    def _plan(self, fragment: Fragment) -> tuple[int, list[Slot]]:
        return self.conductor.plan((fragment.index, fragment.numel, fragment.slots), lambda: [
            Slot(s.name, s.shape, s.offset, s.numel, *self._shapes[s.name][1:]) for s in fragment.slots])

    def gather(self, fragment: Fragment) -> torch.Tensor:
        plan, slots = self._plan(fragment)
        out = torch.empty(fragment.numel, dtype=torch.float32)
        self.conductor.announce(GATHER, plan)
        self._gather_batches(slots, out)
        return out

    def install(self, fragment: Fragment, values: torch.Tensor, alpha: float) -> None:
        check_fragment_values(fragment, values)  # before anything is announced to the other ranks
        if alpha != 0.0:  # blend against the masters, in f32, then write exactly that everywhere
            values = self.gather(fragment).mul_(alpha).add_(values, alpha=1.0 - alpha)
        plan, slots = self._plan(fragment)
        self.conductor.announce(INSTALL, plan)
        self._install_batches(slots, values)

    # -- the transfers -----------------------------------------------------------------------
    def _gather_batches(self, slots: list[Slot], out: torch.Tensor | None) -> None:
        for batch in _batches(slots, self.chunk_elems):
            names = {s.name for s in batch}
            if self.rank != 0:
                parts = [m.read()[: m.owned[1] - m.owned[0]].reshape(-1).float()
                         for lp, m in zip(self.local, self.masters, strict=True)
                         if lp.global_name in names and m.owned is not None and not lp.alias]
                if parts:
                    dist.send(torch.cat(parts), 0, group=self.group)
                continue
            assert out is not None
            self._assemble(batch, out)

    def _owned(self, rank: int, names: set[str]) -> list[Piece]:
        return [p for p in self.catalogs[rank] if p.name in names and p.owned is not None and not p.alias]

    def _assemble(self, batch: list[Slot], out: torch.Tensor) -> None:
        names = {s.name for s in batch}
        received: dict[int, torch.Tensor] = {}
        works: list[Any] = []
        for rank in range(1, self.world):
            n = sum(_span(p) for p in self._owned(rank, names))
            if n:
                received[rank] = torch.empty(n, dtype=torch.float32)
                works.append(dist.irecv(received[rank], rank, group=self.group))
        local = {}  # (name, shard) -> flat TP-local buffer
        for slot in batch:
            count = self._shard_counts[slot.name]
            for t in range(count):
                local[(slot.name, t)] = torch.empty(slot.numel // count, dtype=torch.float32)
        for lp, m in zip(self.local, self.masters, strict=True):
            if lp.global_name in names and m.owned is not None and not lp.alias:
                start, end = m.owned
                local[(lp.global_name, lp.shard[0])][start:end] = m.read()[: end - start].reshape(-1)
        for w in works:
            w.wait()
        for rank, flat in received.items():
            at = 0
            for p in self._owned(rank, names):
                start, end = p.owned  # type: ignore[misc]
                local[(p.name, p.shard[0])][start:end] = flat[at : at + end - start]
                at += end - start
        for slot in batch:
            count = self._shard_counts[slot.name]
            join_shards(out[slot.offset : slot.offset + slot.numel], slot,
                        [local[(slot.name, t)] for t in range(count)])

    def _install_batches(self, slots: list[Slot], values: torch.Tensor | None) -> None:
        for batch in _batches(slots, self.chunk_elems):
            names = {s.name for s in batch}
            if self.rank != 0:
                mine = [(lp, m) for lp, m in zip(self.local, self.masters, strict=True) if lp.global_name in names]
                if not mine:
                    continue
                flat = torch.empty(sum(lp.param.numel() for lp, _ in mine), dtype=torch.float32)
                dist.recv(flat, 0, group=self.group)
                at = 0
                for lp, m in mine:
                    write_parameter(lp, m, flat[at : at + lp.param.numel()])
                    at += lp.param.numel()
                continue
            assert values is not None
            by_name = {s.name: s for s in batch}

            def cut(p: Piece, by_name: dict[str, Slot] = by_name, values: torch.Tensor = values) -> torch.Tensor:
                s = by_name[p.name]
                return shard_of(values[s.offset : s.offset + s.numel], s, p.shard)

            sent: dict[tuple[tuple[str, tuple[int, int]], ...], torch.Tensor] = {}
            for rank in range(1, self.world):
                pieces = [p for p in self.catalogs[rank] if p.name in names]
                if not pieces:
                    continue
                key = tuple((p.name, p.shard) for p in pieces)
                if key not in sent:  # data-parallel replicas receive the same bytes: cut them once
                    sent[key] = torch.cat([cut(p) for p in pieces])
                dist.send(sent[key], rank, group=self.group)
            for lp, m in zip(self.local, self.masters, strict=True):
                if lp.global_name in names:
                    write_parameter(lp, m, cut(Piece(lp.global_name, lp.param.numel(), lp.shard, m.owned, lp.alias)))


def _span(piece: Piece) -> int:
    return 0 if piece.owned is None else piece.owned[1] - piece.owned[0]


def _global_specs(catalogs: Sequence[Any]) -> tuple[list[TensorSpec], dict[str, tuple[tuple[int, ...], int, int]]]:
    """The island's global tensors in canonical order, after checking that the ranks agree on
    each tensor's shape and split and that every element has exactly one answering rank."""
    shapes: dict[str, tuple[tuple[int, ...], int, int]] = {}
    coverage: dict[tuple[str, int], list[tuple[int, int]]] = {}
    numels: dict[tuple[str, int], int] = {}
    shard_counts: dict[str, int] = {}
    for rank, (pieces, described) in enumerate(catalogs):
        for piece, d in zip(pieces, described, strict=True):
            mine = (tuple(d["shape"]), d["tp_dim"], d["stride"])
            seen = shapes.setdefault(d["name"], mine)
            if seen != mine:
                raise ValueError(f"ranks disagree on {d['name']}: {seen} vs {mine} on rank {rank}")
            if piece.alias:
                continue
            shard_counts.setdefault(piece.name, piece.shard[1])
            key = (piece.name, piece.shard[0])
            numels[key] = piece.local_numel
            if piece.owned is not None:
                coverage.setdefault(key, []).append(piece.owned)
    for name, count in shard_counts.items():
        for t in range(count):
            spans = sorted(coverage.get((name, t), []))
            pos = 0
            for start, end in spans:
                if start != pos:
                    raise ValueError(f"{name} (TP slice {t}): elements [{min(pos, start)}, {max(pos, start)}) have "
                                     f"{'no' if start > pos else 'more than one'} rank holding their master")
                pos = end
            if pos != numels[(name, t)]:
                raise ValueError(f"{name} (TP slice {t}): elements [{pos}, {numels[(name, t)]}) have no rank holding "
                                 "their master")
    order = canonical_order([[p.name for p in pieces if not p.alias] for pieces, _ in catalogs])
    specs = [TensorSpec(name, shapes[name][0], "float32", embedding=name == EMBEDDING) for name in order]
    return specs, shapes
