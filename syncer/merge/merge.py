"""The syncer's merge math: pure functions over tensors (DESIGN §3.1, §5).

A round hands the syncer one fragment's deltas from M learners, one row per learner, each row
the learner's d = θ_local − anchor laid out as the fragment's flat buffer: an ``[M, N]`` float32
tensor, or ``Rows``, M separate 1-D float32 tensors (the pushes where they were received, so a
merge never copies them into one stack: M·N·4 bytes the syncer does not hold twice). The math,
in the order the coordinator applies it:

1. ``learner_weights`` — w_m = tokens_m² / steps_m / (1 + age_m), normalised.
2. ``merge_deltas`` — per tensor (``Segment``) of the fragment, radial-directional averaging
   (``rda``), or with ``--merge average`` a plain weighted average (``weighted_average``);
   with ``--merge iso``, each merged 2-D matrix then gets a flat spectrum (``syncer.merge.iso``).
3. ``outer_gradient`` — Δ = −merged delta.
4. ``outer.nesterov_step`` — the outer optimizer, SGD with Nesterov momentum (``syncer/merge/outer.py``).

Everything works on whatever device the inputs live on and synchronises with the host only where
a caller asks for a Python number (``accurate_norm``, ``check_finite``). Norms matter to RDA and
fp32 reductions over tens of millions of elements drift by ~1e-3 relative, so every norm here is
taken per block of ``_NORM_BLOCK`` elements in float32 and the blocks are combined in float64.
Nothing allocates a full-size ``[M, N]`` temporary, nor stacks the rows it is given.

``merge_deltas(..., threads=N)`` and ``check_finite(..., threads=N)`` spread independent work over N
CPU threads (torch kernels release the GIL) and give exactly the bits of ``threads=1``: every
reduction runs as the same single call on the same view as in the serial path, and the
element-wise passes are cut at the serial path's own chunk boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from syncer.merge.iso import isotropic_

__all__ = [
    "Rows",
    "Segment",
    "accurate_norm",
    "check_finite",
    "learner_weights",
    "merge_deltas",
    "outer_gradient",
    "rda",
    "segment_sq_norms",
    "weighted_average",
]

# Float32 norms of 2**14 elements are accurate to ~1e-8 relative, and reducing rows of this length
# runs at memory speed; larger blocks lose accuracy (2**20: ~1e-5), smaller ones gain nothing.
_NORM_BLOCK = 1 << 14
# Column chunk of the CPU weighted sum: M rows of it plus the output chunk stay in cache.
_CPU_CHUNK = 1 << 20
# Multiple of the worst-case rounding in the RDA direction sum below which it counts as zero.
_CANCEL_ULPS = 4
_F32_EPS = float(torch.finfo(torch.float32).eps)
# Column chunk of check_finite's element-wise re-check (and of its threaded sums).
_FINITE_CHUNK = 1 << 22
# With threads, small segments are handed out in about this many batches per thread, so one
# batch of large tensors does not leave the other threads idle while it finishes.
_BATCHES_PER_THREAD = 4


class SpanRow(Protocol):
    """A row read a span at a time: a push held in its wire encoding (`syncer.merge.held`). Slicing
    it gives another `SpanRow`; ``span`` gives float32 values, the same bits as decoding it whole."""

    dtype: torch.dtype
    device: torch.device

    def numel(self) -> int: ...

    def dim(self) -> int: ...

    def span(self, start: int, stop: int) -> torch.Tensor: ...

    def __getitem__(self, window: slice) -> SpanRow: ...


Row = torch.Tensor | SpanRow
Rows = Sequence[Row]
"""A round's deltas as M 1-D float32 rows of one length on one device (tensors, or `SpanRow`s); an
``[M, N]`` tensor also serves."""

# Values a `SpanRow` is read in where no chunk is given: a whole number of norm blocks.
_SPAN_BLOCKS = 64


def _span(row: Row, start: int, stop: int) -> torch.Tensor:
    """Values [start, stop) of ``row`` as a float32 tensor (a view of a tensor row)."""
    return row[start:stop] if isinstance(row, torch.Tensor) else row.span(start, stop)


def _as_rows(name: str, deltas: torch.Tensor | Rows) -> list[Row]:
    """The rows of ``deltas``, checked: M >= 1 1-D float32 tensors of one length on one device."""
    rows: list[Row] | None = list(deltas.unbind()) if isinstance(deltas, torch.Tensor) and deltas.dim() == 2 else None
    if rows is None:
        if isinstance(deltas, torch.Tensor):
            raise ValueError(f"{name}: deltas must be a [M, n] float32 tensor or M rows, got shape "
                             f"{tuple(deltas.shape)}")
        rows = list(deltas)
    if not rows:
        raise ValueError(f"{name}: deltas must hold M >= 1 rows, got none")
    first = rows[0]
    for m, row in enumerate(rows):
        if (row.dim() != 1 or row.dtype != torch.float32 or row.numel() != first.numel()
                or row.device != first.device):
            raise ValueError(f"{name}: deltas must be M float32 rows of one length on one device; row {m} is "
                             f"{row.dtype} {_shape(row)} on {row.device}, row 0 {_shape(first)} on {first.device}")
    return rows


def _shape(row: Row) -> tuple[int, ...]:
    return tuple(row.shape) if isinstance(row, torch.Tensor) else (row.numel(),)


def _cols(rows: Rows, start: int, stop: int) -> list[Row]:
    return [row[start:stop] for row in rows]


@dataclass(frozen=True, slots=True)
class Segment:
    """One tensor inside a fragment's flat buffer.

    ``rda`` selects radial-directional averaging; ``False`` selects the plain weighted average
    (``--merge average``). ``iso_shape`` (``--merge iso``, a 2-D matrix) flattens the
    merged matrix's spectrum afterwards (``syncer.merge.iso``); ``name`` is the tensor's, for errors.
    """

    offset: int
    numel: int
    rda: bool
    iso_shape: tuple[int, int] | None = None
    name: str = ""


class Flattener(Protocol):
    """Where the merged matrices of ``--merge iso`` get their flat spectrum: an `IsoPool`."""

    def flatten(self, matrices: Sequence[tuple[str, torch.Tensor]]) -> None: ...


def raw_weight(tokens: int, steps: int, age: int = 0) -> float:
    """A learner's merge weight before normalisation: tokens² / steps / (1 + age)."""
    return float(tokens) * float(tokens) / float(steps) / (1.0 + age)


def learner_weights(tokens: Sequence[int], steps: Sequence[int], ages: Sequence[int] | None = None,
                    finished: float = 0.0) -> torch.Tensor:
    """Per-learner merge weights w_m = tokens_m² / steps_m / (1 + age_m), normalised to sum 1
    (float64, CPU), or to less than 1 when `finished` (the raw weight of learners that finished
    training, each a zero delta) shares the total: the merge is then scaled by what the answers
    stand for in the fleet.

    A learner that processed more tokens per step (a larger effective batch) and more tokens in
    total counts for more. `ages`: how many commits of the fragment a learner's delta missed (its
    steps were taken on bases that many versions old, then rebased); a stale delta is damped as
    staleness-aware asynchronous SGD damps a stale gradient, so an island that answers every few
    rounds with the steps of all of them does not weigh as several fresh answers. When no learner
    reported any tokens, all learners weigh the same.
    """
    ages = ages if ages is not None else [0] * len(tokens)
    if not len(tokens) == len(steps) == len(ages):
        raise ValueError(f"learner_weights: {len(tokens)} token counts, {len(steps)} step counts, {len(ages)} ages")
    if not tokens:
        raise ValueError("learner_weights: no learners")
    raw: list[float] = []
    for m, (t, s, age) in enumerate(zip(tokens, steps, ages, strict=True)):
        if s < 1:
            raise ValueError(f"learner_weights: learner {m} reported {s} steps; at least 1 is required")
        if t < 0:
            raise ValueError(f"learner_weights: learner {m} reported {t} tokens; must be >= 0")
        if age < 0:
            raise ValueError(f"learner_weights: learner {m} has age {age}; must be >= 0")
        raw.append(raw_weight(t, s, age))
    if not (math.isfinite(finished) and finished >= 0.0):
        raise ValueError(f"learner_weights: finished learners' weight {finished}; must be finite and >= 0")
    total = math.fsum(raw)
    if total == 0.0:
        return torch.full((len(raw),), 1.0 / len(raw), dtype=torch.float64)
    total += finished  # one correctly rounded sum: + 0.0 leaves the bits of the answers' own total
    return torch.tensor([w / total for w in raw], dtype=torch.float64)


def _row_sq_norms(rows: torch.Tensor | Rows) -> torch.Tensor:
    """Squared L2 norm of each row (of a ``[M, n]`` float32 view, or of M 1-D rows), as float64
    ``[M]`` on their device. A row that is not stride-1 is first made contiguous."""
    if isinstance(rows, torch.Tensor):
        rows = list(rows.unbind())
    return torch.stack([_sq_norm(row) if isinstance(row, torch.Tensor) else _span_sq_norm(row) for row in rows])


def _sq_norm(x: torch.Tensor) -> torch.Tensor:
    """‖x‖² of a 1-D float32 tensor as a float64 scalar tensor: float32 norms of blocks of
    ``_NORM_BLOCK``, squared and summed in float64."""
    if x.stride(0) != 1 and x.numel() > 1:
        x = x.contiguous()
    n = x.numel()
    k = n // _NORM_BLOCK
    body = k * _NORM_BLOCK
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    if k:
        total = torch.linalg.vector_norm(x[:body].view(k, _NORM_BLOCK), dim=1).double().square_().sum()
    if body < n:
        total = total + torch.linalg.vector_norm(x[body:]).double().square()
    return total


def _span_sq_norm(row: SpanRow) -> torch.Tensor:
    """``_sq_norm`` of a row read a span at a time, bit for bit: the same blocks, each reduced by
    the same call, their squares summed in one float64 sum, then the short last block."""
    n = row.numel()
    k = n // _NORM_BLOCK
    body = k * _NORM_BLOCK
    total = torch.zeros((), dtype=torch.float64, device=row.device)
    step = _SPAN_BLOCKS * _NORM_BLOCK
    if k:
        squares = [torch.linalg.vector_norm(_span(row, a, min(a + step, body)).view(-1, _NORM_BLOCK), dim=1)
                   .double().square_() for a in range(0, body, step)]
        total = torch.cat(squares).sum()
    if body < n:
        total = total + torch.linalg.vector_norm(_span(row, body, n)).double().square()
    return total


def accurate_norm(x: torch.Tensor) -> float:
    """L2 norm of a 1-D float32 tensor, accurate to ~1e-8 relative even at 10^8 elements.

    Float32 partial norms of fixed-size blocks are combined in float64, so the pass reads ``x``
    once at memory speed and never copies it to float64 (a non-unit-stride ``x`` is first made
    contiguous).
    """
    if x.dim() != 1:
        raise ValueError(f"accurate_norm: expected a 1-D tensor, got shape {tuple(x.shape)}")
    return math.sqrt(float(_sq_norm(x)))


def _check_pair(name: str, deltas: torch.Tensor | Rows, weights: torch.Tensor) -> list[Row]:
    rows = _as_rows(name, deltas)
    if weights.shape != (len(rows),):
        raise ValueError(f"{name}: {tuple(weights.shape)} weights for {len(rows)} learners")
    return rows


def _out_for(name: str, rows: Rows, out: torch.Tensor | None) -> torch.Tensor:
    n, device = rows[0].numel(), rows[0].device
    if out is None:
        return torch.empty(n, dtype=torch.float32, device=device)
    if out.shape != (n,) or out.dtype != torch.float32 or out.device != device:
        raise ValueError(f"{name}: out must be a float32 [{n}] tensor on {device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _combine_into(
    rows: Rows, coef: torch.Tensor, out: torch.Tensor, parts: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """out = Σ_m coef[m] · rows[m], without a temporary the size of ``rows``.

    The sum runs over column chunks with one fused multiply-add per learner, in learner order, so
    the bits do not depend on thread count or chunking; on CPU the chunks are cache-sized (2-3×
    faster than ``torch.mv`` on a transposed ``[M, N]`` buffer), elsewhere one chunk is the whole.
    With ``parts``, the squared block norms of each chunk written are appended to it while the
    chunk is still in cache (``_block_sq``): RDA needs the norm of what it combined.
    """
    scalars = coef.unbind()
    n = rows[0].numel()
    chunk = _CPU_CHUNK if rows[0].device.type == "cpu" else max(n, 1)
    for start in range(0, n, chunk):
        part = _combine_chunk(rows, scalars, out, start, min(start + chunk, n), parts is not None)
        if parts is not None and part is not None:
            parts.append(part)
    return out


def _combine_chunk(
    rows: Rows, scalars: Sequence[torch.Tensor], out: torch.Tensor, start: int, stop: int,
    norms: bool = False,
) -> torch.Tensor | None:
    """One column chunk of ``_combine_into``: out[start:stop] = Σ_m scalars[m] · rows[m][start:stop];
    with ``norms``, the chunk's squared block norms (chunks start on block boundaries)."""
    dst = out[start:stop]
    torch.mul(_span(rows[0], start, stop), scalars[0], out=dst)
    for m in range(1, len(rows)):
        dst.addcmul_(_span(rows[m], start, stop), scalars[m])
    return _block_sq(dst) if norms else None


def _block_sq(x: torch.Tensor) -> torch.Tensor:
    """The float64 squares of the float32 norms of ``x``'s blocks of ``_NORM_BLOCK`` (the last one
    shorter), ``x`` a contiguous 1-D float32 tensor: their sum is ‖x‖², accurate like
    ``accurate_norm``. A tensor cut into pieces at block boundaries gives the same squares, piece
    by piece, as the whole: each block is reduced by the same call."""
    k = x.numel() // _NORM_BLOCK
    body = k * _NORM_BLOCK
    pieces = []
    if k:
        pieces.append(torch.linalg.vector_norm(x[:body].view(k, _NORM_BLOCK), dim=1).double().square_())
    if body < x.numel():
        pieces.append(torch.linalg.vector_norm(x[body:]).double().square_().unsqueeze(0))
    return torch.cat(pieces) if len(pieces) != 1 else pieces[0]


def _rda_coef(sq_norms: torch.Tensor, w: Sequence[float]) -> tuple[list[float], list[float]]:
    """RDA's row norms ‖δ_m‖ and direction coefficients w_m/‖δ_m‖ from the rows' squared norms, as
    float64 Python numbers: there are M of them, and a tensor op on M values costs more than the
    arithmetic (a merge of small tensors was mostly such ops)."""
    norms = [math.sqrt(v) for v in sq_norms.tolist()]
    # A zero row has no direction: its coefficient is 0, and it adds 0 to the mean norm.
    coef = [wm / n if n > 0 else 0.0 for wm, n in zip(w, norms, strict=True)]
    return norms, coef


def _rda_scale(w: Sequence[float], norms: Sequence[float], coef: Sequence[float],
               parts: Sequence[torch.Tensor]) -> float:
    """The factor r/‖u‖, rounded to float32, that stretches the combined directions u (whose
    squared block norms are ``parts``) to the mean norm r."""
    radius = math.fsum(wm * n for wm, n in zip(w, norms, strict=True))
    u_norm = math.sqrt(float(torch.cat(tuple(parts)).sum())) if parts else 0.0
    # Directions that cancel leave float32 rounding noise in u, at most ~M·ε·Σw in norm; scaling
    # that noise up to the radius would invent a direction, so it counts as ‖u‖ = 0.
    noise = _CANCEL_ULPS * len(w) * _F32_EPS * math.fsum(wm for wm, c in zip(w, coef, strict=True) if c > 0)
    return _as_float32(radius / u_norm if u_norm > noise else 0.0)


def _as_float32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _rda_into(rows: Rows, w: Sequence[float], out: torch.Tensor,
              sq_norms: torch.Tensor | None = None, negate: bool = False) -> torch.Tensor:
    norms, coef = _rda_coef(_row_sq_norms(rows) if sq_norms is None else sq_norms, w)
    parts: list[torch.Tensor] = []
    _combine_into(rows, torch.tensor(coef, dtype=torch.float32, device=out.device), out, parts)
    scale = _rda_scale(w, norms, coef, parts)
    return out.mul_(-scale if negate else scale)


def rda(deltas: torch.Tensor | Rows, weights: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Radial-directional averaging of one tensor's learner deltas (Decoupled DiLoCo).

    With row deltas δ_m and weights w_m (summing to 1):
    u = Σ_m w_m · δ_m/‖δ_m‖ (rows with ‖δ_m‖ = 0 contribute no direction), r = Σ_m w_m ‖δ_m‖,
    result = r · u/‖u‖, the zero vector when ‖u‖ = 0 or r = 0. Averaging directions and norms
    separately keeps the merged step as long as the learners' steps: a plain mean of two
    orthogonal unit steps has norm 1/√2, RDA's has norm 1. A ‖u‖ no larger than the float32
    rounding of the sum (4·M·ε·Σ_m w_m over rows with a direction) counts as 0, so exactly
    opposite steps merge to zero instead of to rounding noise blown up to length r.

    ``deltas`` is ``[M, n]`` float32 (rows may be column slices of a wider buffer) or ``Rows``,
    ``weights`` is ``[M]``; the float32 ``[n]`` result is written to ``out`` when given.
    """
    rows = _check_pair("rda", deltas, weights)
    return _rda_into(rows, weights.double().tolist(), _out_for("rda", rows, out))


def weighted_average(
    deltas: torch.Tensor | Rows, weights: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_m w_m δ_m over the rows (``[M, n]`` float32, or ``Rows``), with no ``[M, n]`` temporary.

    The plain DiLoCo average (``--merge average``). RDA merges embeddings as well: its norms are
    per tensor, so rows an island left untouched count as zeros there just as in this mean.
    """
    rows = _check_pair("weighted_average", deltas, weights)
    w32 = weights.to(device=rows[0].device, dtype=torch.float32)
    return _combine_into(rows, w32, _out_for("weighted_average", rows, out))


def _check_segments(name: str, n: int, segments: Sequence[Segment], what: str = "the fragment") -> None:
    """The segments lie back to back from 0 and cover the ``n`` elements of ``what``."""
    expected = 0
    for i, seg in enumerate(segments):
        if seg.offset != expected or seg.numel < 0:
            raise ValueError(f"{name}: segment {i} is at offset {seg.offset} with {seg.numel} "
                             f"elements; the next segment must start at {expected}")
        expected += seg.numel
    if expected != n:
        raise ValueError(f"{name}: segments cover {expected} elements, {what} has {n}")


def segment_sq_norms(deltas: torch.Tensor | Rows, segments: Sequence[Segment], *, threads: int = 1) -> torch.Tensor:
    """The squared L2 norm of every row of every segment of ``[M, N]`` float32 deltas (or ``Rows``), as a float64
    ``[M, S]`` tensor on their device, each accurate like ``accurate_norm``; a row's squared norm
    is the sum of its line.

    A round takes them once (`round_merge.prepare_merge`): they weigh RDA's directions
    (``merge_deltas(sq_norms=...)``) and tell a delta whose norm overflows float32. ``threads`` > 1
    spreads the segments over that many CPU threads, each taken by the same call as serially.
    """
    rows = _as_rows("segment_sq_norms", deltas)
    _check_segments("segment_sq_norms", rows[0].numel(), segments)
    out = torch.zeros(len(rows), len(segments), dtype=torch.float64, device=rows[0].device)

    def take(batch: Sequence[tuple[int, Segment]]) -> None:
        for i, seg in batch:
            if seg.numel:
                out[:, i] = _row_sq_norms(_cols(rows, seg.offset, seg.offset + seg.numel))

    indexed = list(enumerate(segments))
    if threads > 1 and rows[0].device.type == "cpu" and len(indexed) > 1:
        batches = _indexed_batches(indexed, threads * _BATCHES_PER_THREAD)
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="yeto-norms") as pool:
            _run_all(pool, [partial(take, batch) for batch in batches])
    else:
        take(indexed)
    return out


def merge_deltas(
    deltas: torch.Tensor | Rows,
    weights: torch.Tensor,
    segments: Sequence[Segment],
    out: torch.Tensor | None = None,
    *,
    threads: int = 1,
    iso: Flattener | None = None,
    sq_norms: torch.Tensor | None = None,
    negate: bool = False,
) -> torch.Tensor:
    """Merge one fragment's ``[M, N]`` learner deltas (or ``Rows``) into a float32 ``[N]`` merged delta.

    Each ``Segment`` (one tensor; the segments lie back to back and cover ``[0, N)``) is merged
    by ``rda`` or ``weighted_average`` as it asks, straight into its slice of ``out``.
    ``sq_norms``: the rows' squared segment norms as ``segment_sq_norms`` gives them, when the
    caller has them already; RDA then reads the deltas once instead of twice, with the same bits.
    ``negate`` writes −merged, bit for bit the negation, in the same passes (the average's weights
    and RDA's rescaling factor change sign, which rounds symmetrically): the outer gradient without
    a pass of its own.

    ``threads`` > 1 merges CPU segments on that many threads, bit for bit the result of
    ``threads=1``: small segments go whole to a thread; a segment longer than one column chunk
    has its norms taken by one call each, as serially, and its weighted sum and rescaling cut at
    the serial path's chunk boundaries. Other devices ignore ``threads`` (their kernels are
    asynchronous already).

    ``iso`` (an `IsoPool`) flattens the ``iso_shape`` matrices' spectra in its worker processes
    instead of here, one whole matrix per worker: the same bits whatever the workers.
    """
    rows = _check_pair("merge_deltas", deltas, weights)
    if threads < 1:
        raise ValueError(f"merge_deltas: threads must be >= 1, got {threads}")
    device = rows[0].device
    _check_segments("merge_deltas", rows[0].numel(), segments)
    if sq_norms is not None and (sq_norms.shape != (len(rows), len(segments))
                                 or sq_norms.dtype != torch.float64 or sq_norms.device != device):
        raise ValueError(f"merge_deltas: sq_norms must be float64 [{len(rows)}, {len(segments)}] on "
                         f"{device}, got {sq_norms.dtype} {tuple(sq_norms.shape)} on {sq_norms.device}")
    result = _out_for("merge_deltas", rows, out)
    w = weights.double().tolist()  # RDA's scalar math, on the host
    w32 = weights.to(device=device, dtype=torch.float32)
    w32 = w32.neg() if negate else w32
    given = list(sq_norms.unbind(1)) if sq_norms is not None else [None] * len(segments)
    if threads > 1 and device.type == "cpu":
        _merge_threaded(rows, w, w32, segments, given, result, threads, negate)
    else:
        for seg, sq in zip(segments, given, strict=True):
            if seg.numel == 0:
                continue
            cols = _cols(rows, seg.offset, seg.offset + seg.numel)
            dst = result[seg.offset : seg.offset + seg.numel]
            if seg.rda:
                _rda_into(cols, w, dst, sq, negate)
            else:
                _combine_into(cols, w32, dst)
    matrices = [(seg.name or f"at offset {seg.offset}", result[seg.offset : seg.offset + seg.numel].view(seg.iso_shape))
                for seg in segments if seg.iso_shape is not None and seg.numel]
    if iso is not None and matrices:
        iso.flatten(matrices)
    else:
        for _, matrix in matrices:  # one SVD per matrix, in order: the same bits whatever the threads
            isotropic_(matrix)
    return result


def check_finite(deltas: torch.Tensor, *, threads: int = 1) -> int | None:
    """Index of the first row of ``[M, N]`` deltas holding a NaN or ±Inf, else ``None``.

    A finite row sum proves the row finite (NaN and Inf propagate through a sum), so a healthy
    push costs one read pass; only rows whose sum is not finite are checked element-wise, in
    bounded chunks, to tell a bad value from an overflowing sum.

    ``threads`` > 1 sums bounded chunks of every row on that many CPU threads. The answer is the
    same for any thread count: a chunk is bad exactly when it holds a non-finite value, whatever
    order its sum takes.
    """
    if deltas.dim() != 2:
        raise ValueError(f"check_finite: expected [M, N] deltas, got shape {tuple(deltas.shape)}")
    if threads < 1:
        raise ValueError(f"check_finite: threads must be >= 1, got {threads}")
    if threads > 1 and deltas.device.type == "cpu":
        return _check_finite_threaded(deltas, threads)
    suspects = (~torch.isfinite(deltas.sum(dim=1))).nonzero().flatten().tolist()
    for m in suspects:
        row = deltas[m]
        for start in range(0, row.numel(), _FINITE_CHUNK):
            if not bool(torch.isfinite(row[start : start + _FINITE_CHUNK]).all()):
                return int(m)
    return None


def _run_all(pool: ThreadPoolExecutor, tasks: Sequence[Callable[[], object]]) -> None:
    """Run ``tasks`` on ``pool`` and wait for all of them; the first failure is raised."""
    futures = [pool.submit(task) for task in tasks]
    for future in futures:
        future.result()


def _indexed_batches(items: Sequence[tuple[int, Segment]], parts: int) -> list[list[tuple[int, Segment]]]:
    """Consecutive runs of (index, segment) pairs holding about 1/``parts`` of their elements each."""
    target = max(1, sum(seg.numel for _, seg in items) // parts)
    out: list[list[tuple[int, Segment]]] = [[]]
    filled = 0
    for item in items:
        if filled >= target:
            out.append([])
            filled = 0
        out[-1].append(item)
        filled += item[1].numel
    return [batch for batch in out if batch]


def _merge_threaded(
    rows: Rows,
    w: Sequence[float],
    w32: torch.Tensor,
    segments: Sequence[Segment],
    given: Sequence[torch.Tensor | None],
    result: torch.Tensor,
    threads: int,
    negate: bool,
) -> None:
    """``merge_deltas``'s loop on ``threads`` CPU threads, making the same calls on the same views.

    Four stages, each waiting for the one before: (1) whole small segments, the norms of long RDA
    segments (unless given) and the weighted-sum chunks of long averaged segments; (2) the
    direction-sum chunks of long RDA segments, each with its block norms; (3) their rescaling
    factors; (4) the rescaling chunks.
    """
    def cols(seg: Segment) -> list[Row]:
        return _cols(rows, seg.offset, seg.offset + seg.numel)

    def dst(seg: Segment) -> torch.Tensor:
        return result[seg.offset : seg.offset + seg.numel]

    def merge_whole(batch: Sequence[tuple[int, Segment]]) -> None:
        for i, seg in batch:
            if seg.rda:
                _rda_into(cols(seg), w, dst(seg), given[i], negate)
            else:
                _combine_into(cols(seg), w32, dst(seg))

    def chunks(seg: Segment) -> list[tuple[int, int]]:
        return [(start, min(start + _CPU_CHUNK, seg.numel)) for start in range(0, seg.numel, _CPU_CHUNK)]

    long_rda = [(i, seg) for i, seg in enumerate(segments) if seg.rda and seg.numel > _CPU_CHUNK]
    long_avg = [seg for seg in segments if not seg.rda and seg.numel > _CPU_CHUNK]
    short = [(i, seg) for i, seg in enumerate(segments) if 0 < seg.numel <= _CPU_CHUNK]
    coefs: dict[int, tuple[list[float], list[float]]] = {}
    parts: dict[tuple[int, int], torch.Tensor] = {}  # (segment, chunk start) -> the chunk's block norms
    scales: dict[int, float] = {}

    def rda_coef(i: int, seg: Segment) -> None:
        sq = given[i]
        coefs[i] = _rda_coef(_row_sq_norms(cols(seg)) if sq is None else sq, w)

    def rda_chunk(i: int, seg: Segment, start: int, stop: int) -> None:
        part = _combine_chunk(cols(seg), scalars[i], dst(seg), start, stop, True)
        assert part is not None
        parts[i, start] = part

    def rda_scale(i: int, seg: Segment) -> None:
        norms, coef = coefs[i]
        in_order = [parts[i, start] for start, _ in chunks(seg)]
        scale = _rda_scale(w, norms, coef, in_order)
        scales[i] = -scale if negate else scale

    def rescale(i: int, seg: Segment, start: int, stop: int) -> None:
        dst(seg)[start:stop].mul_(scales[i])

    w32_scalars = w32.unbind()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="yeto-merge") as pool:
        stage: list[Callable[[], object]] = [partial(rda_coef, i, seg) for i, seg in long_rda]
        stage += [partial(_combine_chunk, cols(seg), w32_scalars, dst(seg), a, b)
                  for seg in long_avg for a, b in chunks(seg)]
        stage += [partial(merge_whole, batch) for batch in _indexed_batches(short, threads * _BATCHES_PER_THREAD)]
        _run_all(pool, stage)
        scalars = {i: torch.tensor(coefs[i][1], dtype=torch.float32).unbind() for i, _ in long_rda}
        _run_all(pool, [partial(rda_chunk, i, seg, a, b) for i, seg in long_rda for a, b in chunks(seg)])
        _run_all(pool, [partial(rda_scale, i, seg) for i, seg in long_rda])
        _run_all(pool, [partial(rescale, i, seg, a, b) for i, seg in long_rda for a, b in chunks(seg)])


def _check_finite_threaded(deltas: torch.Tensor, threads: int) -> int | None:
    def bad(m: int, start: int) -> bool:
        part = deltas[m, start : start + _FINITE_CHUNK]
        return not bool(torch.isfinite(part.sum())) and not bool(torch.isfinite(part).all())

    jobs = [(m, start) for m in range(deltas.size(0)) for start in range(0, deltas.size(1), _FINITE_CHUNK)]
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="yeto-finite") as pool:
        flags = list(pool.map(lambda job: bad(*job), jobs))
    bad_rows = [m for (m, _), flag in zip(jobs, flags, strict=True) if flag]
    return min(bad_rows) if bad_rows else None


def outer_gradient(merged_delta: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The outer gradient Δ = −d (DiLoCo): learners' deltas point along their progress."""
    return torch.neg(merged_delta, out=out) if out is not None else torch.neg(merged_delta)

