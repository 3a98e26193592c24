"""The bandwidth probe (DESIGN §7.6): measure an island's link to the syncer before joining.

    result = measure_link(("syncer", 7070), key, up_bytes=16 << 20, down_bytes=16 << 20)

A probe is a connection of its own: CHALLENGE, a sealed BW_PROBE, `up` bytes to the syncer, the
syncer's sealed answer once they all arrived, then `down` bytes back. Upload rate = up bytes /
(first byte sent → answer received); download rate = down bytes / (answer → last byte).

The seals, the pieces the bytes move in and the rates are plain functions of their arguments;
`measure_link` (the island's side) and `serve_probe` (the syncer's) move the bytes over a `Stream`.
Neither ends a process: a link too slow to join is the session's verdict (`refusal.ProbeFailed`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from yeto_core.net.stream import Stream
from yeto_core.wire import auth
from yeto_core.wire.errors import ErrorCode, ProtocolError, Refused, WireError
from yeto_core.wire.messages import BwProbe, Challenge, Error

PIECE = 1 << 20
PROBE_TIMEOUT_S = 300.0  # for any one read or write of either side
PROBE_EXIT_CODE = 75  # EX_TEMPFAIL: this island is too slow for now; a supervisor may place it elsewhere


@dataclass(frozen=True)
class ProbeResult:
    up_mbps: float
    down_mbps: float

    @classmethod
    def timed(cls, up_bytes: int, down_bytes: int, sent: float, answered: float, done: float) -> ProbeResult:
        """The rates of a probe whose first byte went at `sent`, whose answer came at `answered` and
        whose last byte back came at `done` (seconds on one clock)."""
        return cls(up_bytes * 8 / 1e6 / max(answered - sent, 1e-9), down_bytes * 8 / 1e6 / max(done - answered, 1e-9))


def _sealed_parts(nonce: bytes, up: int, down: int, *, reply: bool) -> tuple[bytes, ...]:
    return b"reply" if reply else b"request", nonce, up.to_bytes(8, "little"), down.to_bytes(8, "little")


def probe_seal(key: bytes, nonce: bytes, up: int, down: int, *, reply: bool) -> bytes:
    """The MAC of a request for (`up`, `down`) bytes on the connection challenged with `nonce`, or
    of the syncer's `reply` to it."""
    return auth.sign(key, auth.PROBE_LABEL, *_sealed_parts(nonce, up, down, reply=reply))


def probe_authentic(key: bytes, nonce: bytes, request: BwProbe) -> bool:
    """Whether a probe request was sealed with the key for this connection's challenge."""
    return auth.verify(key, request.mac, auth.PROBE_LABEL, *_sealed_parts(nonce, request.up, request.down, reply=False))


def check_probe(key: bytes, nonce: bytes, request: BwProbe) -> None:
    """Raise `Refused` unless `probe_authentic`."""
    if not probe_authentic(key, nonce, request):
        raise Refused(ErrorCode.AUTH, "HMAC check failed on a bandwidth probe: wrong key")


def answer_authentic(key: bytes, nonce: bytes, up: int, down: int, answer: BwProbe) -> bool:
    """Whether the syncer's answer to a request for `up` and `down` bytes was sealed with the key."""
    return auth.verify(key, answer.mac, auth.PROBE_LABEL, *_sealed_parts(nonce, up, down, reply=True))


def pieces(total: int) -> Iterator[int]:
    """The sizes `total` bytes move in: whole `PIECE`s, then the rest."""
    for start in range(0, total, PIECE):
        yield min(PIECE, total - start)


def measure_link(address: tuple[str, int], key: bytes, *, up_bytes: int, down_bytes: int,
                 timeout_s: float = PROBE_TIMEOUT_S) -> ProbeResult:
    sock = socket.create_connection(address, timeout=timeout_s)
    stream = Stream(sock, "probe")
    try:
        challenge = stream.read_message()
        if isinstance(challenge, Error):
            raise Refused(challenge.code, challenge.reason)
        if not isinstance(challenge, Challenge):
            raise ProtocolError(f"expected CHALLENGE, got {challenge.TYPE.name}")
        stream.send_frame(BwProbe(up_bytes, down_bytes, probe_seal(key, challenge.nonce, up_bytes, down_bytes,
                                                                  reply=False)))
        block = _zeros(max(up_bytes, down_bytes))
        sent = time.perf_counter()
        try:
            _send(stream, block, up_bytes)
        except OSError:
            _raise_refusal(stream)  # the syncer may have refused the probe (and closed) before reading it
            raise
        answer = stream.read_message()
        answered = time.perf_counter()
        if isinstance(answer, Error):
            raise Refused(answer.code, answer.reason)
        if not isinstance(answer, BwProbe) or not answer_authentic(key, challenge.nonce, up_bytes, down_bytes, answer):
            raise ProtocolError("the syncer's probe answer is not sealed with the shared key")
        _read_away(stream, down_bytes)
        done = time.perf_counter()
    finally:
        stream.close()
    return ProbeResult.timed(up_bytes, down_bytes, sent, answered, done)


def serve_probe(stream: Stream, key: bytes, nonce: bytes, request: BwProbe, *,
                timeout_s: float = PROBE_TIMEOUT_S) -> tuple[int, int]:
    """The syncer's side, on a handshake thread: verify, take `up` bytes, answer, send `down`."""
    check_probe(key, nonce, request)
    stream.sock.settimeout(timeout_s)
    _read_away(stream, request.up)
    stream.send_frame(BwProbe(request.up, request.down, probe_seal(key, nonce, request.up, request.down,
                                                                   reply=True)))
    _send(stream, _zeros(request.down), request.down)
    return request.up, request.down


def _zeros(most: int) -> memoryview:
    """What a probe sends: zeros, at most a `PIECE` of them at a time."""
    return memoryview(bytes(min(PIECE, max(most, 1))))


def _send(stream: Stream, block: memoryview, total: int) -> None:
    for n in pieces(total):
        stream.sock.sendall(block[:n])


def _read_away(stream: Stream, total: int) -> None:
    view = memoryview(bytearray(min(PIECE, max(total, 1))))
    for n in pieces(total):
        stream.read_into(view[:n])


def _raise_refusal(stream: Stream) -> None:
    """Raise the syncer's ERROR if it sent one before hanging up; return otherwise."""
    try:
        msg = stream.read_message()
    except (OSError, WireError):
        return
    if isinstance(msg, Error):
        raise Refused(msg.code, msg.reason)
