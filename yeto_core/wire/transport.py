"""Sockets, and nothing else: framed streams and connection groups (DESIGN §7.1, PROTOCOL §1).

A *connection group* is one control stream (stream 0) plus N data streams. Control frames are
small and ordered. A bulk message goes out as one control frame that announces a transfer id
and a byte count, followed by CHUNK frames of at most 4 MiB striped round-robin over the data
streams, each sent by that stream's own sender thread so the streams really run in parallel.
The receiver reads every chunk with `recv_into` straight into one buffer per transfer and
delivers the message when the announcement and every byte have arrived, in whichever order,
optionally screening each chunk as it lands (`reassembly.py`; the syncer screens f32 pushes for
NaN/Inf this way).

Both sides send HEARTBEAT on the control stream; a group that hears nothing for
`peer_timeout_s` closes itself. Every failure closes the whole group once, with a reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.wire.buffers import receive_buffer
from yeto_core.wire.connection import Event, Handshake
from yeto_core.wire.errors import ConnectionClosed, ErrorCode, ProtocolError
from yeto_core.wire.messages import (
    CHUNK_BYTES,
    CHUNK_HEADER,
    HEADER,
    MAGIC,
    MAX_CONTROL_BODY,
    PROTOCOL_VERSION,
    Error,
    Heartbeat,
    Message,
    MsgType,
    decode_body,
    encode_frame,
    parse_header,
)
from yeto_core.wire.reassembly import MAX_TRANSFERS_IN_FLIGHT, PartCheck, Reassembler, Screen

__all__ = ["MAX_TRANSFERS_IN_FLIGHT", "ConnectionGroup", "LazyPayload", "PartCheck", "Reassembler", "Screen",
           "SendTicket", "Stream", "pick_stream", "tune_socket"]

log = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 8 * 1024 * 1024
SEND_PIECE = 1024 * 1024
CONTROL_SNDBUF_BYTES = 64 * 1024
SCHEDULES = ("rr", "adaptive")
RATE_EMA = 0.3
LAST_WORDS_S = 1.0
MAX_QUEUED_CONTROL_FRAMES = 10_000
"""Control frames a peer may leave unread before its group is closed (a few MiB at most)."""


def pick_stream(backlog: list[int], rates: list[float | None], nbytes: int) -> int:
    """Adaptive striping: the data stream that would finish `nbytes` first, given what it still has
    queued and its measured rate. Streams not measured yet count as fast as the fastest known one
    (so each gets tried); ties go to the lowest index."""
    known = [r for r in rates if r]
    default = max(known) if known else 1.0
    finish = [(b + nbytes) / (r or default) for b, r in zip(backlog, rates, strict=True)]
    return min(range(len(finish)), key=finish.__getitem__)


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

    def send_frame(self, msg: Message) -> None:
        data = encode_frame(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def send_chunk(self, transfer: int, total: int, offset: int, view: memoryview) -> None:
        head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.CHUNK), 0, CHUNK_HEADER.size + len(view))
        head += CHUNK_HEADER.pack(transfer, total, offset)
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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class LazyPayload(Protocol):
    """Bulk bytes produced part by part as the sender threads need them (e.g. a push rounded to
    bf16 chunk by chunk, so no full encoded copy is made and encoding overlaps the sending)."""

    @property
    def nbytes(self) -> int: ...

    def fill(self, offset: int, out: memoryview) -> None:
        """Write bytes [offset, offset + len(out)) of the payload into `out`."""
        ...


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


class ConnectionGroup:
    """A live, authenticated control stream plus data streams, with reader and sender threads.

    `on_message(msg, payload)` is called from reader threads (payload is None for control-only
    messages); `on_close(reason)` is called exactly once. With a `screen`, every bulk message it
    returns a check for goes to `on_screened(msg, payload, passed)` instead, `passed` telling
    whether every chunk passed that check.
    """

    def __init__(
        self,
        control: Stream,
        data: list[Stream],
        *,
        name: str,
        on_message: Callable[[Message, memoryview | None], None],
        on_close: Callable[[str], None],
        max_payload: Callable[[], int],
        heartbeat_s: float = 2.0,
        peer_timeout_s: float = 30.0,
        heartbeat_step: Callable[[], int] = lambda: 0,
        stall_timeout_s: float = 0.0,
        schedule: str = "rr",
        screen: Screen | None = None,
        on_screened: Callable[[Message, memoryview, bool], None] | None = None,
        faults: FaultInjector = NO_FAULTS,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"stream schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if not data:
            raise ValueError("a connection group needs at least one data stream")
        if (screen is None) != (on_screened is None):
            raise ValueError("a payload screen and on_screened come together")
        self.name = name
        self.control = control
        self.data = data
        self._on_message = on_message
        self._on_close = on_close
        self._on_screened = on_screened
        self._faults = faults  # the owning process's: holds the mid-stripe point of its data readers
        self._reassembler = Reassembler(max_payload, self._deliver_bulk, name, screen=screen)
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._heartbeat_step = heartbeat_step
        self._stall_timeout_s = stall_timeout_s
        self._schedule = schedule
        self._backlog = [0] * len(data)  # bytes queued per data stream, not yet written
        self._rates: list[float | None] = [None] * len(data)  # EWMA bytes/s per data stream
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in data]
        # Control frames go out on a sender thread of their own, so whoever sends (the syncer's
        # coordinator, a learner's training thread) never waits on a peer that stopped reading.
        self._control_queue: queue.SimpleQueue[tuple[Message, SendTicket | None, str | None] | None] = (
            queue.SimpleQueue())
        self._control_queued = 0  # frames in the control queue, not yet written
        self._heartbeat_queued = False
        self._next_transfer = 1
        self._next_stream = 0
        self._id_lock = threading.Lock()
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self._tickets: set[SendTicket] = set()
        self._last_heard = time.monotonic()
        self._last_sent = 0.0
        self._hb_seq = 0
        self.close_reason: str | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the reader and sender threads; a group closed before it started runs none. Under
        the close lock, so `join` (which may run on another thread at any time) only ever sees a
        complete list of started threads."""
        with self._close_lock:
            if self._closed.is_set() or self._threads:
                return
            with contextlib.suppress(OSError):  # a socket already gone: the loops end at once
                self.control.sock.settimeout(max(0.05, self._heartbeat_s / 2))
                for stream in self.data:
                    stream.sock.settimeout(None)
            targets: list[tuple[Callable[..., None], tuple[Any, ...], str]] = [
                (self._control_loop, (), "ctl"), (self._control_sender_loop, (), "ctl-tx")]
            for i, stream in enumerate(self.data):
                targets.append((self._data_loop, (stream,), f"rx{i}"))
                targets.append((self._sender_loop, (i, stream, self._queues[i]), f"tx{i}"))
            threads = [threading.Thread(target=fn, args=args, name=f"{self.name}-{tag}", daemon=True)
                       for fn, args, tag in targets]
            for t in threads:
                t.start()
            self._threads = threads

    @property
    def silent_s(self) -> float:
        """Seconds since the last frame from the peer."""
        return time.monotonic() - self._last_heard

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def wait_closed(self, timeout: float) -> bool:
        return self._closed.wait(timeout)

    def join(self, timeout: float) -> bool:
        """Wait (up to `timeout` in all) for this group's threads to end after `close()`.

        A process must not exit while they still hold payload buffers: a daemon thread that
        frees the last reference to a tensor-backed buffer during interpreter shutdown aborts it.
        """
        deadline = time.monotonic() + timeout
        with self._close_lock:
            threads = list(self._threads)  # every one of them started (see `start`)
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            return False  # a sender still running must find its stop sentinel in its queue
        for q in self._queues:  # drop queued chunks (and their buffers) nobody will send now
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        return True

    def close(self, reason: str, *, last: Message | None = None) -> None:
        """Close the group; with `last`, send that control message first (after every control
        frame queued before it; bounded by the control stream's timeout), then close."""
        if last is not None and not self._closed.is_set():
            if self._threads:
                self._enqueue_control(last, None, reason)
                return
            with contextlib.suppress(OSError):  # not started: no sender thread to hand it to
                self.control.send_frame(last)
        with self._close_lock:
            if self._closed.is_set():
                return
            self.close_reason = reason
            self._closed.set()
        for stream in [self.control, *self.data]:
            stream.close()
        for q in self._queues:
            q.put(None)
        self._control_queue.put(None)
        with self._id_lock:
            tickets, self._tickets = self._tickets, set()
        for ticket in tickets:
            ticket.fail(reason)
        try:
            self._on_close(reason)
        except Exception:
            log.exception("%s: close handler failed", self.name)

    # -- sending ---------------------------------------------------------------------------
    def send(self, msg: Message, payload: bytes | bytearray | memoryview | LazyPayload | None = None) -> SendTicket:
        """Send a control message, or a bulk message with its payload (striped over data streams).

        Never blocks on the bulk bytes: they are queued to the data streams' sender threads and
        the returned ticket completes when every chunk went out (or fails if the group closes).
        """
        if self._closed.is_set():
            ticket = SendTicket(1)
            ticket.fail(self.close_reason or "connection closed")
            return ticket
        if not msg.BULK:
            if payload is not None:
                raise ValueError(f"{msg.TYPE.name} carries no bulk payload")
            ticket = SendTicket(1)
            with self._id_lock:
                self._tickets.add(ticket)
            if self._closed.is_set():  # closed meanwhile: close() may not have seen this ticket
                ticket.fail(self.close_reason or "connection closed")
                return ticket
            self._send_control(msg, ticket)
            return ticket
        if payload is None:
            raise ValueError(f"{msg.TYPE.name} needs a bulk payload")
        lazy = payload if hasattr(payload, "fill") else None
        view = None if lazy is not None else memoryview(payload).cast("B")  # type: ignore[arg-type]
        total = lazy.nbytes if lazy is not None else len(view)  # type: ignore[union-attr,arg-type]
        with self._id_lock:
            if self._closed.is_set():  # closed since the check above: close() saw no ticket of ours
                ticket = SendTicket(1)
                ticket.fail(self.close_reason or "connection closed")
                return ticket
            transfer = self._next_transfer
            self._next_transfer += 1
            chunks = (total + CHUNK_BYTES - 1) // CHUNK_BYTES
            ticket = SendTicket(chunks + 1)  # and the header on the control stream
            self._tickets.add(ticket)
            targets = []
            for offset in range(0, total, CHUNK_BYTES):
                n = min(CHUNK_BYTES, total - offset)
                if self._schedule == "adaptive":
                    i = pick_stream(self._backlog, self._rates, n)
                else:
                    i, self._next_stream = self._next_stream, (self._next_stream + 1) % len(self.data)
                self._backlog[i] += n
                targets.append(i)
        self._send_control(dataclasses.replace(msg, transfer=transfer, nbytes=total), ticket)  # type: ignore[type-var]
        for i, offset in zip(targets, range(0, total, CHUNK_BYTES), strict=True):
            n = min(CHUNK_BYTES, total - offset)
            part = (lazy, n) if view is None else view[offset : offset + n]
            self._queues[i].put((ticket, transfer, total, offset, part))
        return ticket

    def _send_control(self, msg: Message, ticket: SendTicket | None = None) -> None:
        if not self._threads:  # not started (a test driving a group by hand): write it here
            self._write_control(msg, ticket, None)
            return
        self._enqueue_control(msg, ticket)

    def _write_control(self, msg: Message, ticket: SendTicket | None, close_reason: str | None) -> bool:
        try:
            self.control.send_frame(msg)
        except OSError as exc:
            self.close(close_reason or f"send failed on control stream: {exc}")
            return False
        self._last_sent = time.monotonic()
        if ticket is not None:
            self._part_sent(ticket)
        return True

    def _part_sent(self, ticket: SendTicket) -> None:
        ticket.chunk_sent()
        if ticket.done.is_set():
            with self._id_lock:
                self._tickets.discard(ticket)

    def _enqueue_control(self, msg: Message, ticket: SendTicket | None = None, close_reason: str | None = None) -> None:
        with self._id_lock:
            if self._control_queued >= MAX_QUEUED_CONTROL_FRAMES:
                overflow = True
            else:
                overflow = False
                self._control_queued += 1
        if overflow:  # it has not read our last frames for a long while: it is not coming back
            self.close(f"the peer stopped reading: {MAX_QUEUED_CONTROL_FRAMES} control frames waiting to be sent")
            return
        self._control_queue.put((msg, ticket, close_reason))

    def _control_sender_loop(self) -> None:
        while True:
            item = self._control_queue.get()
            if item is None:
                return
            msg, ticket, close_reason = item
            with self._id_lock:
                self._control_queued -= 1
            if isinstance(msg, Heartbeat):
                self._heartbeat_queued = False
            if not self._write_control(msg, ticket, close_reason):
                return
            if close_reason is not None:
                self.close(close_reason)
                return

    def _sender_loop(self, index: int, stream: Stream, q: queue.SimpleQueue[Any]) -> None:
        scratch: memoryview | None = None  # this stream's encode buffer for lazy payloads
        while True:
            item = q.get()
            if item is None:
                return
            ticket, transfer, total, offset, view = item
            if isinstance(view, tuple):  # a lazy payload: produce this part right before sending it
                lazy, n = view
                if scratch is None:
                    scratch = receive_buffer(CHUNK_BYTES)
                view = scratch[:n]
                try:
                    lazy.fill(offset, view)
                except Exception as exc:  # a half-sent transfer cannot be finished: fail the group
                    log.exception("%s: encoding part of transfer %d failed", self.name, transfer)
                    self.close(f"encoding a payload failed: {exc}")
                    return
            started = time.monotonic()
            try:
                stream.send_chunk(transfer, total, offset, view)
            except OSError as exc:
                self.close(f"send failed on {stream.name}: {exc}")
                return
            took = max(time.monotonic() - started, 1e-6)
            with self._id_lock:  # what the adaptive schedule knows about this stream
                self._backlog[index] -= len(view)
                rate = len(view) / took
                old = self._rates[index]
                self._rates[index] = rate if old is None else (1 - RATE_EMA) * old + RATE_EMA * rate
            self._part_sent(ticket)

    # -- receiving -------------------------------------------------------------------------
    def _idle(self) -> None:
        if self._closed.is_set():
            raise ConnectionClosed("closed locally")
        now = time.monotonic()
        if now - self._last_heard > self._peer_timeout_s:
            raise ConnectionClosed(f"no frame from the peer for {self._peer_timeout_s:g} s")
        if self._stall_timeout_s > 0:
            self._check_stall(now)
        if now - self._last_sent >= self._heartbeat_s and not self._heartbeat_queued:
            self._hb_seq += 1
            self._heartbeat_queued = bool(self._threads)
            self._send_control(Heartbeat(self._hb_seq, self._heartbeat_step()))

    def _check_stall(self, now: float) -> None:
        """The WAN watchdog: a stream whose unsent bytes, or an inbound message whose bytes, made no
        progress for the stall timeout fails the whole group (the learner then redials)."""
        limit = self._stall_timeout_s
        for stream in self.data:
            if stream.sending and now - stream.progress_at > limit:
                raise ConnectionClosed(f"{stream.name} stalled: unsent bytes made no progress for {limit:g} s")
        if self._reassembler.incomplete():
            latest = max(s.progress_at for s in self.data)
            if now - latest > limit:
                raise ConnectionClosed(f"{self.name}: an inbound message stopped growing for {limit:g} s")

    def set_user_timeout(self, seconds: float) -> None:
        """TCP_USER_TIMEOUT on every stream: the kernel drops a connection whose sent data stays
        unacknowledged this long. Set only after the initial cut, so a long INIT is never reset."""
        option = getattr(socket, "TCP_USER_TIMEOUT", None)
        if option is None or seconds <= 0:
            return
        for stream in [self.control, *self.data]:
            with contextlib.suppress(OSError):
                stream.sock.setsockopt(socket.IPPROTO_TCP, option, int(seconds * 1000))

    def _control_loop(self) -> None:
        try:
            while not self._closed.is_set():
                msg = self.control.read_message(idle=self._idle)
                self._last_heard = time.monotonic()
                self._idle()
                if isinstance(msg, Heartbeat):
                    continue
                if msg.BULK:
                    self._reassembler.announce(msg)
                else:
                    self._on_message(msg, None)
        except ProtocolError as exc:
            self._refuse(str(exc))
        except (ConnectionClosed, OSError) as exc:
            self.close(str(exc))
        except Exception as exc:  # a handler bug must still close the group, never hang it
            log.exception("%s: control loop failed", self.name)
            self.close(f"internal error: {exc}")

    def _data_loop(self, stream: Stream) -> None:
        head = bytearray(HEADER.size + CHUNK_HEADER.size)
        view = memoryview(head)
        try:
            while not self._closed.is_set():
                stream.read_into(view[: HEADER.size])
                kind, length = parse_header(view[: HEADER.size])
                if kind is MsgType.ERROR:  # the peer refused this stream (e.g. a failed ATTACH)
                    refusal = decode_body(kind, memoryview(stream.read_exact(length)))
                    raise ConnectionClosed(f"{stream.name}: peer refused: {refusal.reason}")  # type: ignore[attr-defined]
                if kind is not MsgType.CHUNK or length < CHUNK_HEADER.size:
                    raise ProtocolError(f"{stream.name}: expected a CHUNK frame, got {kind.name}")
                stream.read_into(view[HEADER.size :])
                transfer, total, offset = CHUNK_HEADER.unpack(view[HEADER.size :])
                n = length - CHUNK_HEADER.size
                part = self._reassembler.chunk_target(transfer, total, offset, n)
                stream.read_into(part)
                self._last_heard = time.monotonic()
                if self._reassembler.chunk_done(transfer, offset, part):
                    self._faults.point("mid-stripe")  # part of a multi-chunk transfer is in, the rest is not
        except ProtocolError as exc:
            self._refuse(str(exc))
        except (ConnectionClosed, OSError) as exc:
            # The peer's last control frames (an ERROR, a BYE) may still be on their way: the
            # control reader gets a moment to read them before this stream's end closes the group.
            self._closed.wait(LAST_WORDS_S)
            self.close(str(exc))
        except Exception as exc:
            log.exception("%s: data loop failed", self.name)
            self.close(f"internal error: {exc}")

    def _refuse(self, reason: str) -> None:
        """The peer broke the protocol: tell it why (best effort), then close the group."""
        if not self._closed.is_set():
            with contextlib.suppress(OSError):
                self.control.send_frame(Error(ErrorCode.PROTOCOL, reason))
        self.close(f"protocol error: {reason}")

    def _deliver_bulk(self, msg: Message, payload: memoryview, passed: bool | None) -> None:
        if passed is None:
            self._on_message(msg, payload)
        else:
            assert self._on_screened is not None  # a screen comes with its handler
            self._on_screened(msg, payload, passed)
