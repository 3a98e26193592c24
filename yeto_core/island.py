"""`IslandSession`: one island (one process, or all the ranks of one) as one DiLoCo learner.

Every trainer adapter makes the same four calls on every rank of its island, at the same points:

    island = IslandSession(settings, named_params)            # one process holds every tensor
    island = IslandSession(settings, store=store)              # or a `CollectiveStore` across ranks
    island.start()                                             # joins; installs the initial cut
    for ...:
        train_step()
        if island.step(tokens):                                # once per optimizer step
            break                                              # the final cut is installed: stop
    island.finish()                                            # training ended first: final cut
    island.close()

With several ranks, rank 0 alone runs the `LearnerSession` and talks to the syncer; the store's
`run` makes every other rank follow rank 0's reads and writes op by op (`yeto_core.conductor`),
and carries the call's answer and rank 0's counters back to every rank, so all ranks stop at the
same step holding the same weights and report the same `IslandStats`. An error on rank 0 is
raised on every rank. Trainers whose steps come in phases (RL: rollouts, then updates) call
`sweep()` at the end of a phase instead of relying on the per-step boundaries alone.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from yeto_core.consensus_report import Probe
from yeto_core.learner import LearnerSession, LearnerStats
from yeto_core.learner_metrics import LearnerMetricsServer
from yeto_core.settings import LearnerSettings, SettingsError
from yeto_core.store import TensorStore
from yeto_core.web_server import read_token

__all__ = ["CollectiveStore", "IslandSession", "IslandStats"]

log = logging.getLogger("yeto.island")

T = TypeVar("T")


class CollectiveStore(TensorStore, Protocol):
    """The tensors of an island of several ranks; every rank holds one of these.

    `gather`, `install` and `tick` are called on rank 0 only (by its learner session); each
    makes the other ranks take part in the same collective. `run` and `close` are called on
    every rank."""

    rank: int

    def run(self, fn: Callable[[], T] | None, encode: Callable[[T], tuple[int, int, int]]) -> tuple[int, int, int]:
        """Rank 0 runs `fn` (the others pass None and follow its reads and writes); every rank
        returns `encode(fn())`. A failure on rank 0 is raised on every rank."""
        ...

    def island_probe(self, probe: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """The consensus probe run by every rank together (a sharded forward pass needs them
        all); every rank calls this, rank 0's session uses the result."""
        ...

    def close(self) -> None:
        """Every rank: release the island's group once no rank uses it any more."""
        ...


@dataclass(frozen=True)
class IslandStats:
    """What every rank knows after each call: rank 0's counters, and whether the final cut is in.
    The learner's full statistics (`learner`) and the syncer's consensus figures are on rank 0."""

    steps: int = 0
    pushes: int = 0
    installs: int = 0
    final_installed: bool = False
    learner: LearnerStats | None = None  # rank 0 (or the only process) only
    in_yeto_s: float = 0.0  # this rank's time inside `step` and `sweep`, the island's collectives included


class IslandSession:
    """Give either the live trainable tensors (`named_params`, one process holds them all) or a
    `store` whose reads and writes span the island's ranks. Keyword arguments mirror
    `LearnerSession`'s."""

    def __init__(
        self,
        settings: LearnerSettings,
        named_params: Sequence[tuple[str, torch.Tensor]] | None = None,
        *,
        store: CollectiveStore | None = None,
        embedding_names: Collection[str] = (),
        probe: Probe | None = None,
    ) -> None:
        if (named_params is None) == (store is None):
            raise ValueError("IslandSession needs exactly one of named_params or store")
        self.settings = settings
        self.store = store
        self.session: LearnerSession | None = None  # rank 0 (or the only process) only
        self._steps = 0
        self._in_yeto_s = 0.0
        self._answer = IslandStats()
        self._closed = False
        self.metrics: LearnerMetricsServer | None = None  # rank 0's /metrics, with `metrics_port`
        if store is None:
            self.session = LearnerSession(settings, named_params, embedding_names=embedding_names, probe=probe)
            return
        if probe is not None:
            probe = store.island_probe(probe)
        if store.rank == 0:
            self.session = LearnerSession(settings, store=store, embedding_names=embedding_names, probe=probe)

    @property
    def rank(self) -> int:
        return 0 if self.store is None else self.store.rank

    @property
    def stats(self) -> IslandStats:
        if self.session is None:
            return self._answer
        s = self.session.stats
        return IslandStats(s.steps, s.pushes, s.installs, s.final_installed, s, self._in_yeto_s)

    # -- the collective calls ------------------------------------------------------------------
    def start(self) -> None:
        """Connect and install the initial cut. A permanent refusal raises here (on every rank),
        unless `alone_if_refused` lets the island train on alone."""
        def start(session: LearnerSession) -> bool:
            if self.settings.metrics_port is not None and self.metrics is None:
                self.metrics = self._serve_metrics(session)
            session.start()
            return False

        self._together(start)

    def step(self, tokens: int) -> bool:
        """Account one optimizer step of `tokens` (the island's tokens; rank 0's value counts).
        True on every rank when the final cut was installed: stop training at this step."""
        self._steps += 1
        return self._timed(lambda session: session.step(tokens))

    def sweep(self) -> bool:
        """A boundary for every fragment at once (`LearnerSession.sweep`): push every fragment the
        syncer asked for, then wait for their merges and install them (at once with `overlap`).
        True when the final cut was installed meanwhile."""
        return self._timed(lambda session: session.sweep())

    def finish(self) -> bool:
        """Training ended here first: wait (at most `final_timeout_s`) for the final cut. True
        when it was installed."""
        return self._together(lambda session: session.finish())

    def close(self) -> None:
        """Every rank, once (later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self.metrics is not None:
            self.metrics.close()
        if self.session is not None:
            self.session.close()
        if self.store is not None:
            self.store.close()

    # -- internals -----------------------------------------------------------------------------
    def _timed(self, call: Callable[[LearnerSession], bool]) -> bool:
        """`_together(call)`, its time added to what the training thread spent in yeto."""
        started = time.perf_counter()
        try:
            return self._together(call)
        finally:
            self._in_yeto_s += time.perf_counter() - started
            self._answer = dataclasses.replace(self._answer, in_yeto_s=self._in_yeto_s)

    def _serve_metrics(self, session: LearnerSession) -> LearnerMetricsServer:
        s = self.settings
        token = None
        if s.metrics_token_file is not None:
            token = read_token(s.metrics_token_file, "YETO_DILOCO_METRICS_TOKEN_FILE")
        try:
            server = LearnerMetricsServer(lambda: session.stats, s.learner_id, s.metrics_host, s.metrics_port or 0,
                                          token=token)
        except OSError as exc:
            setting = "METRICS_HOST" if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL \
                else "METRICS_PORT"
            raise SettingsError(f"learner {s.learner_id}: cannot serve /metrics on {s.metrics_host}:{s.metrics_port} "
                                f"(YETO_DILOCO_{setting}): {exc.strerror}") from None
        log.warning("yeto learner %d: metrics on http://%s:%d/metrics", s.learner_id, s.metrics_host, server.port)
        return server

    def _together(self, call: Callable[[LearnerSession], bool]) -> bool:
        if self.store is None:
            assert self.session is not None
            return bool(call(self.session))
        session = self.session

        def encode(answer: bool) -> tuple[int, int, int]:
            assert session is not None
            s = session.stats
            return int(bool(answer)) | int(s.final_installed) << 1, s.pushes, s.installs

        flags, pushes, installs = self.store.run((lambda: call(session)) if session is not None else None, encode)
        self._answer = IslandStats(self._steps, pushes, installs, bool(flags & 2))
        return bool(flags & 1)
