"""The bandwidth probe (DESIGN §7.6): its seals, pieces and rates as plain functions, then both
sides of one probe over loopback."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from yeto_core.net.stream import Stream
from yeto_core.probe import (
    PIECE,
    ProbeResult,
    answer_authentic,
    check_probe,
    measure_link,
    pieces,
    probe_authentic,
    probe_seal,
    serve_probe,
)
from yeto_core.sections import Schedule
from yeto_core.wire import auth
from yeto_core.wire.connection import ProbeRequested, SyncerHandshake
from yeto_core.wire.errors import ErrorCode, Refused
from yeto_core.wire.messages import BwProbe, Error, encode_frame

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

KEY = b"the shared key"
NONCE = bytes(range(32))


def request(up: int, down: int, key: bytes = KEY, nonce: bytes = NONCE) -> BwProbe:
    return BwProbe(up, down, probe_seal(key, nonce, up, down, reply=False))


def test_the_seal_covers_key_challenge_sizes_and_direction() -> None:
    seal = probe_seal(KEY, NONCE, 5, 7, reply=False)
    assert seal == auth.sign(KEY, auth.PROBE_LABEL, b"request", NONCE, (5).to_bytes(8, "little"),
                             (7).to_bytes(8, "little"))
    assert probe_seal(KEY, NONCE, 5, 7, reply=True) != seal
    assert probe_authentic(KEY, NONCE, request(5, 7))
    assert not probe_authentic(KEY, bytes(32), request(5, 7))  # sealed for another connection's challenge
    assert not probe_authentic(b"another key", NONCE, request(5, 7))
    assert not probe_authentic(KEY, NONCE, BwProbe(5, 8, seal))  # sizes changed on the way
    check_probe(KEY, NONCE, request(5, 7))
    with pytest.raises(Refused) as wrong:
        check_probe(b"another key", NONCE, request(5, 7))
    assert (wrong.value.code, wrong.value.reason) == (ErrorCode.AUTH, "HMAC check failed on a bandwidth probe: "
                                                                      "wrong key")


def test_an_answer_is_checked_against_what_was_asked() -> None:
    answer = BwProbe(5, 7, probe_seal(KEY, NONCE, 5, 7, reply=True))
    assert answer_authentic(KEY, NONCE, 5, 7, answer)
    assert not answer_authentic(KEY, NONCE, 5, 9, answer)
    assert not answer_authentic(KEY, NONCE, 5, 7, request(5, 7))  # a request echoed back is no answer


def test_bytes_move_in_whole_pieces_then_the_rest() -> None:
    assert list(pieces(0)) == []
    assert list(pieces(10)) == [10]
    assert list(pieces(PIECE)) == [PIECE]
    assert list(pieces(2 * PIECE + 3)) == [PIECE, PIECE, 3]


def test_rates_are_bits_over_each_directions_time() -> None:
    result = ProbeResult.timed(1_000_000, 2_000_000, sent=10.0, answered=12.0, done=13.0)
    assert result == ProbeResult(4.0, 16.0)  # 8 Mbit in 2 s up, 16 Mbit in 1 s down
    assert ProbeResult.timed(0, 0, 1.0, 1.0, 1.0) == ProbeResult(0.0, 0.0)  # no time, no division by zero


def fake_syncer(key: bytes, nonce: bytes, served: list[tuple[int, int]]) -> tuple[socket.socket, threading.Thread]:
    """A listener that takes one connection through the syncer's handshake machine and serves its
    probe, as the syncer's shell does."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        sock, _ = listener.accept()
        stream = Stream(sock, "prober")
        hs = SyncerHandshake(key, Schedule(4, "binpack", 0), check=lambda hello, nonce: None,
                             pending=lambda token: None, welcome=lambda hello: (1, bytes(16), False),
                             deadline=time.monotonic() + 10, nonce=lambda: nonce)
        try:
            [probe] = stream.handshake(hs)
            assert isinstance(probe, ProbeRequested)
            try:
                served.append(serve_probe(stream, key, nonce, probe.request, timeout_s=10.0))
            except Refused as exc:
                stream.send_frame(Error(exc.code, exc.reason))
        finally:
            stream.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_a_probe_round_trip_moves_the_requested_bytes_both_ways() -> None:
    served: list[tuple[int, int]] = []
    listener, thread = fake_syncer(KEY, NONCE, served)
    with listener:
        result = measure_link(listener.getsockname()[:2], KEY, up_bytes=PIECE + 17, down_bytes=3 * PIECE,
                              timeout_s=10.0)
        thread.join(10)
    assert served == [(PIECE + 17, 3 * PIECE)]
    assert result.up_mbps > 0 and result.down_mbps > 0


def test_a_probe_with_another_key_is_refused_with_auth() -> None:
    # Nothing to upload: the fake syncer closes at once, and unread bytes would reset the ERROR away.
    listener, thread = fake_syncer(KEY, NONCE, [])
    with listener, pytest.raises(Refused) as refused:
        measure_link(listener.getsockname()[:2], b"another key", up_bytes=0, down_bytes=1024, timeout_s=10.0)
    thread.join(10)
    assert refused.value.code is ErrorCode.AUTH


def test_the_syncer_side_answers_exactly_once_its_bytes_are_in() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(10)
        up, down = 3, PIECE + 1
        result: list[tuple[int, int]] = []
        server = threading.Thread(target=lambda: result.append(
            serve_probe(Stream(theirs, "prober"), KEY, NONCE, request(up, down), timeout_s=10.0)))
        server.start()
        ours.sendall(b"\0" * up)
        answer = encode_frame(BwProbe(up, down, probe_seal(KEY, NONCE, up, down, reply=True)))
        got = b""
        while len(got) < len(answer) + down:
            chunk = ours.recv(1 << 20)
            assert chunk, "the syncer side hung up early"
            got += chunk
        server.join(10)
    assert got == answer + b"\0" * down and result == [(up, down)]
