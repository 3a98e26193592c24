"""A learner's dial: connect and authenticate a control stream and its data streams.

`LearnerHandshake` (`wire/connection.py`) decides every step; this moves its bytes, one stream
after the other, all within one deadline, and closes whatever it opened when a step fails.
"""

from __future__ import annotations

import socket
import time

from yeto_core.net.stream import Stream, tune_socket
from yeto_core.wire.connection import Event, Handshake, LearnerHandshake, Refusal, Welcomed
from yeto_core.wire.errors import Refused


def dial(address: tuple[str, int], hs: LearnerHandshake, *, data_streams: int, deadline: float,
         name: str) -> tuple[Welcomed, Stream, list[Stream]]:
    """The WELCOME and the authenticated streams; a refusal raises `Refused`, a network failure
    OSError or ConnectionClosed, a deadline passed TimeoutError."""
    streams: list[Stream] = []
    try:
        streams.append(_connect(address, f"{name}/ctl", deadline, bulk=False))
        welcome = _settle(streams[0], hs)
        for i in range(data_streams):
            streams.append(_connect(address, f"{name}/data{i}", deadline, bulk=True))
            _settle(streams[-1], hs.attach(i))
    except BaseException:
        for s in streams:
            s.close()
        raise
    assert isinstance(welcome, Welcomed)
    return welcome, streams[0], streams[1:]


def _connect(address: tuple[str, int], name: str, deadline: float, *, bulk: bool) -> Stream:
    sock = socket.create_connection(address, timeout=max(0.001, deadline - time.monotonic()))
    tune_socket(sock, bulk=bulk)
    return Stream(sock, name)


def _settle(stream: Stream, hs: Handshake) -> Event:
    """Run one stream's handshake; a refusal (an ERROR, or a WELCOME that does not verify) raises."""
    last = stream.handshake(hs)[-1]
    if isinstance(last, Refusal):
        raise Refused(last.code, last.reason)
    return last
