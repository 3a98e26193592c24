"""The handshake state machines (PROTOCOL §4, DESIGN §7.2), driven in memory: no socket, no clock.

A learner's machine and the syncer's are wired back to back by `pipe`, which carries whatever each
says to send to the other, whole or one byte at a time; the syncer side admits with the real
`check_hello`, as the server does."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from learner_harness import FakeClock, MemoryLink

from syncer.core.handshake import HandshakeRefused, check_hello
from yeto_core.codecs import F32
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.learner import LearnerSession
from yeto_core.moments import max_bulk_bytes
from yeto_core.sections import DEFAULT_SYNC_INTERVAL, Endpoint, LinkSettings, Schedule
from yeto_core.settings import LearnerSettings
from yeto_core.wire import auth
from yeto_core.wire.connection import (
    ATTACH_TABLE,
    FIRST_FRAME_BOUND,
    LEARNER_TABLE,
    SYNCER_TABLE,
    Admitted,
    Attached,
    Challenged,
    Event,
    Handshake,
    HandshakeState,
    LearnerHandshake,
    OutOfTurn,
    ProbeRequested,
    Refusal,
    SyncerHandshake,
    Welcomed,
    hello_for,
)
from yeto_core.wire.errors import ErrorCode, ProtocolError, Refused
from yeto_core.wire.messages import (
    CHUNK_BYTES,
    HEADER,
    HELLO_CONSENSUS,
    HELLO_OVERLAP,
    HELLO_SENDS_MANIFEST,
    MAGIC,
    PROTOCOL_VERSION,
    Attach,
    BwProbe,
    Challenge,
    Error,
    Heartbeat,
    Hello,
    Manifest,
    MsgType,
    Welcome,
    encode_frame,
)

pytestmark = pytest.mark.unit

KEY = b"the shared key"
NONCE = bytes(range(32))
CLIENT_NONCE = bytes(range(100, 132))
INSTANCE = b"i" * 16
DEADLINE = 10.0
SPECS = (TensorSpec("embed.weight", (32, 8), "float32", embedding=True),
         *(TensorSpec(f"layers.{i}.w", (8, 8), "float32") for i in range(6)))
LAYOUT = build_layout(SPECS, 4)
ME, LINK = Endpoint(("syncer", 7070), KEY, 3), LinkSettings(data_streams=2)
H = 24  # the syncer's sync interval


class FakeSyncer:
    """What the server keeps for its handshakes: generations and pending groups, nothing else."""

    def __init__(self, key: bytes = KEY, pinned: bytes | None = None) -> None:
        self.key, self.pinned = key, pinned
        self.pending: dict[bytes, int] = {}
        self.generations: dict[int, int] = {}

    def check(self, hello: Hello, nonce: bytes) -> None:
        try:
            check_hello(hello, key=self.key, nonce=nonce, who=f"learner {hello.learner_id}", pinned=self.pinned,
                        schedule_problem=lambda flags: None, id_conflict=lambda lid, instance: None)
        except HandshakeRefused as exc:
            raise Refused(exc.code, exc.reason) from exc

    def welcome(self, hello: Hello) -> tuple[int, bytes, bool]:
        generation = self.generations[hello.learner_id] = self.generations.get(hello.learner_id, 0) + 1
        token = bytes([len(self.pending) + 1]) * 16
        self.pending[token] = hello.learner_id
        return generation, token, False

    def accept(self, nonce: bytes = NONCE, check: Callable[[Hello, bytes], None] | None = None, *,
               sync_interval: int = H) -> SyncerHandshake:
        return SyncerHandshake(self.key, Schedule(4, "binpack", sync_interval), check=check or self.check,
                               welcome=self.welcome, pending=self.pending.get, deadline=DEADLINE,
                               nonce=lambda: nonce)


def learner(learner_id: int = 3, *, key: bytes = KEY, sends_init: bool = False) -> LearnerHandshake:
    me = dataclasses.replace(ME, key=key, learner_id=learner_id)
    return LearnerHandshake(me, LINK, F32, sends_init=sends_init, instance=INSTANCE, deadline=DEADLINE,
                            layout_for=lambda s: build_layout(SPECS, s.num_fragments, s.pattern),
                            nonce=lambda: CLIENT_NONCE)


def pipe(a: Handshake, b: Handshake, *, bytewise: bool = False) -> tuple[list[Event], list[Event]]:
    """Carry bytes both ways until neither side has any to send; each side's events."""
    events: tuple[list[Event], list[Event]] = ([], [])
    moved = True
    while moved:
        moved = False
        for src, dst, got in ((a, b, events[1]), (b, a, events[0])):
            out = src.data_to_send()
            moved = moved or bool(out)
            for piece in ([out[i : i + 1] for i in range(len(out))] if bytewise else [out] if out else []):
                assert dst.finished or dst.bytes_wanted() >= 1, "a live machine must want the next byte"
                got += dst.receive_data(piece)
    return events


def test_the_bytes_are_the_protocols() -> None:
    theirs, ours = FakeSyncer().accept(), learner(0, sends_init=True)
    challenge = encode_frame(Challenge(NONCE, 4, "binpack", H))
    assert theirs.data_to_send() == challenge
    ours.receive_data(challenge)
    flags = HELLO_SENDS_MANIFEST | HELLO_CONSENSUS | HELLO_OVERLAP
    hello = Hello(0, 2, LAYOUT.fingerprint, F32.wire_id, CHUNK_BYTES, flags, CLIENT_NONCE, instance=INSTANCE)
    hello = dataclasses.replace(hello, mac=auth.sign(KEY, auth.HELLO_LABEL, NONCE, hello.signed_part()))
    assert ours.data_to_send() == encode_frame(hello)
    theirs.receive_data(encode_frame(hello))
    token, generation = bytes([1]) * 16, (1).to_bytes(4, "little")
    welcome = Welcome(token, 1, False, auth.sign(KEY, auth.WELCOME_LABEL, CLIENT_NONCE, token, generation))
    assert theirs.data_to_send() == encode_frame(welcome)
    ours.receive_data(encode_frame(welcome))
    assert ours.data_to_send() == encode_frame(Manifest(4, "binpack", SPECS))


@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "byte-by-byte"])
def test_a_learner_joins(bytewise: bool) -> None:
    ours, theirs = learner(), FakeSyncer().accept()
    learned, admitted = pipe(ours, theirs, bytewise=bytewise)
    token = bytes([1]) * 16
    assert learned == [Challenged(LAYOUT), Welcomed(1, token, False)]
    hello = hello_for(ME, LINK, LAYOUT, F32, sends_init=False, instance=INSTANCE, challenge_nonce=NONCE,
                      client_nonce=CLIENT_NONCE)
    assert admitted == [Admitted(hello, token, 1, None, 0)]
    assert (ours.state, theirs.state) == (HandshakeState.WELCOMED, HandshakeState.JOINED)
    assert ours.layout == LAYOUT and ours.data_to_send() == b""  # learner 3 sends no MANIFEST
    assert ours.next_deadline() is None and theirs.next_deadline() is None


@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "byte-by-byte"])
def test_learner_0_describes_the_model_after_welcome(bytewise: bool) -> None:
    ours, theirs = learner(0, sends_init=True), FakeSyncer().accept()
    learned, admitted = pipe(ours, theirs, bytewise=bytewise)
    assert isinstance(learned[-1], Welcomed)
    [event] = admitted
    assert isinstance(event, Admitted) and event.manifest == Manifest(4, "binpack", SPECS)
    # a fragment's f32 values and the model's first moment (PUSH_MOMENT): the largest bulk payload
    assert event.payload_bound == max_bulk_bytes(LAYOUT) > max(f.numel for f in LAYOUT.fragments) * 4
    assert theirs.state is HandshakeState.JOINED


def test_a_data_stream_attaches_with_the_token() -> None:
    syncer, ours = FakeSyncer(), learner()
    pipe(ours, syncer.accept())
    other_nonce = bytes(32)
    data, theirs = ours.attach(1), syncer.accept(other_nonce)
    sent, got = pipe(data, theirs, bytewise=True)
    token = bytes([1]) * 16
    assert sent == got == [Attached(token, 1)]
    assert data.state is theirs.state is HandshakeState.ATTACHED


def test_an_attach_for_no_pending_group_or_signed_with_another_key_is_refused() -> None:
    syncer, ours = FakeSyncer(), learner()
    pipe(ours, syncer.accept())
    stranger = LearnerHandshake(Endpoint(("syncer", 7070), b"another key", 3), LINK, F32, sends_init=False,
                                instance=INSTANCE, layout_for=lambda s: LAYOUT, deadline=DEADLINE)
    assert ours.welcome is not None
    stranger.welcome = ours.welcome  # it learned the token by watching the wire
    _, got = pipe(stranger.attach(0), theirs := syncer.accept())
    assert got == [Refusal(ErrorCode.AUTH, "HMAC check failed on a data stream of learner 3")]
    assert theirs.state is HandshakeState.REFUSED
    syncer.pending.clear()
    data = ours.attach(0)
    sent, got = pipe(data, syncer.accept())
    assert got == [Refusal(ErrorCode.PROTOCOL, "ATTACH names no pending connection group")]
    assert sent == [Attached(ours.welcome.token, 0)] and data.state is HandshakeState.ATTACHED  # the learner sent it


def test_a_hello_signed_with_another_key_is_refused_with_auth_both_ways() -> None:
    ours, theirs = learner(key=b"not the key"), FakeSyncer().accept()
    learned, refused = pipe(ours, theirs)
    [verdict] = refused
    assert isinstance(verdict, Refusal) and verdict.code is ErrorCode.AUTH and "HMAC check failed" in verdict.reason
    assert learned == [Challenged(LAYOUT), verdict]  # the syncer's ERROR, as the learner reads it
    assert ours.state is theirs.state is HandshakeState.REFUSED


def test_a_welcome_whose_mac_does_not_verify_is_an_auth_refusal() -> None:
    ours = learner(key=b"not the key")
    theirs = FakeSyncer().accept(check=lambda hello, nonce: None)  # a syncer that admits anyone
    learned, admitted = pipe(ours, theirs)
    assert isinstance(admitted[-1], Admitted)
    assert learned[-1] == Refusal(ErrorCode.AUTH, "the syncer could not prove it holds the same key")
    assert ours.state is HandshakeState.REFUSED and ours.welcome is None


@pytest.mark.parametrize("when", ["instead of CHALLENGE", "instead of WELCOME"])
def test_an_error_from_the_syncer_surfaces_as_a_refusal_with_its_code(when: str) -> None:
    ours = learner()
    if when == "instead of WELCOME":
        ours.receive_data(encode_frame(Challenge(NONCE, 4, "binpack", H)))
        assert ours.state is HandshakeState.AWAIT_WELCOME and ours.data_to_send()
    assert ours.receive_data(encode_frame(Error(ErrorCode.DUPLICATE, "learner 3 is held"))) == [
        Refusal(ErrorCode.DUPLICATE, "learner 3 is held")]
    assert ours.state is HandshakeState.REFUSED and ours.data_to_send() == b""


def test_a_pinned_model_refuses_another_fingerprint_with_layout() -> None:
    ours, theirs = learner(), FakeSyncer(pinned=bytes(32)).accept()
    learned, _ = pipe(ours, theirs)
    assert isinstance(learned[-1], Refusal) and learned[-1].code is ErrorCode.LAYOUT


def awaiting_manifest() -> tuple[SyncerHandshake, Hello]:
    """A syncer machine that WELCOMEd learner 0's HELLO and waits for its MANIFEST."""
    theirs = FakeSyncer().accept()
    hello = hello_for(Endpoint(("s", 1), KEY, 0), LINK, LAYOUT, F32, sends_init=True, instance=INSTANCE,
                      challenge_nonce=NONCE, client_nonce=CLIENT_NONCE)
    assert theirs.receive_data(encode_frame(hello)) == []
    assert theirs.state is HandshakeState.AWAIT_MANIFEST
    return theirs, hello


def test_a_manifest_for_another_layout_is_refused() -> None:
    theirs, _ = awaiting_manifest()
    reason = "manifest asks for 2 binpack fragments; the syncer uses 4 binpack"
    assert theirs.receive_data(encode_frame(Manifest(2, "binpack", SPECS))) == [Refusal(ErrorCode.LAYOUT, reason)]
    assert theirs.data_to_send().endswith(encode_frame(Error(ErrorCode.LAYOUT, reason)))  # after the WELCOME


def test_frames_out_of_turn_are_protocol_errors_naming_state_and_frame() -> None:
    with pytest.raises(OutOfTurn, match=r"^learner handshake in state AWAIT_CHALLENGE: expected CHALLENGE or "
                                        r"ERROR, got WELCOME$"):
        learner().receive_data(encode_frame(Welcome(bytes(16), 1, False)))
    theirs, hello = awaiting_manifest()
    with pytest.raises(ProtocolError, match=r"^syncer handshake in state AWAIT_MANIFEST: expected MANIFEST, "
                                            r"got HELLO$"):
        theirs.receive_data(encode_frame(hello))  # a second HELLO
    with pytest.raises(OutOfTurn, match="AWAIT_MANIFEST: expected MANIFEST, got ATTACH"):
        awaiting_manifest()[0].receive_data(encode_frame(Attach(bytes(16), 0, bytes(32))))
    with pytest.raises(OutOfTurn, match=r"^syncer handshake in state CHALLENGED: expected HELLO or ATTACH or "
                                        r"BW_PROBE, got HEARTBEAT$"):
        FakeSyncer().accept().receive_data(encode_frame(Heartbeat(1, 0))[: HEADER.size])  # its header is enough


def test_the_first_frame_at_the_syncer_is_bounded_before_its_body() -> None:
    big = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.HELLO), 0, FIRST_FRAME_BOUND + 1)
    with pytest.raises(ProtocolError, match="exceeds"):
        FakeSyncer().accept().receive_data(big)
    with pytest.raises(ProtocolError, match="magic"):
        FakeSyncer().accept().receive_data(b"GET / HTTP/1.1\r\n")


def test_the_machine_wants_no_byte_past_the_frame_and_keeps_what_follows() -> None:
    ours = learner()
    assert ours.bytes_wanted() == HEADER.size
    frame = encode_frame(Challenge(NONCE, 4, "binpack", H))
    ours.receive_data(frame[: HEADER.size])
    assert ours.bytes_wanted() == len(frame) - HEADER.size
    ours.receive_data(frame[HEADER.size :])
    welcome = Welcome(b"t" * 16, 2, True, auth.sign(KEY, auth.WELCOME_LABEL, CLIENT_NONCE, b"t" * 16,
                                                    (2).to_bytes(4, "little")))
    after = encode_frame(Heartbeat(1, 0))
    assert ours.receive_data(encode_frame(welcome) + after) == [Welcomed(2, b"t" * 16, True)]
    assert ours.bytes_wanted() == 0 and ours.trailing_data == after  # the connection group's bytes


def test_the_deadline_passes() -> None:
    ours, theirs = learner(), FakeSyncer().accept()
    for side in (ours, theirs):
        assert side.next_deadline() == DEADLINE
        assert not side.timed_out(DEADLINE - 0.001)
        assert side.timed_out(DEADLINE) and side.timed_out(DEADLINE + 5)
    pipe(ours, theirs)
    assert not ours.timed_out(DEADLINE + 5) and not theirs.timed_out(DEADLINE + 5)  # ended in time
    assert ours.attach(0).timed_out(DEADLINE) and not ours.attach(0, DEADLINE + 10).timed_out(DEADLINE)


def test_a_probe_is_handed_to_the_shell_and_the_shell_may_still_refuse() -> None:
    theirs = FakeSyncer().accept()
    request = BwProbe(10, 20, bytes(32))
    assert theirs.receive_data(encode_frame(request)) == [
        ProbeRequested(request)]
    assert theirs.state is HandshakeState.PROBING
    theirs.data_to_send()
    assert theirs.reject(ErrorCode.AUTH, "wrong key") == Refusal(ErrorCode.AUTH, "wrong key")
    assert theirs.data_to_send() == encode_frame(Error(ErrorCode.AUTH, "wrong key"))
    assert theirs.state is HandshakeState.REFUSED


def test_every_transition_in_the_tables_leads_somewhere_the_role_knows() -> None:
    for table in (LEARNER_TABLE, ATTACH_TABLE, SYNCER_TABLE):
        for (state, kind), targets in table.items():
            assert state not in {HandshakeState.WELCOMED, HandshakeState.JOINED, HandshakeState.ATTACHED,
                                 HandshakeState.PROBING, HandshakeState.REFUSED}, (state, kind)
            assert targets and kind is not MsgType.CHUNK


# -- the schedule: H and P are the syncer's ---------------------------------------------------------


def session(sync_interval: int | None = None) -> LearnerSession:
    """A learner session over tensors of SPECS' shapes, whose `_layout_for` a handshake asks as the
    link does on every CHALLENGE."""
    config = LearnerSettings(syncer="syncer:7070", key="k" * 32, learner_id=3, sync_interval=sync_interval)
    tensors = [(spec.name, torch.zeros(spec.shape)) for spec in SPECS]
    return LearnerSession(config, tensors, embedding_names={"embed.weight"}, link=MemoryLink(FakeClock()))


def dialing(s: LearnerSession) -> LearnerHandshake:
    return LearnerHandshake(ME, LINK, F32, sends_init=False, instance=INSTANCE, layout_for=s._layout_for,
                            deadline=DEADLINE, nonce=lambda: CLIENT_NONCE)


def test_a_learner_that_sets_no_h_takes_the_syncers() -> None:
    s = session()
    ours = dialing(s)
    learned, _ = pipe(ours, FakeSyncer().accept(sync_interval=48))
    assert isinstance(learned[-1], Welcomed) and ours.schedule == Schedule(4, "binpack", 48)
    assert (s.sync_interval, s.boundary_every) == (48, 12)  # a boundary every H/P steps, P = 4 the syncer's too


def test_a_learner_whose_h_is_the_syncers_joins() -> None:
    s = session(48)
    learned, _ = pipe(dialing(s), FakeSyncer().accept(sync_interval=48))
    assert isinstance(learned[-1], Welcomed) and s.sync_interval == 48


def test_a_learner_whose_h_disagrees_is_refused_for_good_with_both_values() -> None:
    s = session(12)
    ours, theirs = dialing(s), FakeSyncer().accept(sync_interval=24)
    with pytest.raises(Refused) as refused:
        pipe(ours, theirs)
    assert refused.value.code is ErrorCode.CONTRACT and refused.value.code.permanent  # the link dials no more
    assert refused.value.reason == ("YETO_DILOCO_SYNC_INTERVAL=12, but the syncer runs H=24 (--sync-interval-steps); "
                                    "unset it to take the syncer's")
    assert ours.hello is None and s.layout is None and s.sync_interval == 12  # no HELLO went out


@pytest.mark.parametrize(("own", "followed"), [(None, DEFAULT_SYNC_INTERVAL), (12, 12)], ids=["default", "own"])
def test_under_a_syncer_that_does_not_pace_by_steps_a_learner_keeps_its_own_h(own: int | None, followed: int) -> None:
    s = session(own)
    learned, _ = pipe(dialing(s), FakeSyncer().accept(sync_interval=0))
    assert isinstance(learned[-1], Welcomed) and s.sync_interval == followed


def test_a_learner_takes_the_h_of_a_syncer_restarted_with_another() -> None:
    s = session()
    pipe(dialing(s), FakeSyncer().accept(sync_interval=48))
    learned, _ = pipe(dialing(s), FakeSyncer().accept(sync_interval=8))  # the redial
    assert isinstance(learned[-1], Welcomed) and (s.sync_interval, s.boundary_every) == (8, 2)


def test_a_version_1_peer_is_refused_naming_both_versions() -> None:
    def as_version_1(frame: bytes) -> bytes:
        return frame[:4] + bytes([1]) + frame[5:]

    said = rf"^protocol version 1 is not supported \(this side speaks {PROTOCOL_VERSION}\)$"
    with pytest.raises(ProtocolError, match=said):  # a version-1 syncer's CHALLENGE
        learner().receive_data(as_version_1(encode_frame(Challenge(NONCE, 4, "binpack", H))))
    hello = hello_for(ME, LINK, LAYOUT, F32, sends_init=False, instance=INSTANCE, challenge_nonce=NONCE,
                      client_nonce=CLIENT_NONCE)
    with pytest.raises(ProtocolError, match=said):  # a version-1 learner's HELLO
        FakeSyncer().accept().receive_data(as_version_1(encode_frame(hello)))
