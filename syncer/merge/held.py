"""Pushes kept in their wire encoding until their round is merged (DESIGN §10.2).

A quantized push is a few bits a value on the wire and four bytes once decoded. The syncer has
the pushes of every round in flight to hold (pipeline × M of them), so decoding each on arrival
would hold `4·pipeline·M/P` bytes per parameter of the model, at M = 4 and P = 8 as much as the
model itself. A `HeldDelta` keeps the payload instead and lets the merge read it a span at a time
(`merge.py` reads rows through `span`): each span is decoded as it is read, with the bits the
whole decode gives, so a round merges to the same bits either way. The norms RDA weighs a push by
are taken once, on arrival, on the decode pool, a span at a time as well.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from syncer.merge.merge import Segment, segment_sq_norms
from yeto_core.codecs import BF16, Codec
from yeto_core.quant import QuantCodec

__all__ = ["HeldDelta", "holds"]

_SPAN = 1 << 20  # values decoded at a time where the merge does not say (whole-row reads, max_abs)


def holds(codec: Codec, device: torch.device) -> bool:
    """Whether a push in `codec` is held encoded until its merge: the block-quantized codecs and
    bf16, on a CPU merge device (an accelerator's merge takes its deltas decoded, in its own memory)."""
    return device.type == "cpu" and (isinstance(codec, QuantCodec) or codec is BF16)


class HeldDelta:
    """One push's f32 delta of `numel` values, held as its payload; `start`/`stop` window it (a
    tensor's span of the fragment, as slicing a tensor row would). The merge asks it for float32
    spans (`span`); nothing else of it is a tensor."""

    __slots__ = ("_scales", "_wire", "codec", "payload", "sq_norms", "start", "stop", "total")
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, codec: Codec, payload: memoryview, numel: int) -> None:
        """Raises ValueError when the payload would not decode to `numel` finite values from its
        header, size and scales alone (a quantized code is a bounded multiple of its scale); bf16
        values are checked as their norms are taken (`with_norms`)."""
        if not holds(codec, torch.device("cpu")):
            raise ValueError(f"a {codec.name} push is not held encoded")
        self.codec, self.payload, self.total = codec, payload, numel
        self.start, self.stop = 0, numel
        self.sq_norms: torch.Tensor | None = None  # per tensor of the fragment, float64, from `with_norms`
        if isinstance(codec, QuantCodec):
            self._wire, self._scales = codec.checked_scales(payload, numel)
        else:
            if len(payload) != codec.encoded_nbytes(numel):
                raise ValueError(f"bf16 payload of {len(payload)} bytes, expected {codec.encoded_nbytes(numel)}")
            self._wire, self._scales = np.frombuffer(payload, dtype="<u2"), np.empty(0, dtype=np.float32)

    def numel(self) -> int:
        return self.stop - self.start

    def dim(self) -> int:
        return 1

    @property
    def nbytes(self) -> int:
        """The bytes it holds: its payload's, for the whole fragment."""
        return len(self.payload)

    def __getitem__(self, window: slice) -> HeldDelta:
        """The values [window.start, window.stop) of this window, still held (slices step 1)."""
        start, stop, step = window.indices(self.numel())
        if step != 1:
            raise ValueError("a held delta is sliced with step 1 only")
        view = object.__new__(HeldDelta)
        view.codec, view.payload, view.total, view._wire, view._scales = (
            self.codec, self.payload, self.total, self._wire, self._scales)
        view.start, view.stop, view.sq_norms = self.start + start, self.start + max(start, stop), None
        return view

    def span(self, start: int, stop: int) -> torch.Tensor:
        """Values [start, stop) of this window, decoded into a new float32 tensor."""
        lo, hi = self.start + start, self.start + stop
        if not self.start <= lo <= hi <= self.stop:
            raise ValueError(f"span [{start}, {stop}) is outside the held delta's {self.numel()} values")
        if isinstance(self.codec, QuantCodec):
            return self.codec.decode_span(self._wire, self._scales, self.total, lo, hi)
        bits = torch.from_numpy(self._wire[lo:hi].view(np.int16)).view(torch.bfloat16)
        return bits.float()  # exact: a bf16 value is the top half of its float32

    def decode(self) -> torch.Tensor:
        """The whole window, decoded (HeLoCo rewrites deltas, and an accelerator merges them decoded)."""
        return self.span(0, self.numel())

    def to(self, device: torch.device) -> torch.Tensor:
        return self.decode().to(device)

    def max_abs(self) -> float:
        """The largest |value| of the window, a span at a time."""
        n = self.numel()
        return max((float(self.span(a, min(a + _SPAN, n)).abs().max()) for a in range(0, n, _SPAN)), default=0.0)

    def with_norms(self, segments: list[Segment]) -> HeldDelta:
        """Take the squared norm of each of the fragment's tensors (`segments`), as the merge would
        (`merge.segment_sq_norms`, the same bits); raises ValueError on a NaN or ±Inf value."""
        sq = segment_sq_norms([self], segments)[0]
        if not all(math.isfinite(v) for v in sq.tolist()) and self.codec is BF16:
            for a in range(0, self.numel(), _SPAN):
                if not bool(torch.isfinite(self.span(a, min(a + _SPAN, self.numel()))).all()):
                    raise ValueError("contains NaN or Inf")
        self.sq_norms = sq
        return self
