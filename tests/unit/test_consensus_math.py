"""The consensus signal's math and wire form (DESIGN §8.2), against hand-written references."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncer.core.consensus import ConsensusBoard
from yeto_core.consensus import (
    MAX_PROBE_TOKENS,
    ProbeSummary,
    decode_summary,
    encode_summary,
    js_distance,
    pairwise_js,
    summarize,
)
from yeto_core.consensus_report import ConsensusReporter
from yeto_core.sections import ConsensusSettings
from yeto_core.wire.messages import UNKNOWN, Message, ProbeReport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def reference_js(p: list[float], q: list[float]) -> float:
    """√JSD with base-2 logs, written out term by term."""
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl_pm = sum(a * math.log2(a / c) for a, c in zip(p, m, strict=True) if a > 0)
    kl_qm = sum(b * math.log2(b / c) for b, c in zip(q, m, strict=True) if b > 0)
    return math.sqrt(0.5 * kl_pm + 0.5 * kl_qm)


def dense(probs: list[list[float]]) -> ProbeSummary:
    """An exact (k == V) summary of the given per-token distributions."""
    return summarize(torch.tensor(probs, dtype=torch.float64).log(), k=len(probs[0]))


def test_js_distance_matches_the_hand_computed_reference_with_the_full_vocabulary() -> None:
    p = [[0.5, 0.25, 0.125, 0.125], [0.7, 0.1, 0.1, 0.1]]
    q = [[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]
    want = (reference_js(p[0], q[0]) + reference_js(p[1], q[1])) / 2
    assert js_distance(dense(p), dense(q)) == pytest.approx(want, abs=1e-6)
    # A hand-computed case: P = (1, 0), Q = (½, ½): M = (¾, ¼),
    # JSD = ½·log2(4/3) + ½·(½·log2(2/3) + ½·log2(2)) = ½·log2(4/3) + ¼·log2(4/3)... spelled out:
    jsd = 0.5 * math.log2(1 / 0.75) + 0.5 * (0.5 * math.log2(0.5 / 0.75) + 0.5 * math.log2(0.5 / 0.25))
    one_hot = ProbeSummary(torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([[1.0, 0.0]]),
                           torch.zeros(1), 2)
    assert js_distance(one_hot, dense([[0.5, 0.5]])) == pytest.approx(math.sqrt(jsd), abs=1e-6)


def test_identical_distributions_are_at_distance_zero() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    for k in (1, 5, 50):
        s = summarize(logits, k)
        assert js_distance(s, s) == pytest.approx(0.0, abs=1e-6)
        assert js_distance(s, summarize(logits.clone(), k)) == pytest.approx(0.0, abs=1e-6)


def test_disjoint_one_hot_distributions_are_at_distance_one() -> None:
    a = ProbeSummary(torch.tensor([[3]], dtype=torch.int32), torch.tensor([[1.0]]), torch.zeros(1), 10)
    b = ProbeSummary(torch.tensor([[7]], dtype=torch.int32), torch.tensor([[1.0]]), torch.zeros(1), 10)
    assert js_distance(a, b) == pytest.approx(1.0, abs=1e-9)
    assert not math.isnan(js_distance(a, a)) and js_distance(a, a) == 0.0
    big = torch.full((2, 6), -1e4)
    big[0, 0] = big[1, 1] = 1e4  # softmax underflows to exact zeros: no NaN
    other = torch.full((2, 6), -1e4)
    other[0, 5] = other[1, 4] = 1e4
    assert js_distance(summarize(big, 6), summarize(other, 6)) == pytest.approx(1.0, abs=1e-9)


def test_top_k_approximation_is_exact_for_uniform_tails_and_close_otherwise() -> None:
    # Tails that really are uniform over the unlisted ids: the approximation is exact.
    p = torch.tensor([[0.6, 0.1, 0.1, 0.1, 0.1]])
    q = torch.tensor([[0.1, 0.5, 0.1, 0.2, 0.1]])
    exact = js_distance(summarize(p.log(), 5), summarize(q.log(), 5))
    assert js_distance(summarize(p.log(), 1), summarize(q.log(), 2)) == pytest.approx(exact, abs=1e-6)
    assert exact == pytest.approx(reference_js(p[0].tolist(), q[0].tolist()), abs=1e-6)
    # Random logits: the top-k figure converges to the exact one as k grows, always in [0, 1].
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 200, generator=gen) * 3, torch.randn(16, 200, generator=gen) * 3
    exact = js_distance(summarize(a, 200), summarize(b, 200))
    errors = [abs(js_distance(summarize(a, k), summarize(b, k)) - exact) for k in (8, 32, 128)]
    assert all(0.0 <= e < 0.1 for e in errors), errors
    assert errors[2] < errors[0]


def test_pairwise_js_is_the_mean_over_pairs() -> None:
    s = {i: dense([[0.1 * (i + 1), 1 - 0.1 * (i + 1)]]) for i in range(3)}
    pairs = [js_distance(s[0], s[1]), js_distance(s[0], s[2]), js_distance(s[1], s[2])]
    assert pairwise_js(s) == pytest.approx(sum(pairs) / 3)
    assert pairwise_js({0: s[0]}) is None and pairwise_js({}) is None


def test_summaries_of_different_probes_cannot_be_compared() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        js_distance(summarize(torch.randn(4, 10), 3), summarize(torch.randn(5, 10), 3))


def test_summarize_keeps_the_top_k_and_the_tail_mass() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    s = summarize(logits, 2)
    probs = torch.softmax(logits, -1)[0]
    assert s.ids.tolist() == [[1, 2]] and s.ids.dtype == torch.int32
    assert s.probs[0].tolist() == pytest.approx([probs[1].item(), probs[2].item()])
    assert s.tail.item() == pytest.approx((probs[0] + probs[3]).item(), abs=1e-6)
    assert summarize(logits, 64).k == 4  # k = min(vocab, top-k)
    with pytest.raises(ValueError, match="NaN"):
        summarize(torch.tensor([[float("nan"), 0.0]]), 2)


# -- the wire form -------------------------------------------------------------------------


def _same(a: ProbeSummary, b: ProbeSummary) -> bool:
    return (a.vocab == b.vocab and torch.equal(a.ids, b.ids) and torch.equal(a.probs, b.probs)
            and torch.equal(a.tail, b.tail))


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 12), vocab=st.integers(1, 300), k=st.integers(1, 40), seed=st.integers(0, 2**16),
       scale=st.floats(0.0, 30.0))
def test_encode_decode_round_trip(tokens: int, vocab: int, k: int, seed: int, scale: float) -> None:
    logits = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    s = summarize(logits, k)
    data = encode_summary(s)
    assert len(data) == 12 + s.tokens * s.k * 8 + s.tokens * 4
    back = decode_summary(data)
    assert _same(s, back)
    assert decode_summary(memoryview(data)).vocab == vocab


def test_encoding_is_little_endian_and_fixed() -> None:
    s = ProbeSummary(torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([[0.75, 0.25]]), torch.zeros(1), 3)
    assert encode_summary(s) == struct.pack("<III", 1, 2, 3) + struct.pack("<ii", 2, 0) + struct.pack(
        "<ff", 0.75, 0.25) + struct.pack("<f", 0.0)


def _raw(ids: list[list[int]], probs: list[list[float]], tail: list[float], vocab: int) -> bytes:
    t, k = len(ids), len(ids[0])
    return (struct.pack("<III", t, k, vocab) + np.asarray(ids, "<i4").tobytes() + np.asarray(probs, "<f4").tobytes()
            + np.asarray(tail, "<f4").tobytes())


GOOD = _raw([[1, 0]], [[0.5, 0.25]], [0.25], 4)


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "shorter than its 12-byte header"),
    (GOOD[:-1], "is 31 bytes, expected 32"),
    (GOOD + b"\0", "is 33 bytes, expected 32"),
    (struct.pack("<III", 0, 1, 4), "claims 0 tokens"),
    (struct.pack("<III", MAX_PROBE_TOKENS + 1, 1, 4), f"claims {MAX_PROBE_TOKENS + 1} tokens"),
    (struct.pack("<III", 1, 5, 4), "claims top-5 of 4 ids"),
    (struct.pack("<III", 1, 1, 0), "vocabulary of 0 ids"),
    (_raw([[4, 0]], [[0.5, 0.25]], [0.25], 4), "token id outside 0..3"),
    (_raw([[-1, 0]], [[0.5, 0.25]], [0.25], 4), "token id outside 0..3"),
    (_raw([[1, 1]], [[0.5, 0.25]], [0.25], 4), "lists a token id twice for probe token 0"),
    (_raw([[1, 0]], [[float("nan"), 0.25]], [0.25], 4), "probabilities contain NaN or Inf"),
    (_raw([[1, 0]], [[0.5, 0.25]], [float("inf")], 4), "tail masses contain NaN or Inf"),
    (_raw([[1, 0]], [[1.5, -0.75]], [0.25], 4), "probabilities fall outside"),
    (_raw([[1, 0]], [[0.5, 0.25]], [-0.25], 4), "tail masses fall outside"),
    (_raw([[1, 0]], [[0.5, 0.25]], [0.5], 4), "sum to 1.250000, not 1"),
])
def test_bad_payloads_are_refused_with_the_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(".", r"\.")):
        decode_summary(data)


def test_the_good_payload_decodes() -> None:
    s = decode_summary(GOOD)
    assert s.ids.tolist() == [[1, 0]] and s.tail.tolist() == [0.25] and s.vocab == 4


# -- the two sides' bookkeeping --------------------------------------------------------------


def test_reporter_probes_every_n_installs_after_the_initial_cut() -> None:
    calls: list[int] = []
    sent: list[Message] = []

    def probe() -> torch.Tensor:
        calls.append(1)
        assert not torch.is_grad_enabled()
        return torch.randn(4, 10)

    def send(msg: Message) -> bool:
        sent.append(msg)
        return True

    r = ConsensusReporter(probe, ConsensusSettings(every=2, top_k=3))
    assert not r.after_installs(4, 0, 1, send)  # the installs before the first step: the initial cut
    assert not r.after_installs(5, 1, 2, send)
    assert r.after_installs(6, 2, 3, send)
    assert not r.after_installs(6, 2, 4, send)
    assert r.after_installs(9, 5, 5, send)
    assert len(calls) == 2 and [m.step for m in sent] == [3, 5]  # type: ignore[attr-defined]
    assert isinstance(sent[0], ProbeReport) and decode_summary(sent[0].summary).k == 3
    wrong_shape = lambda: torch.randn(3)  # noqa: E731 - a probe that returns no [T, V] logits: switched off
    failing = ConsensusReporter(wrong_shape, ConsensusSettings(every=1, top_k=3))
    failing.after_installs(0, 0, 1, send)
    assert not failing.after_installs(1, 1, 2, send) and not failing.enabled
    assert not ConsensusReporter(probe, ConsensusSettings(every=0, top_k=3)).enabled


def _report(logits: torch.Tensor, installed: int) -> ProbeReport:
    return ProbeReport(1, installed, encode_summary(summarize(logits, 4)))


def test_board_compares_learners_about_as_far_along_and_keeps_fragment_l2() -> None:
    board = ConsensusBoard(num_fragments=2)
    a, b, c = (torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    rec = board.on_commit(0, [1.0, 3.0])
    assert rec == {"consensus_js": None, "consensus_learners": [], "fragment_l2": [2.0, None]}
    assert board.message(0).js == UNKNOWN and board.message(0).fragment_l2 == (2.0, UNKNOWN)
    assert board.observe(0, _report(a, 10)) is None
    assert board.observe(1, _report(b, 9)) is None
    assert board.observe(2, _report(c, 7)) is None  # 3 versions behind the newest: not compared
    rec = board.on_commit(1, [0.5])
    assert rec["consensus_learners"] == [0, 1] and rec["fragment_l2"] == [2.0, 0.5]
    assert rec["consensus_js"] == pytest.approx(js_distance(summarize(a, 4), summarize(b, 4)), abs=1e-6)
    board.forget(1)
    assert board.on_commit(1, [0.5])["consensus_js"] is None
    assert board.observe(3, _report(a, 10)) is None
    assert "covers 2 tokens" in str(board.observe(3, _report(torch.randn(2, 8), 10)))
    assert "probe summary of learner 4" in str(board.observe(4, ProbeReport(1, 1, b"junk")))
