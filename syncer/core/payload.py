"""Push and INIT payloads (DESIGN §7.5): whether one can be used under the session's codec, the
transport's chunk-by-chunk screen for NaN and Inf, and what the shell computes for the protocol's
asks (DESIGN §4.1): a push decoded into its f32 delta, an INIT fragment's values checked."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from syncer.merge.held import HeldDelta
from syncer.merge.merge import Segment, check_finite
from yeto_core.codecs import F32, Codec
from yeto_core.layout import Layout
from yeto_core.moments import moment_nbytes, moment_problem
from yeto_core.wire.messages import PUSH_MOMENT, Init, Message, Push


def payload_problem(layout: Layout, msg: Push, payload: memoryview | None, codec: Codec) -> str | None:
    """Why a push's payload cannot be used under the session's agreed `codec`, or None."""
    if msg.fragment >= layout.num_fragments:
        return f"fragment {msg.fragment} does not exist ({layout.num_fragments} fragments)"
    if msg.steps < 1:
        return "push reports zero steps"
    if msg.codec & ~PUSH_MOMENT != codec.wire_id:
        return f"push codec id {msg.codec} differs from the session contract ({codec.name}, id {codec.wire_id})"
    expected = codec.encoded_nbytes(layout.fragments[msg.fragment].numel)
    if msg.codec & PUSH_MOMENT:
        expected += moment_nbytes(layout.fragments[msg.fragment])
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
    if isinstance(msg, Push | Init) and msg.codec == F32.wire_id:  # a moment after the delta is not f32
        return finite_f32_part
    return None


def decode_push(layout: Layout, msg: Push, payload: memoryview, codec: Codec, screened: bool | None = None,
                *, hold: bool = False) -> tuple[torch.Tensor | HeldDelta, memoryview | None] | str:
    """The push's f32 delta (`hold`: kept in its wire form, `decode_delta`) and, with
    `PUSH_MOMENT`, the fragment's first moment that follows it, checked and kept in its wire form
    (DESIGN §3.9); or why they cannot be used (a bad block header or scale, NaN, Inf in either)."""
    if not msg.codec & PUSH_MOMENT:
        delta = decode_delta(layout, msg, payload, codec, screened, hold=hold)
        return delta if isinstance(delta, str) else (delta, None)
    cut = codec.encoded_nbytes(layout.fragments[msg.fragment].numel)
    delta = decode_delta(layout, msg, payload[:cut], codec, screened, hold=hold)
    if isinstance(delta, str):
        return delta
    moment = payload[cut:]
    problem = moment_problem(layout.fragments[msg.fragment], moment)
    if problem is not None:
        return f"push for fragment {msg.fragment}: first moment: {problem}"
    return delta, moment


def decode_delta(layout: Layout, msg: Push, payload: memoryview, codec: Codec,
                 screened: bool | None = None, *, hold: bool = False) -> torch.Tensor | HeldDelta | str:
    """The push's f32 delta (one part of its payload), or why it cannot be used (a bad block
    header or scale, NaN, Inf).

    `screened` is the transport's verdict when `payload_screen` already checked every chunk of an
    f32 payload for finiteness (True: all finite), None when it did not. `hold` (a codec that
    `held.holds`): the delta stays in its payload until merged, checked and its tensors' norms
    taken now, a span at a time, so no f32 copy of it is ever whole (DESIGN §10.2).
    """
    if codec is F32 and screened is False:
        return f"delta for fragment {msg.fragment} contains NaN or Inf"
    if hold:
        fragment = layout.fragments[msg.fragment]
        try:
            held = HeldDelta(codec, payload, fragment.numel)
        except ValueError as exc:
            return f"push for fragment {msg.fragment}: {exc}"
        try:
            return held.with_norms([Segment(s.offset, s.numel, rda=True) for s in fragment.slots])
        except ValueError:
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


def init_values(payload: memoryview, screened: bool | None, device: torch.device) -> torch.Tensor | None:
    """An INIT fragment's f32 values on `device`, or None when they hold NaN or Inf: checked here
    unless the transport screened every chunk as it landed (`screened`). The reassembled buffer
    is the message's alone: on the CPU it becomes the fragment, no copy."""
    values = torch.frombuffer(payload, dtype=torch.float32)
    if screened is False or (screened is None and check_finite(values.view(1, -1)) is not None):
        return None
    return values.to(device)
