"""The listener's gate: what a connection may hold before it proves the key.

A connection is *unauthenticated* from `accept()` until its handshake hands it on (HELLO answered
with WELCOME and the manifest read, ATTACH verified, a probe's MAC checked). Such connections are
bounded in number and in time: at most `cap` at once, at most `per_host` of them from one address,
and each for at most `deadline_s` from accept to hand-over however slowly its bytes trickle in.
All three protect the same thing: the descriptors and threads a legitimate learner needs to
(re)join. The per-address bound keeps one flooding host to its share, so learners elsewhere are
admitted at once; among connections from one address, the oldest (past `min_age_to_evict_s`)
makes room for a newcomer. Trouble is logged once per burst (`BurstLog`), never once per
connection, so a flood cannot flood the log as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
import socket
import threading
import time
from collections.abc import Callable

from yeto_core.wire.errors import WireError

# A real learner finishes its handshake in a few round trips; one older than this at the cap is
# taken for a slow or silent crowd member and makes room for the newcomer.
MIN_AGE_TO_EVICT_S = 2.0
MAX_HANDSHAKES = 64
ACCEPT_BACKOFF_MIN_S = 0.05
ACCEPT_BACKOFF_MAX_S = 1.0


def default_per_host(cap: int) -> int:
    """Unauthenticated connections from one address: a quarter of the cap, at least 2."""
    return max(2, cap // 4)


def default_cap(descriptor_limit: int | None = None) -> int:
    """Unauthenticated handshakes at once when not set: 64, or a quarter of the process's soft
    descriptor limit when that is lower, so a full crowd leaves room for the learners' groups,
    the checkpoint and the tape."""
    if descriptor_limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        descriptor_limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return max(4, min(MAX_HANDSHAKES, descriptor_limit // 4))


class BurstLog:
    """One warning when a kind of trouble starts, one more when it has been quiet for `quiet_s`
    (with how often it happened in between)."""

    def __init__(self, log: logging.Logger, what: str, *, quiet_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._what = what
        self._quiet_s = quiet_s
        self._clock = clock
        self._lock = threading.Lock()
        self._count = 0
        self._first = self._last = 0.0

    @property
    def count(self) -> int:
        """Occurrences in the current burst (0 when quiet)."""
        return self._count

    def hit(self, detail: str) -> None:
        now = self._clock()
        with self._lock:
            starts = self._count == 0
            self._count += 1
            self._last = now
            if starts:
                self._first = now
        if starts:
            self._log.warning("%s: %s", self._what, detail)

    def tick(self) -> None:
        """Close the burst once it has been quiet long enough."""
        now = self._clock()
        with self._lock:
            if not self._count or now - self._last < self._quiet_s:
                return
            count, span = self._count, self._last - self._first
            self._count = 0
        self._log.warning("%s: %d time%s in %.1f s; quiet again", self._what, count, "" if count == 1 else "s", span)


@dataclasses.dataclass(eq=False)
class Unauthenticated:
    sock: socket.socket
    peer: str  # host:port
    started: float
    host: str = ""
    cut: bool = False  # closed by the gate (deadline or eviction): its thread ends quietly


class HandshakeGate:
    """Counts and times unauthenticated connections; thread-safe."""

    def __init__(self, cap: int, deadline_s: float, *, per_host: int | None = None,
                 min_age_to_evict_s: float = MIN_AGE_TO_EVICT_S, clock: Callable[[], float] = time.monotonic) -> None:
        if cap < 1:
            raise ValueError(f"handshake cap must be at least 1, got {cap}")
        self.cap = cap
        self.per_host = min(cap, per_host if per_host is not None else default_per_host(cap))
        self.deadline_s = deadline_s
        self._min_age = min_age_to_evict_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open: list[Unauthenticated] = []  # oldest first

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def admit(self, sock: socket.socket, peer: str,
              host: str | None = None) -> tuple[Unauthenticated | None, Unauthenticated | None]:
        """(the newcomer's entry or None when it is refused, the older connection cut to make room).

        At its address's bound, or at the cap, the oldest connection (of that address, or of
        all) makes room if it is older than `min_age_to_evict_s`: a crowd that holds its sockets
        open cannot keep a fast, honest handshake out. Otherwise the newcomer is refused and the
        caller closes it at once."""
        now = self._clock()
        host = host if host is not None else peer.rpartition(":")[0]
        evicted = None
        with self._lock:
            same = [e for e in self._open if e.host == host]
            crowd = same if len(same) >= self.per_host else self._open if len(self._open) >= self.cap else None
            if crowd is not None:
                if now - crowd[0].started < self._min_age:
                    return None, None
                evicted = crowd[0]
                self._open.remove(evicted)
                evicted.cut = True
            entry = Unauthenticated(sock, peer, now, host)
            self._open.append(entry)
        if evicted is not None:
            _wake(evicted.sock)
        return entry, evicted

    def age(self, entry: Unauthenticated) -> float:
        """Seconds since `entry` was accepted."""
        return self._clock() - entry.started

    def hand_over(self, entry: Unauthenticated) -> None:
        """The connection proved the key: stop timing it. Raises `WireError` when the gate had
        already cut it (past its deadline, or to make room), so that it is not handed on."""
        if not self.release(entry):
            raise WireError(f"handshake did not finish within {self.deadline_s:g} s")

    def release(self, entry: Unauthenticated) -> bool:
        """The handshake hands its socket on, or ended: stop counting it. False when the gate had
        already cut it (the caller must not hand it on)."""
        with self._lock:
            if entry in self._open:
                self._open.remove(entry)
            return not entry.cut

    def expire(self) -> list[Unauthenticated]:
        """Cut every connection past its deadline; their blocked reads return at once."""
        now = self._clock()
        with self._lock:
            late = [e for e in self._open if now - e.started > self.deadline_s]
            for e in late:
                e.cut = True
            self._open = [e for e in self._open if not e.cut]
        for e in late:
            _wake(e.sock)
        return late


class AcceptPace:
    """The accept loop's timing: housekeeping every `housekeeping_s` (the first at once), and after
    accept() fails a pause that doubles from `ACCEPT_BACKOFF_MIN_S` to `ACCEPT_BACKOFF_MAX_S`,
    forgotten at the next accepted connection. Time is an argument."""

    def __init__(self, housekeeping_s: float) -> None:
        self.housekeeping_s = housekeeping_s
        self._next = 0.0
        self._backoff = 0.0

    def housekeeping_due(self, now: float) -> bool:
        """Whether to do the housekeeping now; when it is, the next is `housekeeping_s` away."""
        if now < self._next:
            return False
        self._next = now + self.housekeeping_s
        return True

    def failed(self) -> float:
        """accept() failed: how long to wait before the next try."""
        self._backoff = min(ACCEPT_BACKOFF_MAX_S, max(ACCEPT_BACKOFF_MIN_S, 2 * self._backoff))
        return self._backoff

    def accepted(self) -> None:
        self._backoff = 0.0


class GateLogs:
    """The listener's kinds of trouble, each logged once per burst: the gate's crowd and deadline,
    accept() failing, no thread for a handshake, and handshakes failing before authentication
    (unauthenticated peers may be anyone: a crowd that hangs up at once must cost a line, not one each)."""

    def __init__(self, log: logging.Logger, gate: HandshakeGate, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.crowd = BurstLog(log, f"too many unauthenticated connections ({gate.cap} at once, {gate.per_host} "
                              "per address; --max-handshakes); closing the excess", clock=clock)
        self.late = BurstLog(log, f"handshakes cut at their {gate.deadline_s:g} s deadline", clock=clock)
        self.accept = BurstLog(log, "accept() failing; retrying with backoff", clock=clock)
        self.thread = BurstLog(log, "cannot start a handshake thread; closing the connection", clock=clock)
        self.failed = BurstLog(log, "handshakes failed before authentication", clock=clock)

    def tick(self) -> None:
        """Close every burst that has been quiet long enough."""
        for trouble in (self.crowd, self.late, self.accept, self.thread, self.failed):
            trouble.tick()


def _wake(sock: socket.socket) -> None:
    """Shut a socket down so the thread reading it gets EOF now; that thread closes it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
