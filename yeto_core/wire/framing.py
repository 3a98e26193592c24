"""Frames (PROTOCOL §1.1) cut out of a byte stream, without I/O.

`FrameReader` is fed whatever bytes a socket gave and hands back whole frames, one at a time,
each header checked (magic, version, type, a length bound) before any of its body is waited
for. It asks for no more bytes than complete the frame in hand (`bytes_wanted`), so a shell
that reads only that much never takes a byte meant for whoever reads the stream next: the
handshake hands its stream over to the connection group this way.

CHUNK frames, the bulk bytes of the data streams, are not cut out of a buffer: a data stream's
shell reads a chunk's head (`CHUNK_HEAD.size` bytes), parses it here, and then reads the chunk's
bytes straight into their place in the transfer's buffer.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

from yeto_core.wire.errors import ProtocolError
from yeto_core.wire.messages import (
    CHUNK_HEADER,
    HEADER,
    MAGIC,
    MAX_CONTROL_BODY,
    PROTOCOL_VERSION,
    MsgType,
    parse_header,
)

CHUNK_HEAD = struct.Struct(HEADER.format + CHUNK_HEADER.format.lstrip("<"))
"""A CHUNK frame's header and its chunk header, as one data stream reads them."""


class FrameReader:
    """Bytes in, `(type, body)` frames out; the bytes after the last whole frame stay buffered."""

    def __init__(self, max_body: int = MAX_CONTROL_BODY) -> None:
        self.max_body = max_body
        self._inbox = bytearray()
        self._head: tuple[MsgType, int] | None = None  # the header of the frame in hand, once checked

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._inbox += data

    def bytes_wanted(self) -> int:
        """How many more bytes complete the header or the frame in hand."""
        if self._head is None:
            return HEADER.size - len(self._inbox)
        return HEADER.size + self._head[1] - len(self._inbox)

    def next_frame(self, *, max_body: int | None = None,
                   accept: Callable[[MsgType], None] | None = None) -> tuple[MsgType, bytes] | None:
        """The next whole frame, or None until more bytes come. `accept(type)` may refuse a frame
        (by raising) on its header alone, before its body is waited for."""
        if self._head is None:
            if len(self._inbox) < HEADER.size:
                return None
            kind, length = parse_header(bytes(self._inbox[: HEADER.size]),
                                        self.max_body if max_body is None else max_body)
            if kind is MsgType.CHUNK:
                raise ProtocolError("CHUNK frames are only valid on data streams")
            if accept is not None:
                accept(kind)
            self._head = kind, length
        kind, length = self._head
        end = HEADER.size + length
        if len(self._inbox) < end:
            return None
        body = bytes(self._inbox[HEADER.size : end])
        del self._inbox[:end]
        self._head = None
        return kind, body

    def rest(self) -> bytes:
        """The bytes received after the last frame handed out (none while a header is in hand)."""
        return b"" if self._head is not None else bytes(self._inbox)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkHead:
    """Where one chunk's bytes go: `nbytes` at `offset` of transfer `transfer` (`total` bytes)."""

    transfer: int
    total: int
    offset: int
    nbytes: int


def chunk_head(transfer: int, total: int, offset: int, nbytes: int) -> bytes:
    """The bytes that precede a chunk of `nbytes` on a data stream."""
    return CHUNK_HEAD.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.CHUNK), 0, CHUNK_HEADER.size + nbytes,
                           transfer, total, offset)


def data_frame_header(header: memoryview | bytes, stream: str) -> tuple[MsgType, int]:
    """The header of a frame on a data stream: a CHUNK, or the ERROR of a peer refusing the stream."""
    kind, length = parse_header(header)
    if kind is MsgType.ERROR:
        return kind, length
    if kind is not MsgType.CHUNK or length < CHUNK_HEADER.size:
        raise ProtocolError(f"{stream}: expected a CHUNK frame, got {kind.name}")
    return kind, length


def parse_chunk_head(length: int, rest: memoryview | bytes) -> ChunkHead:
    """A chunk's place, from its frame's body `length` and its chunk header `rest`."""
    transfer, total, offset = CHUNK_HEADER.unpack(rest)
    return ChunkHead(transfer, total, offset, length - CHUNK_HEADER.size)
