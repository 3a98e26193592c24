"""The bandwidth probe (DESIGN §7.6): measure an island's link to the syncer before joining.

    result = measure_link(("syncer", 7070), key, up_bytes=16 << 20, down_bytes=16 << 20)

A probe is a connection of its own: CHALLENGE, a sealed BW_PROBE, `up` bytes to the syncer, the
syncer's sealed answer once they all arrived, then `down` bytes back. Upload rate = up bytes /
(first byte sent → answer received); download rate = down bytes / (answer → last byte).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from yeto_core.wire import auth
from yeto_core.wire.errors import ErrorCode, ProtocolError, Refused, WireError
from yeto_core.wire.messages import BwProbe, Challenge, Error
from yeto_core.wire.transport import Stream

PIECE = 1 << 20
PROBE_EXIT_CODE = 75  # EX_TEMPFAIL: this island is too slow for now; a supervisor may place it elsewhere


@dataclass(frozen=True)
class ProbeResult:
    up_mbps: float
    down_mbps: float


def probe_seal(key: bytes, nonce: bytes, up: int, down: int, *, reply: bool) -> bytes:
    side = b"reply" if reply else b"request"
    return auth.sign(key, auth.PROBE_LABEL, side, nonce, up.to_bytes(8, "little"), down.to_bytes(8, "little"))


def measure_link(address: tuple[str, int], key: bytes, *, up_bytes: int, down_bytes: int,
                 timeout_s: float = 300.0) -> ProbeResult:
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
        block = memoryview(bytes(min(PIECE, max(up_bytes, down_bytes, 1))))
        t0 = time.perf_counter()
        try:
            for start in range(0, up_bytes, PIECE):
                sock.sendall(block[: min(PIECE, up_bytes - start)])
        except OSError:
            _raise_refusal(stream)  # the syncer may have refused the probe (and closed) before reading it
            raise
        answer = stream.read_message()
        t1 = time.perf_counter()
        if isinstance(answer, Error):
            raise Refused(answer.code, answer.reason)
        if not isinstance(answer, BwProbe) or not auth.verify(
            key, answer.mac, auth.PROBE_LABEL, b"reply", challenge.nonce, up_bytes.to_bytes(8, "little"),
            down_bytes.to_bytes(8, "little")):
            raise ProtocolError("the syncer's probe answer is not sealed with the shared key")
        sink = bytearray(min(PIECE, max(down_bytes, 1)))
        view = memoryview(sink)
        for start in range(0, down_bytes, PIECE):
            stream.read_into(view[: min(PIECE, down_bytes - start)])
        t2 = time.perf_counter()
    finally:
        stream.close()
    return ProbeResult(up_bytes * 8 / 1e6 / max(t1 - t0, 1e-9), down_bytes * 8 / 1e6 / max(t2 - t1, 1e-9))


def _raise_refusal(stream: Stream) -> None:
    """Raise the syncer's ERROR if it sent one before hanging up; return otherwise."""
    try:
        msg = stream.read_message()
    except (OSError, WireError):
        return
    if isinstance(msg, Error):
        raise Refused(msg.code, msg.reason)


def probe_authentic(key: bytes, nonce: bytes, request: BwProbe) -> bool:
    """Whether a probe request was sealed with the key for this connection's challenge."""
    return auth.verify(key, request.mac, auth.PROBE_LABEL, b"request", nonce, request.up.to_bytes(8, "little"),
                       request.down.to_bytes(8, "little"))


def serve_probe(stream: Stream, key: bytes, nonce: bytes, request: BwProbe) -> tuple[int, int]:
    """The syncer's side, on a handshake thread: verify, take `up` bytes, answer, send `down`."""
    if not probe_authentic(key, nonce, request):
        raise Refused(ErrorCode.AUTH, "HMAC check failed on a bandwidth probe: wrong key")
    sink = bytearray(min(PIECE, max(request.up, 1)))
    view = memoryview(sink)
    for start in range(0, request.up, PIECE):
        stream.read_into(view[: min(PIECE, request.up - start)])
    stream.send_frame(BwProbe(request.up, request.down, probe_seal(key, nonce, request.up, request.down,
                                                                   reply=True)))
    block = memoryview(bytes(min(PIECE, max(request.down, 1))))
    for start in range(0, request.down, PIECE):
        stream.sock.sendall(block[: min(PIECE, request.down - start)])
    return request.up, request.down

