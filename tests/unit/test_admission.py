"""The syncer's verdicts on a new connection that need no socket: the HELLO check, the probe slots,
how a broken handshake is counted and answered, and the accept loop's pacing and trouble logs."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from syncer.service.admission import MAX_PROBES, Admission, ProbeSlots, broken_off
from syncer.service.gate import ACCEPT_BACKOFF_MAX_S, ACCEPT_BACKOFF_MIN_S, AcceptPace, GateLogs, HandshakeGate
from yeto_core.codecs import F32
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.sections import Endpoint, LinkSettings
from yeto_core.wire.connection import hello_for
from yeto_core.wire.errors import ConnectionClosed, ErrorCode, ProtocolError, Refused, WireError
from yeto_core.wire.messages import Hello

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

KEY = b"the shared key"
NONCE = bytes(range(32))
LAYOUT = build_layout((TensorSpec("w", (8, 8), "float32"), TensorSpec("v", (8, 8), "float32")), 2)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hello(learner_id: int = 3, key: bytes = KEY) -> Hello:
    return hello_for(Endpoint(("syncer", 7070), key, learner_id), LinkSettings(), LAYOUT, F32, sends_init=False,
                     instance=b"i" * 16, challenge_nonce=NONCE, client_nonce=bytes(32))


def test_admission_checks_a_hello_against_the_syncers_live_view() -> None:
    pinned: list[bytes | None] = [None]
    held = {7: "learner 7 is held by another live process"}
    admission = Admission(KEY, pinned_fingerprint=lambda: pinned[0], schedule_problem=lambda flags: None,
                          id_conflict=lambda lid, instance: held.get(lid))
    admission.check(hello(3), NONCE, "10.0.0.1:5000")
    with pytest.raises(Refused) as wrong_key:
        admission.check(hello(3, key=b"another key"), NONCE, "10.0.0.1:5000")
    assert wrong_key.value.code is ErrorCode.AUTH
    assert wrong_key.value.reason == ("HMAC check failed for learner 3 (10.0.0.1:5000): it does not hold the "
                                      "syncer's key")
    with pytest.raises(Refused) as replayed:  # answers another connection's challenge
        admission.check(hello(3), bytes(32), "10.0.0.1:5000")
    assert replayed.value.code is ErrorCode.AUTH
    with pytest.raises(Refused) as duplicate:
        admission.check(hello(7), NONCE, "peer")
    assert (duplicate.value.code, duplicate.value.reason) == (ErrorCode.DUPLICATE, held[7])
    pinned[0] = bytes(32)  # the model is pinned after the admission was made: the next HELLO sees it
    with pytest.raises(Refused) as layout:
        admission.check(hello(3), NONCE, "peer")
    assert layout.value.code is ErrorCode.LAYOUT


def test_the_schedule_problem_refuses_with_contract() -> None:
    admission = Admission(KEY, pinned_fingerprint=lambda: None, schedule_problem=lambda flags: "sweeps need P > 1",
                          id_conflict=lambda lid, instance: None)
    with pytest.raises(Refused) as unfit:
        admission.check(hello(2), NONCE, "peer")
    assert (unfit.value.code, unfit.value.reason) == (ErrorCode.CONTRACT, "learner 2 (peer): sweeps need P > 1")


def test_probe_slots_bound_the_probes_at_once_and_free_on_any_exit() -> None:
    assert ProbeSlots().limit == MAX_PROBES == 64
    slots = ProbeSlots(2)
    with slots.slot(), slots.slot():
        assert len(slots) == 2
        with pytest.raises(Refused) as full, slots.slot():
            pass
        assert (full.value.code, full.value.reason) == (ErrorCode.REFUSED, "more than 2 bandwidth probes at once")
        assert len(slots) == 2  # the refused one took nothing
    with pytest.raises(ConnectionError), slots.slot():
        raise ConnectionError("the prober hung up")
    assert len(slots) == 0


def test_probe_slots_are_counted_across_threads() -> None:
    slots, go = ProbeSlots(3), threading.Event()

    def probe() -> None:
        with slots.slot():
            go.wait(5)

    threads = [threading.Thread(target=probe) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(500):
        if len(slots) == 3:
            break
        go.wait(0.01)
    with pytest.raises(Refused, match="more than 3 bandwidth probes at once"), slots.slot():
        pass
    go.set()
    for t in threads:
        t.join(5)
    assert len(slots) == 0


@pytest.mark.parametrize(("exc", "cut", "reason", "answer"), [
    (ConnectionClosed("peer closed the connection"), False, "broken", "handshake failed: peer closed the connection"),
    (TimeoutError("the handshake passed its deadline"), False, "broken",
     "handshake failed: the handshake passed its deadline"),
    (ProtocolError("bad magic"), False, "broken", "handshake failed: bad magic"),
    (ConnectionResetError("reset"), True, "deadline", None),  # the gate cut it: closed already
    (WireError("handshake did not finish within 10 s"), True, "deadline", None),
    (KeyError("bug"), False, "error", "syncer error during handshake: 'bug'"),
    (KeyError("bug"), True, "error", "syncer error during handshake: 'bug'"),  # a bug is a bug, cut or not
])
def test_a_broken_handshake_is_counted_and_answered_by_what_broke_it(exc: Exception, cut: bool, reason: str,
                                                                     answer: str | None) -> None:
    assert broken_off(exc, cut=cut) == (reason, answer)


def test_the_accept_loop_keeps_house_on_time_and_backs_off_doubling() -> None:
    pace = AcceptPace(0.25)
    assert pace.housekeeping_due(1000.0)  # the first at once
    assert not pace.housekeeping_due(1000.2)
    assert pace.housekeeping_due(1000.25) and not pace.housekeeping_due(1000.4) and pace.housekeeping_due(1000.5)
    waits = [pace.failed() for _ in range(8)]
    assert waits[0] == ACCEPT_BACKOFF_MIN_S and waits[-1] == ACCEPT_BACKOFF_MAX_S
    assert waits[:5] == [0.05, 0.1, 0.2, 0.4, 0.8] and all(w == 1.0 for w in waits[5:])
    pace.accepted()
    assert pace.failed() == ACCEPT_BACKOFF_MIN_S


def test_the_gate_logs_name_its_bounds_and_speak_once_per_burst(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    gate = HandshakeGate(16, 7.5, clock=clock)
    logs = GateLogs(logging.getLogger("test.admission"), gate, clock=clock)
    with caplog.at_level(logging.WARNING, "test.admission"):
        for n in range(3):
            logs.crowd.hit(f"closed peer{n} at once")
            logs.late.hit("1 connection(s), first from x:1")
        clock.now += 4.0
        logs.tick()  # not quiet for long enough yet
        clock.now += 1.0
        logs.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "too many unauthenticated connections (16 at once, 4 per address; --max-handshakes); closing the excess: "
        "closed peer0 at once",
        "handshakes cut at their 7.5 s deadline: 1 connection(s), first from x:1",
        "too many unauthenticated connections (16 at once, 4 per address; --max-handshakes); closing the excess: "
        "3 times in 0.0 s; quiet again",
        "handshakes cut at their 7.5 s deadline: 3 times in 0.0 s; quiet again",
    ]
    assert logs.accept.count == logs.thread.count == logs.failed.count == 0


def test_a_connection_the_gate_cut_cannot_be_handed_over() -> None:
    clock = Clock()
    gate = HandshakeGate(8, 10.0, clock=clock)
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        prompt, _ = gate.admit(pairs[0][0], "fast:1")
        slow, _ = gate.admit(pairs[1][0], "slow:1")
        assert prompt is not None and slow is not None
        clock.now += 4.0
        assert gate.age(slow) == 4.0
        gate.hand_over(prompt)  # in time: the gate stops timing it
        clock.now += 7.0
        assert gate.expire() == [slow] and len(gate) == 0
        with pytest.raises(WireError, match=r"^handshake did not finish within 10 s$"):
            gate.hand_over(slow)
    finally:
        for a, b in pairs:
            a.close()
            b.close()

