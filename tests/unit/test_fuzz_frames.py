"""Fuzzing the frame decoder, the framed stream reader and the reassembler (short run for CI).

Hostile or corrupt bytes may only ever raise the protocol's own errors (`ProtocolError`, and
`ConnectionClosed` when the bytes simply stop), never ValueError / struct.error /
UnicodeDecodeError / IndexError / MemoryError ..., and decoding never allocates more than a small
multiple of the input, or the configured bound. The oracles (`check_*`) and the mutator are plain
functions so that `benchmarks/fuzz.py` runs the very same checks for as long as it is told.
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from yeto_core.layout import TensorSpec
from yeto_core.net.stream import Stream
from yeto_core.wire.codec import MAX_LIST_ITEMS, MAX_STR_BYTES
from yeto_core.wire.errors import ConnectionClosed, ErrorCode, ProtocolError
from yeto_core.wire.messages import (
    CHUNK_BYTES,
    CHUNK_HEADER,
    HEADER,
    MAGIC,
    MAX_CONTROL_BODY,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    UNKNOWN,
    Attach,
    Bcast,
    BwProbe,
    Bye,
    Challenge,
    Consensus,
    Done,
    Error,
    Final,
    Heartbeat,
    Hello,
    Init,
    Manifest,
    Message,
    MsgType,
    ProbeReport,
    Pull,
    Push,
    Welcome,
    decode_body,
    encode_frame,
    parse_header,
)
from yeto_core.wire.reassembly import MAX_TRANSFERS_IN_FLIGHT, Reassembler

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# -- seeds: one valid frame of every message type ----------------------------------------------
SEED_MESSAGES: tuple[Message, ...] = (
    Challenge(b"\x11" * 32, 4, "layers", 24),
    Hello(3, 2, b"\x22" * 32, 1, CHUNK_BYTES, 1, b"\x33" * 32, b"\x44" * 32, 0),
    Welcome(b"\x55" * 16, 7, True, b"\x66" * 32),
    Attach(b"\x55" * 16, 1, b"\x77" * 32),
    Error(ErrorCode.REFUSED, "stale push"),
    Manifest(4, "layers", (TensorSpec("model.layers.0.w", (16, 8), "float32"),
                           TensorSpec("embed", (100, 8), "bfloat16", True))),
    Init(0, 1, 4096, 1),
    Pull(5, 1, 2, 3),
    Push(5, 1, 2, 3, 1000, 8, 1234, 9, 4096, 1),
    Bcast(2, 4, 5, 1, 10, 4096, 1, b"\x88" * 32),
    Final(3, 9, 4, 24, 11, 4096, 1),
    Heartbeat(12, 340),
    Bye("finished"),
    Done(1000),
    BwProbe(1 << 20, 1 << 20, b"\x99" * 32),
    ProbeReport(12, 4, b"\xaa" * 40),
    Consensus(5, 2, 0.25, (0.1, UNKNOWN, 3.5)),
)
assert {m.TYPE for m in SEED_MESSAGES} == set(MESSAGE_TYPES)


def chunk_frame(transfer: int, total: int, offset: int, data: bytes) -> bytes:
    head = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.CHUNK), 0, CHUNK_HEADER.size + len(data))
    return head + CHUNK_HEADER.pack(transfer, total, offset) + data


SEED_FRAMES: tuple[bytes, ...] = (*(encode_frame(m) for m in SEED_MESSAGES), chunk_frame(1, 64, 0, b"\xab" * 64))

# Values a hostile peer puts into length and count fields.
NASTY_INTS = (0, 1, 2, 11, 12, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x10000, MAX_STR_BYTES, MAX_STR_BYTES + 1,
              MAX_LIST_ITEMS, MAX_LIST_ITEMS + 1, CHUNK_BYTES, CHUNK_BYTES + CHUNK_HEADER.size + 1,
              MAX_CONTROL_BODY, MAX_CONTROL_BODY + 1, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF, 1 << 32, 1 << 40,
              (1 << 63) - 1, 1 << 63, (1 << 64) - 1)

# -- mutations -----------------------------------------------------------------------------------
# An op is (kind, position, value, blob); position and value are reduced modulo what fits.
OPS = ("flip", "set", "insert", "delete", "truncate", "u32", "u64", "length", "splice")
Op = tuple[str, int, int, bytes]


def apply_ops(frame: bytes, ops: Sequence[Op]) -> bytes:
    buf = bytearray(frame)
    for kind, pos, value, blob in ops:
        n = len(buf)
        p = pos % (n + 1)
        if kind == "flip" and n:
            buf[p % n] ^= 1 << (value % 8)
        elif kind == "set" and n:
            buf[p % n] = value & 0xFF
        elif kind == "insert":
            buf[p:p] = blob
        elif kind == "delete":
            del buf[p : p + 1 + value % 16]
        elif kind == "truncate":
            del buf[p:]
        elif kind == "u32":  # overwrite a (length, count, id ...) field with a nasty value
            buf[p : p + 4] = struct.pack("<I", NASTY_INTS[value % len(NASTY_INTS)] & 0xFFFF_FFFF)
        elif kind == "u64":
            buf[p : p + 8] = struct.pack("<Q", NASTY_INTS[value % len(NASTY_INTS)] & ((1 << 64) - 1))
        elif kind == "length" and n >= HEADER.size:  # the header's body length
            buf[8:12] = struct.pack("<I", NASTY_INTS[value % len(NASTY_INTS)] & 0xFFFF_FFFF)
        elif kind == "splice":  # the tail of another seed frame (a different type's body)
            other = SEED_FRAMES[value % len(SEED_FRAMES)]
            buf[p:] = other[pos % (len(other) + 1):]
    return bytes(buf)


def random_ops(rng: random.Random, max_ops: int = 4) -> list[Op]:
    return [(rng.choice(OPS), rng.randrange(1 << 16), rng.randrange(1 << 16), rng.randbytes(rng.randrange(9)))
            for _ in range(rng.randint(1, max_ops))]


def random_input(rng: random.Random) -> bytes:
    """One fuzz input: mostly a mutated seed frame (or two back to back), sometimes pure noise."""
    r = rng.random()
    if r < 0.1:
        return rng.randbytes(rng.randrange(64))
    if r < 0.2:  # a valid header, then noise
        kind = rng.choice(list(MsgType))
        body = rng.randbytes(rng.randrange(200))
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(kind), 0, len(body)) + body
    data = apply_ops(rng.choice(SEED_FRAMES), random_ops(rng))
    if r > 0.9:
        data += apply_ops(rng.choice(SEED_FRAMES), random_ops(rng))
    return data


# -- oracles ---------------------------------------------------------------------------------------
ALLOC_FACTOR = 64  # decoding may allocate this many times its input (Python objects per field) ...
ALLOC_SLACK = 64 * 1024  # ... plus this much (exception objects, tracebacks, formatting)


class Unexpected(AssertionError):
    """An exception the protocol does not allow to escape, or an allocation beyond the bound."""


def _within(peak: int, bound: int, what: str) -> None:
    if peak > bound:
        raise Unexpected(f"{what}: allocated {peak} bytes (bound {bound})")


def decode_all(data: bytes, max_body: int = MAX_CONTROL_BODY) -> list[Message]:
    """Every frame in `data`, decoded the way a stream reads it; stops at a truncation."""
    out = []
    pos = 0
    while len(data) - pos >= HEADER.size:
        kind, length = parse_header(memoryview(data)[pos : pos + HEADER.size], max_body)
        body = memoryview(data)[pos + HEADER.size : pos + HEADER.size + length]
        if len(body) < length:
            break  # truncated: a stream would report ConnectionClosed here
        out.append(decode_body(kind, body))
        pos += HEADER.size + length
    return out


def check_decode(data: bytes, max_body: int = MAX_CONTROL_BODY) -> str:
    """parse_header + decode_body over `data`: only ProtocolError, bounded allocation. Returns
    the outcome ('ok' or the error's class name) for statistics."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            decode_all(data, max_body)
            outcome = "ok"
        except ProtocolError:
            outcome = "ProtocolError"
        except Exception as exc:
            raise Unexpected(f"decoding {data!r} raised {type(exc).__name__}: {exc}") from exc
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    _within(peak, ALLOC_FACTOR * len(data) + ALLOC_SLACK, f"decoding {len(data)} bytes")
    return outcome


def check_stream(data: bytes, max_body: int = 64 * 1024) -> str:
    """Stream.read_message over a socketpair carrying `data`, then EOF: only ProtocolError or
    ConnectionClosed; allocation within the body bound plus a small multiple of the input."""
    a, b = socket.socketpair()
    try:
        b.settimeout(5.0)  # a read that waits for bytes that never come is a hang, not EOF
        writer = threading.Thread(target=_send_and_close, args=(a, data), daemon=True)
        writer.start()
        stream = Stream(b, "fuzz")
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            try:
                for _ in range(len(data) // HEADER.size + 1):
                    stream.read_message(max_body=max_body)
                outcome = "ok"
            except ProtocolError:
                outcome = "ProtocolError"
            except ConnectionClosed:
                outcome = "ConnectionClosed"
            except Exception as exc:
                raise Unexpected(f"reading {data!r} raised {type(exc).__name__}: {exc}") from exc
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        writer.join(5.0)
    finally:
        a.close()
        b.close()
    limit = CHUNK_HEADER.size + CHUNK_BYTES if data[:4] == MAGIC else 0  # CHUNK bound applies to CHUNK headers
    bound = max(max_body, limit) + ALLOC_FACTOR * len(data) + ALLOC_SLACK
    _within(peak, bound, f"reading {len(data)} bytes (max_body {max_body})")
    return outcome


def _send_and_close(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the reader gave up first (a protocol error): fine


# A reassembler op: ("announce", transfer, nbytes) or ("chunk", transfer, total, offset, n).
RA_CHUNK = 16
RA_MAX_PAYLOAD = 100


def check_reassembler(ops: Sequence[tuple[Any, ...]], *, chunk_bytes: int = RA_CHUNK,
                      max_payload: int = RA_MAX_PAYLOAD) -> str:
    """Drive a Reassembler like a connection group's reader threads do. Only ProtocolError may
    escape; no single call allocates more than `max_payload` (plus bookkeeping); a delivered
    payload is exactly the announced size and holds exactly the bytes written into its chunks
    (a transfer id may be reused once its transfer was delivered)."""
    delivered: list[tuple[Message, bytes, bytes]] = []  # (message, payload, bytes written into its chunks)
    written: dict[int, dict[int, bytes]] = {}

    def deliver(msg: Message, payload: memoryview, passed: bool | None) -> None:
        chunks = written.pop(msg.transfer, {})  # type: ignore[attr-defined]  # a later reuse of the id is a new transfer
        delivered.append((msg, bytes(payload), b"".join(fill for _, fill in sorted(chunks.items()))))

    ra = Reassembler(lambda: max_payload, deliver, "fuzz", chunk_bytes=chunk_bytes)
    errors = 0
    tracemalloc.start()
    try:
        for op in ops:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            try:
                if op[0] == "announce":
                    _, transfer, nbytes = op
                    ra.announce(Push(1, 1, 0, 0, 1, 1, 0, transfer, nbytes, 1))
                else:
                    _, transfer, total, offset, n = op
                    view = ra.chunk_target(transfer, total, offset, n)
                    if len(view) != n:
                        raise Unexpected(f"chunk_target({transfer}, {total}, {offset}, {n}) gave {len(view)} bytes")
                    fill = bytes([(transfer + offset) & 0xFF]) * n
                    view[:] = fill
                    written.setdefault(transfer, {})[offset] = fill
                    ra.chunk_done(transfer, offset, view)
            except ProtocolError:
                errors += 1
            except Unexpected:
                raise
            except Exception as exc:
                raise Unexpected(f"reassembler op {op!r} raised {type(exc).__name__}: {exc}") from exc
            peak = tracemalloc.get_traced_memory()[1] - base
            _within(peak, max_payload + ALLOC_SLACK, f"reassembler op {op!r}")
            if ra.incomplete() > MAX_TRANSFERS_IN_FLIGHT:
                raise Unexpected(f"{ra.incomplete()} transfers in flight")
    finally:
        tracemalloc.stop()
    for msg, payload, expected in delivered:
        transfer, nbytes = msg.transfer, msg.nbytes  # type: ignore[attr-defined]
        if len(payload) != nbytes or nbytes > max_payload:
            raise Unexpected(f"transfer {transfer}: delivered {len(payload)} bytes, announced {nbytes}")
        if payload != expected:
            raise Unexpected(f"transfer {transfer}: delivered bytes differ from the chunks written")
    return f"{len(delivered)} delivered, {errors} refused"


def random_reassembler_ops(rng: random.Random, n: int = 24) -> list[tuple[Any, ...]]:
    def size() -> int:
        return rng.choice((rng.randrange(RA_MAX_PAYLOAD + 2), rng.randrange(2 * RA_CHUNK), rng.choice(NASTY_INTS)))

    ops: list[tuple[Any, ...]] = []
    for _ in range(n):
        transfer = rng.choice((rng.randrange(4), rng.choice(NASTY_INTS)))
        total = size()
        if rng.random() < 0.3:
            ops.append(("announce", transfer, total))
        else:
            offset = rng.choice((RA_CHUNK * rng.randrange(8), size()))
            n_ = rng.choice((min(RA_CHUNK, max(total - offset, 0)), size()))
            ops.append(("chunk", transfer, total, offset, n_))
    return ops


# -- hypothesis strategies ----------------------------------------------------------------------
ops_st = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1 << 16), st.integers(0, 1 << 16),
                            st.binary(max_size=8)), min_size=1, max_size=5)
seed_st = st.sampled_from(SEED_FRAMES)
mutated_st = st.builds(apply_ops, seed_st, ops_st)
frames_st = st.one_of(st.binary(max_size=256), mutated_st,
                      st.builds(lambda a, b: a + b, mutated_st, mutated_st),
                      st.builds(lambda k, body: HEADER.pack(MAGIC, PROTOCOL_VERSION, int(k), 0, len(body)) + body,
                                st.sampled_from(list(MsgType)), st.binary(max_size=300)))

u64 = st.one_of(st.integers(0, 3 * RA_CHUNK), st.integers(0, RA_MAX_PAYLOAD + 1), st.sampled_from(NASTY_INTS))
ra_op_st = st.one_of(
    st.tuples(st.just("announce"), st.one_of(st.integers(0, 3), st.sampled_from(NASTY_INTS)), u64),
    st.tuples(st.just("chunk"), st.one_of(st.integers(0, 3), st.sampled_from(NASTY_INTS)), u64,
              st.one_of(st.integers(0, 7).map(lambda i: i * RA_CHUNK), u64), u64),
)
ra_ops_st = st.lists(ra_op_st, max_size=30)

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- tests ------------------------------------------------------------------------------------------
def test_seed_frames_decode() -> None:
    for frame, msg in zip(SEED_FRAMES, SEED_MESSAGES, strict=False):
        assert decode_all(frame) == [msg]
        assert check_stream(frame) == "ConnectionClosed"  # one good message, then EOF


@FAST
@given(data=st.binary(max_size=512))
def test_random_bytes_decode_to_protocol_errors_only(data: bytes) -> None:
    check_decode(data)


@FAST
@given(data=frames_st)
def test_mutated_frames_decode_to_protocol_errors_only(data: bytes) -> None:
    check_decode(data)
    check_decode(data, max_body=64 * 1024)


@settings(FAST, max_examples=150)
@given(data=frames_st, max_body=st.sampled_from([64 * 1024, MAX_CONTROL_BODY]))
def test_stream_reads_mutated_frames_with_protocol_errors_only(data: bytes, max_body: int) -> None:
    check_stream(data, max_body)


@given(ops=st.lists(st.tuples(st.sampled_from(("u32", "u64", "length")), st.integers(0, 1 << 16),
                              st.integers(0, 1 << 16), st.just(b"")), min_size=1, max_size=3),
       seed=seed_st)
@FAST
def test_huge_length_fields_are_refused_before_allocating(ops: list[Op], seed: bytes) -> None:
    data = apply_ops(seed, ops)
    check_decode(data)
    check_stream(data)


def test_manifest_expansion_stays_within_a_small_multiple() -> None:
    """The largest inline body: a MANIFEST packed with minimal specs decodes within the factor."""
    spec = struct.pack("<I", 2) + b"ab" + b"\x01" + struct.pack("<Q", 3) + struct.pack("<I", 2) + b"f4" + b"\x00"
    count = 20_000
    body = struct.pack("<I", 4) + struct.pack("<I", 6) + b"layers" + struct.pack("<I", count) + spec * count
    frame = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.MANIFEST), 0, len(body)) + body
    assert check_decode(frame) == "ok"


@FAST
@given(ops=ra_ops_st)
def test_reassembler_only_raises_protocol_errors(ops: list[tuple[Any, ...]]) -> None:
    check_reassembler(ops)


def test_reassembler_random_sequences() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        check_reassembler(random_reassembler_ops(rng))


def test_random_mutations_of_every_seed() -> None:
    """A fixed-seed sweep without hypothesis: every seed frame, 100 mutations each."""
    rng = random.Random(42)
    for frame in SEED_FRAMES:
        for _ in range(100):
            check_decode(apply_ops(frame, random_ops(rng)))
