"""A round's merge and its outer step in one pass, a chunk of the fragment at a time (DESIGN §5.3, §10.2).

The plain order merges every tensor of the fragment into an ``[N]`` merged delta, then steps from
it: an N-float buffer for every round between its merge and its commit, 1/P of the model each.
Both halves are element-wise once each tensor's coefficients are known, and RDA's one quantity of
a whole tensor is the norm of its combined directions, so the work is cut the other way:

1. ``plan_fused`` (the heavy half, ahead of the commit): each tensor's coefficients and, for RDA,
   the norm of Σ_m c_m·δ_m, combined a cache-sized chunk at a time into a scratch and dropped;
2. ``step_fused`` (the commit): for each chunk of the fragment the outer gradient's values are
   formed again in a scratch, by the same operations from the same coefficients, and the
   Nesterov step is taken from them while they are in cache.

Every value is the one ``merge.merge_deltas(negate=True)`` and ``outer.Nesterov.step`` compute,
element for element, and the gradient's norm is summed over the same blocks as
``merge.accurate_norm``: params, momentum and the tape's norm keep their bits (the tests compare
them). No ``[N]`` temporary exists, and a round's deltas are read twice instead of the merged
delta being written, rescaled and read back three times.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from syncer.merge.merge import (
    _CPU_CHUNK,
    _NORM_BLOCK,
    Row,
    Segment,
    _block_sq,
    _rda_coef,
    _rda_scale,
    _span,
)
from syncer.merge.outer import STEP_CHUNK, Nesterov, OuterOptimizer

__all__ = ["PLAN_CHUNK", "FusedPlan", "fusable", "plan_fused", "step_fused"]

PLAN_CHUNK = _CPU_CHUNK
"""Values `plan_fused` combines at a time: the merge's own column chunk, so its block norms are RDA's."""

_T = TypeVar("_T")
_R = TypeVar("_R")

# How far above its true norm the gradient's bound is set: each value is rounded a few times
# more than the exact product it bounds, each rounding at most 2^-24 relative.
_BOUND_SLACK = 1.0 + 1e-5


def fusable(outer: OuterOptimizer, device: torch.device, segments: Sequence[Segment], *, corrected: bool) -> bool:
    """Whether a merge can take the fused path: Nesterov on a CPU fragment, no HeLoCo (it rewrites
    the deltas) and no `--merge iso` matrix (its SVD needs the merged matrix whole). Every other
    merge holds the merged delta as before."""
    return (type(outer) is Nesterov and device.type == "cpu" and not corrected
            and all(seg.iso_shape is None for seg in segments))


class _Scratch:
    """A float32 chunk buffer for each thread that asks (the caller's own for the first)."""

    def __init__(self, size: int, given: torch.Tensor | None) -> None:
        self.size = size
        self._given = given if given is not None and given.numel() >= size else None
        self._local = threading.local()
        self._lock = threading.Lock()

    def get(self) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            with self._lock:
                buf, self._given = self._given, None
            if buf is None:
                buf = torch.empty(self.size)
            self._local.buf = buf
        return buf


def _in_order(threads: int, work: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """`work` on every item, on up to `threads` threads; the results in the items' order."""
    if threads <= 1 or len(items) <= 1:
        return [work(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items)), thread_name_prefix="yeto-merge") as pool:
        return list(pool.map(work, items))


@dataclass(frozen=True)
class FusedPlan:
    """A merge ready for its fused commit: per segment, one float32 scalar per row (RDA's
    w_m/‖δ_m‖, or the average's −w_m) and RDA's float32 factor −r/‖u‖ (None for the average)."""

    rows: list[Row]
    segments: list[Segment]
    scalars: list[tuple[torch.Tensor, ...]]
    scales: list[float | None]
    grad_bound: float  # at least the outer gradient's L2 norm, for the output screen


def plan_fused(rows: Sequence[Row], weights: torch.Tensor, segments: Sequence[Segment], sq_norms: torch.Tensor,
               scratch: torch.Tensor | None = None, threads: int = 1) -> FusedPlan:
    """The coefficients of `merge_deltas(rows, weights, segments, sq_norms=sq_norms, negate=True)`
    (``weights`` float32 [M], as that call takes them; ``sq_norms`` its float64 [M, S]), and for
    each RDA segment its rescaling factor, from the block norms that call takes of its combined
    directions, each chunk combined on one of ``threads`` threads. ``scratch``: float32 values to
    combine into, ``PLAN_CHUNK`` or the largest RDA segment."""
    rows = list(rows)
    buffers = _Scratch(min(PLAN_CHUNK, max((seg.numel for seg in segments if seg.rda), default=0)), scratch)
    w = weights.double().tolist()
    negated = weights.to(torch.float32).neg().unbind()
    norms_all = sq_norms.sqrt().tolist()
    scalars: list[tuple[torch.Tensor, ...]] = []
    coefs: dict[int, tuple[list[float], list[float]]] = {}
    for i, seg in enumerate(segments):
        if seg.rda and seg.numel:
            coefs[i] = _rda_coef(sq_norms[:, i], w)
            scalars.append(torch.tensor(coefs[i][1], dtype=torch.float32).unbind())
        else:
            scalars.append(negated)
    chunks = [(i, start, min(start + PLAN_CHUNK, segments[i].offset + segments[i].numel)) for i in coefs
              for start in range(segments[i].offset, segments[i].offset + segments[i].numel, PLAN_CHUNK)]

    def directions(chunk: tuple[int, int, int]) -> torch.Tensor:
        i, start, stop = chunk
        return _block_sq(_combine(rows, scalars[i], start, stop, buffers.get()[: stop - start]))

    parts: dict[int, list[torch.Tensor]] = {i: [] for i in coefs}
    for (i, _, _), part in zip(chunks, _in_order(threads, directions, chunks), strict=True):
        parts[i].append(part)
    scales: list[float | None] = []
    bound_sq = 0.0
    for i in range(len(segments)):
        if i not in coefs:
            scales.append(None)
            bound_sq += math.fsum(abs(wm) * row[i] for wm, row in zip(w, norms_all, strict=True)) ** 2
            continue
        norms, coef = coefs[i]
        scale = _rda_scale(w, norms, coef, parts[i])
        scales.append(-scale)
        bound_sq += scale * scale * float(torch.cat(parts[i]).sum())
    return FusedPlan(rows, list(segments), scalars, scales, math.sqrt(bound_sq) * _BOUND_SLACK)


def _combine(rows: Sequence[Row], scalars: Sequence[torch.Tensor], start: int, stop: int,
             dst: torch.Tensor) -> torch.Tensor:
    """dst = Σ_m scalars[m]·rows[m][start:stop], the operations of `merge._combine_chunk`."""
    torch.mul(_span(rows[0], start, stop), scalars[0], out=dst)
    for m in range(1, len(rows)):
        dst.addcmul_(_span(rows[m], start, stop), scalars[m])
    return dst


def step_fused(plan: FusedPlan, params: torch.Tensor, momentum: torch.Tensor, *, lr: float, mu: float,
               grad_scratch: torch.Tensor | None = None, step_scratch: torch.Tensor | None = None,
               threads: int = 1) -> float:
    """Take the Nesterov step (momentum ← μ·momentum + g, params ← params − lr·(g + μ·momentum))
    from the planned merge's outer gradient g, formed ``STEP_CHUNK`` values at a time, the chunks
    on up to ``threads`` threads; returns ‖g‖ as `merge.accurate_norm` gives it. The scratches lend
    the first thread's two chunk buffers their memory."""
    n = params.numel()
    size = min(max(n, 1), STEP_CHUNK)
    grads, temps = _Scratch(size, grad_scratch), _Scratch(size, step_scratch)
    p, m = params.view(-1), momentum.view(-1)
    ends = [seg.offset + seg.numel for seg in plan.segments]

    def chunk(a: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        b = min(a + STEP_CHUNK, n)
        g = grads.get()[: b - a]
        for i in range(bisect.bisect_right(ends, a), len(plan.segments)):
            seg = plan.segments[i]
            if seg.offset >= b:
                break
            lo, hi = max(a, seg.offset), min(b, ends[i])
            if hi > lo:
                dst = _combine(plan.rows, plan.scalars[i], lo, hi, g[lo - a : hi - a])
                if (scale := plan.scales[i]) is not None:
                    dst.mul_(scale)
        # `accurate_norm`'s blocks: STEP_CHUNK is a whole number of them, so they start where its do.
        whole = (b - a) // _NORM_BLOCK * _NORM_BLOCK
        blocks = torch.linalg.vector_norm(g[:whole].view(-1, _NORM_BLOCK), dim=1).double().square_() if whole else None
        tail = torch.linalg.vector_norm(g[whole:]).double().square() if whole < b - a else None
        m[a:b].mul_(mu).add_(g)
        p[a:b].add_(torch.add(g, m[a:b], alpha=mu, out=temps.get()[: b - a]), alpha=-lr)
        return blocks, tail

    done = _in_order(threads, chunk, range(0, n, STEP_CHUNK))
    blocks = [b for b, _ in done if b is not None]
    total = torch.cat(blocks).sum() if blocks else torch.zeros((), dtype=torch.float64)
    if done and (tail := done[-1][1]) is not None:  # only the last chunk can end in a short block
        total = total + tail
    return math.sqrt(float(total))
