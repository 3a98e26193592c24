"""Background checkpoints (DESIGN §6.2): write a copy-on-write snapshot on its own thread while
rounds go on.

`CheckpointWriter.save(state)` snapshots the committed state at a commit boundary (so it is a
contiguous prefix) and writes it on a writer thread. The snapshot copies only the small
bookkeeping at once; the fragments' params, momentum and outer-optimizer accumulator are read
from the live tensors, and a fragment is copied only when a commit is about to change it before
the writer got to it: the coordinator calls `preserve(f)` before merging into fragment f (see
`CopyOnWrite`). A round changes one fragment, so a write that overlaps k commits copies at most k
fragments instead of all of them.

One writer at a time: the next save, and every synchronous save, first waits for the write in
flight, so the newest checkpoint always lands last. A failed write is raised by that wait (the
file on disk is the previous one: `save_checkpoint` only ever replaces it atomically).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from syncer.checkpoint import CheckpointError, SyncerState, save_checkpoint
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.layout import build_layout


class CopyOnWrite:
    """The fragment tensors of one snapshot: live until `preserve` copies them, and never
    mutated while the writer reads them (`preserve` waits for the piece being read)."""

    def __init__(self, state: SyncerState) -> None:
        self._cond = threading.Condition()
        self.kinds: dict[str, list[torch.Tensor]] = {"param": list(state.params), "momentum": list(state.momentum)}
        if state.outer_accum is not None:
            self.kinds["accum"] = list(state.outer_accum)
        # Pieces the writer still has to read per fragment: once none are left, the fragment is free.
        slots = [0] * state.num_fragments
        for frag in build_layout(state.specs, state.num_fragments, state.pattern).fragments:
            slots[frag.index] = len(frag.slots) * len(self.kinds)
        self._left = slots
        self._reading: int | None = None
        self.copied: list[int] = []  # fragments copied because a commit came first

    @contextlib.contextmanager
    def read(self, kind: str, fragment: int) -> Iterator[torch.Tensor]:
        with self._cond:
            source = self.kinds[kind][fragment]
            self._reading = fragment
        try:
            yield source
        finally:
            with self._cond:
                self._reading = None
                self._left[fragment] -= 1
                self._cond.notify_all()

    def preserve(self, fragment: int) -> None:
        """A commit is about to change `fragment` in place: keep the snapshot's values first."""
        with self._cond:
            if self._left[fragment] <= 0 or fragment in self.copied:
                return  # already written, or already copied
            while self._reading == fragment:
                self._cond.wait()
            for tensors in self.kinds.values():
                tensors[fragment] = tensors[fragment].detach().to("cpu", copy=True)
            self.copied.append(fragment)


class CheckpointWriter:
    def __init__(self, path: Path, *, background: bool, progress: Callable[[], bool] = lambda: False,
                 faults: FaultInjector = NO_FAULTS) -> None:
        self.path = path
        self.faults = faults
        self.background = background
        self._progress = progress
        self._thread: threading.Thread | None = None
        self._cow: CopyOnWrite | None = None
        self._error: BaseException | None = None
        self.last_ms: float | None = None  # duration of the last completed write
        self.last_copied: list[int] = []  # fragments the last background write had to copy

    def save(self, state: SyncerState, *, wait: bool = False) -> float:
        """Checkpoint `state`; returns how long the caller was held (ms). With `wait`, or without
        background writes, the write is durable when this returns."""
        t0 = time.perf_counter()
        self.wait()
        if self.background and not wait:
            cow = self._cow = CopyOnWrite(state)
            snap = dataclasses.replace(  # the bookkeeping now; the tensors through `cow`
                state, versions=list(state.versions), ledger=dict(state.ledger),
                outer_count=list(state.outer_count), extra=dict(state.extra),
                params=list(state.params), momentum=list(state.momentum),
                outer_accum=None if state.outer_accum is None else list(state.outer_accum))
            self._thread = threading.Thread(target=self._write, args=(snap, cow), name="syncer-checkpoint",
                                            daemon=True)
            self._thread.start()
        else:
            self._write(state, None)
            self._raise_failure()
        return (time.perf_counter() - t0) * 1000

    def preserve(self, fragment: int) -> None:
        """Call before changing `fragment`'s params, momentum or accumulator in place."""
        cow = self._cow
        if cow is not None:
            cow.preserve(fragment)

    def wait(self) -> None:
        """Wait for the write in flight; raise CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._cow is not None:
            self.last_copied = list(self._cow.copied)
            self._cow = None
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"writing checkpoint {self.path} failed ({error}); the previous checkpoint "
                                  "is intact") from error

    def _write(self, state: SyncerState, cow: CopyOnWrite | None) -> None:
        t0 = time.perf_counter()
        try:
            save_checkpoint(self.path, state, progress=self._progress(), read=cow.read if cow else None,
                            faults=self.faults)
        except BaseException as exc:  # surfaced by the next wait()
            self._error = exc
            return
        self.last_ms = (time.perf_counter() - t0) * 1000
