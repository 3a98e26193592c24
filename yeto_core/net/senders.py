"""A data stream's sender thread: its chunks, in the order queued, so the streams of a group
really run in parallel and whoever sends only queues. A failed write closes the whole group
(`close`); a written chunk is reported (`part_sent`, and `wrote` for the striping plan).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from yeto_core.buffers import receive_buffer
from yeto_core.net.stream import Stream
from yeto_core.net.tickets import SendTicket
from yeto_core.wire.messages import CHUNK_BYTES

log = logging.getLogger(__name__)



class ChunkSender:
    """One data stream's chunks, each `(ticket, transfer, total, offset, part)`; a part is a view,
    or `(lazy payload, nbytes)` to be produced right before it is sent."""

    def __init__(self, index: int, stream: Stream, *, group: str, close: Callable[[str], None],
                 part_sent: Callable[[SendTicket], None], wrote: Callable[[int, int, float], None]) -> None:
        self.index, self.stream, self._group = index, stream, group
        self._close, self._part_sent, self._wrote = close, part_sent, wrote
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, item: tuple[SendTicket, int, int, int, Any]) -> None:
        self._queue.put(item)

    def stop(self) -> None:
        self._queue.put(None)

    def drain(self) -> None:
        """Drop queued chunks (and their buffers) nobody will send now."""
        while not self._queue.empty():
            self._queue.get_nowait()

    def run(self) -> None:
        scratch: memoryview | None = None  # this stream's encode buffer for lazy payloads
        while (item := self._queue.get()) is not None:
            ticket, transfer, total, offset, view = item
            if isinstance(view, tuple):  # a lazy payload: produce this part right before sending it
                lazy, n = view
                scratch = scratch if scratch is not None else receive_buffer(CHUNK_BYTES)
                view = scratch[:n]
                try:
                    lazy.fill(offset, view)
                except Exception as exc:  # a half-sent transfer cannot be finished: fail the group
                    log.exception("%s: encoding part of transfer %d failed", self._group, transfer)
                    self._close(f"encoding a payload failed: {exc}")
                    return
            started = time.monotonic()
            try:
                self.stream.send_chunk(transfer, total, offset, view)
            except OSError as exc:
                self._close(f"send failed on {self.stream.name}: {exc}")
                return
            self._wrote(self.index, len(view), time.monotonic() - started)
            self._part_sent(ticket)
