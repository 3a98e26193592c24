"""Completion of outgoing bytes: a `SendTicket` per control frame or bulk transfer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol


class LazyPayload(Protocol):
    """Bulk bytes produced part by part as the sender threads need them (e.g. a push rounded to
    bf16 chunk by chunk, so no full encoded copy is made and encoding overlaps the sending)."""

    @property
    def nbytes(self) -> int: ...

    def fill(self, offset: int, out: memoryview) -> None:
        """Write bytes [offset, offset + len(out)) of the payload into `out`."""
        ...


Payload = bytes | bytearray | memoryview | LazyPayload


class SendTicket:
    """Completion of one outgoing bulk transfer (its header and all its chunks handed to the
    kernel), or of one control frame."""

    def __init__(self, chunks: int) -> None:
        self._left = chunks
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[SendTicket], None]] = []
        self.done = threading.Event()
        self.error: str | None = None
        if chunks == 0:
            self.done.set()

    @classmethod
    def failed(cls, reason: str) -> SendTicket:
        ticket = cls(1)
        ticket.fail(reason)
        return ticket

    def chunk_sent(self) -> None:
        with self._lock:
            self._left -= 1
            finished = self._left == 0
            if finished:
                self.done.set()
        if finished:
            self._completed()

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.done.is_set():
                return
            self.error = reason
            self.done.set()
        self._completed()

    def add_done_callback(self, fn: Callable[[SendTicket], None]) -> None:
        """Call `fn(ticket)` once it is done (at once if it is): on the thread that finished it,
        so `fn` must be quick and must not raise."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _completed(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    @property
    def ok(self) -> bool:
        return self.done.is_set() and self.error is None

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout) and self.error is None
