"""What the shell sees that no tape record carries: bytes on the wire, and how long broadcasts take.

The tape records decisions (DESIGN §6.4); the bytes each learner sends and receives, and the
time until every learner holds a commit's broadcast, happen on the connection groups' threads.
The coordinator reports them to a `ShellObserver` (the metrics, `syncer/service/metrics.py`): each
message once, as it is handed over or taken in, labelled by its codec.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from yeto_core.codecs import WIRE_CODEC_NAMES
from yeto_core.net.tickets import SendTicket
from yeto_core.wire.messages import HEADER, PUSH_MOMENT, Message

CONTROL = "control"  # the codec label of control frames (no bulk payload)


class ShellObserver(Protocol):
    def traffic(self, direction: str, learner_id: int, codec: str, nbytes: int) -> None:
        """`direction` is "in" (from the learner) or "out" (to it); called on any thread."""
        ...

    def broadcast_done(self, seconds: float) -> None:
        """A commit's broadcast reached every learner's socket `seconds` after it was queued."""
        ...


def wire_size(msg: Message, payload_bytes: int | None) -> tuple[str, int]:
    """The codec label and the bytes one message puts on the wire: a bulk message's payload under
    its codec's name (its small header frame is not counted), a control frame whole."""
    if msg.BULK:
        codec = int(getattr(msg, "codec", -1))
        codec = codec & ~PUSH_MOMENT if codec >= 0 else codec  # a push's moment is counted under its codec
        nbytes = payload_bytes if payload_bytes is not None else int(getattr(msg, "nbytes", 0))
        return WIRE_CODEC_NAMES.get(codec, f"codec{codec}"), nbytes
    return CONTROL, HEADER.size + len(msg.encode())


class FanOut:
    """Several observers as one (the metrics and the status board)."""

    def __init__(self, observers: Sequence[ShellObserver]) -> None:
        self._observers = tuple(observers)

    def traffic(self, direction: str, learner_id: int, codec: str, nbytes: int) -> None:
        for observer in self._observers:
            observer.traffic(direction, learner_id, codec, nbytes)

    def broadcast_done(self, seconds: float) -> None:
        for observer in self._observers:
            observer.broadcast_done(seconds)


class BroadcastTimer:
    """Times one commit's broadcast: from now until the last of its sends is done (or failed: a
    learner that dropped meanwhile does not hold the broadcast up forever)."""

    def __init__(self, tickets: Sequence[SendTicket], done: Callable[[float], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._started = clock()
        self._clock = clock
        self._left = len(tickets)
        self._lock = threading.Lock()
        self._done = done
        for ticket in tickets:
            ticket.add_done_callback(self._one_done)

    def _one_done(self, _ticket: SendTicket) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done(self._clock() - self._started)
