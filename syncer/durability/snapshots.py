"""Background checkpoints (DESIGN §6.2): write a snapshot on its own thread while rounds go on.

`CheckpointWriter.save(state)` snapshots the committed state at a commit boundary (so it is a
contiguous prefix) and writes it on a writer thread. The snapshot copies only the small
bookkeeping at once; it holds the fragments' params, momentum and outer-optimizer accumulator by
reference, with a lease on each fragment until the writer has read it (`leases.py`). A commit
that comes first writes a copy of the fragment instead, and the writer reads the old tensor,
which nothing writes again. A round changes one fragment, so a write that overlaps k commits
copies at most k fragments instead of all of them.

One writer at a time: the next save, and every synchronous save, first waits for the write in
flight, so the newest checkpoint always lands last. A failed write is raised by that wait (the
file on disk is the previous one: `save_checkpoint` only ever replaces it atomically). A stop
request abandons the write in flight within one piece, so that wait never outlasts a signal by
more than a moment; it raises `stopping.Stopped`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from syncer.core.leases import Leases
from syncer.durability.checkpoint import CheckpointError, SyncerState, downlink_kind, save_checkpoint
from syncer.durability.stopping import Stopped, StopRequest
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.layout import build_layout


class SnapshotReads:
    """How far a background write has read its snapshot: each fragment's tensor of each kind is
    leased (`leases.py`) until the writer has read every piece of it."""

    def __init__(self, state: SyncerState) -> None:
        self.kinds: dict[str, list[torch.Tensor]] = {"param": state.params, "momentum": state.momentum}
        if state.outer_accum is not None:
            self.kinds["accum"] = state.outer_accum
        for wire_id, anchors in state.downlink.items():
            self.kinds[downlink_kind(wire_id)] = anchors
        self._lock = threading.Lock()
        self.left: dict[tuple[str, int], int] = {}  # pieces still to read, per (kind, fragment)
        for frag in build_layout(state.specs, state.num_fragments, state.pattern).fragments:
            for kind in self.kinds:
                self.left[kind, frag.index] = len(frag.slots)

    def reading(self, kind: str, fragment: int) -> bool:
        with self._lock:
            return self.left.get((kind, fragment), 0) > 0

    @contextlib.contextmanager
    def read(self, kind: str, fragment: int) -> Iterator[torch.Tensor]:
        try:
            yield self.kinds[kind][fragment]
        finally:
            with self._lock:
                self.left[kind, fragment] -= 1


class CheckpointWriter:
    def __init__(self, path: Path, *, background: bool, leases: Leases | None = None,
                 progress: Callable[[], bool] = lambda: False, faults: FaultInjector = NO_FAULTS,
                 stop: StopRequest | None = None) -> None:
        """`leases`: where a background snapshot leases the tensors it still has to read (needed
        with `background`, so that commits do not write what the writer reads); `stop`: a write
        gives up once it is set (`save_checkpoint`)."""
        if background and leases is None:
            raise ValueError("a background checkpoint writer needs the run's leases")
        self.path = path
        self.faults = faults
        self.stop = stop
        self.background = background
        self.leases = leases
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
            assert self.leases is not None
            snap = dataclasses.replace(  # the bookkeeping copied now, the tensors by reference
                state, versions=list(state.versions), ledger=dict(state.ledger),
                outer_count=list(state.outer_count), extra=dict(state.extra),
                params=list(state.params), momentum=list(state.momentum),
                outer_accum=None if state.outer_accum is None else list(state.outer_accum),
                downlink={k: list(v) for k, v in state.downlink.items()},
                downlink_versions={k: list(v) for k, v in state.downlink_versions.items()})
            reads = SnapshotReads(snap)
            for f in range(state.num_fragments):
                for kind in reads.kinds:
                    self.leases.take(f, kind, functools.partial(reads.reading, kind, f))
            self._thread = threading.Thread(target=self._write, args=(snap, reads), name="syncer-checkpoint",
                                            daemon=True)
            self._thread.start()
        else:
            self._write(state, None)
            self._raise_failure()
        return (time.perf_counter() - t0) * 1000

    def wait(self) -> None:
        """Wait for the write in flight; raise CheckpointError if it failed, Stopped if it gave up."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, Stopped):
                raise error
            raise CheckpointError(f"writing checkpoint {self.path} failed ({error}); the previous checkpoint "
                                  "is intact") from error

    def _write(self, state: SyncerState, reads: SnapshotReads | None) -> None:
        t0 = time.perf_counter()
        try:
            save_checkpoint(self.path, state, progress=self._progress(), read=reads.read if reads else None,
                            faults=self.faults, stop=self.stop)
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc
            return
        self.last_ms = (time.perf_counter() - t0) * 1000
