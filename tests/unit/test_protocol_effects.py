"""The protocol asks the shell for its tensor work and takes the answers in (DESIGN §4.1).

An INIT fragment is checked, a push (f32, or carried into a later round) decoded and a downlink
broadcast encoded by the shell (`effects.is_ask`); the protocol decides nothing that needs the
answer until it is back, and what it decided after an ask reaches the world behind it, so the
effects keep the order, and the bytes, they had when the protocol did the work itself. The
tests drive `SyncerProtocol.handle` by hand, answer each ask with the shell's own `answer`, and
compare with what the old inline code produced (`DownlinkEncoder`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from syncer_harness import FakeClock, MemoryGroup, RecordingTape

from syncer.core import records
from syncer.core.effects import (
    CheckInit,
    Close,
    Decode,
    Effect,
    Encode,
    FaultPoint,
    Log,
    Merge,
    Peer,
    Record,
    Send,
    StallTimeout,
    is_ask,
)
from syncer.core.events import Decoded, Encoded, Got, InitChecked, Joined, Merged, is_answer
from syncer.core.links import Phase
from syncer.core.protocol import SyncerProtocol
from syncer.core.run_state import RunState
from syncer.merge.round_merge import RoundMerger
from syncer.service.coordinator import Coordinator, answer
from yeto_core.codecs import BF16, F32, codec_by_name, tensor_bytes
from yeto_core.downlink import DELTA, FULL, DownlinkEncoder
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.settings import SyncerSettings
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import (
    BCAST_DELTA,
    BCAST_FULL,
    Bcast,
    Error,
    Init,
    Manifest,
    Pull,
    Push,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SPECS = (TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32"))
LAYOUT = build_layout(SPECS, 2, "binpack")
CPU = torch.device("cpu")


class Hand:
    """The test as the shell, one step at a time: every turn's effects as returned, asks included."""

    def __init__(self, **settings: Any) -> None:
        config: dict[str, Any] = {"learners": 2, "fragments": 2, "grace_s": 0.0, "device": "cpu", "pipeline": 1}
        self.settings = SyncerSettings(**{**config, **settings})
        self.now = 10.0
        self.protocol = SyncerProtocol(self.settings, device=CPU, now=self.now)
        self.merger = RoundMerger(self.settings.merging)
        self.generations: dict[int, int] = {}

    def turn(self, event: Any = None) -> list[Effect]:
        return self.protocol.handle(self.now, event)

    def answer(self, effects: list[Effect]) -> list[Effect]:
        """Answer the ask that ends `effects` as the shell does; the next turn's effects."""
        assert effects and is_ask(effects[-1]), effects
        back = answer(effects[-1], LAYOUT, CPU)  # type: ignore[arg-type]
        assert is_answer(back)
        return self.turn(back)

    def through(self, effects: list[Effect]) -> list[Effect]:
        """`effects` and everything the answers to its asks bring, asks included, in order."""
        out, batch = list(effects), effects
        while batch and is_ask(batch[-1]):
            batch = self.answer(batch)
            out += batch
        return out

    def join(self, lid: int, *, flags: int = 0, wire_dtype: int = F32.wire_id,
             downlink: int = F32.wire_id) -> list[Effect]:
        self.generations[lid] = self.generations.get(lid, 0) + 1
        manifest = Manifest(LAYOUT.num_fragments, LAYOUT.pattern, SPECS) if lid == 0 else None
        return self.turn(Joined(lid, self.generations[lid], LAYOUT.fingerprint, wire_dtype, manifest, flags,
                                instance=bytes([lid + 1]) * 16, downlink_dtype=downlink))

    def got(self, lid: int, msg: Any, payload: bytes | None = None, screened: bool | None = None) -> list[Effect]:
        view = None if payload is None else memoryview(bytearray(payload))
        return self.turn(Got(lid, self.generations[lid], msg, view, screened))

    def init(self, values: float = 0.0) -> list[Effect]:
        out: list[Effect] = []
        for f in LAYOUT.fragments:
            out += self.through(self.got(0, Init(f.index, 0, 0, F32.wire_id),
                                         tensor_bytes(torch.full((f.numel,), values))))
        return out

    def push(self, lid: int, pull: Pull, value: float, *, base: int | None = None) -> list[Effect]:
        numel = LAYOUT.fragments[pull.fragment].numel
        msg = Push(pull.round, pull.attempt, pull.fragment, pull.version if base is None else base, 100, 4, 0, 0,
                   numel * 4, F32.wire_id)
        return self.got(lid, msg, tensor_bytes(torch.full((numel,), value)), screened=True)

    def merge(self, effect: Merge) -> Merged:
        outcome, back = self.merger.merge(effect.lent, list(effect.answers), list(effect.segments))
        return Merged(effect.round, outcome, back)


def kinds(effects: list[Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def pulls(effects: list[Effect]) -> list[Pull]:
    return [e.msg for e in effects if isinstance(e, Send) and isinstance(e.msg, Pull)]


# -- the stream: an ask ends what a turn hands out --------------------------------------------------
def test_what_is_decided_behind_an_ask_is_handed_out_after_its_answer_in_the_order_decided() -> None:
    run = RunState(SyncerSettings(device="cpu"))
    ask = CheckInit(Peer(0, 1), 0, memoryview(b""))
    run.emit(Log("a"))
    run.emit(ask)
    run.emit(Log("b"))
    run.later(lambda: run.emit(Log("step")))  # a step runs where it stands
    run.emit(Log("c"))
    assert run.effects == [Log("a"), ask] and run.asked
    run.effects = []
    run.answered(lambda: run.emit(Log("answer")))  # what taking the answer in decides goes first
    assert run.effects == [Log("answer"), Log("b"), Log("step"), Log("c")] and not run.asked and not run.held


def test_an_ask_behind_an_ask_waits_its_turn_and_a_step_goes_before_what_waited_behind_it() -> None:
    run = RunState(SyncerSettings(device="cpu"))
    first, second = CheckInit(Peer(0, 1), 0, memoryview(b"")), CheckInit(Peer(0, 1), 1, memoryview(b""))
    run.emit(first)
    run.later(lambda: (run.emit(Log("step")), run.emit(second), run.emit(Log("after second"))))
    run.emit(Log("last"))
    run.effects = []
    run.answered(lambda: None)
    assert run.effects == [Log("step"), second]  # the step ran, up to its own ask
    run.effects = []
    run.answered(lambda: None)
    assert run.effects == [Log("after second"), Log("last")]


def test_an_answer_to_no_ask_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        RunState(SyncerSettings(device="cpu")).answered(lambda: None)


# -- (a) the INIT check ---------------------------------------------------------------------------------
def test_an_init_fragment_is_checked_by_the_shell_and_taken_in_when_it_answers() -> None:
    h = Hand()
    h.join(0)
    h.join(1)
    payload = tensor_bytes(torch.arange(4, dtype=torch.float32))
    asked = h.got(0, Init(0, 0, 0, F32.wire_id), payload)
    (check,) = asked
    assert isinstance(check, CheckInit) and check.to == Peer(0, 1) and check.fragment == 0 and check.screened is None
    state = h.protocol.state
    assert state is not None and state.params[0].numel() == 0  # nothing taken in before the answer
    back = answer(check, LAYOUT, CPU)
    assert isinstance(back, InitChecked) and back.values is not None
    assert back.values.data_ptr() == torch.frombuffer(check.payload, dtype=torch.float32).data_ptr()  # no copy
    assert h.turn(back) == [FaultPoint("mid-init")]
    assert torch.equal(state.params[0], torch.arange(4, dtype=torch.float32))


def test_the_cut_comes_with_the_last_answer_and_round_0_after_it_as_when_the_protocol_checked_inline() -> None:
    h = Hand()
    h.join(0)
    h.join(1)
    h.through(h.got(0, Init(0, 0, 0, F32.wire_id), tensor_bytes(torch.zeros(4))))
    ask = h.got(0, Init(1, 0, 0, F32.wire_id), tensor_bytes(torch.zeros(4)))
    assert kinds(ask) == ["CheckInit"] and h.protocol.phase is Phase.WAIT_INIT
    h.now += 1e6  # far past the INIT deadline: nothing is decided until the answer is in
    cut = h.answer(ask)
    assert h.protocol.phase is Phase.RUNNING and h.protocol.exit_code == 0
    assert kinds(cut[:3]) == ["Checkpoint", "Record", "Log"]
    assert [p.round for p in pulls(cut)] == [0, 0]
    assert cut.index(next(e for e in cut if isinstance(e, Send) and isinstance(e.msg, Pull))) > max(
        i for i, e in enumerate(cut) if isinstance(e, Send) and isinstance(e.msg, Bcast))


@pytest.mark.parametrize("screened", [None, False])
def test_a_nonfinite_init_is_refused_found_by_the_shell_or_by_the_transports_screen(screened: bool | None) -> None:
    h = Hand()
    h.join(0)
    bad = tensor_bytes(torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    effects = h.got(0, Init(0, 0, 0, F32.wire_id), bad, screened=screened)
    if screened is None:
        assert kinds(effects) == ["CheckInit"]
        effects = h.answer(effects)
    else:  # the screen said so as the chunks landed: nothing to ask
        assert not any(is_ask(e) for e in effects)
    record, close = effects
    assert isinstance(record, Record) and isinstance(record.record, records.Refused)
    assert isinstance(close, Close) and isinstance(close.last, Error) and close.last.code is ErrorCode.REFUSED
    assert "INIT of fragment 0 contains NaN or Inf" in close.reason


# -- (b) push decodes -------------------------------------------------------------------------------------
def test_an_f32_push_is_an_inline_decode_answered_with_a_view_of_its_payload_before_the_round_is_decided() -> None:
    h = Hand()
    h.join(0)
    h.join(1)
    pull = pulls(h.init())[0]
    h.through(h.push(0, pull, 1.0))
    effects = h.push(1, pull, 3.0)
    assert kinds(effects) == ["FaultPoint", "Decode"]  # the round is not decided yet: its answer is out
    decode = effects[-1]
    assert isinstance(decode, Decode) and decode.inline and decode.screened is True and not decode.carried
    back = answer(decode, LAYOUT, CPU)
    assert isinstance(back, Decoded) and back.inline and isinstance(back.delta, torch.Tensor)
    assert back.delta.data_ptr() == torch.frombuffer(decode.payload, dtype=torch.float32).data_ptr()
    merge = h.turn(back)[-1]  # taken in, then the round closes and asks for its merge
    assert isinstance(merge, Merge) and sorted(a.learner_id for a in merge.answers) == [0, 1]


def test_a_quantized_push_still_goes_to_the_decode_pool_not_an_ask() -> None:
    h = Hand()
    h.join(0)
    h.join(1, wire_dtype=codec_by_name("int8").wire_id)
    pull = pulls(h.init())[0]
    codec = h.protocol.links[1].codec
    payload = bytearray(codec.encoded_nbytes(4))
    codec.encode(torch.full((4,), 0.5), memoryview(payload))
    msg = Push(pull.round, pull.attempt, pull.fragment, pull.version, 10, 1, 0, 0, len(payload), codec.wire_id)
    (_, decode) = h.got(1, msg, bytes(payload))
    assert isinstance(decode, Decode) and not decode.inline and not is_ask(decode)


def late_push_setup(wire: str = "f32") -> tuple[Hand, Pull, Push, bytes]:
    """Round 0 (fragment 0) merged without learner 1, whose push for it then comes late, as `wire`;
    returns the hand, round 1's pull, and that late push and its payload."""
    h = Hand(carry_answers_round=False, max_base_lag=2, quorum=1)
    h.join(0)
    h.join(1, wire_dtype=codec_by_name(wire).wire_id)
    p0 = pulls(h.init())[0]
    merge = h.through(h.push(0, p0, 1.0))[-1]
    assert isinstance(merge, Merge)
    committed = h.through(h.turn(h.merge(merge)))
    p1 = pulls(committed)[0]
    assert p1.round == 1 and p1.fragment == 1
    codec = h.protocol.links[1].codec
    payload = bytearray(codec.encoded_nbytes(4))
    codec.encode(torch.full((4,), 2.0), memoryview(payload))
    late = Push(0, p0.attempt, 0, 0, 100, 4, 0, 0, len(payload), codec.wire_id)
    return h, p1, late, bytes(payload)


@pytest.mark.parametrize("wire", ["f32", "int8"])
def test_a_carried_push_is_decoded_by_the_shell_when_it_joins_its_fragments_next_round(wire: str) -> None:
    h, p1, late, payload = late_push_setup(wire)
    carried = h.through(h.got(1, late, payload, screened=True if wire == "f32" else None))
    assert not any(isinstance(e, Decode) for e in carried)  # kept encoded: fragment 0 has no round open
    assert any(isinstance(e, Record) and isinstance(e.record, records.Carry) for e in carried)
    merge = h.through(h.push(0, p1, 1.0))[-1]  # quorum 1: round 1 (fragment 1) closes at once
    assert isinstance(merge, Merge)
    effects = h.through(h.turn(h.merge(merge)))  # it commits, and round 2 (fragment 0) launches
    decodes = [e for e in effects if isinstance(e, Decode)]
    assert len(decodes) == 1 and decodes[0].carried and decodes[0].inline and decodes[0].msg == late
    attempt = h.protocol.rounds.collecting_on(0)
    assert attempt is not None and decodes[0].attempt == attempt.attempt
    held = attempt.answers[1]
    delta = held.delta if isinstance(held.delta, torch.Tensor) else held.delta.decode()  # int8: held encoded
    assert held.carried and held.origin == 0 and torch.allclose(delta, torch.full((4,), 2.0), atol=0.05)
    # the decode was asked at the launch, before its pulls went out, as the inline decode stood
    launched = [i for i, e in enumerate(effects) if isinstance(e, Record) and isinstance(e.record, records.Launch)
                and e.record.round == 2]
    assert launched and launched[0] < effects.index(decodes[0]) < min(
        i for i, e in enumerate(effects) if isinstance(e, Send) and isinstance(e.msg, Pull) and e.msg.round == 2)


def test_a_carried_push_that_does_not_decode_is_refused_where_the_inline_decode_refused_it() -> None:
    h, p1, late, payload = late_push_setup("int8")
    bad = bytearray(payload)
    bad[0:4] = torch.tensor([float("nan")]).numpy().tobytes()  # the first block's scale
    h.through(h.got(1, late, bytes(bad)))
    merge = h.through(h.push(0, p1, 1.0))[-1]
    assert isinstance(merge, Merge)
    effects = h.through(h.turn(h.merge(merge)))
    (refusal,) = [e for e in effects if isinstance(e, Send) and isinstance(e.msg, Error)]
    assert refusal.to == Peer(1, 1) and "carried push dropped" in refusal.msg.reason  # type: ignore[union-attr]
    pull_at = min(i for i, e in enumerate(effects) if isinstance(e, Send) and isinstance(e.msg, Pull))
    assert effects.index(refusal) < pull_at  # before round 2's pulls, as when it was decoded inline
    attempt = h.protocol.rounds.collecting_on(0)
    assert attempt is not None and 1 not in attempt.answers


# -- (c) the downlink encode ------------------------------------------------------------------------------
def delta_run(full_every: int = 1000) -> tuple[Hand, Pull]:
    h = Hand(bcast_delta_full_every=full_every)
    h.join(0, downlink=BF16.wire_id)
    h.join(1)
    pull = pulls(h.init(0.5))[0]
    return h, pull


def test_a_delta_learner_joining_makes_the_anchors_first_and_then_gets_a_copy_of_each() -> None:
    h = Hand()
    h.join(0, downlink=BF16.wire_id)
    h.join(1)
    cut = h.init(0.5)
    encodes = [e for e in cut if isinstance(e, Encode)]
    assert [(e.fragment, e.full, e.lent) for e in encodes] == [(0, True, None), (1, True, None)]
    bcasts = [e for e in cut if isinstance(e, Send) and isinstance(e.msg, Bcast)]
    mine = [b for b in bcasts if b.to == Peer(0, 1)]
    assert [(b.anchor, b.committed, b.msg.flags & BCAST_FULL) for b in mine] == [((0, 2), None, 1), ((1, 2), None, 1)]  # type: ignore[union-attr]
    reference = DownlinkEncoder(2, 1000)
    state = h.protocol.state
    assert state is not None
    for b in mine:
        assert b.anchor is not None
        f, codec = b.anchor
        expect = reference.commit(f, 0, state.params[f])
        assert b.msg.digest == expect.digest  # type: ignore[union-attr]
        assert bytes(tensor_bytes(h.protocol.anchor(f, codec))) == bytes(expect.payload)
    # order: learner 0's stall timeout, its fragments, then learner 1's, as before
    order = [(type(e).__name__, getattr(e, "to", None)) for e in cut if isinstance(e, StallTimeout | Send)
             and not isinstance(getattr(e, "msg", None), Pull)]
    assert order == [("StallTimeout", Peer(0, 1)), ("Send", Peer(0, 1)), ("Send", Peer(0, 1)),
                     ("StallTimeout", Peer(1, 1)), ("Send", Peer(1, 1)), ("Send", Peer(1, 1))]
    rejoin = h.through(h.join(0, downlink=BF16.wire_id))  # anchors held now: nothing to encode
    assert not any(isinstance(e, Encode) for e in rejoin)
    assert [e.anchor for e in rejoin if isinstance(e, Send) and isinstance(e.msg, Bcast)] == [(0, 2), (1, 2)]


def test_a_commit_lends_the_anchor_to_be_encoded_and_its_broadcast_follows_the_answer_bit_for_bit() -> None:
    h, pull = delta_run()
    reference = DownlinkEncoder(2, 1000)
    state = h.protocol.state
    assert state is not None
    for f in (0, 1):
        reference.commit(f, 0, state.params[f])
    h.through(h.push(0, pull, 1.0))
    merge = h.through(h.push(1, pull, 3.0))[-1]
    assert isinstance(merge, Merge)
    lent = h.protocol.anchor(0, BF16.wire_id)
    effects = h.turn(h.merge(merge))
    assert kinds(effects) == ["FaultPoint", "Checkpoint", "Record", "Encode"]  # the sends wait for the answer
    encode = effects[-1]
    assert isinstance(encode, Encode) and not encode.full and encode.lent is lent and encode.version == 1
    back = answer(encode, LAYOUT, CPU)
    assert isinstance(back, Encoded) and back.anchor is lent  # moved in place
    rest = h.turn(back)
    expect = reference.commit(0, 1, state.params[0])
    bcasts = [e for e in rest if isinstance(e, Send) and isinstance(e.msg, Bcast)]
    delta = [b for b in bcasts if b.to == Peer(0, 1)]
    assert len(delta) == 1 and delta[0].msg.flags & BCAST_DELTA and expect.flags == DELTA  # type: ignore[union-attr]
    assert delta[0].msg.digest == expect.digest and bytes(delta[0].payload or b"") == bytes(expect.payload)  # type: ignore[union-attr]
    downlinks = h.protocol.shared.downlinks
    assert downlinks is not None and downlinks.by_id[BF16.wire_id].digests[0] == expect.digest
    f32 = [b for b in bcasts if b.to == Peer(1, 1)]
    assert len(f32) == 1 and f32[0].committed == 0
    log = [e for e in rest if isinstance(e, Log)]
    assert log and rest.index(log[0]) > rest.index(bcasts[-1])  # the commit's line still comes last
    assert pulls(rest) and rest.index(log[0]) < rest.index(
        next(e for e in rest if isinstance(e, Send) and isinstance(e.msg, Pull)))  # the next round after it


def test_every_full_every_versions_the_commit_asks_for_a_full_and_with_no_delta_learner_the_chain_drops() -> None:
    h, pull = delta_run(full_every=1)
    h.through(h.push(0, pull, 1.0))
    merge = h.through(h.push(1, pull, 3.0))[-1]
    assert isinstance(merge, Merge)
    encode = h.turn(h.merge(merge))[-1]
    assert isinstance(encode, Encode) and encode.full and encode.lent is None
    back = answer(encode, LAYOUT, CPU)
    assert isinstance(back, Encoded) and back.broadcast.flags == FULL
    h.through(h.turn(back))
    f32_only = Hand()
    f32_only.join(0)
    f32_only.join(1)
    pull = pulls(f32_only.init())[0]
    f32_only.through(f32_only.push(0, pull, 1.0))
    merge = f32_only.through(f32_only.push(1, pull, 3.0))[-1]
    assert isinstance(merge, Merge)
    committed = f32_only.turn(f32_only.merge(merge))
    assert not any(is_ask(e) for e in committed)  # nothing to encode: one turn, as before
    assert f32_only.protocol.shared.downlinks is not None and not f32_only.protocol.shared.downlinks.by_id


def test_learners_on_two_downlink_codecs_get_one_encode_each_and_their_own_codecs_delta() -> None:
    int4 = codec_by_name("int4")
    h = Hand()
    h.join(0, downlink=BF16.wire_id)
    h.join(1, downlink=int4.wire_id)
    pull = pulls(h.init(0.5))[0]
    state = h.protocol.state
    assert state is not None
    references = {BF16.wire_id: DownlinkEncoder(2, 0, BF16), int4.wire_id: DownlinkEncoder(2, 0, int4)}
    for reference in references.values():
        for f in (0, 1):
            reference.commit(f, 0, state.params[f])
    h.through(h.push(0, pull, 1.0))
    merge = h.through(h.push(1, pull, 3.0))[-1]
    assert isinstance(merge, Merge)
    effects = h.through(h.turn(h.merge(merge)))
    encodes = [e for e in effects if isinstance(e, Encode)]
    assert sorted(e.codec.wire_id for e in encodes) == sorted(references) and not any(e.full for e in encodes)
    bcasts = {b.to.learner_id: b for b in effects if isinstance(b, Send) and isinstance(b.msg, Bcast)}
    for lid, wire_id in ((0, BF16.wire_id), (1, int4.wire_id)):
        expect = references[wire_id].commit(0, 1, state.params[0])
        msg = bcasts[lid].msg
        assert isinstance(msg, Bcast) and msg.flags & BCAST_DELTA and msg.codec == wire_id
        assert msg.digest == expect.digest and bytes(bcasts[lid].payload or b"") == bytes(expect.payload)
    downlinks = h.protocol.shared.downlinks
    assert downlinks is not None and sorted(downlinks.by_id) == sorted(references)


def test_a_checkpoint_keeps_the_downlink_chains_and_a_resumed_syncer_holds_the_bits_it_would_have() -> None:
    """The checkpoint is taken between a commit and its broadcast's encode: its anchor stands for
    the version before. The resumed protocol brings it forward by that same encode, and its chain
    then holds, bit for bit, the anchor the syncer that went on holds."""
    int4 = codec_by_name("int4")
    h = Hand()
    h.join(0, downlink=int4.wire_id)
    h.join(1, downlink=int4.wire_id)
    pull = pulls(h.through(h.init(0.5)))[0]
    h.through(h.push(0, pull, 1.0))
    merge = h.through(h.push(1, pull, 3.0))[-1]
    assert isinstance(merge, Merge)
    effects = h.turn(h.merge(merge))
    assert kinds(effects)[1] == "Checkpoint" and isinstance(effects[-1], Encode)  # the checkpoint, then the encode
    saved = copy.deepcopy(h.protocol.checkpoint_state())  # what the checkpoint file holds
    assert saved is not None and list(saved.downlink) == [int4.wire_id]
    assert saved.versions == [1, 0] and saved.downlink_versions[int4.wire_id] == [0, 0]  # fragment 0: one behind
    h.through(h.answer(effects))
    live = h.protocol.shared.downlinks
    assert live is not None and live.by_id[int4.wire_id].versions == [1, 0]
    resumed = SyncerProtocol(h.settings, device=CPU, state=saved, now=h.now)
    chains = resumed.shared.downlinks
    assert chains is not None and chains.by_id[int4.wire_id].versions == [1, 0]
    for f in (0, 1):
        mine, theirs = chains.by_id[int4.wire_id], live.by_id[int4.wire_id]
        assert torch.equal(resumed.anchor(f, int4.wire_id), h.protocol.anchor(f, int4.wire_id)), f
        assert mine.digests[f] == theirs.digests[f], f


# -- the shell ----------------------------------------------------------------------------------------------
def test_the_shell_answers_each_ask_before_any_other_event_and_reports_sync_after_the_commits_last_send() -> None:
    clock = FakeClock()
    settings = SyncerSettings(learners=2, fragments=2, grace_s=0.0, device="cpu", pipeline=1)
    co = Coordinator(settings, device=CPU, tape=RecordingTape(), clock=clock)  # type: ignore[arg-type]
    layout = build_layout(SPECS, 2, "binpack")
    groups = {0: MemoryGroup(), 1: MemoryGroup()}
    from syncer.core.events import Connected

    for lid in (0, 1):
        manifest = Manifest(2, layout.pattern, SPECS) if lid == 0 else None
        co.handle(Connected(groups[lid], Joined(lid, 1, layout.fingerprint, F32.wire_id, manifest, 0,
                                                instance=bytes([lid + 1]) * 16,
                                                downlink_dtype=BF16.wire_id if lid == 0 else F32.wire_id)))
    for f in layout.fragments:
        co.handle(Got(0, 1, Init(f.index, 0, 0, F32.wire_id), memoryview(bytearray(tensor_bytes(torch.zeros(4))))))
    assert co.protocol.phase is Phase.RUNNING
    assert [m.flags & BCAST_FULL for m in groups[0].of(Bcast)] == [1, 1]
    assert [payload for m, payload in groups[0].sent if isinstance(m, Bcast)] == [bytes(16), bytes(16)]
    synced: list[Any] = []
    original = co.protocol.handle

    def spy(now: float, event: Any) -> list[Effect]:
        if event is not None and type(event).__name__ in ("Synced", "Encoded"):
            synced.append((type(event).__name__, len(groups[1].of(Bcast))))
        return original(now, event)

    co.protocol.handle = spy  # type: ignore[method-assign]
    pull = groups[0].of(Pull)[0]
    for lid, value in ((0, 1.0), (1, 3.0)):
        msg = Push(pull.round, pull.attempt, pull.fragment, pull.version, 100, 4, 0, 0, 16, F32.wire_id)
        co.handle(Got(lid, 1, msg, memoryview(bytearray(tensor_bytes(torch.full((4,), value)))), True))
    # the commit's broadcasts went out after the encode was answered, and only then came Synced
    assert synced == [("Encoded", 2), ("Synced", 3)]
    delta = groups[0].of(Bcast)[-1]
    assert delta.flags & BCAST_DELTA and delta.version == 1
