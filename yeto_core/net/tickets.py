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


def _bytes_view(payload: Payload) -> memoryview | LazyPayload:
    if isinstance(payload, bytes | bytearray | memoryview):
        return memoryview(payload).cast("B")
    return payload


def payload_nbytes(payload: Payload) -> int:
    return _bytes_view(payload).nbytes


class Concatenated:
    """One bulk payload made of several, back to back, none of them copied ahead: each part is
    read (or produced, if lazy) only for the byte ranges the sender threads ask of it."""

    def __init__(self, parts: list[Payload]) -> None:
        self._parts: list[tuple[int, memoryview | LazyPayload]] = []
        start = 0
        for part in parts:
            view = _bytes_view(part)
            self._parts.append((start, view))
            start += view.nbytes
        self.nbytes = start

    def fill(self, offset: int, out: memoryview) -> None:
        out = out.cast("B") if out.format != "B" else out
        end = offset + len(out)
        if offset < 0 or end > self.nbytes:
            raise ValueError(f"bytes [{offset}, {end}) are outside the {self.nbytes}-byte payload")
        for start, part in self._parts:
            lo, hi = max(offset, start), min(end, start + part.nbytes)
            if lo >= hi:
                continue
            target = out[lo - offset : hi - offset]
            if isinstance(part, memoryview):
                target[:] = part[lo - start : hi - start]
            else:
                part.fill(lo - start, target)


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
