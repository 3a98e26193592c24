"""One TCP socket of a connection: framed sends under a lock, exact reads, and the handshake loop."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from yeto_core.wire.connection import Event, Handshake
from yeto_core.wire.errors import ConnectionClosed
from yeto_core.wire.framing import ChunkHead, chunk_head, data_frame_header, parse_chunk_head
from yeto_core.wire.liveness import StreamMotion
from yeto_core.wire.messages import (
    CHUNK_HEADER,
    HEADER,
    MAX_CONTROL_BODY,
    Message,
    MsgType,
    decode_body,
    encode_frame,
    parse_header,
)

SOCKET_BUFFER_BYTES = 8 * 1024 * 1024
SEND_PIECE = 1024 * 1024
CONTROL_SNDBUF_BYTES = 64 * 1024


def tune_socket(sock: socket.socket, *, bulk: bool) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if bulk:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        return
    # Control frames are small: a fixed send buffer (instead of one autotuned to megabytes) keeps
    # what a peer that stopped reading can leave unread small, so its send deadline finds it.
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CONTROL_SNDBUF_BYTES)


class Stream:
    """One TCP socket with framed sends (under a lock) and exact, resumable reads."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.name = name
        self._send_lock = threading.Lock()
        self._closed = False
        self.sending = False  # a chunk is being written (the stall watchdog looks at this)
        self.progress_at = time.monotonic()  # the last time bytes moved either way
        self._chunk_head = memoryview(bytearray(HEADER.size + CHUNK_HEADER.size))

    def send_frame(self, msg: Message) -> None:
        data = encode_frame(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def send_chunk(self, transfer: int, total: int, offset: int, view: memoryview) -> None:
        head = chunk_head(transfer, total, offset, len(view))
        with self._send_lock:
            self.sending = True
            try:
                self._send_all(memoryview(head))
                self._send_all(view)
            finally:
                self.sending = False

    def _send_all(self, view: memoryview) -> None:
        """`sendall` in pieces, so the watchdog can tell a slow stream from a stalled one."""
        sent, n = 0, len(view)
        while sent < n:
            sent += self.sock.send(view[sent : sent + SEND_PIECE])
            self.progress_at = time.monotonic()

    def read_into(self, view: memoryview, *, idle: Callable[[], None] | None = None) -> None:
        """Fill `view` exactly. On a socket timeout call `idle()` (which may raise) and go on."""
        got = 0
        n = len(view)
        while got < n:
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except TimeoutError:
                if idle is None:
                    raise
                idle()
                continue
            except OSError as exc:
                raise ConnectionClosed(f"{self.name}: {exc}") from exc
            if k == 0:
                raise ConnectionClosed(f"{self.name}: peer closed the connection")
            got += k
            self.progress_at = time.monotonic()

    def read_exact(self, n: int, *, idle: Callable[[], None] | None = None) -> bytearray:
        buf = bytearray(n)
        self.read_into(memoryview(buf), idle=idle)
        return buf

    def read_frame(
        self, *, max_body: int = MAX_CONTROL_BODY, idle: Callable[[], None] | None = None
    ) -> tuple[MsgType, bytearray]:
        kind, length = parse_header(memoryview(self.read_exact(HEADER.size, idle=idle)), max_body)
        return kind, self.read_exact(length, idle=idle)

    def read_message(self, *, max_body: int = MAX_CONTROL_BODY, idle: Callable[[], None] | None = None) -> Message:
        kind, body = self.read_frame(max_body=max_body, idle=idle)
        return decode_body(kind, memoryview(body))

    def read_chunk_head(self) -> ChunkHead:
        """A data stream's next chunk head; a peer's ERROR in its place (it refused this stream, e.g.
        a failed ATTACH) is a ConnectionClosed naming its reason."""
        head = self._chunk_head
        self.read_into(head[: HEADER.size])
        kind, length = data_frame_header(head[: HEADER.size], self.name)
        if kind is MsgType.ERROR:
            refusal = decode_body(kind, memoryview(self.read_exact(length)))
            raise ConnectionClosed(f"{self.name}: peer refused: {refusal.reason}")  # type: ignore[attr-defined]
        self.read_into(head[HEADER.size :])
        return parse_chunk_head(length, head[HEADER.size :])

    def handshake(self, machine: Handshake) -> list[Event]:
        """Run a sans-I/O handshake (`connection.py`) over this socket until it ends: write what it
        says to write, read no more than it wants (never a byte of what follows the handshake),
        and hold it to its deadline however slowly bytes trickle in. Returns its events."""
        events: list[Event] = []
        while True:
            deadline = machine.next_deadline()
            if deadline is not None:
                now = time.monotonic()
                if machine.timed_out(now):
                    raise TimeoutError(f"{self.name}: the handshake passed its deadline")
                self.sock.settimeout(deadline - now)
            out = machine.data_to_send()
            if out:
                with self._send_lock:
                    self.sock.sendall(out)
            if deadline is None:
                return events
            data = self.sock.recv(min(machine.bytes_wanted(), SEND_PIECE))
            if not data:
                raise ConnectionClosed(f"{self.name}: peer closed the connection")
            events += machine.receive_data(data)

    def set_user_timeout(self, seconds: float) -> None:
        """TCP_USER_TIMEOUT: the kernel drops the connection when sent data stays unacknowledged this long."""
        option = getattr(socket, "TCP_USER_TIMEOUT", None)
        if option is not None and seconds > 0:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.IPPROTO_TCP, option, int(seconds * 1000))

    def motion(self) -> StreamMotion:
        return StreamMotion(self.name, self.sending, self.progress_at)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
