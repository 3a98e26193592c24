"""Checkpoint writes as the coordinator asks for them (DESIGN §6.2): durable or stop.

A failed write (this one, or the background write before it) is retried synchronously, with
backoff, while the coordinator holds every round: nothing is committed or broadcast meanwhile,
and the learners train on locally. The previous file stays valid throughout. Past
`checkpoint_retry_s` the syncer stops with exit code 4 (`DurabilityLost`). A signal ends the
retries (and a write in progress) within a moment (`stopping.Stopped`), the previous file as it was.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from syncer.core.leases import Leases
from syncer.durability.checkpoint import CheckpointError, SyncerState
from syncer.durability.snapshots import CheckpointWriter
from syncer.durability.stopping import Stopped, StopRequest
from syncer.durability.tape import EventTape
from yeto_core.faults import FaultInjector

log = logging.getLogger("yeto.syncer")

PROGRESS_BAR_BYTES = 256 << 20
DURABILITY_EXIT_CODE = 4
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0


class DurabilityLost(Exception):
    """No checkpoint could be written within `checkpoint_retry_s`: the syncer stops."""


class Checkpointing:
    """Writes to `path` (None: no checkpoints, every save is a no-op); failures go on the `tape`."""

    def __init__(self, path: Path | None, *, background: bool, retry_s: float, leases: Leases, tape: EventTape,
                 faults: FaultInjector, stop: StopRequest | None = None) -> None:
        self.tape = tape
        self.retry_s = retry_s
        self.stop = stop if stop is not None else StopRequest()
        self._size = 0  # bytes of params and momentum of the last state saved
        self.writer = (CheckpointWriter(path, background=background, leases=leases, progress=self.show_progress,
                                        faults=faults, stop=self.stop)
                       if path is not None else None)

    def show_progress(self) -> bool:
        # A bar only where someone watches, or where the write takes long enough to wonder about.
        return self._size > PROGRESS_BAR_BYTES or sys.stderr.isatty()

    def save(self, state: SyncerState | None, *, wait: bool = False) -> float | None:
        """Checkpoint the committed state; returns how long the coordinator was held (ms).

        Durable or stop. A failed write (this one, or the background write before it) is retried
        synchronously, with backoff, while the coordinator holds every round: nothing is
        committed or broadcast meanwhile, and the learners train on locally. The previous file
        stays valid throughout. Past `checkpoint_retry_s` it raises `DurabilityLost`; once a stop
        is requested it raises `Stopped` instead of writing, retrying or waiting on."""
        if self.writer is None or state is None:
            return None
        self.stop.check(f"checkpoint {self.writer.path}")
        self._size = sum(t.numel() for t in state.params) * 8
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.retry_s
        delay, failures = RETRY_FIRST_S, 0
        while True:
            try:
                held = self.writer.save(state, wait=wait)
            except CheckpointError as exc:
                failures += 1
                self.tape.append({"event": "checkpoint_failed", "reason": str(exc)})
                left = deadline - time.monotonic()
                if left <= 0:
                    retry = self.retry_s
                    raise DurabilityLost(f"{exc}; no checkpoint could be written in {retry:g} s "
                                         "(--checkpoint-retry-s), so the syncer stops: nothing after the previous "
                                         "checkpoint is durable") from exc
                log.error("%s; holding every round and retrying in %.1f s (learners train on locally)", exc,
                          min(delay, left))
                if self.stop.wait(min(delay, left)):
                    raise Stopped(f"retrying checkpoint {self.writer.path} abandoned: the syncer is stopping; the "
                                  "previous checkpoint is intact, nothing after it is durable") from exc
                delay, wait = min(2 * delay, RETRY_MAX_S), True  # retries write synchronously
                continue
            if failures:
                log.warning("checkpoint %s written after %d failed attempt%s; rounds go on", self.writer.path,
                            failures, "" if failures == 1 else "s")
                self.tape.append({"event": "checkpoint_recovered", "failures": failures})
                return (time.perf_counter() - t0) * 1000
            return held
