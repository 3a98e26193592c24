"""The listener's gate: unauthenticated connections bounded in number and time, trouble logged per burst."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from syncer.service.gate import BurstLog, HandshakeGate, default_cap

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    made: list[tuple[socket.socket, socket.socket]] = []
    yield made
    for a, b in made:
        a.close()
        b.close()


def pair(pairs: list[tuple[socket.socket, socket.socket]]) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    b.settimeout(5)
    pairs.append((a, b))
    return a, b


def woken(sock: socket.socket) -> bool:
    """The gate shut the socket down: its reader sees EOF at once."""
    sock.settimeout(1.0)
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def test_default_cap_follows_the_descriptor_limit() -> None:
    assert default_cap(1 << 20) == 64
    assert default_cap(256) == 64
    assert default_cap(64) == 16
    assert default_cap(8) == 4  # never below 4, even under a tiny limit


def test_the_deadline_counts_from_accept_not_per_read(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock = Clock()
    gate = HandshakeGate(8, 10.0, clock=clock)
    server_side, _client = pair(pairs)
    entry, evicted = gate.admit(server_side, "slow:1")
    assert entry is not None and evicted is None
    clock.now += 9.9
    assert gate.expire() == []
    clock.now += 0.2  # 10.1 s since accept, whatever trickled in meanwhile
    assert gate.expire() == [entry]
    assert entry.cut and len(gate) == 0
    assert woken(server_side)
    assert gate.release(entry) is False  # its handshake must not hand the socket on now


def test_a_released_connection_is_no_longer_timed(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock = Clock()
    gate = HandshakeGate(8, 10.0, clock=clock)
    entry, _ = gate.admit(pair(pairs)[0], "fast:1")
    assert entry is not None
    assert gate.release(entry) is True
    assert gate.release(entry) is True  # idempotent: the handshake's `finally` releases again
    clock.now += 60
    assert gate.expire() == [] and not entry.cut


def test_at_the_cap_a_young_crowd_refuses_the_newcomer(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock = Clock()
    gate = HandshakeGate(2, 10.0, min_age_to_evict_s=2.0, clock=clock)
    first, _ = gate.admit(pair(pairs)[0], "a:1")
    clock.now += 0.5
    second, _ = gate.admit(pair(pairs)[0], "b:1")
    clock.now += 1.0  # the oldest is 1.5 s old: it could still be an honest handshake
    refused, evicted = gate.admit(pair(pairs)[0], "c:1")
    assert refused is None and evicted is None
    assert len(gate) == 2 and first is not None and second is not None and not first.cut


def test_at_the_cap_the_oldest_stale_connection_makes_room(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock = Clock()
    gate = HandshakeGate(2, 10.0, min_age_to_evict_s=2.0, clock=clock)
    old_sock, _ = pair(pairs)
    oldest, _ = gate.admit(old_sock, "a:1")
    clock.now += 1.0
    middle, _ = gate.admit(pair(pairs)[0], "b:1")
    clock.now += 1.5  # the oldest has sat 2.5 s without proving the key
    newcomer, evicted = gate.admit(pair(pairs)[0], "c:1")
    assert newcomer is not None and evicted is oldest
    assert oldest is not None and oldest.cut and middle is not None and not middle.cut
    assert woken(old_sock)
    assert len(gate) == 2


def test_one_address_is_held_to_its_share(pairs: list[tuple[socket.socket, socket.socket]]) -> None:
    clock = Clock()
    gate = HandshakeGate(8, 10.0, per_host=2, min_age_to_evict_s=2.0, clock=clock)
    assert gate.per_host == 2
    crowd = [gate.admit(pair(pairs)[0], f"10.0.0.9:{port}")[0] for port in (1, 2)]
    assert all(e is not None for e in crowd)
    assert gate.admit(pair(pairs)[0], "10.0.0.9:3") == (None, None)  # the crowd's share is full
    learner, evicted = gate.admit(pair(pairs)[0], "10.0.0.5:1")  # another address: admitted at once
    assert learner is not None and evicted is None
    clock.now += 2.5
    newcomer, evicted = gate.admit(pair(pairs)[0], "10.0.0.9:4")  # its own oldest makes room, nobody else's
    assert newcomer is not None and evicted is crowd[0]
    assert not learner.cut and len(gate) == 3
    assert HandshakeGate(64, 10.0).per_host == 16 and HandshakeGate(4, 10.0).per_host == 2


def test_a_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        HandshakeGate(0, 10.0)


def test_burst_log_says_start_and_end_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    burst = BurstLog(logging.getLogger("test.gate"), "accept() failing", quiet_s=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.gate"):
        for _ in range(500):
            burst.hit("[Errno 24] Too many open files")
            clock.now += 0.01
            burst.tick()
        assert burst.count == 500
        clock.now += 4.0
        burst.tick()  # 4 s quiet: still the same burst
        clock.now += 1.1
        burst.tick()
        burst.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["accept() failing: [Errno 24] Too many open files",
                     "accept() failing: 500 times in 5.0 s; quiet again"]
    assert burst.count == 0
