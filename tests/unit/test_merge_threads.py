"""``merge_deltas``/``check_finite`` with ``threads`` > 1 give exactly the bits of ``threads=1``."""

from __future__ import annotations

import random

import pytest
import torch

from syncer.merge import merge
from syncer.merge.merge import Segment, check_finite, merge_deltas, segment_sq_norms

pytestmark = pytest.mark.unit

THREADS = [1, 2, 3, 4]


def layout(sizes: list[int], rda: list[bool]) -> list[Segment]:
    segments: list[Segment] = []
    offset = 0
    for numel, flag in zip(sizes, rda, strict=True):
        segments.append(Segment(offset, numel, flag))
        offset += numel
    return segments


def weights(m: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(m, generator=g, dtype=torch.float64) + 0.1
    return (w / w.sum()).float()


def deltas_for(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, n, generator=g) * torch.logspace(-4, 0, m).unsqueeze(1)


def assert_same_for_every_thread_count(deltas: torch.Tensor, w: torch.Tensor, segments: list[Segment]) -> None:
    serial = merge_deltas(deltas, w, segments)
    for threads in THREADS:
        threaded = merge_deltas(deltas, w, segments, threads=threads)
        assert torch.equal(threaded, serial), f"threads={threads} differs from the serial merge"
        # Bit patterns too: torch.equal would accept -0.0 for 0.0.
        assert torch.equal(threaded.view(torch.int32), serial.view(torch.int32))


def test_many_small_segments() -> None:
    rng = random.Random(1)
    sizes = [rng.randint(1, 3000) for _ in range(400)]
    rda = [rng.random() < 0.7 for _ in sizes]
    segments = layout(sizes, rda)
    assert_same_for_every_thread_count(deltas_for(5, sum(sizes), 2), weights(5, 3), segments)


def test_a_few_segments_longer_than_one_column_chunk() -> None:
    chunk = merge._CPU_CHUNK
    sizes = [chunk + 3, 17, 2 * chunk + chunk // 3, 1000, chunk + 1, chunk]
    rda = [True, True, False, False, True, True]
    segments = layout(sizes, rda)
    assert_same_for_every_thread_count(deltas_for(3, sum(sizes), 4), weights(3, 5), segments)


def test_rda_and_averaging_mix_with_many_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A small column chunk makes every long-segment stage run many chunks on few elements.
    monkeypatch.setattr(merge, "_CPU_CHUNK", 1000)
    rng = random.Random(6)
    sizes = [rng.choice([0, 1, 7, 999, 1000, 1001, 4321, 25_000]) for _ in range(60)]
    rda = [rng.random() < 0.5 for _ in sizes]
    segments = layout(sizes, rda)
    assert_same_for_every_thread_count(deltas_for(4, sum(sizes), 7), weights(4, 8), segments)


def test_zero_rows_cancelling_rows_and_a_single_learner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge, "_CPU_CHUNK", 512)
    sizes = [3000, 40, 2048, 5, 1500]
    segments = layout(sizes, [True, True, False, True, True])
    d = deltas_for(4, sum(sizes), 9)
    d[1] = 0.0  # no direction
    d[3] = -d[2]  # exactly opposite to row 2
    w = torch.tensor([0.1, 0.2, 0.35, 0.35])
    assert_same_for_every_thread_count(d, w, segments)
    cancelled = torch.stack([d[2], d[3]])
    assert_same_for_every_thread_count(cancelled, torch.tensor([0.5, 0.5]), segments)
    assert_same_for_every_thread_count(d[:1], torch.tensor([1.0]), segments)


def test_threads_write_into_a_given_buffer_and_column_slices() -> None:
    sizes = [merge._CPU_CHUNK + 11, 300, 77]
    segments = layout(sizes, [True, False, True])
    n = sum(sizes)
    wide = deltas_for(3, n + 50, 10)
    d = wide[:, 25 : 25 + n]  # rows strided inside a wider buffer
    w = weights(3, 11)
    serial = merge_deltas(d, w, segments)
    for threads in THREADS:
        out = torch.full((n,), float("nan"))
        got = merge_deltas(d, w, segments, out, threads=threads)
        assert got is out
        assert torch.equal(out, serial)


def test_threads_must_be_positive() -> None:
    segments = layout([4], [True])
    with pytest.raises(ValueError, match="threads"):
        merge_deltas(torch.ones(2, 4), torch.tensor([0.5, 0.5]), segments, threads=0)
    with pytest.raises(ValueError, match="threads"):
        check_finite(torch.ones(2, 4), threads=0)


def test_check_finite_answers_the_same_for_every_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge, "_FINITE_CHUNK", 1000)
    clean = deltas_for(5, 4321, 12)
    cases: list[tuple[torch.Tensor, int | None]] = [(clean, None), (clean[:, :0], None)]
    nan_late = clean.clone()
    nan_late[3, 4000] = float("nan")
    cases.append((nan_late, 3))
    two_bad = nan_late.clone()
    two_bad[1, 2500] = float("-inf")
    cases.append((two_bad, 1))
    overflow = clean.clone()
    overflow[0] = 3e38  # every value finite, every sum of two overflows
    overflow[4, 10] = float("inf")
    cases.append((overflow, 4))
    for d, expected in cases:
        assert check_finite(d) == expected
        for threads in THREADS:
            assert check_finite(d, threads=threads) == expected, f"threads={threads}"


def test_given_segment_norms_change_no_bit_for_any_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round takes the norms once (`segment_sq_norms`) and hands them to the merge: the bits are
    those of a merge that takes them itself, serial or threaded, and so are the norms themselves."""
    monkeypatch.setattr(merge, "_CPU_CHUNK", 1 << 15)  # long segments of several chunks, quickly
    rng = random.Random(7)
    sizes = [rng.randint(1, 3000) for _ in range(60)] + [(1 << 15) * 3 + 5, 1 << 16, 40_000]
    rda = [rng.random() < 0.7 for _ in sizes[:-3]] + [True, True, False]
    segments = layout(sizes, rda)
    deltas, w = deltas_for(4, sum(sizes), 8), weights(4, 9)
    serial = merge_deltas(deltas, w, segments)
    sq = segment_sq_norms(deltas, segments)
    for threads in THREADS:
        assert torch.equal(segment_sq_norms(deltas, segments, threads=threads), sq)
        given = merge_deltas(deltas, w, segments, threads=threads, sq_norms=sq)
        assert torch.equal(given.view(torch.int32), serial.view(torch.int32)), f"threads={threads}"


def test_segment_norms_against_float64() -> None:
    sizes = [1, 100, 16_384, 16_385, 70_001]
    segments = layout(sizes, [True] * len(sizes))
    deltas = deltas_for(3, sum(sizes), 10)
    sq = segment_sq_norms(deltas, segments)
    for i, seg in enumerate(segments):
        ref = deltas[:, seg.offset : seg.offset + seg.numel].double().square().sum(dim=1)
        assert torch.allclose(sq[:, i], ref, rtol=1e-6, atol=0), seg  # float32 blocks: ~1e-7
    # A row's norm is the sum of its line, as the tape reports it.
    assert torch.allclose(sq.sum(dim=1), deltas.double().square().sum(dim=1), rtol=1e-6, atol=0)


def test_given_norms_of_the_wrong_shape_are_refused() -> None:
    segments = layout([10, 20], [True, False])
    deltas = deltas_for(2, 30, 11)
    with pytest.raises(ValueError, match=r"sq_norms must be float64 \[2, 2\]"):
        merge_deltas(deltas, weights(2, 1), segments, sq_norms=torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="sq_norms must be float64"):
        merge_deltas(deltas, weights(2, 1), segments, sq_norms=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="segment 1 is at offset 11"):
        segment_sq_norms(deltas, [Segment(0, 10, True), Segment(11, 19, True)])


@pytest.mark.parametrize("threads", [1, 3])
def test_negate_writes_the_exact_negation(threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The round asks the merge for −merged (the outer gradient) in the merge's own passes: bit for
    bit the negation, zero rows, cancelling rows and the sign of zero included."""
    monkeypatch.setattr(merge, "_CPU_CHUNK", 1 << 14)
    sizes = [5, 3000, (1 << 14) * 2 + 7, 9000, 1 << 15]
    segments = layout(sizes, [True, False, True, True, False])
    deltas = deltas_for(3, sum(sizes), 12)
    deltas[1, : sizes[0] + sizes[1]] = 0.0
    deltas[2, sum(sizes[:3]) : sum(sizes[:4])] = -deltas[0, sum(sizes[:3]) : sum(sizes[:4])]
    w = torch.tensor([0.5, 0.0, 0.5])
    plain = merge_deltas(deltas, w, segments, threads=threads)
    negated = merge_deltas(deltas, w, segments, threads=threads, negate=True)
    assert torch.equal(negated.view(torch.int32), plain.neg().view(torch.int32))
