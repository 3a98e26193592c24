"""Push codecs: how a fragment's flat float32 delta becomes wire bytes (DESIGN §7.3, PROTOCOL §8).

A codec turns a contiguous 1-D float32 tensor into exactly ``encoded_nbytes(numel)`` bytes and
back. Bytes are little-endian. ``wire_id`` goes on the wire, so the numbers never change.

- ``f32`` (id 1): the float32 values as they are; lossless.
- ``bf16`` (id 2): the upper 16 bits after round-to-nearest-even — the very conversion torch
  performs in ``tensor.to(torch.bfloat16)``, because encoding goes through torch's own kernel.
  Decoding widens exactly (bf16 bits << 16).
- ``int8`` (id 3), ``int4`` (id 4), ``e3m0`` (id 5), ``int4-log`` (id 6): block-quantized, with a
  block size agreed out of band and repeated in a payload header; see ``yeto_core.quant``.
  ``CODECS`` holds only the codecs without a block size; ``codec_by_name``/``codec_by_id`` (and
  ``quant_codec``) also give the quantized ones, at ``block`` values a block (default 128).

Bulk buffers are tens to hundreds of MiB, so both directions write straight into the buffers
they are given: the wire buffer is viewed as a tensor (``torch.frombuffer``) or array
(``numpy.frombuffer``) and filled in place. Work between different devices goes in chunks of at
most ``_CHUNK_BYTES`` of wire bytes, which bounds the temporaries torch makes for a cross-device,
cross-dtype copy.

``bf16_round_reference`` is an independent, bit-level statement of the rounding rule that the
tests hold torch to.
"""

from __future__ import annotations

import sys
import warnings
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from yeto_core.quant import DEFAULT_BLOCK, QUANT_WIRE_IDS, quant_codec

__all__ = [
    "BF16",
    "CODECS",
    "F32",
    "WIRE_CODEC_NAMES",
    "Codec",
    "bf16_round_reference",
    "codec_by_id",
    "codec_by_name",
    "quant_codec",
]

# torch.frombuffer views bytes in host order; the wire is little-endian.
if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("yeto_core.codecs needs a little-endian host")

# Large enough that per-chunk overhead vanishes, small enough to stay a modest temporary.
_CHUNK_BYTES = 4 << 20


class Codec(Protocol):
    """Encodes a contiguous 1-D float32 tensor into a byte buffer of a size fixed by ``numel``."""

    @property
    def name(self) -> str: ...

    @property
    def wire_id(self) -> int: ...

    def encoded_nbytes(self, numel: int) -> int: ...

    def encode(self, src: torch.Tensor, out: memoryview) -> None: ...

    def decode(self, buf: memoryview, out: torch.Tensor) -> None: ...


class _Float32Codec:
    __slots__ = ()
    name = "f32"
    wire_id = 1

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, src: torch.Tensor, out: memoryview) -> None:
        _check_src(self, src)
        dst = _writable_bytes(self, out, self.encoded_nbytes(src.numel()))
        if src.numel():
            _copy_chunked(torch.frombuffer(dst, dtype=torch.float32), src, _CHUNK_BYTES // 4)

    def decode(self, buf: memoryview, out: torch.Tensor) -> None:
        _check_out(self, out)
        raw = _as_bytes(self, buf, self.encoded_nbytes(out.numel()))
        if not out.numel():
            return
        # numpy views a read-only buffer without complaint; torch.frombuffer would warn.
        values = np.frombuffer(raw, dtype="<f4")
        if out.device.type == "cpu":
            out.detach().copy_(_read_only_tensor(values))  # torch's copy runs on its threads; numpy's on one
        else:
            _upload_chunked(out, values, torch.float32)


class _BFloat16Codec:
    __slots__ = ()
    name = "bf16"
    wire_id = 2

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, src: torch.Tensor, out: memoryview) -> None:
        _check_src(self, src)
        dst = _writable_bytes(self, out, self.encoded_nbytes(src.numel()))
        if src.numel():
            # copy_ across dtypes runs torch's RNE conversion kernel, the same one .to() uses.
            _copy_chunked(torch.frombuffer(dst, dtype=torch.bfloat16), src, _CHUNK_BYTES // 2)

    def decode(self, buf: memoryview, out: torch.Tensor) -> None:
        _check_out(self, out)
        raw = _as_bytes(self, buf, self.encoded_nbytes(out.numel()))
        if not out.numel():
            return
        bits = np.frombuffer(raw, dtype="<u2")
        if out.device.type == "cpu":
            # bf16 → f32 is exact (the 16 bits become the top half): torch's conversion kernel, on
            # its threads, with no full-size temporary.
            out.detach().copy_(_read_only_tensor(bits.view(np.int16)).view(torch.bfloat16))
        else:
            _upload_chunked(out, bits, torch.bfloat16)


class Bf16Parts:
    """The bf16 wire bytes of an f32 tensor, rounded part by part as a sender asks for them.

    The transport calls `fill(offset, out)` for each chunk of the transfer, on the chunk's own
    sender thread, right before sending it: no full-size encoded copy exists, and rounding one
    part overlaps sending the others. A part boundary may fall inside a value (odd offsets):
    the values it cuts are rounded whole and only the requested bytes are copied, so any split
    concatenates to exactly `BF16.encode` of the whole tensor.
    """

    def __init__(self, src: torch.Tensor) -> None:
        _check_src(BF16, src)
        self.src = src.detach().reshape(-1)
        self.nbytes = BF16.encoded_nbytes(self.src.numel())

    def fill(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        end = offset + len(out)
        if offset < 0 or end > self.nbytes:
            raise ValueError(f"bytes [{offset}, {end}) are outside the {self.nbytes}-byte bf16 payload")
        if not len(out):
            return
        first, last = offset // 2, (end + 1) // 2  # the values the byte range touches
        if offset % 2 == 0 and end % 2 == 0:
            torch.frombuffer(out, dtype=torch.bfloat16).copy_(self.src[first:last])
            return
        whole = self.src[first:last].to(torch.bfloat16)  # at most one chunk's worth, plus a value
        raw = whole.cpu().view(torch.uint8).numpy()
        skip = offset - 2 * first
        out[:] = raw[skip : skip + len(out)].tobytes()


F32: Codec = _Float32Codec()
BF16: Codec = _BFloat16Codec()
CODECS: dict[str, Codec] = {c.name: c for c in (F32, BF16)}
_BY_ID: dict[int, Codec] = {c.wire_id: c for c in CODECS.values()}


# Every codec a push may name, by wire id: the fixed ones above and the block-quantized ones.
WIRE_CODEC_NAMES: dict[int, str] = {c.wire_id: c.name for c in CODECS.values()} | {
    i: n for n, i in QUANT_WIRE_IDS.items()
}


def codec_by_name(name: str, *, block: int = DEFAULT_BLOCK) -> Codec:
    """The codec called ``name``; ``block`` is the block size of a quantized codec (others ignore it)."""
    if name in QUANT_WIRE_IDS:
        return quant_codec(name, block)
    try:
        return CODECS[name]
    except KeyError:
        accepted = ", ".join([*CODECS, *QUANT_WIRE_IDS])
        raise ValueError(f"unknown codec {name!r}; accepted: {accepted}") from None


def codec_by_id(wire_id: int, *, block: int = DEFAULT_BLOCK) -> Codec:
    """The codec with ``wire_id``; ``block`` is the block size of a quantized codec (others ignore it)."""
    if wire_id in _BY_ID:
        return _BY_ID[wire_id]
    name = WIRE_CODEC_NAMES.get(wire_id)
    if name is None:
        known = ", ".join(f"{i} ({n})" for i, n in sorted(WIRE_CODEC_NAMES.items()))
        raise ValueError(f"unknown codec wire id {wire_id!r}; known: {known}")
    return quant_codec(name, block)


def bf16_round_reference(bits_f32: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint16]:
    """float32 bit patterns → bfloat16 bit patterns, round-to-nearest-even, from bit operations.

    Adding 0x7FFF plus the lowest kept bit and truncating rounds halfway cases to the even
    neighbour; a carry out of the mantissa bumps the exponent, which is also how the largest
    finite values round up to infinity. NaN becomes the quiet NaN 0x7FC0 (torch's scalar rule;
    its vector kernels may pick other NaN bits, so compare NaN-ness, not bits, for NaN).
    """
    bits = np.asarray(bits_f32, dtype=np.uint32).astype(np.uint64)  # room for the carry
    lsb = (bits >> np.uint64(16)) & np.uint64(1)
    rounded = ((bits + np.uint64(0x7FFF) + lsb) >> np.uint64(16)).astype(np.uint16)
    is_nan = (bits & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    return np.where(is_nan, np.uint16(0x7FC0), rounded).astype(np.uint16)


def _check_src(codec: Codec, src: torch.Tensor) -> None:
    if src.dtype != torch.float32 or src.dim() != 1 or not src.is_contiguous():
        raise ValueError(
            f"{codec.name} encode needs a contiguous 1-D float32 tensor, "
            f"got dtype {src.dtype} shape {tuple(src.shape)} contiguous={src.is_contiguous()}"
        )


def _check_out(codec: Codec, out: torch.Tensor) -> None:
    if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous():
        raise ValueError(
            f"{codec.name} decode needs a contiguous 1-D float32 output tensor, "
            f"got dtype {out.dtype} shape {tuple(out.shape)} contiguous={out.is_contiguous()}"
        )


def _as_bytes(codec: Codec, buf: memoryview, expected: int) -> memoryview:
    try:
        raw = memoryview(buf).cast("B")
    except TypeError as e:
        raise ValueError(f"{codec.name} buffer must be C-contiguous: {e}") from None
    if raw.nbytes != expected:
        raise ValueError(f"{codec.name} buffer size mismatch: expected {expected} bytes, got {raw.nbytes}")
    return raw


def _writable_bytes(codec: Codec, out: memoryview, expected: int) -> memoryview:
    raw = _as_bytes(codec, out, expected)
    if raw.readonly:
        raise ValueError(f"{codec.name} encode needs a writable output buffer")
    return raw


def _read_only_tensor(values: np.ndarray) -> torch.Tensor:
    """A tensor over a (possibly read-only) array, only ever copied from: torch warns that it
    cannot be written to, which is the point."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(values)


def _copy_chunked(dst: torch.Tensor, src: torch.Tensor, chunk: int) -> None:
    if src.device == dst.device:
        dst.copy_(src)
        return
    # A device source converts on the device before the transfer; chunking bounds that copy.
    for start in range(0, src.numel(), chunk):
        dst[start : start + chunk].copy_(src[start : start + chunk])


def _upload_chunked(out: torch.Tensor, values: np.ndarray, wire_dtype: torch.dtype) -> None:
    """Fill a non-CPU ``out`` from a (possibly read-only) host array through a small staging tensor."""
    itemsize = values.dtype.itemsize
    chunk = _CHUNK_BYTES // itemsize
    staging = torch.empty(min(chunk, values.size), dtype=wire_dtype)
    # bfloat16 has no numpy dtype; fill its bits through a same-width integer view.
    staging_np = staging.view(torch.int16).numpy().view(np.uint16) if itemsize == 2 else staging.numpy()
    for start in range(0, values.size, chunk):
        n = min(chunk, values.size - start)
        np.copyto(staging_np[:n], values[start : start + n])
        out[start : start + n].copy_(staging[:n])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy (the view keeps it alive)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        raise ValueError("tensor_bytes needs a CPU tensor")
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
