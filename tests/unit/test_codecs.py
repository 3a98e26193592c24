from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_core import codecs
from yeto_core.codecs import BF16, CODECS, F32, Bf16Parts, Codec, bf16_round_reference, codec_by_id, codec_by_name

pytestmark = pytest.mark.unit

# float32 bit patterns where bf16 rounding is easy to get wrong.
EDGE_BITS = [
    0x00000000,  # +0
    0x80000000,  # -0
    0x7F800000,  # +inf
    0xFF800000,  # -inf
    0x7FC00000,  # quiet NaN
    0xFFC00000,  # negative quiet NaN
    0x7F800001,  # signalling NaN: rounding must not carry it into inf
    0x7FFFFFFF,  # NaN with every payload bit set: the carry would wrap
    0xFFFFFFFF,
    0x7F7FFFFF,  # max finite float32: rounds up to +inf
    0xFF7FFFFF,  # → -inf
    0x7F7F7FFF,  # just below the halfway point: stays the max finite bf16
    0x7F7F8000,  # halfway, odd lsb: up to inf
    0x3F808000,  # halfway, even lsb (1.0 + half ulp): stays 1.0
    0x3F818000,  # halfway, odd lsb: up to the even neighbour
    0x3F808001,  # just above halfway: up
    0x3F807FFF,  # just below halfway: down
    0xBF818000,  # negative tie
    0x00000001,  # smallest subnormal: to +0
    0x00008000,  # subnormal tie, even: to +0
    0x00018000,  # subnormal tie, odd: up
    0x007FFFFF,  # largest subnormal: carries into the smallest normal
    0x807FFFFF,
    0x00800000,  # smallest normal
    0x3F800000,  # 1.0
    0x4049_0FDB,  # pi
]


def f32_from_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint32).view(np.float32))


def sample_data(seed: int = 0, n: int = 100_003) -> torch.Tensor:
    """Random bit patterns (every class of float), normal values at several scales, the edge list."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2**32, size=n, dtype=np.uint32)
    normal = rng.standard_normal(n).astype(np.float32) * rng.choice([1e-30, 1e-3, 1.0, 1e30], size=n)
    bits = np.concatenate([raw, normal.astype(np.float32).view(np.uint32), np.array(EDGE_BITS, np.uint32)])
    return f32_from_bits(bits)


def encode(codec: Codec, src: torch.Tensor) -> bytes:
    out = bytearray(codec.encoded_nbytes(src.numel()))
    codec.encode(src, memoryview(out))
    return bytes(out)


def torch_bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


# --- bf16 rounding -----------------------------------------------------------------------------


def test_bf16_encode_matches_torch_bit_for_bit() -> None:
    x = sample_data()
    got = np.frombuffer(encode(BF16, x), dtype="<u2")
    want = torch_bf16_bits(x)
    nan = np.isnan(x.numpy())
    assert nan.any() and (~nan).sum() > 100_000
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # torch's kernels choose NaN bits per platform; what matters is that NaN stays NaN.
    assert np.all((got[nan] & 0x7FFF) > 0x7F80)


def test_bf16_edge_values() -> None:
    x = f32_from_bits(np.array(EDGE_BITS, np.uint32))
    got = np.frombuffer(encode(BF16, x), dtype="<u2")
    by_input = dict(zip(EDGE_BITS, got.tolist(), strict=True))
    assert by_input[0x00000000] == 0x0000
    assert by_input[0x80000000] == 0x8000
    assert by_input[0x7F800000] == 0x7F80
    assert by_input[0xFF800000] == 0xFF80
    assert by_input[0x7F7FFFFF] == 0x7F80
    assert by_input[0xFF7FFFFF] == 0xFF80
    assert by_input[0x7F7F7FFF] == 0x7F7F
    assert by_input[0x7F7F8000] == 0x7F80
    assert by_input[0x3F808000] == 0x3F80
    assert by_input[0x3F818000] == 0x3F82
    assert by_input[0x3F808001] == 0x3F81
    assert by_input[0x3F807FFF] == 0x3F80
    assert by_input[0xBF818000] == 0xBF82
    assert by_input[0x00000001] == 0x0000
    assert by_input[0x00008000] == 0x0000
    assert by_input[0x00018000] == 0x0002
    assert by_input[0x007FFFFF] == 0x0080
    assert by_input[0x807FFFFF] == 0x8080
    for nan_bits in (0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF):
        assert (by_input[nan_bits] & 0x7FFF) > 0x7F80, hex(nan_bits)


def test_reference_rounding_matches_torch() -> None:
    x = sample_data(seed=1)
    bits = x.numpy().view(np.uint32)
    ref = bf16_round_reference(bits)
    assert ref.dtype == np.uint16
    want = torch_bf16_bits(x)
    nan = np.isnan(x.numpy())
    np.testing.assert_array_equal(ref[~nan], want[~nan])
    assert np.all(ref[nan] == 0x7FC0)


def test_bf16_encode_into_unaligned_buffer() -> None:
    x = sample_data(seed=2, n=1001)
    nbytes = BF16.encoded_nbytes(x.numel())
    backing = bytearray(nbytes + 3)
    BF16.encode(x, memoryview(backing)[1 : 1 + nbytes])
    assert bytes(backing[1 : 1 + nbytes]) == encode(BF16, x)
    assert backing[0] == 0 and backing[-2:] == b"\0\0"


def test_encode_into_other_buffer_formats() -> None:
    x = torch.randn(64)
    arr = np.zeros(32, dtype=np.float32)  # a typed, read-write buffer of the right byte size
    BF16.encode(x, arr.data)
    assert arr.tobytes() == encode(BF16, x)


# --- decode and round trips --------------------------------------------------------------------


def test_f32_round_trip_is_exact() -> None:
    x = sample_data(seed=3)
    wire = encode(F32, x)
    assert wire == x.numpy().astype("<f4").tobytes()
    out = torch.full_like(x, 7.0)
    F32.decode(memoryview(wire), out)  # a read-only buffer is fine for decoding
    np.testing.assert_array_equal(out.numpy().view(np.uint32), x.numpy().view(np.uint32))


def test_bf16_decode_equals_torch_upcast() -> None:
    rng = np.random.default_rng(4)
    bits = np.concatenate(
        [
            rng.integers(0, 2**16, size=50_000, dtype=np.uint16),
            np.array([0x7FC0, 0xFFFF, 0x8000, 0x0001], np.uint16),
        ]
    )
    out = torch.empty(bits.size)
    BF16.decode(memoryview(bits.astype("<u2").tobytes()), out)
    upcast = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32)
    got = out.numpy().view(np.uint32)
    nan = np.isnan(upcast.numpy())
    np.testing.assert_array_equal(got[~nan], upcast.numpy().view(np.uint32)[~nan])
    # Widening is exact, NaN payloads included.
    np.testing.assert_array_equal(got, bits.astype(np.uint32) << 16)


def test_bf16_round_trip_is_torch_round_trip() -> None:
    x = torch.randn(10_000) * 3
    out = torch.empty_like(x)
    BF16.decode(memoryview(encode(BF16, x)), out)
    assert torch.equal(out, x.to(torch.bfloat16).to(torch.float32))


def test_decode_into_tensor_that_requires_grad() -> None:
    out = torch.zeros(4, requires_grad=True)
    F32.decode(memoryview(encode(F32, torch.arange(4.0))), out)
    assert out.detach().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_chunked_upload_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Devices other than the CPU go through a staging tensor in chunks; drive that loop on the
    # CPU with a tiny chunk so it runs many times and ends on a partial chunk.
    monkeypatch.setattr(codecs, "_CHUNK_BYTES", 64)
    x = torch.randn(1000)
    for codec, wire_dtype, np_dtype in ((F32, torch.float32, "<f4"), (BF16, torch.bfloat16, "<u2")):
        values = np.frombuffer(encode(codec, x), dtype=np_dtype)
        out = torch.empty_like(x)
        codecs._upload_chunked(out, values, wire_dtype)
        expected = torch.empty_like(x)
        codec.decode(memoryview(encode(codec, x)), expected)
        assert torch.equal(out, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_match_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codecs, "_CHUNK_BYTES", 4096)
    x = sample_data(seed=5, n=10_000)
    finite = x[torch.isfinite(x)].contiguous()
    for codec in (F32, BF16):
        wire = encode(codec, finite)
        assert encode(codec, finite.cuda()) == wire
        out = torch.empty(finite.numel(), device="cuda")
        codec.decode(memoryview(wire), out)
        cpu = torch.empty_like(finite)
        codec.decode(memoryview(wire), cpu)
        assert torch.equal(out.cpu(), cpu)


# --- sizes, zero length, errors ----------------------------------------------------------------


@pytest.mark.parametrize("codec", [F32, BF16], ids=lambda c: c.name)
def test_size_mismatch_errors(codec: Codec) -> None:
    x = torch.zeros(10)
    want = codec.encoded_nbytes(10)
    for wrong in (want - 2, want + 2, 0):
        with pytest.raises(ValueError, match=rf"expected {want} bytes, got {wrong}"):
            codec.encode(x, memoryview(bytearray(wrong)))
        with pytest.raises(ValueError, match=rf"expected {want} bytes, got {wrong}"):
            codec.decode(memoryview(bytes(wrong)), x)


@pytest.mark.parametrize("codec", [F32, BF16], ids=lambda c: c.name)
def test_zero_length(codec: Codec) -> None:
    assert codec.encoded_nbytes(0) == 0
    empty = torch.empty(0)
    codec.encode(empty, memoryview(bytearray()))
    codec.decode(memoryview(b""), empty)
    with pytest.raises(ValueError, match="expected 0 bytes, got 4"):
        codec.encode(empty, memoryview(bytearray(4)))


@pytest.mark.parametrize("codec", [F32, BF16], ids=lambda c: c.name)
def test_bad_tensors_and_buffers(codec: Codec) -> None:
    nbytes = codec.encoded_nbytes(8)
    with pytest.raises(ValueError, match="float32"):
        codec.encode(torch.zeros(8, dtype=torch.float64), memoryview(bytearray(nbytes)))
    with pytest.raises(ValueError, match="1-D"):
        codec.encode(torch.zeros(2, 4), memoryview(bytearray(nbytes)))
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode(torch.zeros(16)[::2], memoryview(bytearray(nbytes)))
    with pytest.raises(ValueError, match="writable"):
        codec.encode(torch.zeros(8), memoryview(bytes(nbytes)))
    with pytest.raises(ValueError, match="float32"):
        codec.decode(memoryview(bytes(nbytes)), torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="C-contiguous"):
        strided = np.zeros(2 * nbytes, dtype=np.uint8)[::2]
        codec.encode(torch.zeros(8), strided.data)


def test_registry() -> None:
    assert (F32.name, F32.wire_id) == ("f32", 1)
    assert (BF16.name, BF16.wire_id) == ("bf16", 2)
    assert CODECS == {"f32": F32, "bf16": BF16}
    assert codec_by_name("bf16") is BF16
    assert codec_by_id(1) is F32
    with pytest.raises(ValueError, match="accepted: f32, bf16"):
        codec_by_name("fp8")
    with pytest.raises(ValueError, match=r"wire id 9; known: 1 \(f32\), 2 \(bf16\)"):
        codec_by_id(9)


# -- bf16 streamed part by part ---------------------------------------------------------------------
def _bf16_whole(src: torch.Tensor) -> bytes:
    out = bytearray(BF16.encoded_nbytes(src.numel()))
    BF16.encode(src, memoryview(out))
    return bytes(out)


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 300), cuts=st.lists(st.integers(0, 600), max_size=12), seed=st.integers(0, 2**16))
def test_bf16_parts_concatenate_to_the_whole_encoding_for_any_split(numel: int, cuts: list[int], seed: int) -> None:
    src = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e3
    parts = Bf16Parts(src)
    assert parts.nbytes == 2 * numel
    bounds = sorted({0, parts.nbytes, *(c for c in cuts if c <= parts.nbytes)})
    got = bytearray()
    for start, end in itertools.pairwise(bounds):  # part boundaries fall inside values too
        piece = bytearray(end - start)
        parts.fill(start, memoryview(piece))
        got += piece
    assert bytes(got) == _bf16_whole(src)


def test_bf16_parts_round_the_edge_patterns_like_torch() -> None:
    src = torch.from_numpy(np.array(EDGE_BITS, dtype=np.uint32).view(np.float32).copy())
    parts = Bf16Parts(src)
    out = bytearray(parts.nbytes)
    parts.fill(0, memoryview(out)[:7])  # odd cut: the fourth value is split across two parts
    parts.fill(7, memoryview(out)[7:])
    assert bytes(out) == src.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


def test_bf16_parts_refuse_a_range_outside_the_payload() -> None:
    parts = Bf16Parts(torch.zeros(4))
    with pytest.raises(ValueError, match=r"outside the 8-byte bf16 payload"):
        parts.fill(6, memoryview(bytearray(4)))
    with pytest.raises(ValueError, match="contiguous 1-D float32"):
        Bf16Parts(torch.zeros(4, dtype=torch.float64))
