"""The syncer's protocol with no shell at all: events in, effects out, in order.

Each test drives `SyncerProtocol.handle(now, event)` by hand and reads the effects it returns:
what it sends and to whom, what it records, when it asks for a checkpoint, a merge or a decode,
and where its fault points fall. Merges are performed by the real `RoundMerger`, as the shell
would, and handed back as `Merged`; the protocol's asks (an INIT checked, an f32 or carried push
decoded, a broadcast encoded) are answered by the shell's own `answer`, as the shell would, and
left out of the effects a turn returns (`Driver.asked` keeps them)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from syncer.core import records
from syncer.core.effects import (
    Checkpoint,
    Close,
    Decode,
    Effect,
    ExpectInit,
    FaultPoint,
    Log,
    Merge,
    Peer,
    Record,
    Send,
    StallTimeout,
    is_ask,
)
from syncer.core.events import Decoded, Got, Joined, Left, Merged, Stop, Synced
from syncer.core.links import Phase
from syncer.core.payload import decode_delta
from syncer.core.protocol import SyncerProtocol
from syncer.core.rounds import RoundState, last_of_fragment
from syncer.durability.checkpoint import SyncerState
from syncer.merge.round_merge import PreparedMerge, RoundMerger
from syncer.service.coordinator import answer
from yeto_core.codecs import F32, codec_by_name, tensor_bytes
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.settings import SyncerSettings
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import BCAST_FULL, BCAST_LAST, Bcast, Bye, Done, Error, Final, Init, Manifest, Pull, Push

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SPECS = (TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32"))
LAYOUT = build_layout(SPECS, 2, "binpack")


class Driver:
    """The test as the shell: one protocol, a clock it moves by hand, and every effect returned."""

    def __init__(self, state: SyncerState | None = None, **settings: Any) -> None:
        config: dict[str, Any] = {"learners": 2, "fragments": 2, "grace_s": 0.0, "device": "cpu", "pipeline": 1}
        self.settings = SyncerSettings(**{**config, **settings})
        self.now = 50.0
        self.protocol = SyncerProtocol(self.settings, device=torch.device("cpu"), state=state, now=self.now)
        self.merger = RoundMerger(self.settings.merging)
        self.generations: dict[int, int] = {}
        self.asked: list[Effect] = []  # every ask answered, in order

    def turn(self, event: Any = None) -> list[Effect]:
        """One turn, then the turns that take in the answers to its asks, as the shell runs them:
        the effects performed, in order, without the asks."""
        out: list[Effect] = []
        effects = self.protocol.handle(self.now, event)
        while True:
            out += [e for e in effects if not is_ask(e)]
            if not effects or not is_ask(effects[-1]):
                return out
            ask = effects[-1]
            self.asked.append(ask)
            layout = self.protocol.layout
            assert layout is not None
            effects = self.protocol.handle(self.now, answer(ask, layout, torch.device("cpu")))  # type: ignore[arg-type]

    def join(self, lid: int, *, fingerprint: bytes = LAYOUT.fingerprint, wire_dtype: int = F32.wire_id,
             conflict: str | None = None) -> list[Effect]:
        self.generations[lid] = self.generations.get(lid, 0) + 1
        manifest = Manifest(LAYOUT.num_fragments, LAYOUT.pattern, SPECS) if lid == 0 else None
        return self.turn(Joined(lid, self.generations[lid], fingerprint, wire_dtype, manifest, conflict=conflict))

    def got(self, lid: int, msg: Any, payload: bytes | memoryview | None = None) -> list[Effect]:
        view = None if payload is None else memoryview(bytearray(payload))
        return self.turn(Got(lid, self.generations[lid], msg, view))

    def init(self) -> list[Effect]:
        effects: list[Effect] = []
        for f in LAYOUT.fragments:
            effects += self.got(0, Init(f.index, 0, 0, F32.wire_id), tensor_bytes(torch.zeros(f.numel)))
        return effects

    def push(self, lid: int, pull: Pull, value: float) -> list[Effect]:
        numel = LAYOUT.fragments[pull.fragment].numel
        msg = Push(pull.round, pull.attempt, pull.fragment, pull.version, 100, 4, 0, 0, numel * 4, F32.wire_id)
        return self.got(lid, msg, tensor_bytes(torch.full((numel,), value)))

    def merge(self, effect: Merge, prepared: PreparedMerge | None = None) -> Merged:
        """What the shell does with a `Merge`: the real merge, on the tensors the protocol lent."""
        outcome, back = self.merger.merge(effect.lent, list(effect.answers), list(effect.segments), prepared,
                                          finished=effect.finished_weight)
        return Merged(effect.round, outcome, back)


def kinds(effects: list[Effect]) -> list[str]:
    return [type(e).__name__ for e in effects]


def sends(effects: list[Effect], kind: type) -> list[Send]:
    return [e for e in effects if isinstance(e, Send) and isinstance(e.msg, kind)]


def started(**settings: Any) -> tuple[Driver, Pull]:
    """Two learners joined, the initial cut made, round 0 launched (in the cut's own turn)."""
    d = Driver(**settings)
    d.join(0)
    d.join(1)
    pull = sends(d.init(), Pull)[0].msg
    assert isinstance(pull, Pull)
    return d, pull


def first_round_merged(**settings: Any) -> tuple[Driver, list[Effect]]:
    """Round 0 answered by both learners and merged: the driver and the effects of that turn."""
    d, pull = started(**settings)
    d.push(0, pull, 1.0)
    merge = d.push(1, pull, 1.0)[-1]
    assert isinstance(merge, Merge)
    return d, d.turn(d.merge(merge))


def test_the_initial_cut_is_checkpointed_recorded_then_sent_to_every_learner_with_its_stall_timeout() -> None:
    d = Driver()
    d.join(0)
    d.join(1)
    first = d.got(0, Init(0, 0, 0, F32.wire_id), tensor_bytes(torch.zeros(LAYOUT.fragments[0].numel)))
    assert first == [FaultPoint("mid-init")]  # one fragment of two: no cut yet
    cut = d.got(0, Init(1, 0, 0, F32.wire_id), tensor_bytes(torch.zeros(LAYOUT.fragments[1].numel)))
    assert kinds(cut[:2]) == ["Checkpoint", "Record"] and isinstance(cut[1].record, records.Init)  # type: ignore[union-attr]
    for lid in (0, 1):
        peer = Peer(lid, 1)
        mine = [e for e in cut if getattr(e, "to", None) == peer]
        assert mine[0] == StallTimeout(peer, d.settings.streams.stall_timeout_s)
        full = [(e.committed, e.msg.flags & BCAST_FULL) for e in mine if isinstance(e, Send)
                and isinstance(e.msg, Bcast)]
        assert full == [(0, BCAST_FULL), (1, BCAST_FULL)]
    pulls = sends(cut, Pull)  # the same turn launches round 0 to both
    assert [p.to for p in pulls] == [Peer(0, 1), Peer(1, 1)] and pulls[0].msg == Pull(0, 1, 0, 0)


def test_a_commit_is_a_merge_asked_for_then_its_effects_in_the_contracts_order() -> None:
    d = Driver(checkpoint="unused.safetensors", checkpoint_every=1)
    d.join(0)
    d.join(1)
    pull = sends(d.init(), Pull)[0].msg
    assert isinstance(pull, Pull)
    assert d.push(0, pull, 1.0) == [FaultPoint("before-push")]
    closing = d.push(1, pull, 3.0)
    assert isinstance(closing[-1], Merge) and closing[-1].round == 0  # the last thing this turn does
    merge = closing[-1]
    assert sorted(a.learner_id for a in merge.answers) == [0, 1]
    assert d.protocol.rounds.state_of(0, 0) is RoundState.CLOSED
    # Until the merge is back nothing is decided: far past every deadline, nothing happens.
    d.now += 1000.0
    assert d.turn() == []
    committed = d.turn(d.merge(merge))
    assert kinds(committed[:3]) == ["FaultPoint", "Checkpoint", "Record"]
    assert committed[0] == FaultPoint("mid-merge")
    record = committed[2]
    assert isinstance(record, Record) and record.checkpoint_ms and isinstance(record.record, records.Commit)
    bcasts = sends(committed, Bcast)
    assert [b.to for b in bcasts] == [Peer(0, 1), Peer(1, 1)] and all(b.committed == 0 for b in bcasts)
    between = committed.index(bcasts[0]) + 1
    assert committed[between] == FaultPoint("mid-bcast", drain=True)  # after the first learner's, before the other's
    (line,) = [e for e in committed if isinstance(e, Log)]
    assert committed.index(line) > committed.index(bcasts[-1]) and line.message.startswith("round 0 committed")
    state = d.protocol.state
    assert state is not None and state.versions == [1, 0] and state.next_round == 1
    # The merged delta is the mean 2.0; the first outer step has no momentum yet (warm-up), so
    # Nesterov at the shipped lr 0.7 from θ = 0 gives θ + lr·2 = 1.4.
    assert torch.allclose(state.params[0], torch.full((4,), 1.4))


def test_a_merge_lends_the_fragments_tensors_and_the_protocol_takes_back_what_the_shell_returns() -> None:
    d = Driver()
    d.join(0)
    d.join(1)
    pull = sends(d.init(), Pull)[0].msg
    assert isinstance(pull, Pull)
    d.push(0, pull, 1.0)
    merge = d.push(1, pull, 3.0)[-1]
    assert isinstance(merge, Merge)
    state = d.protocol.state
    assert state is not None and merge.lent.params is state.params[0] and merge.lent.momentum is state.momentum[0]
    # A shell whose sender still reads the params writes a fresh copy: the protocol keeps that one.
    copied = dataclasses.replace(merge.lent, params=merge.lent.params.clone())
    outcome, back = d.merger.merge(copied, list(merge.answers), list(merge.segments))
    d.turn(Merged(merge.round, outcome, back))
    assert state.params[0] is back.params and torch.allclose(state.params[0], torch.full((4,), 1.4))


def test_a_learner_that_finished_stays_in_the_fleets_average_as_a_zero_delta_at_its_last_weight() -> None:
    d, pull = started()
    d.push(0, pull, 1.0)
    merge = d.push(1, pull, 1.0)[-1]
    assert isinstance(merge, Merge) and merge.finished_weight == 0.0  # nobody finished
    committed = d.turn(d.merge(merge))
    assert d.protocol.shared.merged_weights == {0: 100.0 * 100 / 4, 1: 100.0 * 100 / 4}
    nxt = sends(committed, Pull)[0].msg
    assert isinstance(nxt, Pull) and nxt.round == 1
    # learner 1 finished training: round 1 goes again, learner 0's alone
    again = [p.msg for p in sends(d.got(1, Done(step=4)), Pull) if p.to.learner_id == 0]
    assert isinstance(again[-1], Pull) and again[-1].round == 1
    alone = d.push(0, again[-1], 2.0)[-1]
    assert isinstance(alone, Merge) and [a.learner_id for a in alone.answers] == [0]
    assert alone.finished_weight == 100.0 * 100 / 4
    merged = d.merge(alone)
    assert merged.outcome.weights == [0.5]  # half of the fleet's weight: learner 1 adds no change
    record = next(e.record for e in d.turn(merged) if isinstance(e, Record))
    assert isinstance(record, records.Commit) and record.weights == [0.5]


def test_the_broadcast_of_a_fragments_last_round_says_no_pull_will_follow_and_a_rejoin_hears_it_too() -> None:
    """Rounds 0..2 of 3 over 2 fragments: round 0 is not fragment 0's last (round 2 is), round 1 is
    fragment 1's. A sweeping learner waits for the pull of each fragment it trained unless told."""
    d, committed = first_round_merged(total_rounds=3)
    assert {b.msg.flags & BCAST_LAST for b in sends(committed, Bcast)} == {0}  # type: ignore[attr-defined]
    (pull,) = {s.msg for s in sends(committed, Pull)}
    assert isinstance(pull, Pull) and pull.round == 1
    d.push(0, pull, 1.0)
    merge = d.push(1, pull, 1.0)[-1]
    assert isinstance(merge, Merge)
    last = sends(d.turn(d.merge(merge)), Bcast)
    assert [(b.to.learner_id, b.msg.fragment, b.msg.flags & BCAST_LAST) for b in last] == [  # type: ignore[attr-defined]
        (0, 1, BCAST_LAST), (1, 1, BCAST_LAST)]
    rejoin = sends(d.join(1), Bcast)  # the full state on a reconnect: fragment 0 still has a round
    assert [(b.msg.fragment, b.msg.flags & BCAST_LAST) for b in rejoin] == [(0, 0), (1, BCAST_LAST)]  # type: ignore[attr-defined]


def test_rounds_end_per_fragment_with_the_runs_total() -> None:
    assert [r for r in range(7) if last_of_fragment(r, 3, 7)] == [4, 5, 6]
    assert [r for r in range(2) if last_of_fragment(r, 3, 2)] == [0, 1]
    assert not any(last_of_fragment(r, 3, 0) for r in range(100))  # no total: rounds never end


def test_the_sync_time_is_sampled_once_the_shell_has_performed_the_commit() -> None:
    d, _ = first_round_merged()
    assert d.protocol.commits.sync_s is None
    d.turn(Synced(0, 0.25))
    assert d.protocol.commits.sync_s == 0.25
    d.turn(Synced(0, 1.0))  # a second report of the same round is no sample
    assert d.protocol.commits.sync_s == 0.25


def test_a_quantized_push_is_decoded_off_the_protocol_and_answers_when_it_comes_back() -> None:
    d = Driver()
    d.join(0)
    d.join(1, wire_dtype=codec_by_name("int8").wire_id)
    pull = sends(d.init(), Pull)[0].msg
    assert isinstance(pull, Pull)
    codec = d.protocol.links[1].codec
    assert codec.name == "int8"
    payload = bytearray(codec.encoded_nbytes(4))
    codec.encode(torch.full((4,), 0.5), memoryview(payload))
    msg = Push(pull.round, pull.attempt, pull.fragment, pull.version, 10, 1, 0, 0, len(payload), codec.wire_id)
    effects = d.got(1, msg, bytes(payload))
    decode = effects[-1]
    assert isinstance(decode, Decode) and decode.learner_id == 1 and decode.codec is codec
    attempt = d.protocol.rounds.attempt_of(pull.round)
    assert attempt is not None and 1 not in attempt.answers  # not an answer until it is decoded
    layout = d.protocol.layout
    assert layout is not None
    delta = decode_delta(layout, decode.msg, decode.payload, decode.codec)
    d.turn(Decoded(1, decode.generation, decode.attempt, decode.msg, delta))
    assert 1 in attempt.answers and torch.allclose(attempt.answers[1].delta, torch.full((4,), 0.5), atol=0.01)


def test_pinning_the_model_readies_memory_for_learner_0s_init_once_and_a_resumed_run_asks_none() -> None:
    d = Driver()
    assert not any(isinstance(e, ExpectInit) for e in d.join(1))  # no manifest: nothing pinned yet
    expect = [e for e in d.join(0) if isinstance(e, ExpectInit)]
    assert expect == [ExpectInit(tuple(f.numel * 4 for f in LAYOUT.fragments))]
    assert not any(isinstance(e, ExpectInit) for e in d.join(0))  # a redial: pinned already
    d2, _ = first_round_merged()
    resumed = Driver(state=d2.protocol.state)
    assert not any(isinstance(e, ExpectInit) for e in resumed.turn() + resumed.join(0))


def test_a_layout_mismatch_is_recorded_and_closed_with_the_error_sent_first() -> None:
    d = Driver()
    d.join(0)
    effects = d.join(1, fingerprint=b"\x01" * 32)
    record, close = effects
    assert isinstance(record, Record) and isinstance(record.record, records.Refused)
    assert record.record.code == "LAYOUT" and record.record.learner == 1
    assert isinstance(close, Close) and close.to == Peer(1, 1) and isinstance(close.last, Error)
    assert close.last.code is ErrorCode.LAYOUT and "layout fingerprint mismatch: learner 1" in close.reason
    assert 1 not in d.protocol.links


def test_a_learner_refused_when_the_model_is_pinned_is_forgotten_and_the_finale_does_not_wait_for_it() -> None:
    """A learner of another model that joined before learner 0 pinned the layout is refused at the
    pin; it never trained, so the run ends as soon as learner 0 has the cut, not at the deadline."""
    d = Driver(total_rounds=1, quorum=1, final_timeout_s=60.0)
    d.join(1, fingerprint=b"\x01" * 32)  # no model yet: accepted for now
    refused = d.join(0)
    assert any(isinstance(e, Close) and e.to == Peer(1, 1) for e in refused) and 1 not in d.protocol.links
    assert d.protocol.shared.lives.get(1) is None
    pull = sends(d.init(), Pull)[0].msg
    assert isinstance(pull, Pull)
    merge = d.push(0, pull, 1.0)[-1]
    assert isinstance(merge, Merge)
    d.turn(d.merge(merge))
    assert d.protocol.phase is Phase.FINALIZING
    d.got(0, Bye("final cut installed"))
    d.turn()
    assert d.protocol.phase is Phase.DONE and d.protocol.exit_code == 0


def test_an_id_held_by_another_process_is_refused_and_the_holder_keeps_it() -> None:
    d = Driver()
    d.join(0)
    effects = d.join(0, conflict="learner id 0 is held by another live process")
    assert kinds(effects) == ["Record", "Close"] and effects[1].to == Peer(0, 2)  # type: ignore[union-attr]
    assert d.protocol.links[0].generation == 1


def test_a_reconnect_closes_the_replaced_connection_and_a_late_left_from_it_changes_nothing() -> None:
    d, _ = started()
    effects = d.join(1)
    assert effects[0] == Close(Peer(1, 1), "replaced by generation 2")
    assert sends(effects, Bcast) and all(s.to == Peer(1, 2) for s in sends(effects, Bcast))
    assert d.turn(Left(1, 1, "replaced")) == [] and d.protocol.links[1].generation == 2


def test_finalization_makes_the_cut_durable_before_the_first_final_and_the_fault_point_falls_between() -> None:
    d, committed = first_round_merged(total_rounds=1)  # the budget is spent: that turn finalizes too
    assert Checkpoint() not in committed  # the last commit's cut is the final one, written once
    effects = committed[committed.index(Checkpoint(wait=True)):]
    assert isinstance(effects[1], Record) and isinstance(effects[1].record, records.Final)
    first_final = next(i for i, e in enumerate(effects) if isinstance(e, Send) and isinstance(e.msg, Final))
    assert isinstance(effects[2], Log) and "sending the final cut to 2 learners" in effects[2].message
    assert first_final == 3 and not sends(committed[:len(committed) - len(effects)], Final)
    finals = sends(effects, Final)
    assert [f.to.learner_id for f in finals] == [0, 0, 1, 1] and [f.committed for f in finals] == [0, 1, 0, 1]
    assert effects.index(FaultPoint("mid-final", drain=True)) == effects.index(finals[2]) - 1
    assert d.protocol.phase is Phase.FINALIZING


def test_a_run_resumed_from_its_final_cut_waits_for_the_learners_that_trained_and_hands_them_the_cut() -> None:
    """A syncer killed after its final checkpoint but before every learner had the cut comes back
    finalizing: it waits (until --final-timeout-s) for the learners in its ledger, not connected
    yet, instead of ending at once."""
    d, _ = first_round_merged(total_rounds=1)
    final = d.protocol.state
    assert final is not None and final.finalized
    resumed = Driver(state=final, total_rounds=1, final_timeout_s=60.0)
    assert not sends(resumed.turn(), Final) and resumed.protocol.phase is Phase.FINALIZING
    resumed.now += 59.0
    resumed.turn()
    assert resumed.protocol.phase is Phase.FINALIZING  # nobody is back yet: it still waits
    cut = resumed.join(0)
    assert [(s.to, s.committed) for s in sends(cut, Final)] == [(Peer(0, 1), 0), (Peer(0, 1), 1)]
    resumed.got(0, Bye("final cut installed"))
    assert resumed.protocol.phase is Phase.FINALIZING  # learner 1 trained too, and may still come
    resumed.now += 2.0
    resumed.turn()
    assert resumed.protocol.phase is Phase.DONE and resumed.protocol.exit_code == 0


def test_stop_ends_the_run_with_its_exit_code() -> None:
    d, _ = started()
    assert d.turn(Stop(4, "no durable checkpoint")) == []
    assert d.protocol.phase is Phase.DONE and d.protocol.exit_code == 4


def test_without_init_the_run_gives_up_at_its_deadline() -> None:
    d = Driver(init_timeout_s=30.0)
    d.join(0)
    d.now += 29.0
    d.turn()
    assert d.protocol.phase is Phase.WAIT_INIT
    d.now += 2.0
    d.turn()
    assert d.protocol.phase is Phase.DONE and d.protocol.exit_code == 3


def test_with_iso_workers_merges_are_prepared_ahead_and_still_committed_in_round_order() -> None:
    """Rounds 0 and 1 (fragments 0 and 1) both close; each closing asks for its heavy half at once
    (`Prepare`), so their SVDs overlap in the pool. Round 1's comes back first and waits; round 0's
    merge, then round 1's, each use the half prepared for it, and commit in round order, to the
    same state as the serial merges."""
    from syncer.core.effects import Prepare
    from syncer.core.events import Prepared

    d = Driver(merge="iso", iso_worker_devices="cpu", pipeline=2)
    serial = Driver(merge="iso", pipeline=2)
    for drv in (d, serial):
        drv.join(0)
        drv.join(1)
        drv.init()
        drv.turn()  # round 1 launched beside round 0
    p0, p1 = Pull(0, 1, 0, 0), Pull(1, 2, 1, 0)
    for drv in (d, serial):
        drv.push(0, p0, 1.0)
        drv.push(0, p1, 2.0)
    closing0 = d.push(1, p0, 3.0)
    (ask0,) = [e for e in closing0 if isinstance(e, Prepare)]
    assert (ask0.round, ask0.attempt, ask0.fragment) == (0, 1, 0) and not any(isinstance(e, Merge) for e in closing0)
    closing1 = d.push(1, p1, 4.0)
    (ask1,) = [e for e in closing1 if isinstance(e, Prepare)]
    assert (ask1.round, ask1.fragment) == (1, 1) and not any(isinstance(e, Merge) for e in closing1)
    state = d.protocol.state
    assert state is not None
    halves = {a.attempt: d.merger.prepare(state.momentum[a.fragment], list(a.answers), list(a.segments))
              for a in (ask0, ask1)}
    assert not any(isinstance(e, Merge) for e in d.turn(Prepared(1, ask1.attempt)))  # round 0 comes first
    merge0 = d.turn(Prepared(0, ask0.attempt))[-1]
    assert isinstance(merge0, Merge) and merge0.round == 0 and merge0.prepared == ask0.attempt
    after0 = d.turn(d.merge(merge0, halves[ask0.attempt]))
    merge1 = after0[-1]
    assert isinstance(merge1, Merge) and merge1.round == 1 and merge1.prepared == ask1.attempt
    d.turn(d.merge(merge1, halves[ask1.attempt]))
    m0 = serial.push(1, p0, 3.0)[-1]
    assert isinstance(m0, Merge) and m0.prepared is None
    serial.turn(serial.merge(m0))
    m1 = serial.push(1, p1, 4.0)[-1]
    assert isinstance(m1, Merge) and m1.prepared is None
    serial.turn(serial.merge(m1))
    ref = serial.protocol.state
    assert ref is not None and state.versions == ref.versions == [1, 1] and state.next_round == 2
    for f in (0, 1):
        assert torch.equal(state.params[f], ref.params[f]) and torch.equal(state.momentum[f], ref.momentum[f])
