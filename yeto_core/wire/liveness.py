"""A connection group's deadlines (DESIGN §7.6), without I/O: time is an argument.

Three rules, each a deadline from the last time something happened:
- *heartbeat*: when nothing was sent for `heartbeat_s`, a HEARTBEAT goes out;
- *peer timeout*: when nothing was heard for `peer_timeout_s`, the peer is gone;
- *stall* (the WAN watchdog, on with `stall_timeout_s` > 0): a data stream writing a chunk, or an
  inbound transfer, whose bytes made no progress for that long fails the group (a learner then
  redials), so a path that silently stopped moving is not waited on until TCP gives up.
The shell reports what happened (`heard`, `sent`) and what its streams are doing, and asks
`verdict(now, ...)` whether the group lives and `next_deadline()` when to ask again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class StreamMotion:
    """What one data stream is doing: writing a chunk or not, and when its bytes last moved."""

    name: str
    sending: bool
    progress_at: float


class Liveness:
    def __init__(self, now: float, *, heartbeat_s: float, peer_timeout_s: float, stall_timeout_s: float = 0.0) -> None:
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.last_heard = now
        self.last_sent = float("-inf")  # a first heartbeat goes out at once

    def heard(self, now: float) -> None:
        self.last_heard = now

    def sent(self, now: float) -> None:
        self.last_sent = now

    def silent_s(self, now: float) -> float:
        return now - self.last_heard

    def heartbeat_due(self, now: float) -> bool:
        return now - self.last_sent >= self.heartbeat_s

    def verdict(self, now: float, streams: Sequence[StreamMotion] = (), *, inbound_incomplete: bool = False,
                group: str = "group") -> str | None:
        """Why the group is dead at `now`, or None while it lives."""
        if now - self.last_heard > self.peer_timeout_s:
            return f"no frame from the peer for {self.peer_timeout_s:g} s"
        limit = self.stall_timeout_s
        if limit <= 0:
            return None
        for stream in streams:
            if stream.sending and now - stream.progress_at > limit:
                return f"{stream.name} stalled: unsent bytes made no progress for {limit:g} s"
        if inbound_incomplete and streams and now - max(s.progress_at for s in streams) > limit:
            return f"{group}: an inbound message stopped growing for {limit:g} s"
        return None

    def next_deadline(self, *, heartbeat_pending: bool = False) -> float:
        """When the heartbeat or peer-timeout rule next fires (the heartbeat's only while none is
        pending). A stall depends on the streams, not on time alone: the shell checks it on a tick."""
        deadline = self.last_heard + self.peer_timeout_s
        return deadline if heartbeat_pending else min(deadline, self.last_sent + self.heartbeat_s)
