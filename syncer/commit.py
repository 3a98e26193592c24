"""One round's merge, as a function of tensors and settings (SPEC §3.6).

The coordinator hands over the answers of a closed round; this module corrects stale deltas
(HeLoCo, optional), weights the learners (tokens²/steps), merges (RDA per tensor, plain average
for the embedding), and takes the outer optimizer step in place on the fragment's params and
momentum. It also decodes and validates push payloads. No sockets, no clocks but a stopwatch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from syncer.correction import HelocoConfig, heloco_correct
from syncer.merge import Segment, accurate_norm, check_finite, learner_weights, merge_deltas, outer_gradient
from syncer.outer import OuterOptimizer
from syncer.rounds import Answer
from yeto_core.codecs import F32, Codec
from yeto_core.layout import Layout
from yeto_core.wire.messages import Init, Message, Push


@dataclass(frozen=True)
class MergeOutcome:
    answers: list[Answer]  # in learner-id order, the order they were merged in
    weights: list[float]
    outer_grad_norm: float
    delta_norms: list[float]
    merge_ms: float


class MergeWorkspace:
    """Scratch tensors kept from one merge to the next. A merge needs a stack of the deltas, the
    merged delta and one step-sized temporary; a fresh 64 MiB CPU tensor faults in every page as it is first
    written (~16 ms here, allocations that size are always fresh memory), which made up most of
    a merge. Each buffer grows to the largest fragment merged and is viewed at the size asked."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._buffers[name] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf[:numel].view(shape)


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
    workspace: MergeWorkspace | None = None,
) -> MergeOutcome:
    """Merge one fragment's answers into `params` / `momentum` (in place)."""
    t0 = time.perf_counter()
    ordered = sorted(answers, key=lambda a: a.learner_id)
    weights = learner_weights([a.tokens for a in ordered], [a.steps for a in ordered])
    rows = [a.delta for a in ordered]
    stacked = None if workspace is None else workspace.take("deltas", (len(rows), params.numel()), params.device)
    deltas = torch.stack(rows, out=stacked)
    delta_norms = [accurate_norm(row) for row in deltas]
    if heloco is not None:  # realign deltas that oppose the outer momentum (a no-op while it is zero)
        for row in deltas:
            heloco_correct(row, momentum, segments, heloco, out=row)
    out = None if workspace is None else workspace.take("merged", (params.numel(),), params.device)
    merged = merge_deltas(deltas, weights.to(device=deltas.device, dtype=torch.float32), segments, out=out,
                          threads=threads)
    grad = outer_gradient(merged, out=merged)  # the merged delta is not needed after this
    scratch = None if workspace is None else workspace.take("step", tuple(params.shape), params.device)
    outer.step(params, momentum, grad, outer_state, scratch=scratch)
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


def finite_f32_part(part: memoryview) -> bool:
    """Whether one received chunk of an f32 payload holds no NaN or ±Inf (a part whose size is not
    whole floats passes: `payload_problem` refuses the push for its size).

    One read pass: the sum of squares is finite when every value is (NaN and Inf propagate
    through it); only a sum that overflows, or a poisoned one, pays for the element-wise check.
    `np.vdot` runs on the calling reader thread alone: a torch reduction would start a thread
    team per reader thread and oversubscribe the cores of a syncer with many connections.
    """
    if len(part) % 4 or not len(part):
        return True
    values = np.frombuffer(part, dtype=np.float32)
    return bool(np.isfinite(np.vdot(values, values))) or bool(np.isfinite(values).all())


def payload_screen(msg: Message) -> Callable[[memoryview], bool] | None:
    """The transport's screen for a syncer: f32 pushes and INIT fragments are checked for NaN/Inf
    chunk by chunk as they arrive, on the reader threads, so the coordinator need not read the
    payload again. (Quantized pushes are checked as they are decoded.)"""
    if isinstance(msg, Push | Init) and msg.codec == F32.wire_id:
        return finite_f32_part
    return None


def decode_delta(layout: Layout, msg: Push, payload: memoryview, codec: Codec,
                 screened: bool | None = None) -> torch.Tensor | str:
    """The push's f32 delta, or why it cannot be used (a bad block header or scale, NaN, Inf).

    `screened` is the transport's verdict when `payload_screen` already checked every chunk of an
    f32 payload for finiteness (True: all finite), None when it did not.
    """
    if codec is F32 and screened is False:
        return f"delta for fragment {msg.fragment} contains NaN or Inf"
    if codec is F32:  # the reassembled buffer belongs to this message alone: view it, no copy
        delta = torch.frombuffer(payload, dtype=torch.float32)
        if screened:
            return delta
    else:
        delta = torch.empty(layout.fragments[msg.fragment].numel, dtype=torch.float32)
        try:
            codec.decode(payload, delta)
        except ValueError as exc:
            return f"push for fragment {msg.fragment}: {exc}"
    if check_finite(delta.view(1, -1)) is not None:
        return f"delta for fragment {msg.fragment} contains NaN or Inf"
    return delta
