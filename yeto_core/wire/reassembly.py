"""Reassembly of bulk transfers (PROTOCOL §1.3): the receiving half of a connection group.

A bulk message arrives as one announcement on the control stream and CHUNK frames of at most
4 MiB on the data streams, in whichever order. Each chunk is read with `recv_into` straight into
one buffer per transfer (its size checked against the bound first; `take` hands it out: in a
process, from the pool of recycled buffers, `yeto_core/buffers.py`), and the message is
delivered when the announcement and every byte are in.
An optional *screen* checks each chunk on its reader thread right after it lands, while the bytes
are still in cache; chunks that arrived before their announcement are screened at delivery, so
every byte is screened once whatever the order.

Several reader threads of one group call it at once; the shell that runs them passes a `lock`
(nothing here knows of threads), held only while the transfer table changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

from yeto_core.wire.errors import ProtocolError
from yeto_core.wire.messages import CHUNK_BYTES, Message

MAX_TRANSFERS_IN_FLIGHT = 256

PartCheck = Callable[[memoryview], bool]
"""A screen's verdict on one part (chunk) of a payload: True when the part passes."""
Screen = Callable[[Message], PartCheck | None]
"""Which check a bulk message's parts get, or None for messages that are not screened."""


@dataclasses.dataclass
class _Incoming:
    buffer: memoryview
    received: int = 0
    msg: Message | None = None
    chunks: set[int] = dataclasses.field(default_factory=set)  # indices of chunks already written
    screened: set[int] = dataclasses.field(default_factory=set)  # indices of chunks already screened
    failed: bool = False  # some screened chunk did not pass


class Reassembler:
    """Collects announced bulk transfers and their chunks into one buffer each."""

    def __init__(self, max_payload: Callable[[], int], deliver: Callable[[Message, memoryview, bool | None], None],
                 peer: str, chunk_bytes: int = CHUNK_BYTES, take: Callable[[int], memoryview] | None = None,
                 screen: Screen | None = None, lock: contextlib.AbstractContextManager[object] | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self._take = take or (lambda n: memoryview(bytearray(n)))
        self.max_payload = max_payload  # evaluated per transfer: the bound can tighten once a layout is known
        self.screen = screen
        self._deliver = deliver  # (msg, payload, passed): passed is None when the screen skips msg
        self._peer = peer
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._transfers: dict[int, _Incoming] = {}

    def _check_bound(self, total: int) -> None:
        bound = self.max_payload()
        if total > bound:
            raise ProtocolError(f"{self._peer}: transfer of {total} bytes exceeds the {bound}-byte bound")

    def _get(self, transfer: int, total: int) -> _Incoming:
        inc = self._transfers.get(transfer)
        if inc is None:
            self._check_bound(total)
            if len(self._transfers) >= MAX_TRANSFERS_IN_FLIGHT:
                raise ProtocolError(f"{self._peer}: more than {MAX_TRANSFERS_IN_FLIGHT} transfers in flight")
            inc = _Incoming(self._take(total))
            self._transfers[transfer] = inc
        elif len(inc.buffer) != total:
            announced = len(inc.buffer)
            raise ProtocolError(f"{self._peer}: transfer {transfer} announced {announced} bytes, chunk says {total}")
        return inc

    def _complete(self, transfer: int, inc: _Incoming) -> _Incoming | None:
        if inc.msg is not None and inc.received == len(inc.buffer):
            del self._transfers[transfer]
            return inc
        return None

    def _finish(self, inc: _Incoming) -> None:
        """Screen the chunks that came in before their announcement, then deliver (outside the lock)."""
        assert inc.msg is not None
        check = self.screen(inc.msg) if self.screen is not None else None
        passed = None
        if check is not None:
            size = self.chunk_bytes
            for index in range(-(-len(inc.buffer) // size)):
                if inc.failed:
                    break
                if index not in inc.screened and not check(inc.buffer[index * size : (index + 1) * size]):
                    inc.failed = True
            passed = not inc.failed
        self._deliver(inc.msg, inc.buffer, passed)

    def announce(self, msg: Message) -> None:
        transfer, nbytes = msg.transfer, msg.nbytes  # type: ignore[attr-defined]
        with self._lock:
            inc = self._get(transfer, nbytes)
            if inc.msg is not None:
                raise ProtocolError(f"{self._peer}: transfer {transfer} announced twice")
            inc.msg = msg
            done = self._complete(transfer, inc)
        if done:
            self._finish(done)

    def chunk_target(self, transfer: int, total: int, offset: int, n: int) -> memoryview:
        # Chunks tile the transfer exactly (4 MiB each, the last one shorter), so tracking chunk
        # indices proves every byte was written once: a repeated chunk cannot hide a hole.
        if transfer not in self._transfers:  # a new transfer: refuse an oversize claim before anything else
            self._check_bound(total)
        size = self.chunk_bytes
        index, misaligned = divmod(offset, size)
        if misaligned or offset >= total or n != min(size, total - offset):
            raise ProtocolError(f"{self._peer}: chunk [{offset}, {offset + n}) does not tile a transfer of {total} "
                                f"bytes in {size}-byte chunks")
        with self._lock:
            inc = self._get(transfer, total)
            if index in inc.chunks:
                raise ProtocolError(f"{self._peer}: chunk at offset {offset} of transfer {transfer} sent twice")
            inc.chunks.add(index)
            return inc.buffer[offset : offset + n]

    def incomplete(self) -> int:
        """How many transfers are announced or partly received but not delivered yet."""
        with self._lock:
            return len(self._transfers)

    def chunk_done(self, transfer: int, offset: int, part: memoryview) -> bool:
        """Account the chunk `part` at `offset` of `transfer` written (screening it now when its
        announcement is already in); True while some of the transfer's bytes are still missing."""
        passed = None
        if self.screen is not None:
            with self._lock:
                inc = self._transfers.get(transfer)
                msg = inc.msg if inc is not None else None
            check = self.screen(msg) if msg is not None else None
            if check is not None:
                passed = check(part)  # on this reader thread, while the chunk is still in cache
        with self._lock:
            inc = self._transfers.get(transfer)
            if inc is None:
                raise ProtocolError(f"{self._peer}: chunk for unknown transfer {transfer}")
            inc.received += len(part)
            if inc.received > len(inc.buffer):
                raise ProtocolError(f"{self._peer}: transfer {transfer} received more bytes than announced")
            if passed is not None:
                inc.screened.add(offset // self.chunk_bytes)
                inc.failed |= not passed
            missing = inc.received < len(inc.buffer)
            done = self._complete(transfer, inc)
        if done:
            self._finish(done)
        return missing
