"""The control stream's one thread: it reads, writes and keeps the group's deadlines.

Whoever sends a control frame (the syncer's coordinator, a learner's training thread) only
queues it (`put`) and wakes this thread, so a sender never waits on a peer that stopped reading.
The thread waits on the socket (readable, and writable while frames wait) and on a wake-up pair,
never past the channel's next deadline: what it reads goes to the group's `ControlChannel`
(`wire/channel.py`), which hands back whole messages, and after every wake-up the channel says
whether a heartbeat is due or the group is dead. A queued frame whose bytes make no progress for
`write_timeout_s` fails the group, as does a queue the peer leaves unread for too long.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence

from yeto_core.net.stream import Stream
from yeto_core.net.tickets import SendTicket
from yeto_core.wire.channel import ControlChannel
from yeto_core.wire.errors import ConnectionClosed
from yeto_core.wire.messages import Message
from yeto_core.wire.reassembly import Reassembler

READ_BYTES = 256 * 1024
LAST_WORDS_S = 1.0
MAX_QUEUED_CONTROL_FRAMES = 10_000
"""Control frames a peer may leave unread before its group is closed (a few MiB at most)."""


@dataclasses.dataclass
class _Outgoing:
    data: memoryview
    msg: Message
    ticket: SendTicket | None
    close_reason: str | None  # the group closes once this frame is out
    started: bool = False  # part of it is written


class ControlLoop:
    def __init__(self, stream: Stream, channel: ControlChannel, reassembler: Reassembler, data: Sequence[Stream], *,
                 closed: threading.Event, on_message: Callable[[Message, memoryview | None], None],
                 close: Callable[[str], None], part_sent: Callable[[SendTicket], None],
                 heartbeat_step: Callable[[], int], write_timeout_s: float) -> None:
        self.stream, self._channel, self._reassembler, self._data = stream, channel, reassembler, data
        self._closed, self._on_message, self._close, self._part_sent = closed, on_message, close, part_sent
        self._step, self._write_timeout_s = heartbeat_step, write_timeout_s
        self._tick_s = write_timeout_s  # the stall watchdog looks at the streams at least this often
        self._outbox: collections.deque[_Outgoing] = collections.deque()
        self._lock = threading.Lock()
        self._written_at = 0.0  # when the frame at the head of the outbox last moved
        self._wake_r, self._wake_w = socket.socketpair()
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)

    def put(self, msg: Message, ticket: SendTicket | None = None, close_reason: str | None = None) -> None:
        """Queue `msg`; with `close_reason`, the group closes once it is written."""
        with self._lock:
            overflow = len(self._outbox) >= MAX_QUEUED_CONTROL_FRAMES
            if not overflow:
                if not self._outbox:
                    self._written_at = time.monotonic()
                self._outbox.append(_Outgoing(memoryview(self._channel.send(msg)), msg, ticket, close_reason))
        if overflow:  # it has not read our last frames for a long while: it is not coming back
            self._close(f"the peer stopped reading: {MAX_QUEUED_CONTROL_FRAMES} control frames waiting to be sent")
            return
        self.wake()

    def write_now(self, msg: Message, ticket: SendTicket | None) -> None:
        """Write `msg` on the calling thread (a group not started has no loop to queue it for)."""
        try:
            self.stream.send_frame(msg)
        except OSError as exc:
            self._close(f"send failed on control stream: {exc}")
            return
        self._channel.sent(msg, time.monotonic())
        if ticket is not None:
            self._part_sent(ticket)

    def last_words(self, msg: Message) -> None:
        """On this thread, as it ends: `msg` at once (within a second), unless a frame is half written."""
        if self._outbox and self._outbox[0].started:
            return
        with contextlib.suppress(OSError):
            self.stream.sock.settimeout(LAST_WORDS_S)
            self.stream.send_frame(msg)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # full: a wake-up is pending already; closed: the loop is done
            self._wake_w.send(b"\0")

    def run(self) -> None:
        sock = self.stream.sock
        sock.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake_r, selectors.EVENT_READ)
            selector.register(sock, selectors.EVENT_READ)
            try:
                self._serve(sock, selector)
            finally:
                self._wake_r.close()
                self._wake_w.close()

    def _serve(self, sock: socket.socket, selector: selectors.BaseSelector) -> None:
        while not self._closed.is_set():
            writing = bool(self._outbox)
            try:
                selector.modify(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if writing else 0))
            except ValueError:  # the socket was closed under us: the group is closing
                raise ConnectionClosed("closed locally") from None
            now = time.monotonic()
            deadline = min(self._channel.next_deadline(), now + self._tick_s)
            if writing:
                deadline = min(deadline, self._written_at + self._write_timeout_s)
            for key, mask in selector.select(max(0.0, deadline - now)):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                    continue
                if mask & selectors.EVENT_READ:
                    self._read(sock)
                if mask & selectors.EVENT_WRITE and not self._write(sock):
                    return
            now = time.monotonic()
            if self._outbox and now - self._written_at > self._write_timeout_s:
                raise ConnectionClosed(self._outbox[0].close_reason or "send failed on control stream: timed out")
            self._poll(now)

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(READ_BYTES)
        except BlockingIOError:
            return
        if not data:
            raise ConnectionClosed(f"{self.stream.name}: peer closed the connection")
        for msg in self._channel.receive_data(data, time.monotonic()):
            if self._closed.is_set():
                return
            if msg.BULK:
                self._reassembler.announce(msg)
            else:
                self._on_message(msg, None)

    def _write(self, sock: socket.socket) -> bool:
        """Write what the socket takes; False once a frame asked the group to close after it."""
        while self._outbox:
            head = self._outbox[0]
            try:
                n = sock.send(head.data)
            except BlockingIOError:
                return True
            except OSError as exc:
                self._close(head.close_reason or f"send failed on control stream: {exc}")
                return False
            now = time.monotonic()
            self._written_at = now
            head.data = head.data[n:]
            if head.data:
                head.started = True
                return True
            with self._lock:
                self._outbox.popleft()
            self._channel.sent(head.msg, now)
            if head.ticket is not None:
                self._part_sent(head.ticket)
            if head.close_reason is not None:
                self._linger(sock)
                self._close(head.close_reason)
                return False
        return True

    def _linger(self, sock: socket.socket) -> None:
        """After a closing frame (a BYE): end our side, then read and drop what the peer still sends
        until it closes too, for `LAST_WORDS_S` at most. A socket closed with unread bytes resets the
        connection, and a reset can make the peer drop the frame just sent before reading it."""
        deadline = time.monotonic() + LAST_WORDS_S
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
            with selectors.DefaultSelector() as selector:
                selector.register(sock, selectors.EVENT_READ)
                while (left := deadline - time.monotonic()) > 0:
                    if not selector.select(left):
                        continue
                    try:
                        if not sock.recv(READ_BYTES):
                            return  # the peer closed: everything we sent was read
                    except BlockingIOError:
                        continue

    def _poll(self, now: float) -> None:
        poll = self._channel.poll(now, [stream.motion() for stream in self._data],
                                  inbound_incomplete=self._reassembler.incomplete() > 0, step=self._step)
        if poll.dead is not None:
            raise ConnectionClosed(poll.dead)
        if poll.heartbeat is not None:
            self.put(poll.heartbeat)
