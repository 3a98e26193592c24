"""The learner's client hands the session a new connection before anything that came on it.

A PULL of the new connection taken before its `Connected` would be matched against the old
connection's pulls, look older, and be ignored; the round would then wait for an answer that never
comes. A loopback syncer stand-in answers the handshake and sends a PULL at once.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from yeto_core.client import SyncerClient
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.link import Connected, Received
from yeto_core.net.stream import Stream
from yeto_core.sections import Endpoint, LinkSettings, Schedule
from yeto_core.wire.connection import SyncerHandshake
from yeto_core.wire.messages import Pull

pytestmark = pytest.mark.timeout(30)

KEY = b"k" * 32
SPECS = [TensorSpec("w", (8,), "float32"), TensorSpec("v", (8,), "float32")]


def serve_once(listener: socket.socket, sent: threading.Event) -> None:
    """Admit one learner with one data stream, then send it a PULL straight away."""
    token: list[bytes] = []

    def handshake(sock: socket.socket) -> Stream:
        stream = Stream(sock, "syncer")
        hs = SyncerHandshake(KEY, Schedule(2, "binpack", 0), check=lambda hello, nonce: None,
                             welcome=lambda hello: (1, token.append(bytes(16)) or token[0], True),
                             pending=lambda t: 1 if token and t == token[0] else None,
                             deadline=time.monotonic() + 10)
        stream.handshake(hs)
        return stream

    control = handshake(listener.accept()[0])
    data = handshake(listener.accept()[0])
    control.send_frame(Pull(0, 1, 0, 0))
    sent.set()
    time.sleep(1.0)  # let the client read it before the sockets go
    for s in (control, data):
        s.close()


@pytest.mark.parametrize("attempt", range(5))
def test_connected_comes_before_the_first_message_of_its_connection(attempt: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    sent = threading.Event()
    server = threading.Thread(target=serve_once, args=(listener, sent), daemon=True)
    server.start()
    client = SyncerClient(Endpoint(listener.getsockname()[:2], KEY, 1), LinkSettings(data_streams=1))
    try:
        client.start(lambda schedule: build_layout(SPECS, schedule.num_fragments, schedule.pattern), lambda: 0)
        first = client.next_event(10.0)
        assert isinstance(first, Connected), first
        second = client.next_event(10.0)
        assert isinstance(second, Received) and isinstance(second.msg, Pull), second
    finally:
        client.close(bye=False)
        server.join(5)
        listener.close()
