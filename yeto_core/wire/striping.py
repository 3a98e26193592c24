"""Which data stream carries each chunk of a bulk transfer (DESIGN §7.1), without I/O.

`rr` deals chunks round-robin. `adaptive` sends each chunk to the stream that would finish it
first, from what that stream still has queued and its measured rate (an EWMA of the bytes per
second its sends achieved), so a slow path of a multi-path WAN gets fewer chunks. The shell
reports each chunk written (`sent`); the caller holds whatever lock guards the plan.
"""

from __future__ import annotations

from typing import Literal

SCHEDULES = ("rr", "adaptive")
RATE_EMA = 0.3  # the weight of the newest measurement in a stream's rate


def pick_stream(backlog: list[int], rates: list[float | None], nbytes: int) -> int:
    """The data stream that would finish `nbytes` first, given what it still has queued and its
    measured rate. Streams not measured yet count as fast as the fastest known one (so each gets
    tried); ties go to the lowest index."""
    known = [r for r in rates if r]
    default = max(known) if known else 1.0
    finish = [(b + nbytes) / (r or default) for b, r in zip(backlog, rates, strict=True)]
    return min(range(len(finish)), key=finish.__getitem__)


class Striper:
    """The chunk-to-stream plan of one connection group's outgoing transfers."""

    def __init__(self, streams: int, schedule: Literal["rr", "adaptive"] | str = "rr") -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"stream schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
        if streams < 1:
            raise ValueError("a connection group needs at least one data stream")
        self.schedule = schedule
        self.backlog = [0] * streams  # bytes queued per data stream, not written yet
        self.rates: list[float | None] = [None] * streams  # EWMA bytes/s per data stream
        self._next = 0

    def plan(self, total: int, chunk_bytes: int) -> list[tuple[int, int, int]]:
        """`(stream, offset, nbytes)` for each chunk of a `total`-byte transfer, in offset order."""
        parts = []
        for offset in range(0, total, chunk_bytes):
            n = min(chunk_bytes, total - offset)
            if self.schedule == "adaptive":
                i = pick_stream(self.backlog, self.rates, n)
            else:
                i, self._next = self._next, (self._next + 1) % len(self.backlog)
            self.backlog[i] += n
            parts.append((i, offset, n))
        return parts

    def sent(self, stream: int, nbytes: int, seconds: float) -> None:
        """Stream `stream` wrote a chunk of `nbytes` in `seconds`."""
        self.backlog[stream] -= nbytes
        rate = nbytes / max(seconds, 1e-6)
        old = self.rates[stream]
        self.rates[stream] = rate if old is None else (1 - RATE_EMA) * old + RATE_EMA * rate
