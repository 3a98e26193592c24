"""Block-quantized codecs (DESIGN §7.3, PROTOCOL §8): ``int8``, ``int4``, ``e3m0``, ``int4-log``, ``int2``.

Every payload has the same container, little-endian throughout::

    u32 B                               block size, checked against the agreed one on decode
    per block of B values (the last block may be shorter, L values):
        f32 scale                       finite and ≥ 0
        codes                           int8: one byte per value
                                        4-bit: ceil(n/2) bytes, two codes a byte, low nibble first
                                        int2: ceil(n/4) bytes, four codes a byte, lowest bits first

so ``encoded_nbytes(numel) = 4 + nblocks·4 + numel`` for int8 and
``4 + nblocks·4 + nfull·ceil(B/2) + ceil(L/2)`` for the 4-bit codecs (``ceil(·/4)`` for int2). An empty tensor is the
4-byte header alone. For each block, ``A`` is its largest magnitude (its absmax):

``int8`` (wire id 3)
    ``scale = A/127``, ``q = round(x/scale)`` clamped to [-127, 127], decoded as ``q·scale``.
    Worst-case error ``A/254``.
``int4`` (wire id 4)
    ``scale = A/7``, ``q = round(x/scale)`` clamped to [-7, 7], stored as the code ``q + 8``
    (1..15; encoders never write 0, and a decoder reads a 0 as -8). Worst-case error ``A/14``.
``int2`` (wire id 7)
    ``scale = A/1.5``, four levels ``(c − 1.5)·scale`` = ``±A/3, ±A`` for the code
    ``c = round(x/scale + 1.5)`` clamped to [0, 3]; no level is zero, which error feedback (the
    downlink's anchor, a push's residual) makes good. Worst-case error ``A/3``.
``e3m0`` (wire id 5)
    ``scale = A``; a code is a sign bit (bit 3) and a 3-bit exponent e: magnitude
    ``scale·2^(e-7)`` for e = 1..7 and zero for e = 0 (levels ``A·{0, 2^-6, …, 2^-1, 1}``).
    The nearest level *in linear space* is chosen. Worst-case error ``A/4`` (halfway between
    A/2 and A).
``int4-log`` (wire id 6)
    ``scale = A``; a code is a sign bit (bit 3) and a 3-bit level index k: magnitude
    ``scale·2^((k-7)/2)`` for k = 1..7 and zero for k = 0 — half-octave steps,
    ``A·{0, 2^-3, 2^-2.5, 2^-2, 2^-1.5, 2^-1, 2^-0.5, 1}`` (the float32 values in
    ``INT4_LOG_LEVELS``), nearest level in linear space. Worst-case error ``A·(1 - 2^-0.5)/2``
    ≈ ``0.1464·A`` (halfway between A·2^-0.5 and A).

A block of zeros has scale 0 and all codes zero-valued. Ties round to even for the linear
codecs (``torch.round``); for the level codecs a value exactly on a midpoint goes down to zero at
the first midpoint and up elsewhere, and float32 rounding of ``|x|/A`` may pick either neighbour
within a few ulps of a midpoint (which the float32 slack below covers). The bounds
above hold up to float32 rounding: every test allows ``A·2^-21 + 2^-148`` on top. To keep them
for subnormal blocks, the linear codecs round the stored scale *up* by one ulp whenever
``qmax·scale < A`` in float32 (and so never store a zero scale for a non-zero block), and down by
one ulp where ``qmax·scale`` would overflow to infinity (A near float32's max); otherwise the scale
is exactly ``fl(A/qmax)``. A decoder accepts any finite scale ≥ 0, so a hostile payload can still
decode to ±inf (e.g. scale 3e38 with q = 127): callers that need finite deltas check them.

On the CPU, with numba installed (``yeto[fast]``), one compiled pass per block does the work on
the torch threads' count of Python threads (``quant_kernels.py``), at about memory speed; it is
the same float32 arithmetic, so the bits are those of the torch path below. Without numba, and
for a tensor on another device, the work runs in chunks of about 4 MiB of input with torch ops
into buffers allocated once per call: no Python loop over elements or blocks, no
``torch.compile``. A tensor on an accelerator is worked on there (its float32 kernels are IEEE
too: the same bits); only codes and scales cross to and from the host buffer.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterator

import numpy as np
import torch

from yeto_core import quant_kernels

__all__ = [
    "DEFAULT_BLOCK",
    "E3M0_LEVELS",
    "ERROR_BOUNDS",
    "INT4_LOG_LEVELS",
    "MAX_BLOCK",
    "QUANT_WIRE_IDS",
    "QuantCodec",
    "quant_codec",
]

DEFAULT_BLOCK = 128
MAX_BLOCK = 1 << 20
_CHUNK_VALUES = (4 << 20) // 4  # 4 MiB of float32 input per chunk
_TINY = float(np.finfo(np.float32).smallest_subnormal)  # 2^-149

QUANT_WIRE_IDS: dict[str, int] = {"int8": 3, "int4": 4, "e3m0": 5, "int4-log": 6, "int2": 7}

# Level magnitudes (multiples of the block scale) by 3-bit index, exactly as float32.
E3M0_LEVELS: tuple[float, ...] = (0.0, *(math.ldexp(1.0, e - 7) for e in range(1, 8)))
_SQRT_HALF = math.sqrt(0.5)  # correctly rounded by IEEE 754, so the table is the same everywhere
INT4_LOG_LEVELS: tuple[float, ...] = tuple(
    float(np.float32(0.0 if k == 0 else math.ldexp(1.0 if (7 - k) % 2 == 0 else _SQRT_HALF, -((7 - k) // 2))))
    for k in range(8)
)

# Worst-case |x - decoded| as a fraction of the block absmax, before float32 rounding.
ERROR_BOUNDS: dict[str, float] = {
    "int8": 1 / 254,
    "int2": 1 / 3,
    "int4": 1 / 14,
    "e3m0": 1 / 4,
    "int4-log": (1.0 - INT4_LOG_LEVELS[6]) / 2,
}

_LEVELS = {"e3m0": E3M0_LEVELS, "int4-log": INT4_LOG_LEVELS}
_QMAX = {"int8": 127.0, "int4": 7.0, "int2": 1.5}  # the largest code's multiple of the scale


def _code_values(name: str) -> np.ndarray:
    """The multiplier of the scale that each 4-bit code decodes to."""
    codes = np.arange(16)
    if name == "int4":
        return (codes - 8).astype(np.float32)
    if name == "int2":
        return ((codes & 3) - 1.5).astype(np.float32)
    levels = np.asarray(_LEVELS[name], dtype=np.float32)
    return np.where(codes & 8, -1.0, 1.0).astype(np.float32) * levels[codes & 7]


class QuantCodec:
    """One block-quantized codec at one block size; satisfies ``yeto_core.codecs.Codec``."""

    __slots__ = ("_pair_table", "_qmax", "_quad_table", "_t0", "_t1", "_table", "block", "compiled", "name",
                 "wire_id")

    def __init__(self, name: str, block: int = DEFAULT_BLOCK) -> None:
        if name not in QUANT_WIRE_IDS:
            raise ValueError(f"unknown quantized codec {name!r}; accepted: {', '.join(QUANT_WIRE_IDS)}")
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK:
            raise ValueError(f"block size must be an integer in [1, {MAX_BLOCK}], got {block!r}")
        self.name = name
        self.wire_id = QUANT_WIRE_IDS[name]
        self.block = block
        self._qmax = _QMAX.get(name, 0)
        self._t0 = self._t1 = 0.0
        self._pair_table: torch.Tensor | None = None
        self._quad_table: torch.Tensor | None = None
        self._table = _code_values(name) if name != "int8" else np.zeros(16, dtype=np.float32)
        self.compiled = quant_kernels.AVAILABLE  # False: the torch path (the tests hold both to the same bits)
        if name in _LEVELS:
            levels = np.asarray(_LEVELS[name], dtype=np.float64)
            mids = ((levels[:-1] + levels[1:]) / 2).astype(np.float32)
            self._t0, self._t1 = float(mids[0]), float(mids[1])
        byte = np.arange(256)
        if name == "int2":  # one gather per packed byte yields its four values, lowest bits first
            self._quad_table = torch.from_numpy(np.stack([self._table[(byte >> s) & 3] for s in (0, 2, 4, 6)], axis=1))
        elif name != "int8":  # ... its two values, low nibble first
            values = _code_values(name)
            self._pair_table = torch.from_numpy(np.stack([values[byte & 15], values[byte >> 4]], axis=1))

    def __repr__(self) -> str:
        return f"quant_codec({self.name!r}, block={self.block})"

    def _code_bytes(self, n: int) -> int:
        return n if self.name == "int8" else (n + 3) // 4 if self.name == "int2" else (n + 1) // 2

    def encoded_nbytes(self, numel: int) -> int:
        nfull, last = divmod(numel, self.block)
        total = 4 + nfull * (4 + self._code_bytes(self.block))
        return total + (4 + self._code_bytes(last) if last else 0)

    # ---- encode -------------------------------------------------------------------------------

    def encode(self, src: torch.Tensor, out: memoryview) -> None:
        if src.dtype != torch.float32 or src.dim() != 1 or not src.is_contiguous():
            raise ValueError(
                f"{self.name} encode needs a contiguous 1-D float32 tensor, "
                f"got dtype {src.dtype} shape {tuple(src.shape)} contiguous={src.is_contiguous()}"
            )
        numel = src.numel()
        dst = _as_bytes(self.name, out, self.encoded_nbytes(numel))
        if dst.readonly:
            raise ValueError(f"{self.name} encode needs a writable output buffer")
        struct.pack_into("<I", dst, 0, self.block)
        if not numel:
            return
        if self.compiled and src.device.type == "cpu":
            self._encode_compiled(src, dst)
            return
        wire = torch.frombuffer(dst, dtype=torch.uint8)
        for first, x, w in self._pieces(src, wire):
            self._encode_blocks(first, x, w)

    def _encode_compiled(self, src: torch.Tensor, dst: memoryview) -> None:
        b, numel = self.block, src.numel()
        nfull, tail = divmod(numel, b)
        stride = 4 + self._code_bytes(b)
        scales = np.empty(nfull + 1, dtype=np.float32)
        bad = np.empty(nfull + 1, dtype=np.int64)
        wire = np.frombuffer(dst, dtype=np.uint8)
        x = src.detach().numpy()
        params: tuple[float | bool, ...]
        if self.name == "int2":
            kernel, params = "encode_int2", ()
        elif self._qmax:
            kernel, params = "encode_linear", (float(self._qmax), self.name == "int4")
        else:
            kernel, params = "encode_level", (self._t0, self._t1, self.name == "int4-log")
        threads = torch.get_num_threads()
        if nfull:  # the whole blocks, then the last one alone (its own length as its block)
            quant_kernels.run(kernel, nfull, threads, x[: nfull * b], b, *params, wire[4 : 4 + nfull * stride],
                              scales, bad)
        if tail:
            quant_kernels.run(kernel, 1, 1, x[nfull * b :], tail, *params, wire[4 + nfull * stride :],
                              scales[nfull:], bad[nfull:])
        nblocks = nfull + (1 if tail else 0)
        failed = np.flatnonzero(bad[:nblocks] >= 0)
        if failed.size:
            where = int(failed[0]) * b + int(bad[failed[0]])
            raise ValueError(f"{self.name} encode: non-finite value {float(x[where])} at element {where}")
        rows = wire[4 : 4 + nfull * stride].reshape(nfull, stride)
        rows[:, :4] = scales[:nfull].view(np.uint8).reshape(nfull, 4)
        if tail:
            off = 4 + nfull * stride
            wire[off : off + 4] = scales[nfull : nfull + 1].view(np.uint8)

    def _pieces(self, flat: torch.Tensor, wire: torch.Tensor) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(first block index, values [nb, b], wire rows [nb, 4 + code bytes]) chunk by chunk."""
        b = self.block
        nfull, last = divmod(flat.numel(), b)
        stride = 4 + self._code_bytes(b)
        per = max(1, _CHUNK_VALUES // b)
        for b0 in range(0, nfull, per):
            nb = min(per, nfull - b0)
            yield (
                b0,
                flat[b0 * b : (b0 + nb) * b].view(nb, b),
                wire[4 + b0 * stride : 4 + (b0 + nb) * stride].view(nb, stride),
            )
        if last:
            off = 4 + nfull * stride
            yield nfull, flat[nfull * b :].view(1, last), wire[off:].view(1, -1)

    def _encode_blocks(self, first: int, x: torch.Tensor, w: torch.Tensor) -> None:
        """One chunk of blocks, on `x`'s own device (an accelerator's kernels are IEEE float32
        too: the same bits); only the codes and scales cross to the host buffer `w`."""
        nb, b = x.shape
        dev = x.device
        work = torch.empty((nb, b), dtype=torch.float32, device=dev)
        torch.abs(x, out=work)
        amax = torch.amax(work, dim=1)
        finite = torch.isfinite(amax)
        if not bool(finite.all()):
            row = int((~finite).nonzero()[0, 0])
            col = int((~torch.isfinite(x[row])).nonzero()[0, 0])
            where = (first + row) * self.block + col
            raise ValueError(f"{self.name} encode: non-finite value {float(x[row, col])} at element {where}")
        if self._qmax:
            qmax = self._qmax
            scale = amax / qmax
            low = scale * qmax < amax
            if bool(low.any()):  # round up so that x/scale never passes qmax (and no zero scale)
                scale = torch.where(low, torch.nextafter(scale, torch.tensor(math.inf, device=dev)), scale)
            high = torch.isinf(scale * qmax)
            if bool(high.any()):  # near float32's max: round down instead, so q·scale stays finite
                scale = torch.where(high, torch.nextafter(scale, torch.tensor(0.0, device=dev)), scale)
            torch.div(x, scale.clamp_min(_TINY).unsqueeze(1), out=work)
            if self.name == "int2":  # the nearest of the levels (c − 1.5)·scale
                work.add_(qmax).round_().clamp_(0, 2 * qmax)
                self._pack_quads(work, w)
            elif self.name == "int8":
                w[:, 4:].view(torch.int8).copy_(work.round_().clamp_(-qmax, qmax))
            else:
                work.round_().clamp_(-qmax, qmax).add_(8)
                self._pack(work, w)
        else:
            # Nearest level in linear space without a search: past the first midpoint t1 (between
            # levels 1 and 2) the midpoints grow by the level ratio r (2, or √2 for int4-log), so
            # index = 2 + floor(log_r(y/t1)), read off the float32 exponent of (y/t1)^(log2 r).
            scale = amax
            torch.div(x, amax.clamp_min(_TINY).unsqueeze(1), out=work)
            negative = torch.lt(work, -self._t0)  # negative and not rounded to zero
            work.abs_()
            nonzero = torch.gt(work, self._t0)
            work.div_(self._t1)
            if self.name == "int4-log":
                work.square_()
            index = torch.bitwise_right_shift(work.view(torch.int32), 23)
            index.sub_(127 - 2).clamp_(1, 7).mul_(nonzero).add_(negative, alpha=8)
            self._pack(index, w)
        w[:, :4].copy_(scale.contiguous().view(torch.uint8).view(nb, 4))

    def _pack(self, codes: torch.Tensor, w: torch.Tensor) -> None:
        """Codes 0..15 [nb, b] → bytes, two a byte, low nibble first, into ``w[:, 4:]``."""
        nb, b = codes.shape
        width = b + (b & 1)
        make = torch.zeros if b & 1 else torch.empty
        nibbles = make((nb, width), dtype=torch.uint8, device=codes.device)
        nibbles[:, :b].copy_(codes)
        pairs = nibbles.view(torch.int16)  # little-endian: low nibble in bits 0-3, high in bits 8-11
        packed = torch.bitwise_right_shift(pairs, 4)
        packed.bitwise_or_(pairs).bitwise_and_(0xFF)
        w[:, 4:].copy_(packed)

    def _pack_quads(self, codes: torch.Tensor, w: torch.Tensor) -> None:
        """Codes 0..3 [nb, b] → bytes, four a byte, lowest bits first, into ``w[:, 4:]``."""
        nb, b = codes.shape
        width = -(-b // 4) * 4
        quads = torch.zeros((nb, width), dtype=torch.uint8, device=codes.device)
        quads[:, :b].copy_(codes)
        v = quads.view(torch.int32)  # little-endian: code k of four in bits 8k..8k+1
        packed = v.bitwise_or(torch.bitwise_right_shift(v, 6))
        packed.bitwise_or_(torch.bitwise_right_shift(v, 12)).bitwise_or_(torch.bitwise_right_shift(v, 18))
        w[:, 4:].copy_(packed.bitwise_and_(0xFF))

    # ---- decode -------------------------------------------------------------------------------

    def decode(self, buf: memoryview, out: torch.Tensor) -> None:
        if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
            raise ValueError(
                f"{self.name} decode needs a contiguous 1-D float32 output tensor, "
                f"got dtype {out.dtype} shape {tuple(out.shape)} contiguous={out.is_contiguous()}"
            )
        numel = out.numel()
        wire, scales = self._scales(buf, numel)
        bad = ~(np.isfinite(scales) & (scales >= 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{self.name} payload: block {i} has scale {float(scales[i])!r}, not a finite value ≥ 0")
        if not numel:
            return
        pieces = list(self._pieces_np(numel, wire))
        if self.compiled and out.device.type == "cpu":
            b = self.block
            nfull, tail = divmod(numel, b)
            stride = 4 + self._code_bytes(b)
            kind, values = quant_kernels.KINDS[self.name], out.detach().numpy()
            if nfull:  # the whole blocks, then the last one alone (its own length as its block)
                quant_kernels.run("decode", nfull, torch.get_num_threads(), wire[4 : 4 + nfull * stride], b, kind,
                                  self._table, scales, values[: nfull * b])
            if tail:
                quant_kernels.run("decode", 1, 1, wire[4 + nfull * stride :], tail, kind, self._table,
                                  scales[nfull:], values[nfull * b :])
            return
        scale_t = torch.from_numpy(scales).to(out.device)
        for first, start, rows in pieces:  # on `out`'s own device: only the codes cross to it
            nb = rows.shape[0]
            b = self.block if first * self.block + self.block <= numel else numel - first * self.block
            target = out[start : start + nb * b].view(nb, b)
            self._decode_blocks(rows, scale_t[first : first + nb].unsqueeze(1), target)

    def decode_span(self, wire: np.ndarray, scales: np.ndarray, numel: int, start: int, stop: int) -> torch.Tensor:
        """Values [start, stop) of a payload of `numel` values, decoded alone on the CPU: `wire`
        and `scales` are what `checked_scales` read of it. The blocks the span touches are decoded
        whole, so a span costs at most two blocks more than its length, and every value has the
        bits `decode` gives it (the same per-block arithmetic)."""
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"{self.name} span [{start}, {stop}) is outside [0, {numel})")
        b = self.block
        nfull = numel // b
        k0, k1 = start // b, -(-stop // b)
        first = k0 * b
        out = torch.empty(min(k1 * b, numel) - first, dtype=torch.float32)
        stride = 4 + self._code_bytes(b)
        values = out.numpy()
        full_end = min(k1, nfull)
        if full_end > k0:
            self._decode_rows(wire[4 + k0 * stride : 4 + full_end * stride], scales[k0:full_end], b,
                              values[: (full_end - k0) * b])
        if k1 > nfull:  # the short last block, its own length as its block
            self._decode_rows(wire[4 + nfull * stride :], scales[nfull:], numel - nfull * b,
                              values[(nfull - k0) * b :])
        return out[start - first : stop - first]

    def _decode_rows(self, rows: np.ndarray, scales: np.ndarray, b: int, values: np.ndarray) -> None:
        """Whole blocks of `b` values, their wire rows back to back in `rows`, into `values`."""
        nb = scales.shape[0]
        if self.compiled:
            quant_kernels.run("decode", nb, 1, rows, b, quant_kernels.KINDS[self.name], self._table, scales, values)
            return
        dest = torch.from_numpy(values).view(nb, b)
        self._decode_blocks(rows.reshape(nb, -1), torch.from_numpy(scales).unsqueeze(1), dest)

    def checked_scales(self, buf: memoryview, numel: int) -> tuple[np.ndarray, np.ndarray]:
        """The payload's bytes and its blocks' scales, for `decode_span`; raises ValueError where
        `problem` names a problem."""
        wire, scales = self._scales(buf, numel)
        problem = self._scale_problem(scales)
        if problem is not None:
            raise ValueError(problem)
        return wire, scales

    def _scales(self, buf: memoryview, numel: int) -> tuple[np.ndarray, np.ndarray]:
        """The payload's bytes and its blocks' scales, once its header and size are checked."""
        expected = self.encoded_nbytes(numel)
        raw = _as_bytes(self.name, buf, None)
        if raw.nbytes >= 4:
            (header,) = struct.unpack_from("<I", raw, 0)
            if header != self.block:
                raise ValueError(f"{self.name} payload: block size {header} in the payload, {self.block} agreed")
        if raw.nbytes != expected:
            raise ValueError(
                f"{self.name} payload of {raw.nbytes} bytes, expected {expected} for {numel} values "
                f"in blocks of {self.block} (truncated or padded)"
            )
        wire = np.frombuffer(raw, dtype=np.uint8)
        pieces = list(self._pieces_np(numel, wire))
        scales = np.empty(sum(rows.shape[0] for _, _, rows in pieces), dtype=np.float32)
        for first, _, rows in pieces:
            np.copyto(scales[first : first + rows.shape[0]].view(np.uint8).reshape(-1, 4), rows[:, :4])
        return wire, scales

    def problem(self, buf: memoryview, numel: int) -> str | None:
        """Why `buf` would not decode to `numel` finite values (its header, its size, a block's
        scale), or None, from the scales alone: every code is a bounded multiple of its block's
        scale, so the values need not be decoded to be known finite."""
        try:
            _, scales = self._scales(buf, numel)
        except ValueError as exc:
            return str(exc)
        return self._scale_problem(scales)

    def _scale_problem(self, scales: np.ndarray) -> str | None:
        """The first block whose scale would make a value NaN or ±Inf, named; or None."""
        reach = float(np.abs(self._table).max()) if self.name != "int8" else float(self._qmax)
        with np.errstate(over="ignore", invalid="ignore"):
            bad = ~(np.isfinite(scales * np.float32(reach)) & (scales >= 0))
        if bad.any():
            i = int(np.argmax(bad))
            return f"{self.name} payload: block {i} has scale {float(scales[i])!r}: a value would not be finite"
        return None

    def _pieces_np(self, numel: int, wire: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
        """(first block index, first value index, wire rows [nb, 4 + code bytes]) chunk by chunk."""
        b = self.block
        nfull, last = divmod(numel, b)
        stride = 4 + self._code_bytes(b)
        per = max(1, _CHUNK_VALUES // b)
        for b0 in range(0, nfull, per):
            nb = min(per, nfull - b0)
            yield b0, b0 * b, wire[4 + b0 * stride : 4 + (b0 + nb) * stride].reshape(nb, stride)
        if last:
            yield nfull, nfull * b, wire[4 + nfull * stride :].reshape(1, -1)

    def _decode_blocks(self, rows: np.ndarray, scale: torch.Tensor, dest: torch.Tensor) -> None:
        nb, b = dest.shape
        dev = dest.device
        if self.name == "int8":
            q = torch.empty((nb, b), dtype=torch.int8)
            np.copyto(q.numpy(), rows[:, 4:].view(np.int8))
            dest.copy_(q)  # int8 → float32 on the way, exact
            dest.mul_(scale)
            return
        width = rows.shape[1] - 4
        packed = torch.empty((nb, width), dtype=torch.uint8)
        np.copyto(packed.numpy(), rows[:, 4:])
        per_byte = 4 if self.name == "int2" else 2
        held = self._quad_table if self.name == "int2" else self._pair_table
        assert held is not None
        table = held if dev.type == "cpu" else held.to(dev)
        index = packed.view(-1).to(device=dev, dtype=torch.int32)
        if b == per_byte * width:
            torch.index_select(table, 0, index, out=dest.view(nb * width, per_byte))
            dest.mul_(scale)
        else:  # a block that does not fill its last byte: the rest of it is padding
            values = torch.index_select(table, 0, index).view(nb, per_byte * width)
            torch.mul(values[:, :b], scale, out=dest)


def _as_bytes(name: str, buf: memoryview, expected: int | None) -> memoryview:
    try:
        raw = memoryview(buf).cast("B")
    except TypeError as e:
        raise ValueError(f"{name} buffer must be C-contiguous: {e}") from None
    if expected is not None and raw.nbytes != expected:
        raise ValueError(f"{name} buffer size mismatch: expected {expected} bytes, got {raw.nbytes}")
    return raw


def quant_codec(name: str, block: int = DEFAULT_BLOCK) -> QuantCodec:
    """The block-quantized codec ``name`` (int8, int4, e3m0, int4-log, int2) at block size ``block``.

    The same (name, block) gives the same object, however the arguments are spelled.
    """
    if isinstance(block, bool):  # True == 1 would otherwise find block 1 in the cache
        raise ValueError(f"block size must be an integer in [1, {MAX_BLOCK}], got {block!r}")
    return _quant_codec(name, block)


@functools.lru_cache(maxsize=64)
def _quant_codec(name: str, block: int) -> QuantCodec:
    return QuantCodec(name, block)
