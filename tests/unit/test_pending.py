"""The syncer's pending connection groups (DESIGN §7.1, §7.2), in memory on a hand-set clock.

Streams are plain strings here: the table only keeps them. The last tests run the handshake
machines of one learner's control and data streams against the syncer's, wired to the table the
way the server wires them, with no socket."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from syncer.core.events import Got, Joined, Left
from syncer.service.admission import Admission
from syncer.service.pending import LATE, NO_GROUP, PendingGroup, PendingGroups
from yeto_core.codecs import F32
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.sections import Endpoint, LinkSettings, Schedule
from yeto_core.wire.connection import (
    Admitted,
    Attached,
    Event,
    Handshake,
    HandshakeState,
    LearnerHandshake,
    Refusal,
    SyncerHandshake,
    hello_for,
)
from yeto_core.wire.errors import ErrorCode, Refused
from yeto_core.wire.messages import Heartbeat, Hello, Manifest

pytestmark = pytest.mark.unit

KEY = b"the shared key"
INSTANCE = b"i" * 16
SPECS = (TensorSpec("embed.weight", (32, 8), "float32", embedding=True),
         *(TensorSpec(f"layers.{i}.w", (8, 8), "float32") for i in range(6)))
LAYOUT = build_layout(SPECS, 4)
TIMEOUT = 10.0


def hello(learner_id: int = 3, data_streams: int = 2) -> Hello:
    me, link = Endpoint(("syncer", 7070), KEY, learner_id), LinkSettings(data_streams=data_streams)
    return hello_for(me, link, LAYOUT, F32, sends_init=learner_id == 0, instance=INSTANCE, challenge_nonce=bytes(32),
                     client_nonce=bytes(range(32)))


def table(generations: dict[int, int] | None = None) -> PendingGroups[str]:
    tokens = (bytes([n]) * 16 for n in itertools.count(1))
    return PendingGroups(TIMEOUT, generations, new_token=lambda: next(tokens))


def refused(reason: str) -> Any:
    return pytest.raises(Refused, match=f"^protocol: {reason}$")


def test_each_welcome_numbers_the_learners_connections_on_from_a_resumed_ledger() -> None:
    pending = table({3: 7})
    first, second = pending.open(hello(3), "c1", 0.0), pending.open(hello(3), "c2", 1.0)
    other = pending.open(hello(5), "c3", 2.0)
    assert (first.generation, second.generation, other.generation) == (8, 9, 1)
    assert (pending.generation(3), pending.generation(5), pending.generation(4)) == (9, 1, 0)
    assert first.token == bytes([1]) * 16 and len({first.token, second.token, other.token}) == 3
    assert first.data == [None, None] and first.created == 0.0 and not first.ready.is_set()
    assert pending.pending_learner(other.token) == 5 and pending.pending_learner(bytes(16)) is None
    assert len(pending) == 3


def test_data_streams_attach_in_any_order_and_the_last_hands_the_group_over() -> None:
    pending = table()
    group = pending.open(hello(3, data_streams=3), "control", 0.0)
    assert pending.attach(group.token, 2, "d2") is None
    assert pending.attach(group.token, 0, "d0") is None
    assert not group.complete and group.streams() == ["control", "d0", "d2"]
    assert pending.attach(group.token, 1, "d1") is group
    assert group.complete and group.streams() == ["control", "d0", "d1", "d2"]
    assert len(pending) == 0 and pending.pending_learner(group.token) is None
    with refused(NO_GROUP):  # a fourth stream for the same token finds nothing
        pending.attach(group.token, 0, "again")


def test_an_attach_is_refused_for_an_unknown_token_and_for_an_index_out_of_range_or_taken() -> None:
    pending = table()
    group = pending.open(hello(3, data_streams=2), "control", 0.0)
    with refused(NO_GROUP):
        pending.attach(bytes(16), 0, "stranger")
    assert pending.attach(group.token, 0, "d0") is None
    with refused("data stream index 0 is invalid or taken"):
        pending.attach(group.token, 0, "duplicate")
    with refused("data stream index 2 is invalid or taken"):
        pending.attach(group.token, 2, "beyond")
    assert group.data == ["d0", None] and len(pending) == 1  # the refusals changed nothing
    assert pending.attach(group.token, 1, "d1") is group


def test_groups_expire_once_their_streams_are_later_than_the_timeout_and_then_take_no_attach() -> None:
    pending = table()
    early, late = pending.open(hello(3), "c3", 100.0), pending.open(hello(4), "c4", 105.0)
    pending.attach(early.token, 1, "d1")
    assert pending.expired(100.0 + TIMEOUT) == []  # at the deadline is still in time
    assert pending.expired(100.0 + TIMEOUT + 0.001) == [early]
    assert early.streams() == ["c3", "d1"]  # what the server closes, after an ERROR saying LATE
    assert LATE == "data streams did not attach in time"
    with refused(NO_GROUP):
        pending.attach(early.token, 0, "d0")
    assert pending.pending_learner(late.token) == 4
    assert pending.expired(200.0) == [late] and len(pending) == 0


def test_a_control_stream_that_fails_before_admission_abandons_its_group() -> None:
    pending = table()
    failed, admitted = pending.open(hello(3), "c3", 0.0), pending.open(hello(4), "c4", 0.0)
    admitted.admitted(None, 0)
    pending.abandon(failed)
    pending.abandon(admitted)  # admitted: its data streams may still come
    assert pending.pending_learner(failed.token) is None and pending.pending_learner(admitted.token) == 4
    with refused(NO_GROUP):
        pending.attach(failed.token, 0, "d0")
    whole = pending.open(hello(5, data_streams=1), "c5", 0.0)
    assert pending.attach(whole.token, 0, "d0") is whole
    pending.abandon(whole)  # its control stream failed after the last ATTACH took the group: nothing to drop
    assert pending.drain() == [admitted] and len(pending) == 0 and pending.drain() == []


def test_admission_records_the_manifest_and_releases_the_group() -> None:
    group = table().open(hello(0), "control", 0.0)
    manifest = Manifest(4, "binpack", SPECS)
    group.admitted(manifest, 4096)
    assert group.ready.is_set() and (group.manifest, group.bound) == (manifest, 4096)


def test_a_finished_group_reports_got_and_left_for_its_learner_and_generation() -> None:
    pending = table({3: 1})
    group = pending.open(hello(3), "control", 0.0)
    posted: list[Any] = []
    wiring = group.wiring(posted.append, screened=False, max_payload=lambda: 123)
    assert wiring["name"] == "syncer<-learner3.2" and wiring["on_screened"] is None
    assert wiring["max_payload"]() == 123  # no manifest: the coordinator's bound
    beat, payload = Heartbeat(1, 0), memoryview(b"x")
    wiring["on_message"](beat, payload)
    wiring["on_close"]("peer closed")
    assert posted == [Got(3, 2, beat, payload), Left(3, 2, "peer closed")]
    group.admitted(None, 4096)
    screened = group.wiring(posted.append, screened=True, max_payload=lambda: 123)
    assert screened["max_payload"]() == 4096  # the manifest's bound
    assert screened["on_screened"] is not None
    screened["on_screened"](beat, payload, False)
    assert posted[-1] == Got(3, 2, beat, payload, False)


def test_joined_carries_what_the_hello_said() -> None:
    h = hello(0)
    group: PendingGroup[str] = table().open(h, "control", 0.0)
    manifest = Manifest(4, "binpack", SPECS)
    group.admitted(manifest, 64)
    assert group.joined("10.0.0.1:5000") == Joined(0, 1, h.fingerprint, h.wire_dtype, manifest, h.flags,
                                                     h.push_block, h.instance, "10.0.0.1:5000",
                                                     downlink_dtype=h.downlink_dtype)


# -- the handshake machines against the table -----------------------------------------------------

def pipe(a: Handshake, b: Handshake) -> list[Event]:
    """Carry bytes both ways until neither side has any to send; the second side's events."""
    got: list[Event] = []
    moved = True
    while moved:
        moved = False
        for src, dst in ((a, b), (b, a)):
            out = src.data_to_send()
            if out:
                moved = True
                events = dst.receive_data(out)
                got += events if dst is b else []
    return got


class Shell:
    """What the server wires a `SyncerHandshake` to, with the clock and streams in hand."""

    def __init__(self) -> None:
        self.now = 50.0
        self.pending: PendingGroups[str] = table()
        self.admission = Admission(KEY, pinned_fingerprint=lambda: None, schedule_problem=lambda flags: None,
                                   id_conflict=lambda lid, instance: None)
        self.opened: list[PendingGroup[str]] = []

    def accept(self, name: str) -> SyncerHandshake:
        def welcome(h: Hello) -> tuple[int, bytes, bool]:
            self.opened.append(self.pending.open(h, name, self.now))
            return self.opened[-1].generation, self.opened[-1].token, False

        return SyncerHandshake(KEY, Schedule(4, "binpack", 0), welcome=welcome, pending=self.pending.pending_learner,
                               check=lambda h, nonce: self.admission.check(h, nonce, name), deadline=1e9)


def learner(learner_id: int, key: bytes = KEY) -> LearnerHandshake:
    me, link = Endpoint(("syncer", 7070), key, learner_id), LinkSettings(data_streams=2)
    return LearnerHandshake(me, link, F32, sends_init=learner_id == 0, instance=INSTANCE, deadline=1e9,
                            layout_for=lambda s: build_layout(SPECS, s.num_fragments, s.pattern))


def test_a_learners_streams_assemble_a_group_even_when_data_attaches_before_the_manifest() -> None:
    shell, ours = Shell(), learner(0)
    control = shell.accept("control")
    # CHALLENGE → HELLO → WELCOME only: the learner's MANIFEST is not delivered yet.
    ours.receive_data(control.data_to_send())
    assert control.receive_data(ours.data_to_send()) == []
    assert control.state is HandshakeState.AWAIT_MANIFEST
    ours.receive_data(control.data_to_send())
    [group] = shell.opened
    for index in (1, 0):
        theirs = shell.accept(f"data{index}")
        [attached] = pipe(ours.attach(index), theirs)
        assert attached == Attached(group.token, index)
        done = shell.pending.attach(attached.token, attached.index, f"data{index}")
        assert done is (group if index == 0 else None)
    assert not group.ready.is_set()  # the last ATTACH waits for the control stream's admission
    [admitted] = control.receive_data(ours.data_to_send())
    assert isinstance(admitted, Admitted) and admitted.token == group.token
    group.admitted(admitted.manifest, admitted.payload_bound)
    assert group.ready.is_set() and group.manifest == Manifest(4, "binpack", SPECS)
    assert group.streams() == ["control", "data0", "data1"] and len(shell.pending) == 0


def test_a_refused_hello_opens_no_group_and_an_expired_group_refuses_its_stragglers() -> None:
    shell = Shell()
    [refusal] = pipe(learner(3, key=b"another key"), shell.accept("stranger"))
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.AUTH
    assert "learner 3 (stranger)" in refusal.reason and shell.opened == [] and len(shell.pending) == 0
    ours = learner(3)
    [admitted] = pipe(ours, shell.accept("control"))
    assert isinstance(admitted, Admitted) and admitted.generation == 1
    shell.now += TIMEOUT + 1
    assert shell.pending.expired(shell.now) == shell.opened
    assert pipe(ours.attach(0), shell.accept("late")) == [Refusal(ErrorCode.PROTOCOL, NO_GROUP)]
