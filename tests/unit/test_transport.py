"""Connection groups over real loopback sockets, and the reassembler on its own."""

from __future__ import annotations

import dataclasses
import queue
import random
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import yeto_core.net.control as control
from yeto_core.net.group import ConnectionGroup
from yeto_core.net.stream import Stream
from yeto_core.net.tickets import SendTicket
from yeto_core.wire.errors import ErrorCode, ProtocolError
from yeto_core.wire.messages import (
    CHUNK_BYTES,
    CHUNK_HEADER,
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Bcast,
    Bye,
    Done,
    Error,
    Heartbeat,
    Init,
    Message,
    MsgType,
    Pull,
    Push,
    encode_frame,
)
from yeto_core.wire.reassembly import MAX_TRANSFERS_IN_FLIGHT, Reassembler, Screen
from yeto_core.wire.striping import pick_stream

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]

MIB = 1024 * 1024
WAIT_S = 5.0  # generous upper bound for anything that should take milliseconds on loopback

PUSH = Push(round=1, attempt=1, fragment=0, base_version=0, tokens=100, steps=4, step_us=1000, transfer=0, nbytes=0,
            codec=1)


def _tcp_pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    """n connected TCP socket pairs on 127.0.0.1 (the same kind of socket the syncer serves)."""
    pairs = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = listener.getsockname()[:2]
        for _ in range(n):
            a = socket.create_connection(address, timeout=WAIT_S)
            b, _ = listener.accept()
            a.settimeout(None)
            pairs.append((a, b))
    return pairs


def _random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _chunk_frame(transfer: int, total: int, offset: int, data: bytes, *, length: int | None = None) -> bytes:
    n = CHUNK_HEADER.size + len(data) if length is None else length
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.CHUNK), 0, n)
    return head + CHUNK_HEADER.pack(transfer, total, offset) + data


class Side:
    """One end of a link: a ConnectionGroup whose messages land in `inbox`."""

    def __init__(
        self,
        name: str,
        socks: list[socket.socket],
        *,
        max_payload: int = 64 * MIB,
        heartbeat_s: float = 0.2,
        peer_timeout_s: float = 5.0,
        heartbeat_step: Callable[[], int] = lambda: 0,
        handler: Callable[[Message, memoryview | None], None] | None = None,
        stall_timeout_s: float = 0.0,
        schedule: str = "rr",
        screen: Screen | None = None,
    ) -> None:
        self.inbox: queue.SimpleQueue[tuple[Message, memoryview | None]] = queue.SimpleQueue()
        self.screened: queue.SimpleQueue[tuple[Message, bytes, bool]] = queue.SimpleQueue()
        self.closes: list[str] = []
        self.close_called = threading.Event()
        self.control = Stream(socks[0], f"{name}/ctl")
        self.data = [Stream(s, f"{name}/data{i}") for i, s in enumerate(socks[1:])]
        self.group = ConnectionGroup(
            self.control,
            self.data,
            name=name,
            on_message=handler or (lambda msg, payload: self.inbox.put((msg, payload))),
            on_close=self._on_close,
            max_payload=lambda: max_payload,
            heartbeat_s=heartbeat_s,
            peer_timeout_s=peer_timeout_s,
            heartbeat_step=heartbeat_step,
            stall_timeout_s=stall_timeout_s,
            schedule=schedule,
            screen=screen,
            on_screened=None if screen is None else (lambda m, p, ok: self.screened.put((m, bytes(p), ok))),
        )

    def _on_close(self, reason: str) -> None:
        self.closes.append(reason)
        self.close_called.set()

    def closed_with(self) -> str:
        """Wait until on_close ran (it runs after `closed` turns true) and return the one reason."""
        assert self.close_called.wait(WAIT_S), "on_close was never called"
        assert self.closes == [self.group.close_reason]
        return self.closes[0]

    def get(self, timeout: float = WAIT_S) -> tuple[Message, memoryview | None]:
        return self.inbox.get(timeout=timeout)

    def stop(self) -> None:
        self.group.close("test finished")
        for t in self.group._threads:
            t.join(WAIT_S)
        alive = [t.name for t in self.group._threads if t.is_alive()]
        assert not alive, f"threads still running after close: {alive}"


class Links:
    """Builds linked sides and cleans every socket and thread up after the test."""

    def __init__(self) -> None:
        self.sides: list[Side] = []
        self.raw: list[socket.socket] = []

    def pair(self, n: int, *, start_a: bool = True, start_b: bool = True, a: dict[str, Any] | None = None,
             b: dict[str, Any] | None = None) -> tuple[Side, Side]:
        pairs = _tcp_pairs(1 + n)
        side_a = Side("a", [x for x, _ in pairs], **(a or {}))
        side_b = Side("b", [y for _, y in pairs], **(b or {}))
        self.sides += [side_a, side_b]
        if start_a:
            side_a.group.start()
        if start_b:
            side_b.group.start()
        return side_a, side_b

    def raw_peer(self, n: int, *, start: bool = True, **kw: Any) -> tuple[list[socket.socket], Side]:
        """A group on one end and plain sockets on the other, to write any bytes at all."""
        pairs = _tcp_pairs(1 + n)
        raw = [x for x, _ in pairs]
        for s in raw:
            s.settimeout(WAIT_S)
        self.raw += raw
        side = Side("b", [y for _, y in pairs], **kw)
        self.sides.append(side)
        if start:
            side.group.start()
        return raw, side

    def cleanup(self) -> None:
        for side in self.sides:
            side.stop()
        for s in self.raw:
            s.close()


@pytest.fixture
def links() -> Iterator[Links]:
    made = Links()
    yield made
    made.cleanup()


def _error_frame(sock: socket.socket) -> Error:
    """The ERROR frame a group sent to a raw peer's control socket (heartbeats skipped)."""
    stream = Stream(sock, "raw")
    while True:
        msg = stream.read_message()
        if isinstance(msg, Error):
            return msg
        assert isinstance(msg, Heartbeat), msg


def _read_frame(sock: socket.socket) -> tuple[MsgType, bytes]:
    stream = Stream(sock, "raw")
    kind, body = stream.read_frame()
    return kind, bytes(body)


# -- control and bulk delivery ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_control_messages_arrive_in_order_both_ways(links: Links, n: int) -> None:
    a, b = links.pair(n)
    to_b = [Pull(i, 1, i % 7, i // 7) for i in range(200)] + [Bye("last")]
    to_a = [Done(i) for i in range(200)]
    sender = threading.Thread(target=lambda: [b.group.send(m) for m in to_a])
    sender.start()
    tickets = [a.group.send(m) for m in to_b]
    sender.join(WAIT_S)
    assert all(t.wait(WAIT_S) for t in tickets)  # each completes once its frame is written
    assert [b.get() for _ in to_b] == [(m, None) for m in to_b]
    assert [a.get() for _ in to_a] == [(m, None) for m in to_a]
    assert not a.group.closed and not b.group.closed


SIZES = [0, 1, 4 * MIB, 4 * MIB + 1, 13 * MIB + 12345]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("size", SIZES, ids=["0", "1", "4MiB", "4MiB+1", "13MiB+"])
def test_bulk_payload_arrives_intact(links: Links, n: int, size: int) -> None:
    a, b = links.pair(n)
    data = _random_bytes(size, seed=size)
    ticket = a.group.send(PUSH, data)
    assert ticket.wait(WAIT_S), ticket.error
    assert ticket.ok
    msg, payload = b.get()
    # The sender assigns the transfer id and the byte count.
    assert msg == dataclasses.replace(PUSH, transfer=1, nbytes=size)
    assert payload is not None
    # One buffer of exactly the transfer's size, filled in place.
    assert payload.nbytes == size and not payload.readonly
    assert payload == data
    assert not b.group.closed


def test_many_transfers_in_both_directions_at_once(links: Links) -> None:
    a, b = links.pair(3)
    a_sizes = [9 * MIB + 7, 0, 1, 5 * MIB, 3 * MIB]
    b_sizes = [6 * MIB + 1, 2]
    a_data = [_random_bytes(s, seed=i) for i, s in enumerate(a_sizes)]
    b_data = [_random_bytes(s, seed=100 + i) for i, s in enumerate(b_sizes)]
    tickets: list[SendTicket] = []
    for i, d in enumerate(a_data):
        tickets.append(a.group.send(Init(i, 0, 0, 1), d))
        a.group.send(Pull(i, 1, i, 0))  # control frames interleave with the bulk traffic
    for i, d in enumerate(b_data):
        tickets.append(b.group.send(Bcast(i, 1, 0, 1, 0, 0, 1), d))
    assert all(t.wait(WAIT_S) for t in tickets)
    got_b = [b.get() for _ in range(2 * len(a_sizes))]
    pulls = [m for m, _ in got_b if isinstance(m, Pull)]
    assert pulls == [Pull(i, 1, i, 0) for i in range(len(a_sizes))]
    inits = {m.transfer: (m, p) for m, p in got_b if isinstance(m, Init)}
    assert sorted(inits) == [1, 2, 3, 4, 5]
    for i, d in enumerate(a_data):
        m, p = inits[i + 1]
        assert (m.fragment, m.nbytes) == (i, len(d))
        assert p == d
    bcasts = {m.transfer: (m, p) for m, p in (a.get() for _ in b_sizes) if isinstance(m, Bcast)}
    for i, d in enumerate(b_data):
        bcast, payload = bcasts[i + 1]
        assert bcast.fragment == i and payload == d


@pytest.mark.parametrize("n", [1, 2, 3])
def test_chunks_are_striped_round_robin_over_the_data_streams(links: Links, n: int) -> None:
    a, b = links.pair(n, start_a=False)
    sent: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    for i, stream in enumerate(a.data):
        original = stream.send_chunk

        def counting(transfer: int, total: int, offset: int, view: memoryview, *, _i: int = i,
                     _send: Callable[..., None] = original) -> None:
            sent[_i].append((transfer, offset, len(view)))
            _send(transfer, total, offset, view)

        stream.send_chunk = counting  # type: ignore[method-assign]
    a.group.start()
    first = _random_bytes(13 * MIB)  # four chunks: 4 + 4 + 4 + 1 MiB
    second = _random_bytes(5 * MIB, seed=1)  # two chunks, continuing where the first left off
    assert a.group.send(PUSH, first).wait(WAIT_S)
    assert a.group.send(PUSH, second).wait(WAIT_S)
    chunks = [(1, o, min(CHUNK_BYTES, len(first) - o)) for o in range(0, len(first), CHUNK_BYTES)]
    chunks += [(2, o, min(CHUNK_BYTES, len(second) - o)) for o in range(0, len(second), CHUNK_BYTES)]
    expected: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    for k, chunk in enumerate(chunks):
        expected[k % n].append(chunk)
    assert sent == expected
    assert all(per_stream for per_stream in sent)  # every data stream carried bytes
    assert all(size <= CHUNK_BYTES for per_stream in sent for _, _, size in per_stream)
    received = dict((m.transfer, p) for m, p in (b.get(), b.get()) if isinstance(m, Push))
    assert received[1] == first and received[2] == second


def test_empty_bulk_sends_no_chunk_and_completes_with_its_header(links: Links) -> None:
    a, b = links.pair(2)
    ticket = a.group.send(PUSH, b"")
    assert ticket.wait(WAIT_S)
    msg, payload = b.get()
    assert msg.nbytes == 0 and payload is not None and len(payload) == 0  # type: ignore[attr-defined]


def test_send_checks_payload_against_the_message_kind(links: Links) -> None:
    a, _ = links.pair(1)
    with pytest.raises(ValueError, match="PULL carries no bulk payload"):
        a.group.send(Pull(0, 0, 0, 0), b"x")
    with pytest.raises(ValueError, match="PUSH needs a bulk payload"):
        a.group.send(PUSH)


def test_a_group_needs_a_data_stream() -> None:
    one, two = socket.socketpair()
    try:
        with pytest.raises(ValueError, match="at least one data stream"):
            ConnectionGroup(Stream(one, "ctl"), [], name="x", on_message=lambda m, p: None,
                            on_close=lambda r: None, max_payload=lambda: 0)
    finally:
        one.close()
        two.close()


# -- bounds and malformed input --------------------------------------------------------------


def test_transfer_over_max_payload_closes_the_receiver(links: Links) -> None:
    a, b = links.pair(2, b={"max_payload": MIB})
    ticket = a.group.send(PUSH, _random_bytes(2 * MIB))
    reason = b.closed_with()
    assert f"transfer of {2 * MIB} bytes exceeds the {MIB}-byte bound" in reason
    assert b.inbox.empty()
    assert a.group.wait_closed(WAIT_S)  # the sender sees its peer go
    assert ticket.done.wait(WAIT_S)


@pytest.mark.parametrize("first", ["announcement", "chunk"])
def test_an_oversize_claim_allocates_nothing(links: Links, first: str) -> None:
    raw, b = links.raw_peer(1, max_payload=MIB)
    claim = 256 * MIB  # allocating this would be easy to see; a bigger claim would just fail to allocate
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        if first == "announcement":
            raw[0].sendall(encode_frame(dataclasses.replace(PUSH, transfer=9, nbytes=claim)))
        else:
            raw[1].sendall(_chunk_frame(9, claim, 0, b"\0" * 16))
        reason = b.closed_with()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"transfer of {claim} bytes exceeds the {MIB}-byte bound" in reason
    assert peak - base < 8 * MIB
    assert b.inbox.empty()
    error = _error_frame(raw[0])
    assert error.code is ErrorCode.PROTOCOL and f"exceeds the {MIB}-byte bound" in error.reason


BAD_DATA_FRAMES = [
    pytest.param(b"JUNK" + bytes(8), "bad frame magic", id="bad-magic"),
    pytest.param(HEADER.pack(MAGIC, 9, int(MsgType.CHUNK), 0, 24), "protocol version 9", id="bad-version"),
    pytest.param(encode_frame(Heartbeat(1, 2)), "expected a CHUNK frame, got HEARTBEAT", id="control-frame"),
    pytest.param(HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.CHUNK), 0, 8), "expected a CHUNK frame",
                 id="short-chunk"),
    pytest.param(_chunk_frame(1, 0, 0, b"", length=CHUNK_HEADER.size + CHUNK_BYTES + 1), "exceeds",
                 id="oversize-chunk"),
    pytest.param(_chunk_frame(1, 4, 0, b"12345678"), "chunk [0, 8) does not tile a transfer of 4 bytes", id="past-end"),
]


@pytest.mark.parametrize(("frame", "reason"), BAD_DATA_FRAMES)
def test_malformed_frame_on_a_data_stream_closes_the_group(links: Links, frame: bytes, reason: str) -> None:
    raw, b = links.raw_peer(2)
    raw[2].sendall(frame)
    assert reason in b.closed_with()
    assert b.inbox.empty()
    # The peer is told why, on the control stream, before the group goes.
    error = _error_frame(raw[0])
    assert error.code is ErrorCode.PROTOCOL and reason in error.reason


def test_malformed_frame_on_the_control_stream_closes_the_group(links: Links) -> None:
    raw, b = links.raw_peer(1)
    raw[0].sendall(b"GET / HTTP/1")  # exactly one header's worth, so nothing is left unread
    assert "bad frame magic" in b.closed_with()
    error = _error_frame(raw[0])
    assert error.code is ErrorCode.PROTOCOL and "bad frame magic" in error.reason


def test_a_failing_handler_closes_the_group(links: Links) -> None:
    def handler(msg: Message, payload: memoryview | None) -> None:
        raise RuntimeError("handler bug")

    a, b = links.pair(1, b={"handler": handler})
    a.group.send(Pull(0, 0, 0, 0))
    assert b.closed_with() == "internal error: handler bug"


# -- heartbeats and peer timeout -------------------------------------------------------------


def test_silent_peer_is_detected(links: Links) -> None:
    # b is built but never started: it neither reads nor sends heartbeats.
    a, b = links.pair(1, start_b=False, a={"heartbeat_s": 0.1, "peer_timeout_s": 0.5})
    t0 = time.monotonic()
    assert a.group.wait_closed(3.0)
    elapsed = time.monotonic() - t0
    assert 0.4 <= elapsed < 3.0
    assert "no frame from the peer" in a.closed_with()
    assert b.closes == []


def test_heartbeats_keep_a_quiet_link_alive(links: Links) -> None:
    fast = {"heartbeat_s": 0.1, "peer_timeout_s": 0.5}
    a, b = links.pair(1, a=fast, b=fast)
    time.sleep(1.5)  # three peer timeouts without a single application message
    assert not a.group.closed and not b.group.closed
    a.group.close("leaving")
    assert b.closed_with()


def test_heartbeats_are_numbered_and_carry_the_step(links: Links) -> None:
    raw, _ = links.raw_peer(1, heartbeat_s=0.05, heartbeat_step=lambda: 42)
    frames = [_read_frame(raw[0]) for _ in range(3)]
    assert [k for k, _ in frames] == [MsgType.HEARTBEAT] * 3
    beats = [Heartbeat.decode(body) for _, body in frames]
    assert [(h.seq, h.step) for h in beats] == [(1, 42), (2, 42), (3, 42)]


# -- closing ---------------------------------------------------------------------------------


def test_close_fails_pending_tickets_and_calls_on_close_once(links: Links) -> None:
    # Not started: nothing drains the send queues, so the ticket stays pending until close().
    raw, a = links.raw_peer(2, start=False)
    ticket = a.group.send(PUSH, _random_bytes(9 * MIB))
    assert not ticket.done.is_set()
    kind, _ = _read_frame(raw[0])  # the announcement went out on the control stream
    assert kind is MsgType.PUSH
    barrier = threading.Barrier(8)

    def close(i: int) -> None:
        barrier.wait()
        a.group.close(f"closer {i}")

    closers = [threading.Thread(target=close, args=(i,)) for i in range(8)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(WAIT_S)
    reason = a.group.close_reason
    assert reason is not None and reason.startswith("closer ")
    assert a.closes == [reason]
    assert a.group.closed
    assert ticket.done.is_set() and not ticket.ok and ticket.error == reason
    assert not ticket.wait(0)
    for later in (a.group.send(Pull(0, 0, 0, 0)), a.group.send(PUSH, b"abc")):
        assert later.done.is_set() and later.error == reason
    a.group.close("again")
    assert a.closes == [reason]


def test_send_ticket_counts_chunks() -> None:
    ticket = SendTicket(3)
    assert not ticket.done.is_set()
    ticket.chunk_sent()
    ticket.chunk_sent()
    assert not ticket.wait(0)
    ticket.chunk_sent()
    assert ticket.ok and ticket.wait(0)
    ticket.fail("too late")  # a completed ticket stays completed
    assert ticket.ok and ticket.error is None
    failed = SendTicket(2)
    failed.fail("gone")
    assert failed.done.is_set() and not failed.ok and failed.error == "gone"


class _CloseOnFirstEnter:
    """Stands in for the group's lock and closes the group just before send() takes it."""

    def __init__(self, group: ConnectionGroup) -> None:
        self._group = group
        self._lock = threading.Lock()
        self._fired = False

    def __enter__(self) -> _CloseOnFirstEnter:
        if not self._fired:
            self._fired = True
            self._group.close("link lost while sending")
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_send_racing_close_still_completes_the_ticket(links: Links) -> None:
    _, a = links.raw_peer(1, start=False)
    a.group._lock = _CloseOnFirstEnter(a.group)  # type: ignore[assignment]
    ticket = a.group.send(PUSH, b"x" * 1000)
    assert a.group.closed
    assert ticket.done.wait(0.5), "the ticket of a send that raced close() never completes"
    assert not ticket.ok


# -- reassembler -----------------------------------------------------------------------------


class Collected:
    """A reassembler with small chunks (the tiling rule is the same at any chunk size)."""

    def __init__(self, bound: int = MIB, chunk_bytes: int = 4, screen: Screen | None = None) -> None:
        self.bound = bound
        self.delivered: list[tuple[Message, bytes]] = []
        self.verdicts: list[bool | None] = []
        self.r = Reassembler(lambda: self.bound, self._deliver, "peer", chunk_bytes=chunk_bytes, screen=screen)

    def _deliver(self, msg: Message, payload: memoryview, passed: bool | None) -> None:
        self.delivered.append((msg, bytes(payload)))
        self.verdicts.append(passed)

    def chunk(self, transfer: int, total: int, offset: int, data: bytes) -> None:
        target = self.r.chunk_target(transfer, total, offset, len(data))
        target[:] = data
        self.r.chunk_done(transfer, offset, target)


def _push(transfer: int, nbytes: int) -> Push:
    return dataclasses.replace(PUSH, transfer=transfer, nbytes=nbytes)


def test_reassembler_announcement_then_chunks() -> None:
    c = Collected(chunk_bytes=5)
    c.r.announce(_push(1, 10))
    c.chunk(1, 10, 0, b"01234")
    assert c.delivered == []
    c.chunk(1, 10, 5, b"56789")
    assert c.delivered == [(_push(1, 10), b"0123456789")]


def test_reassembler_chunks_before_the_announcement() -> None:
    c = Collected(chunk_bytes=5)
    c.chunk(1, 10, 5, b"56789")
    c.chunk(1, 10, 0, b"01234")
    assert c.delivered == []  # every byte is here, but not the message yet
    c.r.announce(_push(1, 10))
    assert c.delivered == [(_push(1, 10), b"0123456789")]


def test_reassembler_announcement_between_chunks() -> None:
    c = Collected(chunk_bytes=3)
    c.chunk(7, 6, 3, b"def")
    c.r.announce(_push(7, 6))
    assert c.delivered == []
    c.chunk(7, 6, 0, b"abc")
    assert c.delivered == [(_push(7, 6), b"abcdef")]


def test_reassembler_empty_transfer_is_delivered_on_announcement() -> None:
    c = Collected()
    c.r.announce(_push(3, 0))
    assert c.delivered == [(_push(3, 0), b"")]


def test_reassembler_forgets_a_delivered_transfer() -> None:
    c = Collected()
    c.r.announce(_push(1, 2))
    c.chunk(1, 2, 0, b"ab")
    c.r.announce(_push(1, 3))  # the id is free again: this is a new transfer
    c.chunk(1, 3, 0, b"xyz")
    assert [p for _, p in c.delivered] == [b"ab", b"xyz"]


def test_reassembler_refuses_a_duplicate_announcement() -> None:
    c = Collected()
    c.r.announce(_push(1, 10))
    with pytest.raises(ProtocolError, match="peer: transfer 1 announced twice"):
        c.r.announce(_push(1, 10))


def test_reassembler_refuses_a_size_that_disagrees_with_the_announcement() -> None:
    c = Collected()
    c.r.announce(_push(1, 10))
    with pytest.raises(ProtocolError, match="transfer 1 announced 10 bytes, chunk says 20"):
        c.r.chunk_target(1, 20, 0, 4)
    c2 = Collected()
    c2.chunk(1, 20, 0, b"abcd")
    with pytest.raises(ProtocolError, match="transfer 1 announced 20 bytes, chunk says 10"):
        c2.r.announce(_push(1, 10))


@pytest.mark.parametrize(("total", "offset", "n"), [(10, 8, 4), (10, 12, 0), (10, 0, 11), (10, 2, 4),
                                                    (10, 4, 2), (2 * CHUNK_BYTES, 0, CHUNK_BYTES + 1)])
def test_reassembler_refuses_a_chunk_that_does_not_tile(total: int, offset: int, n: int) -> None:
    c = Collected(bound=4 * CHUNK_BYTES)
    with pytest.raises(ProtocolError, match=rf"chunk \[{offset}, {offset + n}\) does not tile a transfer of {total}"):
        c.r.chunk_target(1, total, offset, n)


def test_reassembler_refuses_a_repeated_chunk() -> None:
    c = Collected()
    c.chunk(1, 8, 0, b"abcd")
    with pytest.raises(ProtocolError, match="chunk at offset 0 of transfer 1 sent twice"):
        c.chunk(1, 8, 0, b"abcd")
    assert c.delivered == []


def test_reassembler_refuses_a_chunk_for_an_unknown_transfer() -> None:
    c = Collected()
    with pytest.raises(ProtocolError, match="chunk for unknown transfer 5"):
        c.r.chunk_done(5, 0, memoryview(b"abcd"))


class Checks:
    """A screen that checks PUSH parts (a part passes unless it holds b"!") and records each call."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def __call__(self, msg: Message) -> Callable[[memoryview], bool] | None:
        if not isinstance(msg, Push):
            return None

        def check(part: memoryview) -> bool:
            self.parts.append(bytes(part))
            return b"!" not in bytes(part)

        return check


def test_a_screen_checks_each_chunk_once_as_it_lands() -> None:
    checks = Checks()
    c = Collected(chunk_bytes=3, screen=checks)
    c.r.announce(_push(1, 8))
    c.chunk(1, 8, 3, b"def")
    assert checks.parts == [b"def"]  # screened on arrival, before the transfer is complete
    c.chunk(1, 8, 0, b"abc")
    c.chunk(1, 8, 6, b"gh")
    assert sorted(checks.parts) == [b"abc", b"def", b"gh"]
    assert c.delivered == [(_push(1, 8), b"abcdefgh")] and c.verdicts == [True]


def test_chunks_before_their_announcement_are_screened_at_delivery() -> None:
    checks = Checks()
    c = Collected(chunk_bytes=3, screen=checks)
    c.chunk(2, 8, 6, b"gh")
    c.chunk(2, 8, 0, b"abc")
    assert checks.parts == []  # the screen cannot know what they are yet
    c.r.announce(_push(2, 8))
    assert checks.parts == []  # announced; the missing chunk is screened when it lands
    c.chunk(2, 8, 3, b"def")
    assert sorted(checks.parts) == [b"abc", b"def", b"gh"]  # each exactly once
    assert c.verdicts == [True]


def test_a_failed_chunk_fails_the_transfer_whatever_the_order() -> None:
    for announce_first in (True, False):
        c = Collected(chunk_bytes=3, screen=Checks())
        if announce_first:
            c.r.announce(_push(1, 6))
        c.chunk(1, 6, 0, b"a!c")
        c.chunk(1, 6, 3, b"def")
        if not announce_first:
            c.r.announce(_push(1, 6))
        assert c.delivered == [(_push(1, 6), b"a!cdef")] and c.verdicts == [False]


def test_messages_the_screen_skips_are_delivered_unscreened() -> None:
    c = Collected(chunk_bytes=3, screen=Checks())
    init = Init(0, 1, 6, 1)
    c.r.announce(init)
    c.chunk(1, 6, 0, b"a!c")
    c.chunk(1, 6, 3, b"def")
    assert c.verdicts == [None]


def test_a_group_hands_screened_messages_to_on_screened(links: Links) -> None:
    a, b = links.pair(2, b={"screen": Checks()})
    clean, dirty = _random_bytes(9 * MIB + 5).replace(b"!", b"?"), b"x" * MIB + b"!"
    a.group.send(_push(0, 0), clean)
    a.group.send(_push(0, 0), dirty)
    a.group.send(Init(0, 0, 0, 1), b"!!!!")
    got = sorted([b.screened.get(timeout=WAIT_S), b.screened.get(timeout=WAIT_S)], key=lambda g: -len(g[1]))
    assert [(len(p), ok) for _, p, ok in got] == [(len(clean), True), (len(dirty), False)]
    assert got[0][1] == clean
    msg, payload = b.get()
    assert isinstance(msg, Init) and bytes(payload or b"") == b"!!!!"


def test_a_screen_needs_its_handler() -> None:
    one, two = socket.socketpair()
    try:
        with pytest.raises(ValueError, match="screen and on_screened come together"):
            ConnectionGroup(Stream(one, "ctl"), [Stream(two, "d")], name="x", on_message=lambda m, p: None,
                            on_close=lambda r: None, max_payload=lambda: 0, screen=Checks())
    finally:
        one.close()
        two.close()


def test_reassembler_checks_the_bound_before_allocating() -> None:
    c = Collected(bound=100)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        with pytest.raises(ProtocolError, match=f"peer: transfer of {1 << 40} bytes exceeds the 100-byte bound"):
            c.r.announce(_push(1, 1 << 40))
        with pytest.raises(ProtocolError, match="transfer of 101 bytes exceeds the 100-byte bound"):
            c.r.chunk_target(2, 101, 0, 4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 64 * 1024
    c.r.announce(_push(3, 100))  # a refused transfer leaves nothing behind
    for offset in range(0, 100, 4):
        c.chunk(3, 100, offset, bytes(4))
    assert len(c.delivered) == 1


def test_reassembler_reads_the_bound_per_transfer() -> None:
    c = Collected(bound=100)
    c = Collected(bound=100, chunk_bytes=80)
    c.r.announce(_push(1, 80))
    c.bound = 50  # e.g. the layout became known: later transfers get the tighter bound
    c.chunk(1, 80, 0, bytes(80))  # the transfer already admitted completes
    assert len(c.delivered) == 1
    with pytest.raises(ProtocolError, match="exceeds the 50-byte bound"):
        c.r.announce(_push(2, 80))


def test_reassembler_bounds_transfers_in_flight() -> None:
    c = Collected()
    for t in range(MAX_TRANSFERS_IN_FLIGHT):
        c.r.announce(_push(t + 1, 1))
    with pytest.raises(ProtocolError, match=f"more than {MAX_TRANSFERS_IN_FLIGHT} transfers in flight"):
        c.r.announce(_push(MAX_TRANSFERS_IN_FLIGHT + 1, 1))
    c.chunk(1, 1, 0, b"x")  # completing one frees a slot
    c.r.announce(_push(MAX_TRANSFERS_IN_FLIGHT + 1, 1))


def test_reassembler_never_delivers_a_transfer_with_a_hole() -> None:
    c = Collected()
    c.r.announce(_push(1, 8))
    c.chunk(1, 8, 0, b"aaaa")
    try:
        c.chunk(1, 8, 0, b"bbbb")  # the same range again; bytes 4..8 never arrive
    except ProtocolError:
        return  # refusing the repeat is a fix too
    assert c.delivered == [], f"delivered {c.delivered[0][1]!r} although bytes 4..8 never arrived"


# -- WAN stall watchdog --------------------------------------------------------------------------
def test_a_stream_whose_unsent_bytes_stop_moving_fails_the_group(links: Links) -> None:
    # b never reads its data stream: a's sender fills the kernel buffers and makes no progress.
    a, b = links.pair(1, start_b=False, a={"stall_timeout_s": 0.5, "peer_timeout_s": 30.0})
    ticket = a.group.send(PUSH, bytes(64 * MIB))
    for i in range(50):  # b's control stream stays alive: only the data stalled
        if a.group.closed:
            break
        b.control.send_frame(Heartbeat(i, 0))
        time.sleep(0.1)
    assert "stalled: unsent bytes made no progress for 0.5 s" in a.closed_with()
    assert ticket.done.wait(WAIT_S) and not ticket.ok


def test_an_inbound_message_that_stops_growing_fails_the_group(links: Links) -> None:
    raw, b = links.raw_peer(1, stall_timeout_s=0.5, peer_timeout_s=30.0)
    raw[0].sendall(encode_frame(dataclasses.replace(PUSH, transfer=1, nbytes=2 * CHUNK_BYTES)))
    raw[1].sendall(_chunk_frame(1, 2 * CHUNK_BYTES, 0, bytes(CHUNK_BYTES))[: CHUNK_BYTES // 2])  # then silence
    for i in range(20):  # the control stream stays alive: only the data stalled
        if b.group.closed:
            break
        raw[0].sendall(encode_frame(Heartbeat(i, 0)))
        time.sleep(0.1)
    assert "an inbound message stopped growing for 0.5 s" in b.closed_with()


def test_a_slow_but_moving_stream_is_not_a_stall(links: Links) -> None:
    a, b = links.pair(2, a={"stall_timeout_s": 0.3}, b={"stall_timeout_s": 0.3})
    data = _random_bytes(24 * MIB, seed=7)
    ticket = a.group.send(PUSH, data)
    assert ticket.wait(WAIT_S), ticket.error
    _, payload = b.get()
    assert payload == data and not a.group.closed and not b.group.closed


# -- adaptive striping ---------------------------------------------------------------------------
def test_pick_stream_sends_each_chunk_where_it_finishes_first() -> None:
    assert pick_stream([0, 0], [None, None], 4) == 0  # nothing known: the lowest index
    assert pick_stream([8, 0], [None, None], 4) == 1  # equal (unknown) rates: the shorter queue
    assert pick_stream([0, 0], [1.0, 10.0], 4) == 1  # the faster stream
    assert pick_stream([0, 40], [1.0, 10.0], 4) == 0  # 4/1 = 4 s beats (40 + 4)/10 = 4.4 s
    assert pick_stream([0, 0], [5.0, None], 4) == 0  # an unmeasured stream counts as fast as the best


def test_adaptive_striping_delivers_intact_and_uses_every_stream(links: Links) -> None:
    a, b = links.pair(3, a={"schedule": "adaptive"})
    sent = []
    for stream in a.data:
        original = stream.send_chunk

        def counting(transfer: int, total: int, offset: int, view: memoryview, _o=original, _s=stream) -> None:
            sent.append(_s.name)
            _o(transfer, total, offset, view)

        stream.send_chunk = counting  # type: ignore[method-assign]
    data = _random_bytes(13 * CHUNK_BYTES + 5, seed=11)
    for _ in range(3):
        assert a.group.send(PUSH, data).wait(WAIT_S)
        _, payload = b.get()
        assert payload == data
    assert {s.name for s in a.data} == set(sent)


def test_an_unknown_schedule_is_refused() -> None:
    x, y = socket.socketpair()
    try:
        with pytest.raises(ValueError, match="stream schedule 'fastest': expected one of rr, adaptive"):
            ConnectionGroup(Stream(x, "c"), [Stream(y, "d")], name="g", on_message=lambda m, p: None,
                            on_close=lambda r: None, max_payload=lambda: 1, schedule="fastest")
    finally:
        x.close()
        y.close()


class _CountingParts:
    """A lazy payload that records which parts were asked for, on which thread."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.nbytes = len(data)
        self.calls: list[tuple[int, int, str]] = []

    def fill(self, offset: int, out: memoryview) -> None:
        self.calls.append((offset, len(out), threading.current_thread().name))
        out[:] = self.data[offset : offset + len(out)]


@pytest.mark.parametrize("n", [1, 3])
def test_a_lazy_payload_is_produced_part_by_part_by_the_sender_threads(links: Links, n: int) -> None:
    a, b = links.pair(n)
    data = _random_bytes(9 * MIB + 5, seed=7)
    lazy = _CountingParts(data)
    ticket = a.group.send(PUSH, lazy)
    assert ticket.wait(WAIT_S) and ticket.ok, ticket.error
    msg, payload = b.get()
    assert msg.nbytes == len(data) and payload == data  # type: ignore[attr-defined]
    assert sorted((o, k) for o, k, _ in lazy.calls) == [(0, CHUNK_BYTES), (CHUNK_BYTES, CHUNK_BYTES),
                                                        (2 * CHUNK_BYTES, MIB + 5)]
    assert threading.current_thread().name not in {t for _, _, t in lazy.calls}  # never on the caller


def test_a_lazy_payload_that_fails_to_encode_fails_the_group(links: Links) -> None:
    a, _b = links.pair(2)

    class Broken(_CountingParts):
        def fill(self, offset: int, out: memoryview) -> None:
            if offset:
                raise RuntimeError("cannot round this part")
            super().fill(offset, out)

    ticket = a.group.send(PUSH, Broken(_random_bytes(6 * MIB)))
    assert ticket.done.wait(WAIT_S) and not ticket.ok
    assert a.group.wait_closed(WAIT_S)
    assert "encoding a payload failed: cannot round this part" in (a.group.close_reason or "")


def test_joining_at_once_after_close_does_not_strand_the_sender_threads(links: Links) -> None:
    """`join(0)` right after `close` (the syncer retires a refused group this way) must not take the
    senders' stop sentinel out of their queues: each sender thread still ends."""
    for _ in range(20):
        a, _b = links.pair(2)
        a.group.close("refused")
        a.group.join(0.0)
        assert a.group.join(WAIT_S), [t.name for t in a.group._threads if t.is_alive()]


def test_a_group_closed_before_it_starts_runs_no_threads(links: Links) -> None:
    a, _b = links.pair(1, start_a=False)
    a.group.close("refused before it started")
    a.group.start()
    assert a.group._threads == [] and a.group.join(0.0)


def test_retiring_a_group_while_another_thread_starts_it(links: Links) -> None:
    """The syncer's coordinator may close and join a group while the accept thread is starting it."""
    for _ in range(30):
        a, _b = links.pair(2, start_a=False)
        starter = threading.Thread(target=a.group.start)
        starter.start()
        a.group.close("refused")
        a.group.join(0.0)  # must not fail on a thread that is not started yet
        starter.join(WAIT_S)
        assert a.group.join(WAIT_S), [t.name for t in a.group._threads if t.is_alive()]


# -- a peer that stops reading --------------------------------------------------------------------


def test_a_peer_that_stops_reading_never_blocks_the_sender(links: Links, monkeypatch: pytest.MonkeyPatch) -> None:
    # The raw end reads nothing: once its window and our buffers are full, the control sender
    # thread waits; `send` itself returns at once, and past the queue bound the group closes.
    monkeypatch.setattr(control, "MAX_QUEUED_CONTROL_FRAMES", 500)
    raw, side = links.raw_peer(1, heartbeat_s=30.0, peer_timeout_s=60.0)
    for s in raw:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    big = Error(ErrorCode.REFUSED, "x" * 60_000)  # a few of these fill both ends' buffers
    started = time.monotonic()
    tickets = [side.group.send(big) for _ in range(600)]
    took = time.monotonic() - started
    assert took < 2.0, f"600 sends to a peer that reads nothing took {took:.1f} s"
    reason = side.closed_with()
    assert "the peer stopped reading: 500 control frames waiting" in reason
    assert all(t.done.wait(WAIT_S) for t in tickets) and not tickets[-1].ok  # unsent frames failed


def test_close_with_a_last_message_sends_it_after_what_was_queued(links: Links) -> None:
    a, b = links.pair(1)
    a.group.send(Pull(1, 1, 0, 0))
    a.group.close("refused", last=Error(ErrorCode.DUPLICATE, "learner 0 is held"))
    assert b.get()[0] == Pull(1, 1, 0, 0)
    assert b.get()[0] == Error(ErrorCode.DUPLICATE, "learner 0 is held")
    assert a.closed_with() == "refused"


def test_a_control_frame_that_stops_moving_fails_the_group_after_its_write_timeout(links: Links) -> None:
    # heartbeat_s 0.4: a control write may make no progress for 0.2 s. The raw end reads nothing.
    raw, side = links.raw_peer(1, heartbeat_s=0.4, peer_timeout_s=60.0)
    for s in raw:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    started = time.monotonic()
    for _ in range(300):  # far more than both ends' socket buffers hold
        side.group.send(Error(ErrorCode.REFUSED, "x" * 60_000))
    assert side.closed_with() == "send failed on control stream: timed out"
    assert time.monotonic() - started < 5.0


def test_a_stalled_last_message_closes_with_the_reason_it_was_sent_for(links: Links) -> None:
    raw, side = links.raw_peer(1, heartbeat_s=0.4, peer_timeout_s=60.0)
    for s in raw:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for _ in range(300):  # far more than both ends' socket buffers hold
        side.group.send(Error(ErrorCode.REFUSED, "x" * 60_000))
    side.group.close("refused: learner 3 is held", last=Error(ErrorCode.DUPLICATE, "held"))
    assert side.closed_with() in ("refused: learner 3 is held", "send failed on control stream: timed out")


def test_a_protocol_error_on_a_data_stream_reaches_the_peer_after_the_frames_queued_before_it(links: Links) -> None:
    raw, side = links.raw_peer(1)
    side.group.send(Pull(5, 0, 1, 2))
    raw[1].sendall(_chunk_frame(1, 4, 0, b"12345678"))  # does not tile: a protocol error on data0
    stream = Stream(raw[0], "raw")
    frames = []
    while not frames or not isinstance(frames[-1], Error):
        msg = stream.read_message()
        if not isinstance(msg, Heartbeat):
            frames.append(msg)
    assert frames[0] == Pull(5, 0, 1, 2)
    assert frames[-1].code is ErrorCode.PROTOCOL and "does not tile" in frames[-1].reason
    assert "does not tile" in side.closed_with()


@pytest.mark.parametrize("n", [1, 3])
def test_a_group_runs_one_control_thread_and_a_reader_and_sender_per_data_stream(links: Links, n: int) -> None:
    a, _ = links.pair(n)
    names = sorted(t.name for t in a.group._threads)
    assert names == sorted(["a-ctl", *[f"a-rx{i}" for i in range(n)], *[f"a-tx{i}" for i in range(n)]])
