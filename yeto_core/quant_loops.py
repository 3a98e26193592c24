"""The numba loops of the block-quantized codecs (`quant_kernels.py` says how they are used).

Imported only when a process first encodes or decodes on the CPU with numba installed: this
module imports numba at the top, and its functions are module-level so that numba's cache finds
them again in the next process (`cache=True`, next to this file or in numba's cache directory).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

OPTS: dict[str, Any] = {"cache": True, "boundscheck": False, "error_model": "numpy", "nogil": True}
# Only the flags that let min, max and rounding vectorize: no NaN or infinity (every value is
# checked finite first, with integer tests these flags do not touch) and no signed zeros. No
# reassociation, reciprocal or contraction: every sum, product and division is torch's.
FINITE_MATH = {"nnan", "ninf", "nsz"}


# Products of two float32s are exact in float64; their float32 rounding overflows to infinity
# from the midpoint between float32's largest value and 2^128 up (round to nearest, ties to even).
OVERFLOW_EDGE = 2.0**128 - 2.0**103


@numba.njit(inline="always", **OPTS)
def int_scale(amax: Any, qmax: Any, one: Any, one_bits: Any) -> Any:
    """fl(A/qmax), one ulp up when fl(qmax·scale) < A (no zero scale, x/scale within qmax) and one
    down where fl(qmax·scale) overflows (near float32's max), as the torch path does: the
    neighbouring bit pattern of a float ≥ 0, through the caller's one-float scratch. The products
    are taken in float64 and compared with the overflow edge, so no infinity ever arises (the
    kernels run with finite-math flags, under which a test for one could be folded away)."""
    scale = amax / qmax
    p = np.float64(scale) * np.float64(qmax)
    if p < OVERFLOW_EDGE and np.float32(p) < amax:  # an overflowing product is not below A
        one[0] = scale
        one_bits[0] += 1
        scale = one[0]
    if np.float64(scale) * np.float64(qmax) >= OVERFLOW_EDGE:
        one[0] = scale
        one_bits[0] -= 1
        scale = one[0]
    return scale


# The helpers below are inlined into the kernels (numba IR inlining), where their indices are
# known to be non-negative: called, their loops would test every index for wraparound.


@numba.njit(fastmath=FINITE_MATH, inline="always", **OPTS)
def block_amax(bits: Any, start: int, length: int, one: Any, one_bits: Any) -> Any:
    """The block's largest magnitude, or −1 if it holds a non-finite value. One pass of an
    unsigned maximum over the bit patterns without their sign: for floats ≥ 0 the patterns'
    order is the values' order, one at or past 0x7F800000 is an infinity or a NaN, and an
    integer maximum vectorizes (the finite-math flags do not touch it)."""
    top = np.uint32(0)
    for j in range(length):
        top = max(top, bits[start + j] & np.uint32(0x7FFFFFFF))
    if top >= np.uint32(0x7F800000):
        return np.float32(-1.0)
    one_bits[0] = top
    return one[0]


@numba.njit(inline="always", **OPTS)
def first_bad(bits: Any, start: int, length: int) -> int:
    for j in range(length):
        if bits[start + j] & np.uint32(0x7F800000) == np.uint32(0x7F800000):
            return j
    return 0


@numba.njit(inline="always", **OPTS)
def store(codes: Any, pairs: Any, wire: Any, row: int, length: int, packed: bool) -> None:
    """One block's codes into its wire row after the scale: a byte each, or two a byte, low
    nibble first (`pairs` reads them as little-endian pairs; codes[length] is the padding)."""
    if not packed:
        for j in range(length):
            wire[row + 4 + j] = codes[j]
        return
    codes[length] = 0
    for j in range((length + 1) // 2):
        v = np.int32(pairs[j])
        wire[row + 4 + j] = np.uint8((v & 15) | ((v >> 4) & 0xF0))


@numba.njit(fastmath=FINITE_MATH, **OPTS)
def encode_linear(x: Any, block: int, qmax: float, packed: bool, wire: Any, scales: Any, bad: Any,
                  first: int, last: int) -> None:
    """int8 (packed False) and int4: q = round(x/scale) within ±qmax, stored as q (int8) or q + 8."""
    stride = 4 + ((block + 1) // 2 if packed else block)
    # The range's own views, indexed from 0 up: indices numba can see are never negative get no
    # wraparound test, and the inner loops vectorize (twice as fast as with range(first, last)).
    x, wire = x[first * block : last * block], wire[first * stride : last * stride]
    scales, bad = scales[first:last], bad[first:last]
    bits = x.view(np.uint32)
    one = np.empty(1, dtype=np.float32)  # a float's bits, for int_scale and block_amax
    one_bits = one.view(np.uint32)
    signed = wire.view(np.int8)
    tiny = np.float32(1.401298464324817e-45)
    q32 = np.float32(qmax)
    offset = np.int32(8 if packed else 0)
    codes = np.zeros(2 * (block // 2 + 1), dtype=np.uint8)  # even: `pairs` reads two at once
    pairs = codes.view(np.uint16)
    for i in range(last - first):
        start = i * block
        amax = block_amax(bits, start, block, one, one_bits)
        if amax < 0:
            bad[i] = first_bad(bits, start, block)
            continue
        bad[i] = -1
        scale = int_scale(amax, q32, one, one_bits)
        d = max(scale, tiny)
        scales[i] = scale
        if not packed:  # int8: each code is its byte
            row = i * stride + 4
            for j in range(block):
                signed[row + j] = np.int8(min(max(np.rint(x[start + j] / d), np.float32(-127.0)),
                                              np.float32(127.0)))  # (literal bounds: it vectorizes)
            continue
        for j in range(block):
            q = min(max(np.rint(x[start + j] / d), -q32), q32)
            codes[j] = np.uint8(np.int32(q) + offset)
        store(codes, pairs, wire, i * stride, block, packed)


@numba.njit(fastmath=FINITE_MATH, **OPTS)
def encode_level(x: Any, block: int, t0: float, t1: float, square: bool, wire: Any, scales: Any, bad: Any,
                 first: int, last: int) -> None:
    """e3m0 and int4-log (square): the nearest level, its index read off the float32 exponent of
    |x|/(A·t1) (squared for the half-octave levels), 0 within t0, the sign in bit 3."""
    stride = 4 + (block + 1) // 2
    x, wire = x[first * block : last * block], wire[first * stride : last * stride]  # as encode_linear
    scales, bad = scales[first:last], bad[first:last]
    xbits = x.view(np.uint32)
    one = np.empty(1, dtype=np.float32)
    one_bits = one.view(np.uint32)
    tiny = np.float32(1.401298464324817e-45)
    t0f, t1f = np.float32(t0), np.float32(t1)
    work = np.empty(block, dtype=np.float32)
    bits = work.view(np.int32)
    codes = np.zeros(2 * (block // 2 + 1), dtype=np.uint8)
    pairs = codes.view(np.uint16)
    for i in range(last - first):
        start = i * block
        amax = block_amax(xbits, start, block, one, one_bits)
        if amax < 0:
            bad[i] = first_bad(xbits, start, block)
            continue
        bad[i] = -1
        d = max(amax, tiny)
        for j in range(block):
            y = x[start + j] / d
            work[j] = abs(y) / t1f
            codes[j] = np.uint8(8 * np.int32(y < -t0f) + np.int32(abs(y) > t0f))
        if square:
            for j in range(block):
                work[j] = work[j] * work[j]
        for j in range(block):  # 2 + ⌊log_r(y/t1)⌋ from the exponent, 1..7, times "nonzero"
            k = min(max((bits[j] >> 23) - (127 - 2), 1), 7)
            c = np.int32(codes[j])
            codes[j] = np.uint8(k * (c & 1) + (c & 8))
        scales[i] = amax
        store(codes, pairs, wire, i * stride, block, True)


@numba.njit(fastmath=FINITE_MATH, **OPTS)
def encode_int2(x: Any, block: int, wire: Any, scales: Any, bad: Any, first: int, last: int) -> None:
    """int2: the code c = round(x/scale + 1.5) within 0..3 (the level (c − 1.5)·scale), scale =
    A/1.5 as `int_scale` makes it, four codes a byte, lowest bits first."""
    stride = 4 + (block + 3) // 4
    x, wire = x[first * block : last * block], wire[first * stride : last * stride]  # as encode_linear
    scales, bad = scales[first:last], bad[first:last]
    bits = x.view(np.uint32)
    one = np.empty(1, dtype=np.float32)
    one_bits = one.view(np.uint32)
    tiny = np.float32(1.401298464324817e-45)
    half_range = np.float32(1.5)
    codes = np.zeros(4 * (block // 4 + 1), dtype=np.uint8)  # whole bytes' worth: the padding stays 0
    for i in range(last - first):
        start = i * block
        amax = block_amax(bits, start, block, one, one_bits)
        if amax < 0:
            bad[i] = first_bad(bits, start, block)
            continue
        bad[i] = -1
        scale = int_scale(amax, half_range, one, one_bits)
        d = max(scale, tiny)
        scales[i] = scale
        for j in range(block):
            codes[j] = np.uint8(min(max(np.rint(x[start + j] / d + half_range), np.float32(0.0)), np.float32(3.0)))
        row = i * stride + 4
        for j in range((block + 3) // 4):
            wire[row + j] = codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4) | (codes[4 * j + 3] << 6)


@numba.njit(**OPTS)
def decode(wire: Any, block: int, kind: int, table: Any, scales: Any, out: Any, first: int, last: int) -> None:
    """Blocks [first, last) of whole blocks (`out`'s size is a multiple of `block`): codes in
    `wire` (rows from its start) and the checked `scales` → values in `out` (the code's value ×
    scale, in float32, as torch's product)."""
    stride = 4 + (block if kind == 0 else (block + 3) // 4 if kind == 4 else (block + 1) // 2)
    wire, scales = wire[first * stride : last * stride], scales[first:last]  # indexed from 0 (see
    out = out[first * block : last * block]  # encode_linear)
    for i in range(last - first):
        start = i * block
        row = i * stride + 4
        s = scales[i]
        if kind == 0:
            for j in range(block):
                out[start + j] = np.float32(np.int8(wire[row + j])) * s
        elif kind == 4:
            for j in range(block):
                byte = np.int32(wire[row + j // 4])
                out[start + j] = table[(byte >> (2 * (j & 3))) & 3] * s
        else:
            for j in range(block // 2):
                byte = np.int32(wire[row + j])  # (uint8 with int64 would unify to float64)
                out[start + 2 * j] = table[byte & 15] * s
                out[start + 2 * j + 1] = table[byte >> 4] * s
            if block & 1:
                out[start + block - 1] = table[np.int32(wire[row + block // 2]) & 15] * s
