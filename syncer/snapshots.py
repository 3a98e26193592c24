"""Background checkpoints (SPEC §3.8): write a snapshot on its own thread while rounds go on.

`CheckpointWriter.save(state)` takes a snapshot of the committed state (a copy of every
fragment's params, momentum and outer-optimizer accumulator, taken on the coordinator thread at
a commit boundary, so it is a contiguous prefix) and writes it on a writer thread. One writer at
a time: the next save, and every synchronous save, first waits for the write in flight, so the
newest checkpoint always lands last. A failed write is raised by that wait (the file on disk is
the previous one: `save_checkpoint` only ever replaces it atomically).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

from syncer.checkpoint import CheckpointError, SyncerState, save_checkpoint


def snapshot(state: SyncerState) -> SyncerState:
    """A deep copy of the committed state that later commits cannot touch."""
    return dataclasses.replace(
        state,
        params=[t.detach().to("cpu", copy=True) for t in state.params],
        momentum=[t.detach().to("cpu", copy=True) for t in state.momentum],
        outer_accum=None if state.outer_accum is None else [t.detach().to("cpu", copy=True)
                                                              for t in state.outer_accum],
        versions=list(state.versions), ledger=dict(state.ledger), outer_count=list(state.outer_count),
        extra=dict(state.extra),
    )


class CheckpointWriter:
    def __init__(self, path: Path, *, background: bool, progress: Callable[[], bool] = lambda: False) -> None:
        self.path = path
        self.background = background
        self._progress = progress
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_ms: float | None = None  # duration of the last completed write

    def save(self, state: SyncerState, *, wait: bool = False) -> float:
        """Checkpoint `state`; returns how long the caller was held (ms). With `wait`, or without
        background writes, the write is durable when this returns."""
        t0 = time.perf_counter()
        self.wait()
        if self.background and not wait:
            snap = snapshot(state)
            self._thread = threading.Thread(target=self._write, args=(snap,), name="syncer-checkpoint", daemon=True)
            self._thread.start()
        else:
            self._write(state)
            self._raise_failure()
        return (time.perf_counter() - t0) * 1000

    def wait(self) -> None:
        """Wait for the write in flight; raise CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing checkpoint {self.path} failed ({error}); the previous checkpoint "
                                  "is intact") from error

    def _write(self, state: SyncerState) -> None:
        t0 = time.perf_counter()
        try:
            save_checkpoint(self.path, state, progress=self._progress())
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc
            return
        self.last_ms = (time.perf_counter() - t0) * 1000
