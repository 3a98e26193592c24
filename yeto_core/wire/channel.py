"""The control stream of a live connection group (PROTOCOL §1.2), without I/O.

After the handshake (`connection.py`) a control stream carries framed control messages both
ways, and HEARTBEATs whenever it would otherwise fall silent. `ControlChannel` is that, fed
bytes and the time: `receive_data(data, now)` returns the messages in them (heartbeats only
keep the peer alive), `send(msg, now)` returns the bytes to write, `poll(now, ...)` says whether
a heartbeat is due or the group is dead and why, `next_deadline()` when to poll again. The
socket shell (`yeto_core/net/group.py`) reads, writes and sleeps as told.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from yeto_core.wire.framing import FrameReader
from yeto_core.wire.liveness import Liveness, StreamMotion
from yeto_core.wire.messages import MAX_CONTROL_BODY, Heartbeat, Message, decode_body, encode_frame


@dataclasses.dataclass(frozen=True, slots=True)
class Poll:
    """What time alone decided: the group's death (`dead`, a reason) or a heartbeat to send."""

    dead: str | None = None
    heartbeat: Heartbeat | None = None


class ControlChannel:
    def __init__(self, now: float, *, heartbeat_s: float, peer_timeout_s: float, stall_timeout_s: float = 0.0,
                 name: str = "group", max_body: int = MAX_CONTROL_BODY, trailing: bytes = b"") -> None:
        self.name = name
        self.liveness = Liveness(now, heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s,
                                 stall_timeout_s=stall_timeout_s)
        self._frames = FrameReader(max_body)
        self._frames.feed(trailing)  # what the handshake read past its last frame
        self._heartbeats = 0
        self._heartbeat_pending = False  # one handed out and not sent yet

    def receive_data(self, data: bytes | bytearray | memoryview, now: float) -> list[Message]:
        """The messages `data` completes (it may hold parts of frames; the rest waits)."""
        if data:
            self.liveness.heard(now)
        self._frames.feed(data)
        messages = []
        while (frame := self._frames.next_frame()) is not None:
            msg = decode_body(*frame)
            if not isinstance(msg, Heartbeat):
                messages.append(msg)
        return messages

    def heard(self, now: float) -> None:
        """Bytes came in on a data stream: the peer lives."""
        self.liveness.heard(now)

    def send(self, msg: Message) -> bytes:
        return encode_frame(msg)

    def sent(self, msg: Message, now: float) -> None:
        """`msg`'s bytes were written."""
        self.liveness.sent(now)
        if isinstance(msg, Heartbeat):
            self._heartbeat_pending = False

    def poll(self, now: float, streams: Sequence[StreamMotion] = (), *, inbound_incomplete: bool = False,
             step: Callable[[], int] = lambda: 0) -> Poll:
        """`step()` is the sender's training step, which a heartbeat carries (asked only when one is due)."""
        dead = self.liveness.verdict(now, streams, inbound_incomplete=inbound_incomplete, group=self.name)
        if dead is not None:
            return Poll(dead=dead)
        if self._heartbeat_pending or not self.liveness.heartbeat_due(now):
            return Poll()
        self._heartbeats += 1
        self._heartbeat_pending = True
        return Poll(heartbeat=Heartbeat(self._heartbeats, step()))

    def next_deadline(self) -> float:
        return self.liveness.next_deadline(heartbeat_pending=self._heartbeat_pending)

    def silent_s(self, now: float) -> float:
        return self.liveness.silent_s(now)
