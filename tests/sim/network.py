"""The simulated network: connection groups between one learner process and one syncer process.

A real group is a control stream and data streams, each a TCP stream: bytes on one stream arrive
in order, streams overtake each other. Here each direction of a connection has a control lane
(messages without payload) and a data lane (messages with one), each first in, first out, with a
delay drawn per message from the run's seeded random source. So a PULL may overtake the BCAST
sent before it, and a DONE the learner's last PUSH, exactly as on the wire.

The handshake travels as bytes (`send_bytes`): the frames the real sans-I/O machines write, on
the control lane, in order with the messages that follow it. What arrives for a side before its
handshake has ended is held and handed over, in order, when it ends (`deliver`): a real peer
reads its data streams only once they have attached, after WELCOME, so nothing on them can
overtake the handshake.

A connection that is cut delivers nothing more; each side hears of it after its own detection
delay (a reset is quick, a silent peer takes its heartbeat timeout). A graceful close delivers
what is queued first.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from tests.sim.scheduler import Scheduler
from yeto_core.wire.messages import Message

Deliver = Callable[[Message, bytes | None], None]


class Latency:
    """Delays of one run: a base one-way latency, jitter, and a byte rate for payloads."""

    def __init__(self, rng: random.Random, *, base_s: float, jitter_s: float, bytes_per_s: float) -> None:
        self.rng = rng
        self.base_s, self.jitter_s, self.bytes_per_s = base_s, jitter_s, bytes_per_s

    def one_way(self, nbytes: int = 0) -> float:
        return self.base_s + self.rng.random() * self.jitter_s + nbytes / self.bytes_per_s


class Connection:
    """One connection group. `up` is learner → syncer, `down` syncer → learner."""

    def __init__(self, sim: Scheduler, latency: Latency) -> None:
        self.sim = sim
        self.latency = latency
        self.open = True
        self.closing = False  # a graceful close is under way: nothing new is accepted
        self._last: dict[tuple[str, bool], float] = {}  # (direction, data lane) -> last delivery time
        self.on_learner_lost: Callable[[str], None] = lambda reason: None
        self.on_syncer_left: Callable[[str], None] = lambda reason: None
        self.bytes_to_learner: Callable[[bytes], None] = lambda data: None  # the handshake's frames
        self.bytes_to_syncer: Callable[[bytes], None] = lambda data: None
        self._deliver: dict[str, Deliver | None] = {"up": None, "down": None}  # None: that side is in its handshake
        self._held: dict[str, list[tuple[Message, bytes | None]]] = {"up": [], "down": []}

    def _queue(self, direction: str, data_lane: bool, nbytes: int, arrive: Callable[[], None]) -> bool:
        if not self.open or self.closing:
            return False
        lane = (direction, data_lane)
        when = max(self._last.get(lane, 0.0), self.sim.now + self.latency.one_way(nbytes))
        self._last[lane] = when
        self.sim.at(when, arrive)
        return True

    def carry(self, direction: str, msg: Message, payload: bytes | None) -> bool:
        """Queue `msg` on its lane; False when the connection no longer takes messages."""
        return self._queue(direction, payload is not None, len(payload or b""),
                           lambda: self._arrive(direction, msg, payload))

    def send_bytes(self, direction: str, data: bytes) -> bool:
        """Queue handshake bytes on the control lane (a delay for their size, in order with the rest)."""
        return self._queue(direction, False, len(data), lambda: self._arrive_bytes(direction, data))

    def deliver(self, direction: str, to: Deliver) -> None:
        """The receiving side of `direction` ended its handshake: what arrived for it meanwhile goes
        to `to` now, in order, and so does everything after."""
        self._deliver[direction] = to
        held, self._held[direction] = self._held[direction], []
        for msg, payload in held:
            if not self.open:  # `to` cut it
                break
            to(msg, payload)

    def _arrive(self, direction: str, msg: Message, payload: bytes | None) -> None:
        if self.open:
            to = self._deliver[direction]
            if to is None:
                self._held[direction].append((msg, payload))
            else:
                to(msg, payload)

    def _arrive_bytes(self, direction: str, data: bytes) -> None:
        if self.open:
            (self.bytes_to_syncer if direction == "up" else self.bytes_to_learner)(data)

    def drained_at(self, direction: str) -> float:
        """When everything queued in `direction` has arrived."""
        times = [t for (d, _), t in self._last.items() if d == direction]
        return max([self.sim.now, *times])

    def close_after(self, direction: str, last: Message | None, reason: str) -> None:
        """A graceful close by the sending side of `direction`: `last` after what is queued, then the cut."""
        if not self.open or self.closing:
            return
        if last is not None:
            self.carry(direction, last, None)
        self.closing = True
        self.sim.at(self.drained_at(direction) + 1e-6, lambda: self.cut(reason, quick=True))

    def cut(self, reason: str, *, quick: bool, detect_s: float = 0.0) -> None:
        """The connection is gone; each side hears it after a delay (`quick`: a reset or a close)."""
        if not self.open:
            return
        self.open = False
        for hear in (self.on_learner_lost, self.on_syncer_left):
            delay = self.latency.one_way() if quick else detect_s * (0.5 + self.latency.rng.random())
            self.sim.after(delay, _once(hear, reason))


def _once(hear: Callable[[str], None], reason: str) -> Callable[[], None]:
    return lambda: hear(reason)


def payload_bytes(payload: Any) -> bytes | None:
    """What the kernel would copy out of a send's buffer: the bytes as they are at the send."""
    return None if payload is None else bytes(memoryview(payload).cast("B"))
