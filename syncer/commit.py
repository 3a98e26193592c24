"""One round's merge, as a function of tensors and settings (SPEC §3.6).

The coordinator hands over the answers of a closed round; this module corrects stale deltas
(HeLoCo, optional), weights the learners (tokens²/steps), merges (RDA per tensor, plain average
for the embedding), and takes the outer optimizer step in place on the fragment's params and
momentum. It also decodes and validates push payloads. No sockets, no clocks but a stopwatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from syncer.correction import HelocoConfig, heloco_correct
from syncer.merge import Segment, accurate_norm, check_finite, learner_weights, merge_deltas, outer_gradient
from syncer.outer import OuterOptimizer
from syncer.rounds import Answer
from yeto_core.codecs import F32, Codec
from yeto_core.layout import Layout
from yeto_core.wire.messages import Push


@dataclass(frozen=True)
class MergeOutcome:
    answers: list[Answer]  # in learner-id order, the order they were merged in
    weights: list[float]
    outer_grad_norm: float
    delta_norms: list[float]
    merge_ms: float


def merge_round(
    answers: list[Answer],
    *,
    params: torch.Tensor,
    momentum: torch.Tensor,
    outer_state: dict[str, Any],
    segments: list[Segment],
    outer: OuterOptimizer,
    heloco: HelocoConfig | None,
    threads: int = 1,
) -> MergeOutcome:
    """Merge one fragment's answers into `params` / `momentum` (in place)."""
    t0 = time.perf_counter()
    ordered = sorted(answers, key=lambda a: a.learner_id)
    weights = learner_weights([a.tokens for a in ordered], [a.steps for a in ordered])
    deltas = torch.stack([a.delta for a in ordered])
    delta_norms = [accurate_norm(row) for row in deltas]
    if heloco is not None:  # realign deltas that oppose the outer momentum (a no-op while it is zero)
        for row in deltas:
            heloco_correct(row, momentum, segments, heloco, out=row)
    merged = merge_deltas(deltas, weights.to(device=deltas.device, dtype=torch.float32), segments, threads=threads)
    grad = outer_gradient(merged)
    outer.step(params, momentum, grad, outer_state)
    return MergeOutcome(ordered, [float(w) for w in weights], accurate_norm(grad), delta_norms,
                        (time.perf_counter() - t0) * 1000)


def payload_problem(layout: Layout, msg: Push, payload: memoryview | None, codec: Codec) -> str | None:
    """Why a push's payload cannot be used under the session's agreed `codec`, or None."""
    if msg.fragment >= layout.num_fragments:
        return f"fragment {msg.fragment} does not exist ({layout.num_fragments} fragments)"
    if msg.steps < 1:
        return "push reports zero steps"
    if msg.codec != codec.wire_id:
        return f"push codec id {msg.codec} differs from the session contract ({codec.name}, id {codec.wire_id})"
    expected = codec.encoded_nbytes(layout.fragments[msg.fragment].numel)
    if payload is None or len(payload) != expected:
        return f"push of {0 if payload is None else len(payload)} bytes, expected {expected} ({codec.name})"
    return None


def decode_delta(layout: Layout, msg: Push, payload: memoryview, codec: Codec) -> torch.Tensor | str:
    """The push's f32 delta, or why it cannot be used (a bad block header or scale, NaN, Inf)."""
    if codec is F32:  # the reassembled buffer belongs to this message alone: view it, no copy
        delta = torch.frombuffer(payload, dtype=torch.float32)
    else:
        delta = torch.empty(layout.fragments[msg.fragment].numel, dtype=torch.float32)
        try:
            codec.decode(payload, delta)
        except ValueError as exc:
            return f"push for fragment {msg.fragment}: {exc}"
    if check_finite(delta.view(1, -1)) is not None:
        return f"delta for fragment {msg.fragment} contains NaN or Inf"
    return delta
