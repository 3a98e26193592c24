"""A lock-step driver: in-process islands stepped in one thread so every run sees one schedule.

What makes a schedule deterministic (the same bits on every run, whatever the timing):

* every island's data and initial weights come from fixed seeds (`SeededIsland`);
* one thread steps the islands in a fixed order, and before each step of each island the driver
  waits until (a) its last push has been handed to the kernel, (b) the BCAST of the round that
  push answered has arrived, so the island installs it at this very step, and (c) before a
  boundary step, the PULL it answers there has arrived (round k is answered at boundary step
  (k + 1)·H/P);
* the syncer waits for every learner (`--quorum` = learners) and merges on the CPU with a fixed
  thread count.

Round k then merges the same deltas, with the same tokens and steps, in every run. Faults do not
change that: a push lost with its connection, or a round the syncer lost when it died before the
round was durable, is pulled again, and the learner sends the same delta again at once (it keeps
each push until its round's BCAST is installed), while the driver holds the island at its step.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Island, Syncer
from mlp import small_mlp

from yeto_core.client import PushJob
from yeto_core.learner import LearnerSession

BOUNDARIES = {"answer_on_arrival": False}
"""What the driver's islands are built with: it steps them to the boundaries' schedule, round k
answered at step (k + 1)·H/P, which a learner answering on arrival (the default) runs ahead of."""


class SeededIsland(Island):
    """An `Island` whose batches come from its own generator, not torch's global one."""

    def __init__(self, syncer: Syncer, key_file: Path, learner_id: int = 0,
                 model: Callable[[], torch.nn.Module] | None = None, in_features: int = 8, **settings: Any) -> None:
        super().__init__(syncer, key_file, learner_id, **settings)
        self.in_features = in_features
        if model is not None:  # rebuild with another model, seeded the same way
            self.model, self.target, self.opt = small_mlp(learner_id, model, in_features)
            self.session = LearnerSession(self.session.settings, list(self.model.named_parameters()))
        self.batches = torch.Generator().manual_seed(1000 + learner_id)

    def batch(self) -> torch.Tensor:
        return torch.randn(16, self.in_features, generator=self.batches)


def settle(islands: Sequence[Island], what: Callable[[], bool], deadline: float, describe: str,
           syncer: Syncer) -> None:
    """Move whatever the syncer sent into the sessions (nothing is installed) until `what()` holds.

    Every island is drained, not only the one waiting: a round the syncer pulls again completes
    only when every island has seen that PULL and replayed its push."""
    while True:
        for island in islands:
            island.session.pump(0.01 / len(islands))
        if what():
            return
        if time.monotonic() > deadline:
            pytest.fail(f"lock-step driver: timed out waiting for {describe}\n{syncer.proc.tail()}")


def pushed(job: PushJob, s: LearnerSession) -> bool:
    return job.done.is_set() or s.final_ready


def has_bcast(s: LearnerSession, fragment: int, version: int) -> bool:
    return s.final_ready or s.fragments[fragment].bcast_arrived_after(version - 1)


def has_pull(s: LearnerSession, round_id: int) -> bool:
    return s.final_ready or any(p.round == round_id for p in s.pending_pulls())


def lock_step(syncer: Syncer, islands: Sequence[Island], timeout: float, *, faults: bool = False,
              before_step: Callable[[int, int], None] | None = None, overlap_until: int = 0) -> int:
    """Drive `islands` in one thread so that every learner sees the same schedule on every run.

    `faults`: a push may fail (its connection dropped); the driver then waits for the round's
    BCAST all the same, which comes after the learner's replay. `before_step(island, step)` runs
    right before each step (a test's hook to disturb the run at a fixed point of the schedule).
    `overlap_until` R > 0: at the boundary of round k < R − 1, also wait for the PULL of round k + 1,
    so a pipelined syncer (`--pipeline 2`) is seen with two rounds in flight whatever the timing.
    Returns the most PULLs ever pending at once on one island (above 1 only when rounds overlapped).
    """
    if any(i.session.settings.answer_on_arrival for i in islands):
        raise ValueError("the lock-step driver schedules boundaries: build its islands with **BOUNDARIES")
    most = 0
    threads = [threading.Thread(target=i.start) for i in islands]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert all(i.session.initial_cut_installed for i in islands), "an island did not get the initial cut"
    deadline = time.monotonic() + timeout
    waiting: dict[int, tuple[int, int]] = {}  # island -> (fragment, version) of the BCAST it waits for
    while not all(i.finished for i in islands):
        for n, island in enumerate(islands):
            if island.finished:
                continue
            s = island.session
            be = s.boundary_every
            step = s.stats.steps + 1
            if s.push is not None:
                job = s.push
                settle(islands, functools.partial(pushed, job, s), deadline, "a push to stream", syncer)
                assert faults or not job.error, job.error
                waiting[n] = (job.pull.fragment, job.pull.version + 1)
            if n in waiting:
                f, v = waiting[n]
                settle(islands, functools.partial(has_bcast, s, f, v), deadline,
                       f"the BCAST of fragment {f} version {v}", syncer)
                del waiting[n]
            if step % be == 0:
                k = step // be - 1
                settle(islands, functools.partial(has_pull, s, k), deadline, f"the PULL of round {k}", syncer)
                if k + 1 < overlap_until:
                    settle(islands, functools.partial(has_pull, s, k + 1), deadline,
                           f"the PULL of round {k + 1} (overlapping round {k})", syncer)
            if s.push is not None and not s.push.done.is_set():  # a replay submitted while it waited
                settle(islands, functools.partial(pushed, s.push, s), deadline, "a replayed push to stream", syncer)
            most = max(most, len(s.pending_pulls()))
            if before_step is not None:
                before_step(n, step)
            island.train_step()
            if not island.finished and step % be == 0 and not s.final_ready:
                assert s.push is not None and s.push.pull.round == step // be - 1, (
                    f"island {n} step {step}: the boundary pushed nothing (push in flight: "
                    f"{None if s.push is None else (s.push.pull, s.push.done.is_set())}, pulls {s.pending_pulls()})")
    return most


def round_robin(islands: Sequence[Island], steps: int, syncer: Syncer) -> None:
    """The product's own lockstep (`YETO_DILOCO_LOCKSTEP`): start the islands, step them in turn
    `steps` times on this thread (the sessions wait for their pulls and merges themselves), then
    finish every session; each must get the final cut without a lockstep wait running out."""
    starts = [threading.Thread(target=i.start) for i in islands]
    for t in starts:
        t.start()
    for t in starts:
        t.join(60)
    for step in range(steps):
        for island in islands:
            assert not island.train_step(), f"the syncer finalized at step {step}"
    done: list[bool] = []
    finishes = [threading.Thread(target=lambda s=i.session: done.append(s.finish())) for i in islands]
    for t in finishes:
        t.start()
    for t in finishes:
        t.join(60)
    assert done == [True] * len(islands), syncer.proc.tail()
    assert [i.session.stats.lockstep_misses for i in islands] == [0] * len(islands)
