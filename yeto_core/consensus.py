"""The consensus signal (DESIGN §8.2): how far apart the islands' models are, seen from outside.

Every learner evaluates the same fixed probe batch and summarizes its output distribution per
probe token as the top-k token probabilities plus the mass left over (`ProbeSummary`). The
syncer compares the learners' summaries with the Jensen–Shannon *distance* (the square root of
the JS divergence with base-2 logs, so 0 for identical outputs and 1 for disjoint ones; Endres
& Schindelin, "A new metric for probability distributions", IEEE T-IT 2003), averaged over the
probe tokens and over pairs of learners.

Pure functions over tensors and bytes; no sockets, no clocks. The wire form of a summary (little
endian, every length and value checked on decode):

    u32 tokens T | u32 k | u32 vocab V | i32 ids[T·k] | f32 probs[T·k] | f32 tail[T]

row t of `ids`/`probs` being token t's k most likely ids and their probabilities, and
`tail[t]` = 1 − Σ probs[t] the mass of the other V − k ids.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import torch

MAX_PROBE_TOKENS = 512
MAX_TOP_K = 1024
MAX_VOCAB = 2**31 - 1
_HEAD = struct.Struct("<III")
MAX_SUMMARY_BYTES = _HEAD.size + MAX_PROBE_TOKENS * MAX_TOP_K * 8 + MAX_PROBE_TOKENS * 4
SUM_TOLERANCE = 1e-3  # |Σ probs + tail − 1| a decoded summary may show (f32 softmax rounding)


@dataclass(frozen=True, eq=False)
class ProbeSummary:
    """Per probe token: the top-k token ids (int32, [T, k]), their probabilities (float32, [T, k])
    and the tail mass of the remaining V − k ids (float32, [T])."""

    ids: torch.Tensor
    probs: torch.Tensor
    tail: torch.Tensor
    vocab: int

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])


def summarize(logits: torch.Tensor, k: int) -> ProbeSummary:
    """Softmax (in f32) of `logits` [T, V] and its top-min(k, V) entries per row."""
    if logits.dim() != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"probe logits must be [tokens, vocab] with both ≥ 1, got {tuple(logits.shape)}")
    if k < 1:
        raise ValueError(f"top-k must be at least 1, got {k}")
    tokens, vocab = int(logits.shape[0]), int(logits.shape[1])
    if tokens > MAX_PROBE_TOKENS or vocab > MAX_VOCAB:
        raise ValueError(f"probe of {tokens} tokens over a vocabulary of {vocab} exceeds the bounds "
                         f"({MAX_PROBE_TOKENS} tokens, {MAX_VOCAB} ids)")
    k = min(k, vocab, MAX_TOP_K)
    probs = torch.softmax(logits.detach().to("cpu", torch.float32), dim=-1)
    if not torch.isfinite(probs).all():
        raise ValueError("probe logits produce NaN or Inf probabilities")
    top = torch.topk(probs, k, dim=-1, sorted=True)
    tail = (1.0 - top.values.double().sum(dim=-1)).clamp_(0.0, 1.0).float()
    return ProbeSummary(top.indices.to(torch.int32).contiguous(), top.values.contiguous(), tail, vocab)


def _f(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-entry share of the JS divergence (nats): ½(p ln p + q ln q) − m ln m, m = (p + q)/2.
    Summed over a distribution's support it is ½KL(p‖m) + ½KL(q‖m); xlogy makes 0·ln 0 = 0."""
    m = 0.5 * (p + q)
    return 0.5 * (torch.special.xlogy(p, p) + torch.special.xlogy(q, q)) - torch.special.xlogy(m, m)


def _lookup(ids: torch.Tensor, probs: torch.Tensor, at: torch.Tensor, fill: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the probability `ids`/`probs` give each id in `at` (`fill` of that row where the id
    is not listed), and whether it was listed."""
    order = torch.argsort(ids, dim=-1)
    sorted_ids = torch.gather(ids, -1, order)
    sorted_probs = torch.gather(probs, -1, order)
    pos = torch.searchsorted(sorted_ids, at.contiguous()).clamp_(max=ids.shape[-1] - 1)
    found = torch.gather(sorted_ids, -1, pos) == at
    return torch.where(found, torch.gather(sorted_probs, -1, pos), fill[:, None].expand_as(at)), found


def js_distance(a: ProbeSummary, b: ProbeSummary) -> float:
    """Mean over probe tokens of the Jensen–Shannon distance √JSD₂(P_a, P_b), in [0, 1].

    Approximation: each side lists only its top-k ids, so an id that one side did not list gets
    that side's tail mass spread uniformly over the V − k ids it did not list (the union of both
    top-k sets is compared entry by entry; the ids neither side listed share one term). Both
    reconstructed distributions still sum to one. It is exact when k == V, and for k < V it
    differs from the true distance only through how each side's tail is shaped.
    """
    if (a.tokens, a.vocab) != (b.tokens, b.vocab):
        raise ValueError(f"probe summaries differ in shape: {a.tokens} tokens over {a.vocab} ids vs "
                         f"{b.tokens} over {b.vocab} (not the same probe batch or model)")
    pa, pb = a.probs.double(), b.probs.double()
    ta, tb = a.tail.double(), b.tail.double()
    rest_a, rest_b = a.vocab - a.k, b.vocab - b.k
    ua = ta / rest_a if rest_a else torch.zeros_like(ta)  # per unlisted id
    ub = tb / rest_b if rest_b else torch.zeros_like(tb)
    ids_a, ids_b = a.ids.long(), b.ids.long()
    q_at_a, _ = _lookup(ids_b, pb, ids_a, ub)  # b's probability of each id a listed
    p_at_b, in_a = _lookup(ids_a, pa, ids_b, ua)  # a's probability of each id b listed
    only_b = ~in_a
    div = _f(pa, q_at_a).sum(-1) + torch.where(only_b, _f(p_at_b, pb), torch.zeros_like(pb)).sum(-1)
    neither = a.vocab - a.k - only_b.sum(-1)  # ids listed by no side
    div = div + neither.double() * _f(ua, ub)
    dist = torch.sqrt((div / math.log(2.0)).clamp(0.0, 1.0))
    return float(dist.mean())


def pairwise_js(summaries: Mapping[int, ProbeSummary]) -> float | None:
    """Mean JS distance over every pair of learners; None with fewer than two summaries."""
    pairs = list(combinations(sorted(summaries), 2))
    if not pairs:
        return None
    return sum(js_distance(summaries[i], summaries[j]) for i, j in pairs) / len(pairs)


def encode_summary(s: ProbeSummary) -> bytes:
    """The fixed little-endian wire form (module docstring)."""
    t, k = s.tokens, s.k
    if not (1 <= t <= MAX_PROBE_TOKENS and 1 <= k <= min(MAX_TOP_K, s.vocab) and s.vocab <= MAX_VOCAB):
        raise ValueError(f"summary of {t} tokens, top-{k} of {s.vocab} ids is outside the bounds")
    if tuple(s.probs.shape) != (t, k) or tuple(s.tail.shape) != (t,):
        raise ValueError("summary tensors disagree in shape")
    ids = s.ids.to("cpu", torch.int32).numpy().astype("<i4", copy=False)
    probs = s.probs.to("cpu", torch.float32).numpy().astype("<f4", copy=False)
    tail = s.tail.to("cpu", torch.float32).numpy().astype("<f4", copy=False)
    return _HEAD.pack(t, k, s.vocab) + ids.tobytes() + probs.tobytes() + tail.tobytes()


def decode_summary(data: bytes | memoryview) -> ProbeSummary:
    """Parse and validate a summary; any problem raises ValueError naming it."""
    raw = memoryview(data).cast("B")
    if len(raw) < _HEAD.size:
        raise ValueError(f"probe summary of {len(raw)} bytes is shorter than its {_HEAD.size}-byte header")
    t, k, vocab = _HEAD.unpack(raw[: _HEAD.size])
    if not 1 <= t <= MAX_PROBE_TOKENS:
        raise ValueError(f"probe summary claims {t} tokens (1..{MAX_PROBE_TOKENS})")
    if not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"probe summary claims a vocabulary of {vocab} ids (1..{MAX_VOCAB})")
    if not 1 <= k <= min(MAX_TOP_K, vocab):
        raise ValueError(f"probe summary claims top-{k} of {vocab} ids (1..{min(MAX_TOP_K, vocab)})")
    n = t * k
    expected = _HEAD.size + n * 8 + t * 4
    if len(raw) != expected:
        raise ValueError(f"probe summary of {t} tokens, top-{k} is {len(raw)} bytes, expected {expected}")
    body = raw[_HEAD.size :]
    ids = np.frombuffer(body, dtype="<i4", count=n, offset=0).reshape(t, k)
    probs = np.frombuffer(body, dtype="<f4", count=n, offset=n * 4).reshape(t, k)
    tail = np.frombuffer(body, dtype="<f4", count=t, offset=n * 8)
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"probe summary lists a token id outside 0..{vocab - 1}")
    if k > 1 and (np.diff(np.sort(ids, axis=1), axis=1) == 0).any():
        row = int(np.nonzero((np.diff(np.sort(ids, axis=1), axis=1) == 0).any(axis=1))[0][0])
        raise ValueError(f"probe summary lists a token id twice for probe token {row}")
    for name, values in (("probabilities", probs), ("tail masses", tail)):
        if not np.isfinite(values).all():
            raise ValueError(f"probe summary {name} contain NaN or Inf")
        if values.min() < 0.0 or values.max() > 1.0:
            raise ValueError(f"probe summary {name} fall outside [0, 1]")
    sums = probs.astype(np.float64).sum(axis=1) + tail
    worst = int(np.abs(sums - 1.0).argmax())
    if abs(sums[worst] - 1.0) > SUM_TOLERANCE:
        raise ValueError(f"probe token {worst}'s probabilities and tail sum to {sums[worst]:.6f}, not 1")
    return ProbeSummary(torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(probs.astype(np.float32)),
                        torch.from_numpy(tail.astype(np.float32)), vocab)
