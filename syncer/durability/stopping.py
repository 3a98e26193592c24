"""A signal stops the syncer within a second, whatever it is waiting for (DESIGN §6.2).

SIGTERM or SIGINT sets the coordinator's `StopRequest`, and every wait of the syncer that can
last longer than a moment polls it: the sleeps between checkpoint retries, a checkpoint being
written (between two 16 MiB pieces), the iso pool's drains and jobs, the connection groups'
last words at exit. A wait that gives up raises `Stopped`; the coordinator then stops as a
signal stops it. Nothing committed is lost: a checkpoint write that gives up removes its
temporary file, and the checkpoint on disk stays the last one written whole.

Why not a `threading.Event`: the signal handler runs on the coordinator's own thread (the main
thread), between any two bytecodes, possibly inside that very Event's `wait` while it holds the
Event's internal lock; `Event.set` would then wait for a lock its own thread holds, forever.
`StopRequest.set` takes no lock at all; waiters poll it every `POLL_S`.
"""

from __future__ import annotations

import time

POLL_S = 0.05  # how often a waiter looks at the request: a stop is seen within this much


class Stopped(Exception):
    """A wait gave up because the syncer is stopping (a signal)."""


class StopRequest:
    """A flag a signal handler may set (no lock taken); any thread may wait on it."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleep until the stop is requested or `timeout` seconds have passed; True if requested."""
        deadline = time.monotonic() + timeout
        while not self._set:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, POLL_S))
        return True

    def check(self, what: str) -> None:
        """Raise `Stopped` (naming `what` gave up) if the stop is requested."""
        if self._set:
            raise Stopped(f"{what} abandoned: the syncer is stopping")
