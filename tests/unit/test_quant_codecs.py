from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yeto_core import quant_kernels
from yeto_core.codecs import BF16, F32, WIRE_CODEC_NAMES, codec_by_id, codec_by_name, quant_codec
from yeto_core.quant import DEFAULT_BLOCK, E3M0_LEVELS, ERROR_BOUNDS, INT4_LOG_LEVELS, QuantCodec

pytestmark = pytest.mark.unit

NAMES = ["int8", "int4", "e3m0", "int4-log", "int2"]
# Float32 slack on top of ERROR_BOUNDS: relative to the block absmax, plus a subnormal's worth.
REL_SLACK = 2.0**-21
ABS_SLACK = 2.0**-148


def encode(codec: QuantCodec, x: torch.Tensor) -> bytes:
    buf = bytearray(codec.encoded_nbytes(x.numel()))
    codec.encode(x, memoryview(buf))
    return bytes(buf)


def decode(codec: QuantCodec, payload: bytes, numel: int) -> torch.Tensor:
    out = torch.full((numel,), math.nan)
    codec.decode(memoryview(payload), out)
    return out


def block_absmax(x: np.ndarray, block: int) -> np.ndarray:
    """The absmax of each value's block, per value, in float64."""
    a = np.abs(x.astype(np.float64))
    nb = -(-a.size // block)
    padded = np.zeros(nb * block)
    padded[: a.size] = a
    return np.repeat(padded.reshape(nb, block).max(axis=1), block)[: a.size]


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
# Arbitrary float32 values, plus runs at one magnitude so blocks of tiny or huge values appear.
values = st.one_of(
    st.lists(finite_f32, min_size=1, max_size=300),
    st.tuples(
        st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=300),
        st.sampled_from([2.0**-149, 2.0**-140, 2.0**-126, 1e-30, 1.0, 1e30, 2.0**127]),
    ).map(lambda t: [float(np.float32(v * t[1])) for v in t[0]]),
    st.integers(1, 300).map(lambda n: [0.0] * n),
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None)
@given(data=values, block=st.sampled_from([1, 2, 3, 7, 8, 16, 128]))
def test_error_bound(name: str, data: list[float], block: int) -> None:
    codec = quant_codec(name, block)
    x = np.asarray(data, dtype=np.float32)
    payload = encode(codec, torch.from_numpy(x))
    assert len(payload) == codec.encoded_nbytes(x.size)
    y = decode(codec, payload, x.size).numpy()
    amax = block_absmax(x, block)
    err = np.abs(x.astype(np.float64) - y.astype(np.float64))
    limit = amax * (ERROR_BOUNDS[name] + REL_SLACK) + ABS_SLACK
    assert np.all(err <= limit), (name, block, x[err > limit], y[err > limit])
    assert np.all(y[amax == 0] == 0)
    # A subnormal scale rounded up by one ulp can overshoot by qmax ulps (127·2^-149 < 2^-142).
    assert np.all(np.abs(y) <= amax * (1 + REL_SLACK) + 2.0**-142)


def test_bounds_are_attained_and_documented() -> None:
    assert ERROR_BOUNDS["int8"] == 1 / 254
    assert ERROR_BOUNDS["int4"] == 1 / 14
    assert ERROR_BOUNDS["e3m0"] == 1 / 4
    assert ERROR_BOUNDS["int4-log"] == pytest.approx((1 - 2**-0.5) / 2, rel=1e-7)
    assert ERROR_BOUNDS["int2"] == 1 / 3
    assert (0.0, *(2.0 ** (e - 7) for e in range(1, 8))) == E3M0_LEVELS
    assert pytest.approx((0.0, *(2.0 ** ((k - 7) / 2) for k in range(1, 8))), rel=1e-7) == INT4_LOG_LEVELS
    # Halfway points between levels come within float32 rounding of each bound.
    probes = {
        "int8": [1.0, 0.5 / 127],
        "int4": [1.0, 0.5 / 7],
        "e3m0": [1.0, 0.75],
        "int4-log": [1.0, (1 + INT4_LOG_LEVELS[6]) / 2],
        "int2": [1.0, 0.0],  # levels ±1/3, ±1: zero is halfway between −1/3 and 1/3
    }
    for name, probe in probes.items():
        codec = quant_codec(name, 2)
        x = torch.tensor(probe, dtype=torch.float32)
        y = decode(codec, encode(codec, x), 2)
        assert abs(float(x[1]) - float(y[1])) == pytest.approx(ERROR_BOUNDS[name], rel=1e-5)


def _exact_payload(name: str, block: int, numel: int, draw: st.DrawFn) -> bytes:
    """A payload an encoder could have written: each block holds a full-scale code."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    parts = [struct.pack("<I", block)]
    for start in range(0, numel, block):
        n = min(block, numel - start)
        scale = math.ldexp(1.0, draw(st.integers(-100, 100)))
        if name == "int8":
            q = rng.integers(-127, 128, n)
            q[rng.integers(n)] = rng.choice([-127, 127])
            parts += [struct.pack("<f", scale), q.astype(np.int8).tobytes()]
            continue
        if name == "int2":  # (c − 1.5)·scale: a block's largest is 1.5·scale, so scale stays exact
            codes = rng.integers(0, 4, n)
            codes[rng.integers(n)] = rng.choice([0, 3])
            codes = np.concatenate([codes, np.zeros(-n % 4, dtype=codes.dtype)])
            packed = (codes[0::4] | (codes[1::4] << 2) | (codes[2::4] << 4) | (codes[3::4] << 6)).astype(np.uint8)
            parts += [struct.pack("<f", scale), packed.tobytes()]
            continue
        if name == "int4":
            codes = rng.integers(1, 16, n)
            codes[rng.integers(n)] = rng.choice([1, 15])
        else:
            codes = rng.choice([c for c in range(16) if c != 8], n)  # 8 would be a negative zero
            codes[rng.integers(n)] = rng.choice([7, 15])
        codes = np.concatenate([codes, np.zeros(n % 2, dtype=codes.dtype)])
        packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
        parts += [struct.pack("<f", scale), packed.tobytes()]
    return b"".join(parts)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(block=st.sampled_from([1, 3, 8, 128]), numel=st.integers(1, 400), data=st.data())
def test_exact_codes_round_trip(name: str, block: int, numel: int, data: st.DataObject) -> None:
    codec = quant_codec(name, block)
    payload = _exact_payload(name, block, numel, data.draw)
    assert len(payload) == codec.encoded_nbytes(numel)
    y = decode(codec, payload, numel)
    assert encode(codec, y) == payload


GOLDEN = {
    # block 4: one full block and a last block of one value; header, then (f32 scale, codes) per
    # block; the ties -63.5 and -3.5 round to even; then the decoded values.
    "int8": ([127.0, -63.5, 1.0, 0.0, 254.0], "04000000 0000803f 7fc00100 00000040 7f", -64.0),
    "int4": ([7.0, -3.5, 1.0, 0.0, 14.0], "04000000 0000803f 4f89 00000040 0f", -4.0),
    "e3m0": ([1.0, -0.5, 0.25, 0.0, 3.0], "04000000 0000803f e705 00004040 07", -0.5),
    "int4-log": ([1.0, -0.5, 0.125, 0.0, 3.0], "04000000 0000803f d701 00004040 07", -0.5),
    # scale 1.5/1.5: codes 3, 0 (−1 + 1.5 = 0.5, a tie, to even), 2, 1 in one byte 0b01_10_00_11
    "int2": ([1.5, -1.0, 0.5, -0.5, 3.0], "04000000 0000803f 63 00000040 03", -1.5),
}


@pytest.mark.parametrize("name", NAMES)
def test_golden_bytes(name: str) -> None:
    codec = quant_codec(name, 4)
    data, hexbytes, second = GOLDEN[name]
    x = torch.tensor(data, dtype=torch.float32)
    payload = encode(codec, x)
    assert payload == bytes.fromhex(hexbytes)
    expected = x.clone()
    expected[1] = second
    assert torch.equal(decode(codec, payload, x.numel()), expected)


def test_zero_block_and_empty() -> None:
    for name in NAMES:
        codec = quant_codec(name, 8)
        payload = encode(codec, torch.zeros(8))
        assert payload[4:8] == bytes(4)
        assert torch.equal(decode(codec, payload, 8), torch.zeros(8))
        assert encode(codec, torch.zeros(0)) == struct.pack("<I", 8)
        assert decode(codec, struct.pack("<I", 8), 0).numel() == 0


@pytest.mark.parametrize("name", NAMES)
def test_encoded_nbytes(name: str) -> None:
    codec = quant_codec(name, 128)
    code_bytes = {"int8": lambda n: n, "int2": lambda n: (n + 3) // 4}.get(name, lambda n: (n + 1) // 2)
    for numel in [0, 1, 127, 128, 129, 1000, 1 << 20]:
        nfull, last = divmod(numel, 128)
        expected = 4 + nfull * (4 + code_bytes(128)) + (4 + code_bytes(last) if last else 0)
        assert codec.encoded_nbytes(numel) == expected
    assert quant_codec(name, 5).encoded_nbytes(7) == 4 + 8 + {"int8": 7, "int2": 2 + 1}.get(name, 3 + 1)


@pytest.mark.parametrize("name", NAMES)
def test_refusals(name: str) -> None:
    codec = quant_codec(name, 128)
    x = torch.linspace(-1, 1, 300)
    payload = encode(codec, x)
    out = torch.empty(300)
    with pytest.raises(ValueError, match="block size 64 in the payload, 128 agreed"):
        codec.decode(memoryview(struct.pack("<I", 64) + payload[4:]), out)
    with pytest.raises(ValueError, match="truncated"):
        codec.decode(memoryview(payload[:-1]), out)
    with pytest.raises(ValueError, match="truncated"):
        codec.decode(memoryview(payload + b"\0"), out)
    with pytest.raises(ValueError, match="truncated"):
        codec.decode(memoryview(payload[:2]), out)
    stride = 4 + codec.encoded_nbytes(128) - 8
    for bad in (math.nan, math.inf, -math.inf, -1.0):
        for block in (0, 2):
            corrupt = bytearray(payload)
            struct.pack_into("<f", corrupt, 4 + block * stride, bad)
            with pytest.raises(ValueError, match=f"block {block} has scale"):
                codec.decode(memoryview(bytes(corrupt)), out)
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[200] = bad
        with pytest.raises(ValueError, match=r"non-finite value .* at element 200"):
            codec.encode(y, memoryview(bytearray(codec.encoded_nbytes(300))))
    with pytest.raises(ValueError, match="size mismatch"):
        codec.encode(x, memoryview(bytearray(10)))
    with pytest.raises(ValueError, match="writable"):
        codec.encode(x, memoryview(bytes(codec.encoded_nbytes(300))))
    with pytest.raises(ValueError, match="float32"):
        codec.encode(x.double(), memoryview(bytearray(codec.encoded_nbytes(300))))
    with pytest.raises(ValueError, match="float32"):
        codec.decode(memoryview(payload), torch.empty(300, dtype=torch.float64))


def test_large_input_spans_chunks() -> None:
    # More than one 4 MiB chunk, with a partial last block and widely varying magnitudes.
    n = (1 << 20) * 2 + 77
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    for name in NAMES:
        codec = quant_codec(name, 96)
        y = decode(codec, encode(codec, x), n).numpy()
        amax = block_absmax(x.numpy(), 96)
        err = np.abs(x.numpy().astype(np.float64) - y)
        assert np.all(err <= amax * (ERROR_BOUNDS[name] + REL_SLACK) + ABS_SLACK)


def test_registry() -> None:
    assert {i: WIRE_CODEC_NAMES[i] for i in range(3, 8)} == {3: "int8", 4: "int4", 5: "e3m0", 6: "int4-log",
                                                             7: "int2"}
    for name in NAMES:
        codec = codec_by_name(name)
        assert codec is quant_codec(name) is quant_codec(name, DEFAULT_BLOCK)
        assert codec is codec_by_id(codec.wire_id)
        assert codec_by_id(codec.wire_id, block=64) is codec_by_name(name, block=64) is quant_codec(name, 64)
        assert isinstance(codec, QuantCodec) and codec.block == 128 and codec.name == name
    assert codec_by_name("f32", block=64) is F32
    assert codec_by_id(2, block=64) is BF16
    with pytest.raises(ValueError, match="accepted: f32, bf16, int8, int4, e3m0, int4-log, int2"):
        codec_by_name("fp8")
    with pytest.raises(ValueError, match=r"known: 1 \(f32\), 2 \(bf16\), 3 \(int8\), 4 \(int4\), 5 \(e3m0\)"):
        codec_by_id(9)
    for bad in (0, -1, 1.5, True, (1 << 20) + 1):
        with pytest.raises(ValueError, match="block size"):
            quant_codec("int8", bad)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_bf16_matches_torch(data: list[float]) -> None:
    x = torch.tensor(data, dtype=torch.float32)
    buf = bytearray(BF16.encoded_nbytes(x.numel()))
    BF16.encode(x, memoryview(buf))
    got = np.frombuffer(bytes(buf), dtype="<u2")
    expected = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, expected)


# -- the compiled loops (yeto[fast]) and the torch ops: the same bits ---------------------------------
needs_numba = pytest.mark.skipif(not quant_kernels.AVAILABLE, reason="numba is not installed (yeto[fast])")


def both_paths(name: str, block: int) -> tuple[QuantCodec, QuantCodec]:
    compiled, ops = QuantCodec(name, block), QuantCodec(name, block)  # not the shared cached ones
    ops.compiled = False
    return compiled, ops


@needs_numba
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=120, deadline=None)
@given(data=values, block=st.sampled_from([1, 2, 3, 7, 8, 16, 128]))
def test_the_compiled_loops_write_the_bytes_and_values_of_the_torch_ops(name: str, data: list[float],
                                                                         block: int) -> None:
    compiled, ops = both_paths(name, block)
    x = torch.tensor(data, dtype=torch.float32)
    payload = encode(compiled, x)
    assert payload == encode(ops, x)
    assert torch.equal(decode(compiled, payload, x.numel()), decode(ops, payload, x.numel()))


@needs_numba
@pytest.mark.parametrize("name", NAMES)
def test_the_compiled_loops_give_the_same_bits_on_any_number_of_threads(name: str) -> None:
    n = (1 << 20) + 77  # several ranges per thread, and a partial last block
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    x[5000:5128] = 0.0
    x[9000:9100] = 3e38
    compiled, ops = both_paths(name, 128)
    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            payload = encode(compiled, x)
            runs.append((payload, decode(compiled, payload, n)))
    finally:
        torch.set_num_threads(threads)
    want = encode(ops, x)
    assert all(p == want for p, _ in runs)
    assert all(torch.equal(v, decode(ops, want, n)) for _, v in runs)


@needs_numba
@pytest.mark.parametrize("name", NAMES)
def test_both_paths_name_the_first_non_finite_value(name: str) -> None:
    x = torch.linspace(-1, 1, 70_000)
    x[60_001], x[65_000] = math.inf, math.nan
    for codec in both_paths(name, 128):
        with pytest.raises(ValueError, match=r"non-finite value inf at element 60001"):
            codec.encode(x, memoryview(bytearray(codec.encoded_nbytes(x.numel()))))


@needs_numba
@pytest.mark.parametrize("name", NAMES)
def test_both_paths_agree_at_the_edges_of_float32(name: str) -> None:
    """Scales rounded one ulp up (qmax·scale < A) and down (qmax·scale would overflow near
    float32's max), subnormal blocks, zeros and signed zeros, for every block size that splits them."""
    top = float(np.finfo(np.float32).max)
    edges = [top, -top, np.nextafter(np.float32(top), np.float32(0)), 1.7e38, 2.0**127, 3e38 / 7, 2.0**-149,
             -(2.0**-149), 2.0**-126, 1e-40, 0.0, -0.0, 1.0, -1.0, 0.5, 1 / 3, 127.5, -7.5, 2.0**-20]
    x = torch.tensor(edges, dtype=torch.float32)
    for block in (1, 2, 3, 5, len(edges)):
        compiled, ops = both_paths(name, block)
        payload = encode(compiled, x)
        assert payload == encode(ops, x), block
        assert torch.equal(decode(compiled, payload, x.numel()), decode(ops, payload, x.numel())), block
