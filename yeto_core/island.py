"""`IslandSession`: one island (one process, or all the ranks of one) as one DiLoCo learner.

Every trainer adapter makes the same four calls on every rank of its island, at the same points:

    island = IslandSession(settings, named_params)            # one process holds every tensor
    island = IslandSession(settings, store=store)              # or a `CollectiveStore` across ranks
    island.start()                                             # joins; installs the initial cut
    for ...:
        train_step()
        if island.step(tokens, last=this_is_the_last_step):    # once per optimizer step
            break                                              # the final cut is installed: stop
    island.finish()                                            # training ended early: final cut
    island.close()

The island owns the end of the run, so adapters keep no flags of their own: `step(..., last=True)`
on the trainer's last step waits for the final cut there; `end_iteration(last=...)` ends a phase of
an RL trainer (a sweep when `rl_mode` sweeps, the final cut after the last one); `finish` is
idempotent, so an adapter calls it wherever training may end; `final` says, on every rank alike,
that the final cut is in (later `step` calls return True at once: stop, or hold the weights).
Rank 0 says once per island, in one line, at which step the final cut was installed.

With several ranks, rank 0 alone runs the `LearnerSession` and talks to the syncer; the store's
`run` makes every other rank follow rank 0's reads and writes op by op (`yeto_core.conductor`),
and carries the call's answer and rank 0's counters back to every rank, so all ranks stop at the
same step holding the same weights and report the same `IslandStats` (the call's `Outcome`, one
typed header from rank 0). An error on rank 0 is raised on every rank.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import socket
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from yeto_core.conductor import Outcome
from yeto_core.consensus_report import Probe
from yeto_core.learner import LearnerSession, LearnerStats
from yeto_core.learner_metrics import LearnerMetricsServer
from yeto_core.moments import MomentError
from yeto_core.settings import LearnerSettings, SettingsError
from yeto_core.store import TensorStore
from yeto_core.web_server import read_token

__all__ = ["CollectiveStore", "IslandSession", "IslandStats"]

log = logging.getLogger("yeto.island")


class CollectiveStore(TensorStore, Protocol):
    """The tensors of an island of several ranks; every rank holds one of these.

    `gather`, `install` and `tick` are called on rank 0 only (by its learner session); each
    makes the other ranks take part in the same collective. `run` and `close` are called on
    every rank."""

    rank: int

    def run(self, fn: Callable[[], object] | None) -> Outcome:
        """Rank 0 runs `fn` (the others pass None and follow its reads and writes); every rank
        returns the `Outcome` `fn` returned (an empty one for anything else). A failure on rank 0
        is raised on every rank."""
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
    `LearnerSession`'s; `on_final` ends the line that says the final cut is in (what the trainer
    does next)."""

    def __init__(
        self,
        settings: LearnerSettings,
        named_params: Sequence[tuple[str, torch.Tensor]] | None = None,
        *,
        store: CollectiveStore | None = None,
        embedding_names: Collection[str] = (),
        probe: Probe | None = None,
        on_final: str = "training stops",
    ) -> None:
        if (named_params is None) == (store is None):
            raise ValueError("IslandSession needs exactly one of named_params or store")
        self.settings = settings
        self.store = store
        self.session: LearnerSession | None = None  # rank 0 (or the only process) only
        self.on_final = on_final
        self._first_step = 0  # the trainer's steps before this run's first (a resumed run)
        self._steps = 0
        self._in_yeto_s = 0.0
        self._answer = IslandStats()
        self._final = False  # from the last call's outcome: the same on every rank
        self._finished = False  # finish() ran; later calls return its answer
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
    def final(self) -> bool:
        """The final cut is installed (every rank alike)."""
        return self._final

    @property
    def stats(self) -> IslandStats:
        if self.session is None:
            return self._answer
        s = self.session.stats
        return IslandStats(s.steps, s.pushes, s.installs, s.final_installed, s, self._in_yeto_s)

    # -- the collective calls ------------------------------------------------------------------
    def share_momentum(self, optimizer: Any) -> None:
        """Share the optimizer's first moment with the other islands (DESIGN §3.9). Every rank calls
        it with its own optimizer, once it exists; a store of several ranks must offer `moments`
        (their reads and writes are collectives), or the setting is refused (`MomentError`)."""
        if self.store is None:
            assert self.session is not None
            self.session.share_momentum(optimizer)
            return
        make = getattr(self.store, "moments", None)
        if make is None:
            raise MomentError(f"YETO_DILOCO_SHARE_MOMENTUM: this island's {type(self.store).__name__} cannot share "
                              "the optimizer's moment yet; unset it")
        moments = make(optimizer)
        if self.session is not None:
            self.session.share_moments(moments)

    def start(self, first_step: int = 0) -> None:
        """Connect and install the initial cut. A permanent refusal raises here (on every rank),
        unless `alone_if_refused` lets the island train on alone. `first_step`: the trainer's step
        count before this run's first step (a resumed run), so the island's lines name its steps."""
        self._first_step = first_step

        def start(session: LearnerSession) -> bool:
            if self.settings.metrics_port is not None and self.metrics is None:
                self.metrics = self._serve_metrics(session)
            session.start()
            return False

        self._together(start)

    def step(self, tokens: int, *, last: bool = False) -> bool:
        """Account one optimizer step of `tokens` (the island's tokens; rank 0's value counts).
        `last`: the trainer's last step, where the final cut is waited for (`finish`) unless it came
        with the step. True on every rank once the final cut is installed: stop training at this
        step (a later call returns True at once, touching nothing)."""
        if self._final:
            return True
        self._steps += 1
        if self._timed(lambda session: session.step(tokens)):
            self._announce("")
            return True
        return self.finish() if last else False

    def sweep(self) -> bool:
        """A boundary for every fragment at once (`LearnerSession.sweep`): push every fragment the
        syncer asked for, then wait for their merges and install them (at once with `overlap`).
        True when the final cut was installed meanwhile."""
        if self._final:
            return True
        if self._timed(lambda session: session.sweep()):
            self._announce("")
        return self._final

    def end_iteration(self, *, last: bool = False) -> bool:
        """The end of one phase of steps (an RL iteration's update): every fragment swept when
        `rl_mode` sweeps, and after the run's `last` phase the final cut waited for. True once the
        final cut is installed."""
        if self.settings.sweeps:
            self.sweep()
        return self.finish() if last else self._final

    def finish(self) -> bool:
        """Training ended here first: wait (at most `final_timeout_s`) for the final cut. True
        when it was installed. Idempotent: a later call returns the first one's answer."""
        if self._final or self._finished:
            return self._final
        self._finished = True
        if self._together(lambda session: session.finish()):
            self._announce(", the trainer's last")
        return self._final

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
    def _announce(self, which: str) -> None:
        if self.rank == 0:  # every rank stops; the island says so once
            log.warning("yeto learner %d: final cut installed at step %d%s; %s", self.settings.learner_id,
                        self._first_step + self._steps, which, self.on_final)

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
            answer = bool(call(self.session))
            self._final = self.session.stats.final_installed
            return answer
        session = self.session

        def lead() -> Outcome:
            assert session is not None
            answer = call(session)
            s = session.stats
            return Outcome(bool(answer), s.final_installed, s.pushes, s.installs)

        outcome = self.store.run(lead if session is not None else None)
        self._final = outcome.final_installed
        self._answer = IslandStats(self._steps, outcome.pushes, outcome.installs, outcome.final_installed)
        return outcome.answer
