"""A simulated clock and the baton that makes threads deterministic.

The syncer's coordinator is driven by callbacks on the scheduler's own thread. A learner's
training loop blocks (a lockstep wait, a blocking fragment, the final cut), so each learner runs on
a thread of its own, but only while it holds the baton: the scheduler hands the baton to one
actor, and takes it back when that actor waits on the simulated clock (`Actor.sleep`, `Actor.wait`)
or ends. At most one thread ever runs, and every hand-over happens at a point fixed by the seed,
so a run is a pure function of its seed.

Time passes only between callbacks: `now` jumps to the next timer. Timers at the same instant run in
the order they were set.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from typing import Any

BATON_TIMEOUT_S = 60.0  # real seconds an actor may hold the baton: a hang is a bug, not a wait


class _Signal:
    """A binary semaphore on a bare lock: a hand-over is a C-level acquire, not `threading.Semaphore`'s
    condition variable, which made hand-overs most of a simulated run's time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def acquire(self, timeout: float = -1) -> bool:
        return self._lock.acquire(timeout=timeout)


class Killed(BaseException):
    """Raised inside an actor's thread at its next wait when the simulation kills it (a crash).
    A BaseException, so the code under test cannot catch it as a failure of its own."""


class Stuck(Exception):
    """An actor held the baton for `BATON_TIMEOUT_S` real seconds: it waits on something that is
    not the simulated clock."""


class Scheduler:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._baton = _Signal()  # released by an actor when it hands the baton back
        self.failure: BaseException | None = None  # an actor's unexpected exception ends the run

    def clock(self) -> float:
        return self.now

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._timers, (max(when, self.now), self._seq, action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def run(self, *, until: float, done: Callable[[], bool]) -> bool:
        """Run timers in order until `done()` (True) or simulated time passes `until` (False)."""
        while self._timers and not done():
            if self.failure is not None:
                raise self.failure
            when, _, action = self._timers[0]
            if when > until:
                return False
            heapq.heappop(self._timers)
            self.now = when
            action()
        if self.failure is not None:
            raise self.failure
        return done()

    def hand_to(self, actor: Actor) -> None:
        """Give `actor` the baton and wait until it hands it back."""
        actor._go.release()
        if not self._baton.acquire(timeout=BATON_TIMEOUT_S):
            raise Stuck(f"{actor.name} held the baton for {BATON_TIMEOUT_S:g} s at simulated t={self.now:.3f}")


class Actor:
    """`body` on a thread of its own that runs only while it holds the baton."""

    def __init__(self, sim: Scheduler, name: str, body: Callable[[Actor], Any]) -> None:
        self.sim = sim
        self.name = name
        self._body = body
        self._go = _Signal()
        self._wake_token = 0  # a wake-up is for the wait it was set for, not a later one
        self.waiting_for_input = False
        self.killed = False
        self.finished = False
        self.result: Any = None
        self._thread = threading.Thread(target=self._main, name=f"sim-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.sim.hand_to(self)

    def _main(self) -> None:
        self._go.acquire()
        try:
            if not self.killed:
                self.result = self._body(self)
        except Killed:
            pass
        except BaseException as exc:  # the scheduler re-raises it: the seed fails
            if self.sim.failure is None:
                self.sim.failure = exc
        finally:
            self.finished = True
            self.sim._baton.release()

    # -- on the actor's thread ---------------------------------------------------------------------
    def _yield(self) -> None:
        self.sim._baton.release()
        self._go.acquire()
        if self.killed:
            raise Killed

    def sleep(self, seconds: float) -> None:
        """Pass `seconds` of simulated time; input does not wake it."""
        self._schedule_wake(seconds)
        self._yield()

    def wait(self, timeout_s: float) -> None:
        """Pass at most `timeout_s`: `poke` (input arrived) wakes it sooner."""
        self.waiting_for_input = True
        self._schedule_wake(timeout_s)
        try:
            self._yield()
        finally:
            self.waiting_for_input = False

    def _schedule_wake(self, seconds: float) -> None:
        self._wake_token += 1
        token = self._wake_token
        self.sim.after(seconds, lambda: self._wake(token))

    # -- on the scheduler's thread -------------------------------------------------------------
    def _wake(self, token: int) -> None:
        if token == self._wake_token and not self.finished:
            self._wake_token += 1
            self.sim.hand_to(self)

    def poke(self) -> None:
        """Input arrived: an actor waiting for input runs now (after the callbacks already due)."""
        if self.waiting_for_input and not self.finished:
            self._wake_token += 1
            token = self._wake_token
            self.sim.after(0.0, lambda: self._wake(token))

    def kill(self) -> None:
        """The process dies: the actor's thread unwinds from the wait it is in and ends."""
        if self.finished or self.killed:
            return
        self.killed = True
        self._wake_token += 1
        self.sim.hand_to(self)
