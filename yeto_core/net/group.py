"""A live connection group over sockets (DESIGN §7.1, PROTOCOL §1): the threads around the wire.

One control stream plus N data streams. A bulk message is a control frame announcing a transfer,
then CHUNK frames striped over the data streams (`wire/striping.py`) by their sender threads
(`senders.py`) and read by each stream's reader thread straight into the transfer's buffer
(`wire/reassembly.py`). The control thread feeds `wire/channel.py`, which cuts out
the frames and keeps the deadlines: a HEARTBEAT when quiet, the group closed when the peer falls
silent or a stream stalls. Every failure closes the group once, with a reason. Threads: one for
the control stream, which reads and writes (`control.py`), and a reader and a sender per data stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from yeto_core.buffers import RECEIVE_POOL
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.net.control import ControlLoop
from yeto_core.net.senders import ChunkSender
from yeto_core.net.stream import Stream
from yeto_core.net.tickets import Payload, SendTicket
from yeto_core.wire.channel import ControlChannel
from yeto_core.wire.errors import ConnectionClosed, ErrorCode, ProtocolError
from yeto_core.wire.messages import CHUNK_BYTES, Error, Message
from yeto_core.wire.reassembly import Reassembler, Screen
from yeto_core.wire.striping import Striper

log = logging.getLogger(__name__)

LAST_WORDS_S = 1.0


class ConnectionGroup:
    """`on_message(msg, payload)` is called from reader threads (payload None for control messages),
    `on_close(reason)` exactly once. A bulk message `screen` returns a check for goes to
    `on_screened(msg, payload, passed)` instead, `passed` telling whether every chunk passed."""

    def __init__(self, control: Stream, data: list[Stream], *, name: str,
                 on_message: Callable[[Message, memoryview | None], None], on_close: Callable[[str], None],
                 max_payload: Callable[[], int], heartbeat_s: float = 2.0, peer_timeout_s: float = 30.0,
                 heartbeat_step: Callable[[], int] = lambda: 0, stall_timeout_s: float = 0.0, schedule: str = "rr",
                 screen: Screen | None = None, on_screened: Callable[[Message, memoryview, bool], None] | None = None,
                 faults: FaultInjector = NO_FAULTS) -> None:
        if (screen is None) != (on_screened is None):
            raise ValueError("a payload screen and on_screened come together")
        self.name, self.control, self.data = name, control, data
        self._striper = Striper(len(data), schedule)
        self._on_message, self._on_close, self._on_screened = on_message, on_close, on_screened
        self._faults = faults  # the owning process's: holds the mid-stripe point of its data readers
        self._reassembler = Reassembler(max_payload, self._deliver_bulk, name, take=RECEIVE_POOL.take,
                                        screen=screen, lock=threading.Lock())
        self._closed = threading.Event()
        self._channel = ControlChannel(time.monotonic(), heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                                       stall_timeout_s=stall_timeout_s, name=name)
        self._control = ControlLoop(control, self._channel, self._reassembler, data, closed=self._closed,
                                    on_message=on_message, close=self.close, part_sent=self._part_sent,
                                    heartbeat_step=heartbeat_step, write_timeout_s=max(0.05, heartbeat_s / 2))
        self._senders = [ChunkSender(i, stream, group=name, close=self.close, part_sent=self._part_sent,
                                     wrote=self._wrote) for i, stream in enumerate(data)]
        self._next_transfer = 1
        self._lock = threading.Lock()  # transfer ids, tickets, the striping plan
        self._close_lock = threading.Lock()
        self._tickets: set[SendTicket] = set()
        self.close_reason: str | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the reader and sender threads (none for a group closed before it started). Under
        the close lock, so `join` on another thread only ever sees a complete list of them."""
        with self._close_lock:
            if self._closed.is_set() or self._threads:
                return
            with contextlib.suppress(OSError):  # a socket already gone: the loops end at once
                for stream in self.data:
                    stream.sock.settimeout(None)
            targets: list[tuple[Callable[..., None], tuple[Any, ...], str]] = [
                (self._guarded, (self._control.run, False), "ctl"),
                *[(self._guarded, (self._read_chunks, True, s), f"rx{i}") for i, s in enumerate(self.data)],
                *[(sender.run, (), f"tx{i}") for i, sender in enumerate(self._senders)]]
            self._threads = [threading.Thread(target=fn, args=args, name=f"{self.name}-{tag}", daemon=True)
                             for fn, args, tag in targets]
            for t in self._threads:
                t.start()

    def set_user_timeout(self, seconds: float) -> None:
        """On every stream; set only after the initial cut, so a long INIT is never reset."""
        for stream in [self.control, *self.data]:
            stream.set_user_timeout(seconds)

    @property
    def silent_s(self) -> float:  # since the peer was last heard
        return self._channel.silent_s(time.monotonic())

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def wait_closed(self, timeout: float) -> bool:
        return self._closed.wait(timeout)

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` for the threads to end after `close()`: a daemon thread freeing the
        last reference to a tensor-backed buffer during interpreter shutdown aborts the process."""
        deadline = time.monotonic() + timeout
        with self._close_lock:
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            return False  # a sender still running must find its stop sentinel in its queue
        for sender in self._senders:
            sender.drain()
        return True

    def close(self, reason: str, *, last: Message | None = None) -> None:
        """Close the group; with `last`, send that control message first (after every control
        frame queued before it; bounded by the control stream's timeout)."""
        if last is not None and not self._closed.is_set():
            if self._threads:
                self._control.put(last, None, reason)
                return
            with contextlib.suppress(OSError):  # not started: no sender thread to hand it to
                self.control.send_frame(last)
        with self._close_lock:
            if self._closed.is_set():
                return
            self.close_reason = reason
            self._closed.set()
        self._control.wake()
        for stream in [self.control, *self.data]:
            stream.close()
        for sender in self._senders:
            sender.stop()
        with self._lock:
            tickets, self._tickets = self._tickets, set()
        for ticket in tickets:
            ticket.fail(reason)
        try:
            self._on_close(reason)
        except Exception:
            log.exception("%s: close handler failed", self.name)

    # -- sending ---------------------------------------------------------------------------
    def send(self, msg: Message, payload: Payload | None = None) -> SendTicket:
        """Send a control message, or a bulk message with its payload, striped over the data
        streams. Never blocks on the bulk bytes: the ticket completes when every chunk is out."""
        if (payload is not None) != msg.BULK:
            raise ValueError(f"{msg.TYPE.name} {'needs a' if msg.BULK else 'carries no'} bulk payload")
        lazy = payload if hasattr(payload, "fill") else None
        view = memoryview(payload).cast("B") if payload is not None and lazy is None else None  # type: ignore[arg-type]
        total = lazy.nbytes if lazy is not None else len(view) if view is not None else 0  # type: ignore[union-attr]
        with self._lock:
            if self._closed.is_set():  # close() has failed every ticket it knew of: this one too
                return SendTicket.failed(self.close_reason or "connection closed")
            plan = self._striper.plan(total, CHUNK_BYTES) if msg.BULK else []
            ticket = SendTicket(len(plan) + 1)  # and the frame on the control stream
            self._tickets.add(ticket)
            transfer, self._next_transfer = self._next_transfer, self._next_transfer + msg.BULK
        if msg.BULK:
            msg = dataclasses.replace(msg, transfer=transfer, nbytes=total)  # type: ignore[type-var]
        self._send_control(msg, ticket)
        for i, offset, n in plan:
            part = (lazy, n) if view is None else view[offset : offset + n]
            self._senders[i].put((ticket, transfer, total, offset, part))
        return ticket

    def _send_control(self, msg: Message, ticket: SendTicket | None = None) -> None:
        if self._threads:
            self._control.put(msg, ticket)
        else:  # not started (a test driving a group by hand): write it here
            self._control.write_now(msg, ticket)

    def _part_sent(self, ticket: SendTicket) -> None:
        ticket.chunk_sent()
        if ticket.done.is_set():
            with self._lock:
                self._tickets.discard(ticket)

    def _wrote(self, stream: int, nbytes: int, seconds: float) -> None:
        with self._lock:  # what the adaptive schedule knows about this stream
            self._striper.sent(stream, nbytes, seconds)

    # -- receiving -------------------------------------------------------------------------
    def _guarded(self, loop: Callable[..., None], last_words: bool, *args: Any) -> None:
        """Run a reader loop; whatever ends it closes the group, with the reason."""
        try:
            loop(*args)
        except ProtocolError as exc:  # the peer broke the protocol: tell it why (best effort), then close
            refusal, reason = Error(ErrorCode.PROTOCOL, str(exc)), f"protocol error: {exc}"
            if loop != self._control.run:
                return self._control.put(refusal, None, reason)  # in order, by the control thread
            if not self._closed.is_set():
                self._control.last_words(refusal)
            self.close(reason)
        except (ConnectionClosed, OSError) as exc:
            if last_words:  # the peer's last control frames (an ERROR, a BYE) may still be coming
                self._closed.wait(LAST_WORDS_S)
            self.close(str(exc))
        except Exception as exc:  # a handler bug must still close the group, never hang it
            log.exception("%s: %s failed", self.name, loop.__name__)
            self.close(f"internal error: {exc}")

    def _read_chunks(self, stream: Stream) -> None:
        """A data stream's reader: each chunk's head, then its bytes straight into their place."""
        while not self._closed.is_set():
            chunk = stream.read_chunk_head()
            part = self._reassembler.chunk_target(chunk.transfer, chunk.total, chunk.offset, chunk.nbytes)
            stream.read_into(part)
            self._channel.heard(time.monotonic())
            if self._reassembler.chunk_done(chunk.transfer, chunk.offset, part):
                self._faults.point("mid-stripe")  # part of a multi-chunk transfer is in, the rest is not

    def _deliver_bulk(self, msg: Message, payload: memoryview, passed: bool | None) -> None:
        if passed is None:  # not screened (with a screen comes its handler, on_screened)
            return self._on_message(msg, payload)
        self._on_screened(msg, payload, passed)  # type: ignore[misc]
