"""Pushes held in their wire encoding until merged (syncer/merge/held.py): every span, norm and
merge reads the bits a whole decode gives, and the syncer holds the payload alone."""

import numpy as np
import pytest
import torch

from syncer.core.payload import decode_delta
from syncer.core.rounds import Answer
from syncer.merge.held import HeldDelta, holds
from syncer.merge.merge import Segment, merge_deltas, segment_sq_norms
from syncer.merge.outer import Nesterov
from syncer.merge.round_merge import MergeWorkspace, max_abs, merge_round
from yeto_core.codecs import BF16, F32, Codec, codec_by_name
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.quant import quant_codec
from yeto_core.wire.messages import Push

pytestmark = pytest.mark.unit

CODECS = ["int8", "int4", "e3m0", "int4-log"]


def encoded(codec: Codec, x: torch.Tensor) -> memoryview:
    buf = bytearray(codec.encoded_nbytes(x.numel()))
    codec.encode(x, memoryview(buf))
    return memoryview(buf)


def decode_whole(codec: Codec, payload: memoryview, n: int) -> torch.Tensor:
    out = torch.empty(n)
    codec.decode(payload, out)
    return out


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("block", [128, 7])
def test_a_span_decodes_to_the_bits_of_the_whole(name: str, block: int, compiled: bool) -> None:
    codec = quant_codec(name, block)
    if compiled and not codec.compiled:
        pytest.skip("numba is not installed")
    n = 5 * block + 3  # a ragged last block
    payload = encoded(codec, torch.randn(n, generator=torch.Generator().manual_seed(1)))
    whole = decode_whole(codec, payload, n)
    wire, scales = codec.checked_scales(payload, n)
    saved, codec.compiled = codec.compiled, compiled
    try:
        for start, stop in [(0, n), (1, n - 1), (block, 2 * block), (block - 1, block + 1), (n - 2, n), (4, 4)]:
            assert torch.equal(codec.decode_span(wire, scales, n, start, stop), whole[start:stop]), (start, stop)
        with pytest.raises(ValueError, match="outside"):
            codec.decode_span(wire, scales, n, 0, n + 1)
    finally:
        codec.compiled = saved


@pytest.mark.parametrize("name", [*CODECS, "bf16"])
def test_a_held_delta_reads_spans_windows_and_extremes_of_its_payload(name: str) -> None:
    codec = codec_by_name(name)
    n = 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    payload = encoded(codec, x)
    whole = decode_whole(codec, payload, n)
    held = HeldDelta(codec, payload, n)
    assert held.numel() == n and held.nbytes == len(payload) < 4 * n
    assert torch.equal(held.decode(), whole) and torch.equal(held.span(10, 700), whole[10:700])
    window = held[100:600]
    assert window.numel() == 500 and torch.equal(window.span(5, 50), whole[105:150])
    assert torch.equal(window[10:20].decode(), whole[110:120])
    assert max_abs(held) == float(whole.abs().max())


@pytest.mark.parametrize("name", ["int4", "bf16"])
def test_norms_taken_on_arrival_are_the_bits_the_merge_would_take(name: str) -> None:
    codec = codec_by_name(name)
    n = (1 << 20) + 40_000  # a tensor longer than a span, and ragged blocks
    segments = [Segment(0, 12_345, True), Segment(12_345, n - 12_345 - 777, True), Segment(n - 777, 777, True)]
    payload = encoded(codec, torch.randn(n, generator=torch.Generator().manual_seed(3)))
    held = HeldDelta(codec, payload, n).with_norms(segments)
    assert held.sq_norms is not None
    assert torch.equal(held.sq_norms, segment_sq_norms([decode_whole(codec, payload, n)], segments)[0])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name", ["int8", "int4", "bf16"])
def test_held_rows_merge_to_the_bits_of_decoded_rows(name: str, threads: int) -> None:
    """Across column chunks, the averaged and the RDA segments, serial or threaded, with a tensor
    row beside them: a round merges to the same bits whether its pushes were decoded or held."""
    codec = codec_by_name(name)
    gen = torch.Generator().manual_seed(4)
    n = (1 << 20) + 4099
    segments = [Segment(0, 1 << 20, rda=True), Segment(1 << 20, 4000, rda=False), Segment((1 << 20) + 4000, 99, True)]
    payloads = [encoded(codec, torch.randn(n, generator=gen)) for _ in range(3)]
    rows = [decode_whole(codec, p, n) for p in payloads]
    held = [HeldDelta(codec, p, n) for p in payloads]
    w = torch.tensor([0.2, 0.3, 0.5])
    want = merge_deltas(rows, w, segments, threads=threads, negate=True)
    assert torch.equal(merge_deltas(held, w, segments, threads=threads, negate=True), want)
    assert torch.equal(merge_deltas([held[0], rows[1], held[2]], w, segments, threads=threads, negate=True), want)
    assert torch.equal(segment_sq_norms(held, segments, threads=threads), segment_sq_norms(rows, segments))


@pytest.mark.parametrize("heloco", [False, True])
def test_a_round_of_held_pushes_commits_the_bits_of_decoded_ones(heloco: bool) -> None:
    from syncer.merge.correction import HelocoConfig

    codec = codec_by_name("int4")
    layout = build_layout([TensorSpec("a", (300, 7), "float32"), TensorSpec("b", (50,), "float32")], 1)
    n = layout.fragments[0].numel
    segments = [Segment(s.offset, s.numel, True) for s in layout.fragments[0].slots]
    gen = torch.Generator().manual_seed(6)
    payloads = [encoded(codec, torch.randn(n, generator=gen)) for _ in range(2)]
    msg = Push(0, 1, 0, 0, 10, 4, 0, 1, len(payloads[0]), codec.wire_id)
    held = [decode_delta(layout, msg, p, codec, hold=True) for p in payloads]
    assert all(isinstance(h, HeldDelta) and h.sq_norms is not None for h in held)
    results = []
    for deltas in (held, [decode_whole(codec, p, n) for p in payloads]):
        params, momentum = torch.ones(n), torch.full((n,), 0.01)
        out = merge_round([Answer(i, 1, 100 * (i + 1), 4, d, 0) for i, d in enumerate(deltas)],  # type: ignore[arg-type]
                          params=params, momentum=momentum, outer_state={}, segments=segments, outer=Nesterov(),
                          heloco=HelocoConfig(0.1) if heloco else None, workspace=MergeWorkspace())
        results.append((params, momentum, out.delta_norms))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]


def test_a_held_push_is_checked_on_arrival() -> None:
    layout = build_layout([TensorSpec("w", (256,), "float32")], 1)
    int8 = codec_by_name("int8")
    payload = bytearray(encoded(int8, torch.randn(256)))
    msg = Push(0, 1, 0, 0, 10, 4, 0, 1, len(payload), int8.wire_id)
    payload[4:8] = np.float32("nan").tobytes()  # the first block's scale
    assert "block 0 has scale nan" in str(decode_delta(layout, msg, memoryview(payload), int8, hold=True))
    assert "expected" in str(decode_delta(layout, msg, memoryview(payload)[:-1], int8, hold=True))
    bad = torch.ones(256)
    bad[200] = float("inf")
    raw = bytearray(512)
    BF16.encode(torch.where(torch.isinf(bad), torch.zeros(256), bad), memoryview(raw))
    raw[400:402] = np.array([0x7F80], dtype="<u2").tobytes()  # bf16 +inf at value 200
    msg16 = Push(0, 1, 0, 0, 10, 4, 0, 1, 512, BF16.wire_id)
    assert "contains NaN or Inf" in str(decode_delta(layout, msg16, memoryview(raw), BF16, hold=True))


def test_only_the_encoded_codecs_are_held_and_only_on_the_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert holds(codec_by_name("int4"), cpu) and holds(BF16, cpu)
    assert not holds(F32, cpu) and not holds(codec_by_name("int4"), cuda)
    with pytest.raises(ValueError, match="not held"):
        HeldDelta(F32, memoryview(bytes(8)), 2)


def test_the_decode_pool_holds_a_quantized_push_and_views_an_f32_one() -> None:
    from syncer.core.effects import Decode
    from syncer.service.coordinator import decoded

    layout = build_layout([TensorSpec("w", (512,), "float32")], 1)
    cpu = torch.device("cpu")
    x = torch.randn(512, generator=torch.Generator().manual_seed(7))
    for codec, kind in ((codec_by_name("int4"), HeldDelta), (F32, torch.Tensor)):
        payload = encoded(codec, x)
        msg = Push(0, 1, 0, 0, 10, 4, 0, 1, len(payload), codec.wire_id)
        ev = decoded(Decode(0, 1, 1, msg, payload, codec, inline=codec is F32, screened=None), layout, cpu)
        assert isinstance(ev.delta, kind)
        got = ev.delta if isinstance(ev.delta, torch.Tensor) else ev.delta.decode()
        assert torch.equal(got, x if codec is F32 else decode_whole(codec, payload, 512))
