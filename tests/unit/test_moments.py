"""The shared first moment (DESIGN §3.9): read from the optimizer, carried after a push's delta,
averaged by the merge, carried back after a broadcast's values and folded into the optimizer."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from learner_harness import hand_fed

from syncer.core.payload import decode_push, payload_problem, payload_screen
from syncer.core.rounds import Answer
from syncer.service.moments import HELD_MERGES, MomentRelay, merged_moment
from yeto_core import learner as learner_module
from yeto_core import moments as moments_module
from yeto_core.codecs import BF16, F32, Bf16Parts, codec_by_name, tensor_bytes
from yeto_core.downlink import BroadcastReader
from yeto_core.layout import Layout, build_layout, specs_from_named_tensors
from yeto_core.link import PushJob
from yeto_core.moments import (
    MOMENT_CODEC,
    MomentError,
    OptimizerMoments,
    average_moments,
    decode_moment,
    encode_moment,
    moment_nbytes,
    moment_problem,
)
from yeto_core.net.tickets import Concatenated
from yeto_core.uplink import PushEncoder
from yeto_core.wire.errors import ProtocolError
from yeto_core.wire.messages import BCAST_FULL, BCAST_MOMENT, PUSH_MOMENT, Bcast, Pull, Push

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def two_tensors() -> tuple[list[tuple[str, torch.nn.Parameter]], Layout]:
    named = [("a", torch.nn.Parameter(torch.zeros(2, 3))), ("b", torch.nn.Parameter(torch.zeros(4)))]
    layout = build_layout(specs_from_named_tensors(named), 1, "binpack")
    return named, layout


def adam_steps(named: list[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer, steps: int,
               seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def test_gather_reads_adams_first_moment_in_layout_order_once_it_exists() -> None:
    named, layout = two_tensors()
    opt = torch.optim.AdamW([p for _, p in named], lr=0.1, betas=(0.8, 0.99))
    moments = OptimizerMoments(opt, named)
    fragment = layout.fragments[0]
    assert moments.gather(fragment) is None  # no step yet: no state
    adam_steps(named, opt, 3)
    got = moments.gather(fragment)
    assert got is not None
    want = {s.name: opt.state[dict(named)[s.name]]["exp_avg"].reshape(-1) for s in fragment.slots}
    for slot in fragment.slots:
        assert torch.equal(got[slot.offset : slot.offset + slot.numel], want[slot.name])


def test_rebase_replaces_the_pushed_moment_by_the_merged_one_decayed_by_the_steps_since() -> None:
    named, layout = two_tensors()
    opt = torch.optim.AdamW([p for _, p in named], lr=0.1, betas=(0.8, 0.99))
    moments = OptimizerMoments(opt, named)
    fragment = layout.fragments[0]
    adam_steps(named, opt, 2)
    pushed = moments.gather(fragment)
    assert pushed is not None
    adam_steps(named, opt, 3, seed=1)  # three steps trained since the push
    held = moments.gather(fragment)
    merged = pushed + 0.01 * torch.linspace(-1, 1, fragment.numel)  # well inside what √v allows
    moments.rebase(fragment, merged, pushed, 3)
    after = moments.gather(fragment)
    assert after is not None
    torch.testing.assert_close(after, held + 0.8**3 * (merged - pushed), rtol=0, atol=1e-7)


def test_the_rebased_moment_is_what_the_merged_one_would_have_become() -> None:
    """m ← β·m + (1 − β)·g is linear: starting those steps from m̄ gives exactly the rebased value."""
    named, layout = two_tensors()
    opt = torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)
    moments = OptimizerMoments(opt, named)
    fragment = layout.fragments[0]
    adam_steps(named, opt, 2)
    pushed = moments.gather(fragment)
    assert pushed is not None
    merged = pushed * 0.5 + 1.0
    twin_named, _ = two_tensors()
    twin = torch.optim.SGD([p for _, p in twin_named], lr=0.1, momentum=0.9)
    adam_steps(twin_named, twin, 2)
    twin_moments = OptimizerMoments(twin, twin_named)
    twin_moments.rebase(fragment, merged, pushed, 0)  # the twin takes m̄ at the push itself
    adam_steps(named, opt, 4, seed=1)
    adam_steps(twin_named, twin, 4, seed=1)
    moments.rebase(fragment, merged, pushed, 4)
    a, b = moments.gather(fragment), twin_moments.gather(fragment)
    assert a is not None and b is not None
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_fleets_moment_never_outgrows_what_the_islands_own_second_moment_carries() -> None:
    """A coordinate this island never had a gradient for (v = 0: a token its shard lacks, in an
    untied input embedding) takes no moment from the fleet, which Adam would divide by ε; the rest
    stay within Adam's own bound |m| ≤ κ·√v, and a moment within it passes untouched."""
    theta = torch.nn.Parameter(torch.zeros(4))
    named = [("t", theta)]
    layout = build_layout(specs_from_named_tensors(named), 1, "binpack")
    fragment = layout.fragments[0]
    opt = torch.optim.AdamW([theta], lr=0.01, betas=(0.9, 0.999))
    moments = OptimizerMoments(opt, named)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        theta.grad = torch.randn(4, generator=gen) * torch.tensor([0.0, 1.0, 1.0, 1.0])
        opt.step()
    kappa = moments_module.moment_bound(opt.param_groups[0])
    assert kappa == pytest.approx(0.1 / (0.001 * (1 - 0.81 / 0.999)) ** 0.5)
    state = opt.state[theta]
    pushed = moments.gather(fragment)
    assert pushed is not None and float(state["exp_avg_sq"][0]) == 0.0
    moments.rebase(fragment, pushed + 100.0, pushed, 0)  # another island's moment, far larger
    limit = kappa * state["exp_avg_sq"].sqrt()
    assert float(state["exp_avg"][0]) == 0.0
    assert torch.equal(state["exp_avg"].abs(), limit)
    before = theta.detach().clone()
    theta.grad = torch.zeros(4)
    opt.step()  # the step the fleet's moment drives: as long as Adam's own could be, never m/ε
    assert float(theta[0]) == float(before[0])
    assert bool(((theta.detach() - before).abs() <= 0.01 * (kappa * 1.01) + 1e-6).all())
    inside = state["exp_avg"] * 0.5
    held = state["exp_avg"].clone()
    moments.rebase(fragment, inside, held, 0)
    assert torch.equal(state["exp_avg"], inside)


def test_an_optimizer_without_a_first_moment_or_a_tensor_it_does_not_own_is_refused() -> None:
    named, _ = two_tensors()
    with pytest.raises(MomentError, match=r"SHARE_MOMENTUM.*keeps no first moment"):
        OptimizerMoments(torch.optim.SGD([p for _, p in named], lr=0.1), named)
    with pytest.raises(MomentError, match="'b' is not among the optimizer's parameters"):
        OptimizerMoments(torch.optim.AdamW([named[0][1]]), named)
    with pytest.raises(MomentError, match="not a torch optimizer"):
        OptimizerMoments(object(), named)


def test_a_trainers_wrapper_is_looked_through() -> None:
    named, layout = two_tensors()
    opt = torch.optim.AdamW([p for _, p in named])

    class Wrapped:  # accelerate's AcceleratedOptimizer keeps the torch one as `.optimizer`
        optimizer = opt

    moments = OptimizerMoments(Wrapped(), named)
    adam_steps(named, opt, 1)
    assert moments.gather(layout.fragments[0]) is not None


def test_a_non_finite_moment_is_not_sent() -> None:
    named, layout = two_tensors()
    opt = torch.optim.AdamW([p for _, p in named])
    adam_steps(named, opt, 1)
    opt.state[named[1][1]]["exp_avg"][2] = float("nan")
    assert OptimizerMoments(opt, named).gather(layout.fragments[0]) is None


@pytest.mark.parametrize("codec_name", ["f32", "bf16", "int8", "int4"])
def test_a_push_carries_its_moment_after_the_delta_and_the_syncer_reads_both_back(codec_name: str) -> None:
    codec = codec_by_name(codec_name)
    _, layout = two_tensors()
    n = layout.fragments[0].numel
    delta, moment = torch.linspace(-1, 1, n), torch.linspace(2, -3, n)
    job = PushJob(Pull(3, 1, 0, 2), 2, 100, 4, None, delta, encode_moment(moment))
    msg, payload, nbytes = PushEncoder(codec).encode(job)
    assert msg.codec == codec.wire_id | PUSH_MOMENT
    assert nbytes == codec.encoded_nbytes(n) + MOMENT_CODEC.encoded_nbytes(n)
    wire = bytearray(nbytes)
    if isinstance(payload, memoryview):
        wire[:] = payload
    else:
        payload.fill(0, memoryview(wire))
    assert payload_problem(layout, msg, memoryview(wire), codec) is None
    screen = payload_screen(msg)
    screened = None if screen is None else screen(memoryview(wire))
    parts = decode_push(layout, msg, memoryview(wire), codec, screened)
    assert not isinstance(parts, str)
    got_delta, got_wire = parts
    assert got_wire is not None
    assert got_wire.obj is memoryview(wire).obj  # kept as it came: a view of the push's own buffer
    got_moment = decode_moment(layout.fragments[0], got_wire)
    for sent, got, by in ((delta, got_delta, codec), (moment, got_moment, MOMENT_CODEC)):
        one = bytearray(by.encoded_nbytes(n))
        by.encode(sent, memoryview(one))
        want = torch.empty(n)
        by.decode(memoryview(one), want)
        assert torch.equal(got, want)  # each part exactly as its codec alone carries it


def test_the_moment_bit_and_the_payload_size_must_agree_and_a_bad_moment_is_refused() -> None:
    _, layout = two_tensors()
    n = layout.fragments[0].numel
    longer = 4 * n + moment_nbytes(layout.fragments[0])
    msg = Push(3, 1, 0, 2, 100, 4, 0, 0, 0, F32.wire_id)
    assert "expected" in (payload_problem(layout, msg, memoryview(bytearray(longer)), F32) or "")
    with_bit = Push(3, 1, 0, 2, 100, 4, 0, 0, 0, F32.wire_id | PUSH_MOMENT)
    assert "expected" in (payload_problem(layout, with_bit, memoryview(bytearray(4 * n)), F32) or "")
    assert payload_screen(with_bit) is None  # the moment's bytes are no f32: the delta is checked on decoding
    corrupt = bytearray(bytes(tensor_bytes(torch.zeros(n))) + b"\xff" * moment_nbytes(layout.fragments[0]))
    assert payload_problem(layout, with_bit, memoryview(corrupt), F32) is None
    assert "first moment" in str(decode_push(layout, with_bit, memoryview(corrupt), F32))


def test_concatenated_payloads_fill_any_range_with_the_parts_back_to_back() -> None:
    a = torch.arange(5, dtype=torch.float32)
    b = torch.linspace(-2, 2, 7)
    joined = Concatenated([tensor_bytes(a), Bf16Parts(b), b"xyz"])
    whole = bytes(tensor_bytes(a)) + bytes(bytearray(BF16.encoded_nbytes(7))) + b"xyz"
    expect = bytearray(whole)
    Bf16Parts(b).fill(0, memoryview(expect)[20 : 20 + 14])
    assert joined.nbytes == len(expect)
    for start, end in ((0, len(expect)), (3, 25), (19, 21), (20, 34), (33, len(expect))):
        out = bytearray(end - start)
        joined.fill(start, memoryview(out))
        assert bytes(out) == bytes(expect[start:end])
    with pytest.raises(ValueError):
        joined.fill(len(expect) - 1, memoryview(bytearray(2)))


def three_fragments() -> Layout:
    named = [(n, torch.zeros(k)) for n, k in (("a", 70), ("b", 3), ("c", 41))]
    return build_layout(specs_from_named_tensors(named), 3, "binpack")


def answer(lid: int, moment: memoryview | None) -> Answer:
    return Answer(lid, 1, 100, 4, torch.zeros(3), 0, moment=moment)


def test_a_push_carries_its_own_fragments_moment_and_the_syncer_expects_that_fragments_size() -> None:
    layout = three_fragments()
    for fragment in layout.fragments:
        moment = torch.linspace(-3, 5, fragment.numel)
        wire = encode_moment(moment)
        assert len(wire) == moment_nbytes(fragment) == MOMENT_CODEC.encoded_nbytes(fragment.numel)
        assert moment_problem(fragment, wire) is None
        assert torch.equal(decode_moment(fragment, wire), decode_moment(fragment, memoryview(bytes(wire))))
        msg = Push(3, 1, fragment.index, 2, 100, 4, 0, 0, 0, F32.wire_id | PUSH_MOMENT)
        payload = memoryview(bytearray(bytes(tensor_bytes(torch.zeros(fragment.numel))) + bytes(wire)))
        assert payload_problem(layout, msg, payload, F32) is None
        other = layout.fragments[(fragment.index + 1) % 3]  # another fragment's moment is the wrong size
        wrong = memoryview(bytearray(bytes(tensor_bytes(torch.zeros(fragment.numel)))
                                     + bytes(encode_moment(torch.zeros(other.numel)))))
        assert "expected" in (payload_problem(layout, msg, wrong, F32) or "")


def test_a_moment_that_is_short_has_a_bad_scale_or_decodes_to_inf_is_a_problem() -> None:
    fragment = three_fragments().fragments[0]
    wire = bytearray(encode_moment(torch.ones(fragment.numel)))
    assert "expected" in (moment_problem(fragment, memoryview(wire)[:-1]) or "")
    for scale, why in ((float("nan"), "scale"), (3e38, "would not be finite"), (-1.0, "scale")):  # 3e38 · 8 overflows
        bad = bytearray(wire)
        bad[4:8] = torch.tensor([scale]).numpy().tobytes()
        problem = moment_problem(fragment, memoryview(bad))
        assert problem is not None and why in problem
        with pytest.raises(ValueError) if why == "scale" else contextlib.nullcontext():
            values = decode_moment(fragment, memoryview(bad))  # the decode agrees with the check
            assert not bool(torch.isfinite(values).all())


def test_the_scale_check_passes_every_honest_payload_and_nothing_that_decodes_to_inf() -> None:
    rng = torch.Generator().manual_seed(5)
    n, stride = 1000, 4 + MOMENT_CODEC.block // 2
    for trial in range(40):
        wire = bytearray(MOMENT_CODEC.encoded_nbytes(n))
        MOMENT_CODEC.encode(torch.randn(n, generator=rng) * 10.0 ** (trial % 7 * 5), memoryview(wire))
        assert MOMENT_CODEC.problem(memoryview(wire), n) is None
        at = 4 + trial % 8 * stride  # one block's scale made huge: Inf once decoded, unless its codes are 0
        wire[at : at + 4] = torch.tensor([3.4e38 / (1 + trial % 5)]).numpy().tobytes()
        out = torch.empty(n)
        MOMENT_CODEC.decode(memoryview(wire), out)
        if not bool(torch.isfinite(out).all()):
            assert MOMENT_CODEC.problem(memoryview(wire), n) is not None

def test_the_merged_moment_is_weighted_like_the_merge_over_those_that_sent_one() -> None:
    fragment = three_fragments().fragments[0]
    n = fragment.numel
    m0, m2 = encode_moment(torch.linspace(1, 3, n)), encode_moment(torch.linspace(3, -1, n))
    d0, d2 = decode_moment(fragment, m0), decode_moment(fragment, m2)

    def want(mean: torch.Tensor) -> bytes:  # the average of what arrived, carried back in the same code
        return bytes(encode_moment(mean))

    got = merged_moment(fragment, [answer(0, m0), answer(1, None), answer(2, m2)], [0.25, 0.5, 0.25])
    assert got is not None and bytes(got) == want(torch.zeros(n).add_(d0, alpha=0.5).add_(d2, alpha=0.5))
    got = merged_moment(fragment, [answer(0, m0), answer(2, m2)], [0.75, 0.25])
    assert got is not None and bytes(got) == want(torch.zeros(n).add_(d0, alpha=0.75).add_(d2, alpha=0.25))
    assert merged_moment(fragment, [answer(0, None)], [1.0]) is None
    assert bytes(average_moments(fragment, [(m0, 2.0)])) == bytes(m0)  # one moment averages to itself


def test_the_relay_adds_the_moment_only_for_sharers_and_the_version_its_merge_made() -> None:
    relay = MomentRelay()
    pushed = Push(3, 1, 0, 2, 100, 4, 0, 0, 0, F32.wire_id | PUSH_MOMENT)
    relay.heard(1, pushed)
    relay.heard(2, Push(3, 1, 0, 2, 100, 4, 0, 0, 0, F32.wire_id))
    moment = memoryview(bytearray(b"\x01" * MOMENT_CODEC.encoded_nbytes(2)))  # the relay never reads it
    relay.merged(0, 3, moment)
    values = tensor_bytes(torch.tensor([5.0, 6.0]))
    msg = Bcast(0, 3, 3, BCAST_FULL, 0, 0, F32.wire_id)
    sent, payload = relay.attach(1, msg, values)
    assert sent.flags == BCAST_FULL | BCAST_MOMENT
    out = bytearray(8 + MOMENT_CODEC.encoded_nbytes(2))
    payload.fill(0, memoryview(out))  # type: ignore[union-attr]
    assert bytes(out) == bytes(values) + bytes(moment)
    assert relay.attach(2, msg, values) == (msg, values)  # learner 2 does not share
    other = Bcast(0, 4, 4, BCAST_FULL, 0, 0, F32.wire_id)
    assert relay.attach(1, other, values) == (other, values)  # another version
    for version in range(4, 4 + HELD_MERGES):
        relay.merged(0, version, moment)
    assert relay.attach(1, msg, values) == (msg, values)  # no longer held: memory stays bounded
    relay.heard(1, Push(3, 1, 0, 2, 100, 4, 0, 0, 0, F32.wire_id))  # it stopped sharing
    assert 1 not in relay.sharing


def test_the_learner_splits_a_broadcast_into_values_and_moment() -> None:
    _, layout = two_tensors()
    n = layout.fragments[0].numel
    reader = BroadcastReader(layout, delta_codec=None)
    values, moment = torch.arange(n, dtype=torch.float32), torch.linspace(-0.5, 0.5, n)
    wire = memoryview(bytearray(bytes(tensor_bytes(values)) + bytes(encode_moment(moment))))
    msg = Bcast(0, 1, 1, BCAST_FULL | BCAST_MOMENT, 0, 0, F32.wire_id)
    rest, got = reader.moment_of(msg, wire)
    assert got is not None and bytes(got) == bytes(encode_moment(moment))
    assert torch.equal(reader.values(msg, rest), values)
    with pytest.raises(ProtocolError, match="first moment"):
        reader.moment_of(msg, wire[: moment_nbytes(layout.fragments[0]) - 1])
    plain = Bcast(0, 1, 1, BCAST_FULL, 0, 0, F32.wire_id)
    assert reader.moment_of(plain, wire)[1] is None


def pushed_with_moment(theta: torch.nn.Parameter, opt: torch.optim.Optimizer,
                       grad: Callable[[], torch.Tensor]) -> tuple[Any, Any, Callable[[], None]]:
    """A hand-fed session (H = 2, one fragment, overlap) sharing `opt`'s moment, trained to its
    first push: (session, link, one more training step)."""
    session, link, _, _ = hand_fed([("w", theta)], overlap=True)
    session.share_momentum(opt)

    def train() -> None:
        theta.grad = grad()
        opt.step()
        session.step(tokens=10)

    link.bcast(0, 0, 0, torch.zeros(4))
    session.start()
    train()
    link.pull(0, 0, 0)
    train()  # step 2: the boundary pushes round 0 with the moment of now
    return session, link, train


def test_a_session_pushes_its_moment_and_folds_the_fleets_into_its_optimizer() -> None:
    """Hand-fed: AdamW on one tensor, H = 2, one fragment, overlap on."""
    theta = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.AdamW([theta], lr=0.01, betas=(0.9, 0.999))
    gen = torch.Generator().manual_seed(0)
    session, link, train = pushed_with_moment(theta, opt, lambda: torch.randn(4, generator=gen))
    (job,) = link.jobs
    # the moment as the syncer will decode it (4 bits a value), so the install replaces just that
    layout = link.layout
    assert layout is not None and job.moment is not None
    fragment = layout.fragments[0]
    assert bytes(job.moment) == bytes(encode_moment(opt.state[theta]["exp_avg"]))
    pushed = decode_moment(fragment, job.moment)
    train()  # step 3, trained while the round merges
    fleet = decode_moment(fragment, encode_moment(pushed * 0.5 + 0.01))  # as the broadcast carries it
    link.bcast(0, 1, 0, job.delta.clone(), merged=True, moment=fleet)
    theta.grad = torch.randn(4, generator=gen)
    opt.step()  # step 4's optimizer step; its session.step installs the broadcast
    held = opt.state[theta]["exp_avg"].clone()
    session.step(tokens=10)
    assert torch.allclose(opt.state[theta]["exp_avg"], held + 0.9**2 * (fleet - pushed), rtol=0, atol=1e-6)
    assert session.stats.moments_shared == 1


def test_a_session_without_a_shared_optimizer_ignores_a_broadcasts_moment() -> None:
    theta = torch.nn.Parameter(torch.zeros(4))
    session, link, _, _ = hand_fed([("w", theta)], overlap=True)
    link.bcast(0, 0, 0, torch.zeros(4))
    session.start()
    session.step(tokens=10)
    link.pull(0, 0, 0)
    theta.data.add_(1.0)
    session.step(tokens=10)
    (job,) = link.jobs
    assert job.moment is None
    link.bcast(0, 1, 0, job.delta.clone(), merged=True, moment=torch.ones(4))
    session.step(tokens=10)
    assert session.stats.installs == 2 and session.stats.moments_shared == 0


def test_a_plugin_turns_a_moment_it_cannot_share_into_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from yeto_plugins.exits import settings_exit

    named, _ = two_tensors()
    with pytest.raises(SystemExit) as ended, settings_exit():
        OptimizerMoments(torch.optim.SGD([p for _, p in named], lr=0.1), named)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "YETO_DILOCO_SHARE_MOMENTUM" in err and "Traceback" not in err


def test_a_round_pulled_again_gets_the_same_moment_and_a_round_without_us_still_shares() -> None:
    """A re-pull after a lost connection replays the push as it was, moment included; a round
    that committed without this island's push still brings the fleet's moment, rebased on ours."""
    theta = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([theta], lr=0.01, momentum=0.5)
    session, link, train = pushed_with_moment(theta, opt, lambda: torch.full((4,), 1.0))
    first = link.jobs[0]
    assert first.moment is not None
    train()  # the moment moves on; the replay must not pick that up
    link.lose()
    link.connect()
    link.pull(0, 0, 0, attempt=2)
    session.pump(0.0)
    replay = link.jobs[1]
    assert replay.pull.attempt == 2 and replay.moment is first.moment and torch.equal(replay.delta, first.delta)
    layout = link.layout
    assert layout is not None
    fragment = layout.fragments[0]
    fleet = decode_moment(fragment, encode_moment(torch.full((4,), 3.0)))
    link.bcast(0, 1, 0, torch.full((4,), 0.5), merged=False, moment=fleet)  # committed without us
    theta.grad = torch.full((4,), 1.0)
    opt.step()
    held = opt.state[theta]["momentum_buffer"].clone()
    session.step(tokens=10)
    steps = 2  # from the push at step 2 to this install at step 4
    pushed = decode_moment(fragment, first.moment)
    assert torch.allclose(opt.state[theta]["momentum_buffer"], held + 0.5**steps * (fleet - pushed))


def test_a_fragments_moment_is_read_and_rebased_in_its_own_tensors_only() -> None:
    named = [(n, torch.nn.Parameter(torch.zeros(k))) for n, k in (("a", 5), ("b", 3), ("c", 4))]
    layout = build_layout(specs_from_named_tensors(named), 2, "binpack")
    opt = torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.5)  # no second moment to bound the + 1
    moments = OptimizerMoments(opt, named)
    adam_steps(named, opt, 2)  # type: ignore[arg-type]
    by_name = {n: opt.state[p]["momentum_buffer"] for n, p in named}
    fragment = layout.fragments[0]
    wire = moments.encode(fragment)
    assert wire is not None and len(wire) == moment_nbytes(fragment)
    pushed = decode_moment(fragment, wire)
    for slot in fragment.slots:  # within half a 4-bit step of what the optimizer holds
        step = by_name[slot.name].abs().max().item() / 7
        torch.testing.assert_close(pushed[slot.offset : slot.offset + slot.numel], by_name[slot.name], rtol=0,
                                   atol=step / 2 + 1e-7)
    before = {n: m.clone() for n, m in by_name.items()}
    merged = encode_moment(pushed + 1.0)
    shift = decode_moment(fragment, merged) - pushed  # what the 4-bit code carries of the + 1
    moments.rebase_wire(fragment, merged, wire, 1)
    mine = {slot.name for slot in fragment.slots}
    for slot in fragment.slots:
        want = before[slot.name] + 0.5 * shift[slot.offset : slot.offset + slot.numel]
        torch.testing.assert_close(by_name[slot.name], want, rtol=0, atol=1e-6)
    for name in set(by_name) - mine:  # the other fragment's tensors keep their own moment
        assert torch.equal(by_name[name], before[name])


def test_a_session_of_two_fragments_pushes_and_takes_each_fragments_own_moment() -> None:
    """Hand-fed, two fragments, H = 2 (a boundary every step): the push of a fragment carries that
    fragment's moment, and its install changes that fragment's tensors' moments only."""
    a, b = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([a, b], lr=0.01, momentum=0.5)
    session, link, _, _ = hand_fed([("a", a), ("b", b)], fragments=2, overlap=True)
    session.share_momentum(opt)

    def train() -> None:
        a.grad, b.grad = torch.full((6,), 1.0), torch.full((2,), 2.0)
        opt.step()
        session.step(tokens=10)

    link.bcast(0, 0, 0, torch.zeros(6))
    link.bcast(1, 0, 0, torch.zeros(2))
    session.start()
    layout = link.layout
    assert layout is not None
    which = {f.index: {s.name for s in f.slots} for f in layout.fragments}
    first = next(i for i, names in which.items() if "a" in names)
    train()
    link.pull(0, first, 0)
    train()
    (job,) = link.jobs
    fragment = layout.fragments[first]
    assert job.moment is not None and len(job.moment) == moment_nbytes(fragment)
    pushed = decode_moment(fragment, job.moment)
    held = {n: opt.state[p]["momentum_buffer"].clone() for n, p in (("a", a), ("b", b))}
    fleet = decode_moment(fragment, encode_moment(pushed + 4.0))
    link.bcast(first, 1, 0, job.delta.clone(), merged=True, moment=fleet)
    session.step(tokens=10)  # one step after the push, with no optimizer step: it installs, and only the fold moves
    assert session.stats.moments_shared == 1
    for name, p in (("a", a), ("b", b)):
        now = opt.state[p]["momentum_buffer"]
        if name in which[first]:
            slot = next(s for s in fragment.slots if s.name == name)
            change = (fleet - pushed)[slot.offset : slot.offset + slot.numel] * 0.5  # β^1
            torch.testing.assert_close(now, held[name] + change, rtol=0, atol=1e-6)
        else:
            assert torch.equal(now, held[name])


def test_islands_whose_optimizer_keeps_its_moments_elsewhere_are_refused_naming_the_setting() -> None:
    """DeepSpeed ZeRO and Megatron keep their moments in partitions of their own: refused before
    anything is built, in one line naming the setting."""
    from types import SimpleNamespace

    from yeto_core.settings import LearnerSettings
    from yeto_plugins.megatron.sync import MegatronDiLoCoSync
    from yeto_plugins.torch_dist.moments import IslandMoments

    partitioned = torch.nn.Parameter(torch.zeros(4))
    partitioned.ds_id = 1  # type: ignore[attr-defined]  # what ZeRO-3 marks its parameters with
    with pytest.raises(MomentError, match=r"SHARE_MOMENTUM: DeepSpeed ZeRO.*'w'"):
        IslandMoments(SimpleNamespace(params={"w": partitioned}), torch.optim.AdamW([partitioned]))  # type: ignore[arg-type]
    settings = LearnerSettings(syncer="127.0.0.1:7070", share_momentum=True)
    with pytest.raises(MomentError, match=r"SHARE_MOMENTUM: Megatron's optimizer.*unset it"):
        MegatronDiLoCoSync([torch.nn.Linear(2, 2)], object(), settings)


def test_the_codec_is_warmed_on_a_thread_of_its_own_when_a_session_starts_sharing() -> None:
    theta = torch.nn.Parameter(torch.zeros(4))
    session, _, _, _ = hand_fed([("w", theta)])
    started: list[threading.Thread] = []
    real = moments_module.warm_codec

    def spy() -> threading.Thread:
        started.append(real())
        return started[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(learner_module, "warm_codec", spy)
        session.share_momentum(torch.optim.AdamW([theta]))
    (thread,) = started
    assert thread is not threading.current_thread() and thread.daemon
    thread.join(60)
    assert not thread.is_alive()
