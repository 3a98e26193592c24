"""The framework-free DiLoCo learner (DESIGN §3).

A trainer plugin hands `LearnerSession` its live trainable tensors (or a `TensorStore` that reads
and writes them where they live, e.g. across a Megatron island's ranks) and calls `step(tokens)`
once per optimizer step. The session never blocks a step on the network:

* **Anchors.** For every fragment the session keeps the f32 global value it last installed
  (the anchor) and that value's version. A push carries d = θ − anchor, never θ itself, plus
  the tokens and steps trained since the anchor (the syncer weights learners by tokens²/steps).
* **Schedule.** The syncer PULLs fragments round by round, one round per H/P steps of the
  fleet (streaming DiLoCo); the session answers each at its own boundaries, one every
  max(1, H // P) steps, or with `answer_on_arrival` at the first step after it arrives, gathering
  one fragment per answer. H and P are the syncer's: its CHALLENGE announces them, and a learner
  setting that disagrees is refused at the handshake rather than followed. A pull waits while a
  push is still streaming or while the fragment's anchor is older than the version the pull
  names (its BCAST has not been installed yet).
* **Background sender.** The delta is computed on the training thread (one memory pass); the
  link's sender thread encodes and streams it.
* **Sans-I/O.** The session owns no socket, thread or wall clock: it talks to the syncer
  through a `Link` (`link.py`), measures every deadline on the clock it is given, and keeps one
  record per fragment (`learner_state.py`); the per-fragment rules live in `fragment_sync.py`.
  Learner 0's INIT upload is a request the training thread answers at its next step or wait
  tick, so no wait can starve it.
* **Installing.** A BCAST is installed in place (optimizer moments untouched) by rebasing,
  θ ← Θ + (θ − θ at the push) (`overlap`, the default: the steps trained while the round was in
  flight are kept), or by blending, θ ← α·θ_local + (1−α)·Θ (`merge_alpha`, 0: overwrite); the
  anchor becomes Θ. The very first cut overwrites, so every learner starts from learner 0's
  initial weights.
* **Lockstep** (`lockstep`, for reproducible experiments). Boundary k waits for the PULL of
  round k, and the next step (or the `lockstep_round_trip`-th, at most H/P) waits for that round's
  BCAST and installs it: the schedule is a function of steps.
* **Finalization.** When all P FINAL cuts are in, they are installed exactly (no blending) and
  `step` returns True: training ends at that step, and every learner holds the syncer's bits.
  A learner that reaches its own step limit first sends DONE and waits (with a deadline) for
  the final cut in `finish`; with `final_flush` it first pushes what every fragment trained
  since its last push and waits for those rounds to merge.
* **Refusals.** A permanent refusal stops the island at its next call (`refusal.py`), unless
  `alone_if_refused` lets it train on alone.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from yeto_core.blocking import blocking_fragments
from yeto_core.codecs import codec_by_name
from yeto_core.consensus_report import ConsensusReporter, Probe, metrics
from yeto_core.fragment_sync import FragmentSync
from yeto_core.layout import Layout, TensorSpec, build_layout
from yeto_core.learner_state import FragmentState, LearnerStats
from yeto_core.link import MONOTONIC, Clock, Connected, Inbound, InitWanted, Link, Lost, PushEnded, PushJob
from yeto_core.moments import MomentError, OptimizerMoments, warm_codec
from yeto_core.refusal import ProbeFailed, stop_if_refused
from yeto_core.sections import DEFAULT_SYNC_INTERVAL, Schedule
from yeto_core.settings import LearnerSettings
from yeto_core.store import FRAGMENT_POOL, STEADY_FRAGMENT_BUFFERS, LocalStore, TensorStore, nonfinite_tensor
from yeto_core.wire.errors import ErrorCode, Refused, WireError
from yeto_core.wire.messages import Bye, Consensus, Done, Pull

log = logging.getLogger("yeto.learner")

FINAL_INSTALLED = "final cut installed"  # the goodbye that tells the syncer the final cut arrived
# How long an island answering the rounds it is owed waits for the next one: four of its rounds'
# worth of steps, at least this. A syncer that cannot launch (its quorum waits for a crashed
# member) must not hold every DONE for half the final timeout.
OWED_ROUND_PATIENCE_S = 5.0

__all__ = ["FragmentState", "LearnerSession", "LearnerStats"]


def say_on_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class LearnerSession:
    def __init__(
        self,
        settings: LearnerSettings,
        named_params: Sequence[tuple[str, torch.Tensor]] | None = None,
        *,
        embedding_names: Collection[str] = (),
        store: TensorStore | None = None,
        probe: Probe | None = None,
        link: Link | None = None,
        clock: Clock = MONOTONIC,
        say: Callable[[str], None] = say_on_stderr,
    ) -> None:
        """Give either the live trainable tensors (`named_params`, one process holds them all)
        or a `store` that reads and writes them wherever they live. `link` is the connection to
        the syncer (by default a `SyncerClient` to `settings.syncer`), `clock` the time every
        deadline is measured on, `say` where messages for the user go (stderr)."""
        if (named_params is None) == (store is None):
            raise ValueError("LearnerSession needs exactly one of named_params or store")
        self.settings = settings
        self.store: TensorStore = store if store is not None else LocalStore(named_params or (), embedding_names)
        self.specs: list[TensorSpec] = list(self.store.specs)
        self.codec = codec_by_name(settings.wire_dtype, block=settings.push_block)
        self.stats = LearnerStats()
        self.clock = clock
        self._say = say
        self.link: Link = link if link is not None else self._syncer_client()
        self.sync = FragmentSync(learner_id=settings.learner_id, store=self.store, codec=self.codec,
                                 stats=self.stats, overlap=settings.link.overlap, merge_alpha=settings.merge_alpha,
                                 submit=lambda job: self.link.submit(job), say=say)
        self._init_snapshot: list[torch.Tensor] | None = None  # learner 0: INIT values before the first cut
        # DONE is owed once per connection, counted here: a restarted syncer numbers its
        # generations from 1 again, so a DONE the dead one swallowed may share the new one's number.
        self._done_sent_on: int | None = None
        self._generation: int | None = None
        self._last_step_at: float | None = None
        self._step_s: float | None = None
        self._sync_interval = settings.sync_interval or DEFAULT_SYNC_INTERVAL  # the syncer's, once announced
        self._paced = False  # the syncer paces rounds by H learner steps (it announced an H)
        self.consensus = ConsensusReporter(probe, settings.consensus, learner_id=settings.learner_id)

    def _syncer_client(self) -> Link:
        from yeto_core.client import SyncerClient  # the socket layer, only when no link is given

        s = self.settings
        return SyncerClient(s.endpoint(), s.link, codec=self.codec, sends_init=s.learner_id == 0,
                            faults=s.fault_injector())

    def share_momentum(self, optimizer: Any) -> None:
        """Share `optimizer`'s first moment of the synced tensors with the other islands (DESIGN
        §3.9): the trainer's plugin calls this once its optimizer exists, when the settings ask
        for it (`share_momentum`). Only a session over the live tensors (`named_params`) can."""
        if not isinstance(self.store, LocalStore):
            raise MomentError("YETO_DILOCO_SHARE_MOMENTUM needs the trainer's own tensors; this island's "
                              f"{type(self.store).__name__} keeps them elsewhere")
        self.share_moments(OptimizerMoments(optimizer, list(self.store.params.items())))

    def share_moments(self, moments: OptimizerMoments) -> None:
        """`share_momentum` through `moments`: an island of several ranks reads and changes its
        optimizer's moment through its store's collectives (`yeto_plugins.torch_dist.moments`)."""
        self.sync.moments = moments
        warm_codec()

    # -- what a driver may look at -------------------------------------------------------------
    @property
    def layout(self) -> Layout | None:
        return self.sync.layout

    @property
    def fragments(self) -> list[FragmentState]:
        return self.sync.fragments

    @property
    def blocking(self) -> frozenset[int]:
        return self.sync.blocking

    @property
    def initial_cut_installed(self) -> bool:
        return self.sync.initial_cut_installed

    @property
    def final_ready(self) -> bool:
        """Every fragment's final cut has arrived (the next step or `finish` installs it)."""
        return self.sync.final_ready

    @property
    def push(self) -> PushJob | None:
        """The push last handed to the link, until a later call finds it done and counts it."""
        return self.sync.push

    @property
    def generation(self) -> int | None:
        """The syncer's generation of the live connection; None while the link is down."""
        return self._generation

    def pending_pulls(self) -> list[Pull]:
        return self.sync.pending_pulls()

    def pulls_to_answer(self) -> bool:
        return self.sync.pulls_to_answer()

    @property
    def sync_interval(self) -> int:
        """H, the steps per fragment round trip: the syncer's, as its last CHALLENGE announced it, or
        this learner's own (else the default) under a syncer that does not pace by steps. Until the
        first CHALLENGE no boundary counts by it: there is no layout, nothing to push yet."""
        return self._sync_interval

    @property
    def boundary_every(self) -> int:
        num = self.layout.num_fragments if self.layout else 1
        return max(1, self.sync_interval // num)

    # -- set-up ------------------------------------------------------------------------------
    def _interval_for(self, announced: int) -> int:
        """The H this learner follows under a syncer that announces `announced`. The syncer paces
        rounds by it, so a learner that keeps another would answer its pulls too early or too late:
        one set to disagree is refused for good, with both values, rather than silently overruled."""
        own = self.settings.sync_interval
        if announced and own is not None and own != announced:
            raise Refused(ErrorCode.CONTRACT, f"YETO_DILOCO_SYNC_INTERVAL={own}, but the syncer runs H={announced} "
                          "(--sync-interval-steps); unset it to take the syncer's")
        return announced or own or DEFAULT_SYNC_INTERVAL

    def _layout_for(self, schedule: Schedule) -> Layout:
        """Asked by the link on every CHALLENGE: the layout to fingerprint in HELLO, and the H to
        follow from now on (a syncer restarted with another H paces rounds by that one)."""
        num_fragments, pattern = schedule.num_fragments, schedule.pattern
        expected = self.settings.fragments
        if expected is not None and expected != num_fragments:
            raise Refused(ErrorCode.LAYOUT, f"the syncer splits the model into {num_fragments} fragments but "
                          f"YETO_DILOCO_FRAGMENTS={expected}")
        # Set before the layout, whose arrival makes the training thread count boundaries by it.
        self._sync_interval = self._interval_for(schedule.sync_interval)
        self._paced = bool(schedule.sync_interval)
        # Only the link asks, one dial at a time, so the layout is built once without a lock.
        layout = self.sync.layout
        if layout is None:
            try:
                layout = build_layout(self.specs, num_fragments, pattern)
                blocking = blocking_fragments(layout, self.settings.blocking)
            except ValueError as exc:
                where = " (YETO_DILOCO_BLOCKING)" if "blocking" in str(exc) else ""
                raise Refused(ErrorCode.LAYOUT, f"{exc}{where}") from exc
            self.sync.begin(layout, blocking)
        elif (layout.num_fragments, layout.pattern) != (num_fragments, pattern):
            raise Refused(ErrorCode.LAYOUT, f"the syncer now asks for {num_fragments} {pattern} fragments; "
                          f"this learner joined with {layout.num_fragments} {layout.pattern}")
        return layout

    def _answer_init(self, request: InitWanted) -> None:
        """Learner 0, on the training thread: read the INIT values the link waits for (a sharded
        store reads collectively, so never on the link's thread). Before the first cut it is one
        snapshot of the initial weights, replayed on every new connection; a syncer that lost its
        state later is seeded from the current weights, so the run goes on instead of waiting
        forever. A run never starts from NaN or Inf."""
        if not request.reseed and self._init_snapshot is not None:
            self.link.provide_init(self._init_snapshot)
            return
        values: list[torch.Tensor] | None = [self.sync.gather(i) for i in range(len(self.fragments))]
        assert self.layout is not None and values is not None
        for fragment, part in zip(self.layout.fragments, values, strict=True):
            name = nonfinite_tensor(fragment, part)
            if name is None:
                continue
            self.link.provide_init(None)
            if not request.reseed:
                raise ValueError(f"learner 0: the initial weights hold NaN or Inf (first in {name!r}); "
                                 "a run cannot start from them")
            self._say(f"yeto learner 0: the weights hold NaN or Inf (first in {name!r}); no INIT for the syncer "
                      "that lost its state")
            return
        if request.reseed:
            self.sync.reseeded(values)
        else:
            self._init_snapshot = values
        self.stats.init_answers += 1
        self.link.provide_init(values)

    def start(self) -> None:
        """Connect, and wait (at most `init_timeout_s`) for the initial cut before training.

        With a minimum link rate set, the link is probed first; a too-slow island raises
        `ProbeFailed` (exit code 75, and the line that says what was measured) before it joins, for
        whoever owns the process to exit with (so a supervisor can place it anew).
        """
        s = self.settings
        if s.wan_probe_min_mbps > 0 or s.wan_probe_min_down_mbps > 0:
            self._probe_link()
        self.link.start(self._layout_for, lambda: self.stats.steps)
        deadline = self.clock() + s.init_timeout_s
        while not self.initial_cut_installed:
            if self.final_ready:
                return  # joined a run that is finalizing: the first step installs the final cut
            left = deadline - self.clock()
            if left <= 0:
                log.warning("learner %d: no initial cut after %.0f s; training locally until it arrives",
                            s.learner_id, s.init_timeout_s)
                return
            if stop_if_refused(s, self.link.refused):
                return
            self._tick(min(left, 0.5))
            self.sync.install_bcasts()
            if self._init_snapshot is not None and any(f.version >= 0 for f in self.fragments):
                self._drop_init_snapshot()
        self._drop_init_snapshot()
        log.info("learner %d: initial cut installed (%d fragments)", s.learner_id, len(self.fragments))

    def _drop_init_snapshot(self) -> None:
        """Once the syncer made its initial cut it holds the model and never asks for this INIT again:
        dropped then, the snapshot and the installed anchors are never both held (two copies of the
        model beside the weights). Its buffers go back to the fragment pool, which keeps only what
        steady rounds reuse."""
        if self._init_snapshot is None:
            return
        self._init_snapshot = None
        FRAGMENT_POOL.trim(keep=STEADY_FRAGMENT_BUFFERS)

    def _probe_link(self) -> None:
        s = self.settings
        try:
            result = self.link.measure(s.wan_probe_mib << 20)
        except (OSError, WireError) as exc:
            why = f"the bandwidth probe to {s.syncer} failed ({exc})"
        else:
            self.stats.probe = result
            log.info("learner %d: link to %s measured %.0f Mbit/s up, %.0f Mbit/s down", s.learner_id, s.syncer,
                     result.up_mbps, result.down_mbps)
            if result.up_mbps >= s.wan_probe_min_mbps and result.down_mbps >= s.wan_probe_min_down_mbps:
                return
            why = (f"link to {s.syncer} measured {result.up_mbps:.1f} Mbit/s up and {result.down_mbps:.1f} Mbit/s "
                   f"down; YETO_DILOCO_WAN_PROBE_MIN_MBPS={s.wan_probe_min_mbps:g}, "
                   f"YETO_DILOCO_WAN_PROBE_MIN_DOWN_MBPS={s.wan_probe_min_down_mbps:g}")
        raise ProbeFailed(s, why)

    # -- taking in what the link delivered ---------------------------------------------------
    def pump(self, timeout_s: float) -> None:
        """Take in every event the link has (waiting at most `timeout_s` for the first) and answer
        an INIT request; nothing is installed here."""
        wait = timeout_s
        while (event := self.link.next_event(wait)) is not None:
            wait = 0.0
            self._take(event)

    def _take(self, event: Inbound) -> None:
        if isinstance(event, Connected):
            self._generation = event.generation
            self.sync.links += 1
            self.stats.connected_generations.append(event.generation)
        elif isinstance(event, Lost):
            # Held PULLs are kept: a boundary reached while the link is down still computes its
            # push (sent, or replayed when the syncer pulls the round again), so a reconnect
            # never moves an answer to a later boundary.
            self._generation = None
        elif isinstance(event, InitWanted):
            self._answer_init(event)
        elif isinstance(event, PushEnded):
            pass  # it woke a wait; the push is counted where the session looks at it
        elif isinstance(event.msg, Bye):
            log.info("learner %d: syncer said goodbye (%s)", self.settings.learner_id, event.msg.reason)
        elif isinstance(event.msg, Consensus):
            self.stats.consensus_js, self.stats.fragment_l2 = metrics(event.msg)
        else:
            self.sync.take(event.msg, event.values, event.moment)

    def _tick(self, timeout_s: float) -> None:
        """One turn of a wait: let the island's other ranks follow, then take in events."""
        self.store.tick()
        self.pump(timeout_s)

    # -- the per-step entry point ------------------------------------------------------------
    def step(self, tokens: int) -> bool:
        """Account one optimizer step of `tokens` trained tokens; True means: stop training now."""
        started = self.clock()
        try:
            return self._step(tokens)
        finally:
            self.stats.in_yeto_s += self.clock() - started

    def _step(self, tokens: int) -> bool:
        self.stats.steps += 1
        self.stats.tokens += int(tokens)
        now = self.clock()
        if self._last_step_at is not None:  # EMA of the wall time per step, reported with pushes
            took = now - self._last_step_at
            self._step_s = took if self._step_s is None else 0.8 * self._step_s + 0.2 * took
        self._last_step_at = now
        stop_if_refused(self.settings, self.link.refused)
        self.pump(0.0)  # an INIT asked for meanwhile is answered here too
        self.sync.push_in_flight()  # a push that went out since the last step is counted now
        if self.settings.sweeps:  # RL: weights change only between iterations, at the sweep
            return False
        held: Collection[int] = ()
        if self.settings.lockstep:  # a push's merge is installed `lockstep_round_trip` steps after it
            held = self.sync.recent_pushes(min(self.settings.lockstep_round_trip, self.boundary_every))
            self._lockstep_wait(lambda: self.sync.pushes_merged(skip=held), "the merge of this island's last push")
        if self.final_ready:
            self._install_final()
            return True
        self.sync.install_bcasts(hold=held)
        self.consensus.after_installs(self.stats.installs, sum(f.version for f in self.fragments if f.version > 0),
                                      self.stats.steps, self.link.send_probe)
        # Boundaries follow the syncer's schedule: none before its first CHALLENGE announced it.
        if self.layout is not None and (self.stats.steps % self.boundary_every == 0 or self._answers_on_arrival):
            if self.settings.lockstep:  # every boundary answers one round
                self._lockstep_wait(self.sync.pull_answerable, f"a pull to answer at step {self.stats.steps}")
            self._boundary()
        return False

    @property
    def _answers_on_arrival(self) -> bool:
        """Whether every step is a boundary (`answer_on_arrival`): a syncer that paces its rounds by
        steps already spaces them H/P steps of the fleet apart, and an island that waits for its own
        next boundary adds up to H/P steps to each round's quorum and to every member's round trip.
        Never in lockstep (its schedule is the boundaries) or under a syncer that does not pace by
        steps (there the boundaries are the only pace)."""
        s = self.settings
        return s.answer_on_arrival and self._paced and not s.lockstep and not s.sweeps

    def _boundary(self) -> None:
        job = self.sync.boundary(self._step_s)
        if job is not None and job.pull.fragment in self.blocking:
            self._wait_for_merge(job)

    def _install_final(self) -> None:
        self.sync.push_in_flight()  # pushes that ended since the last step are counted before the report
        rounds = self.sync.install_final()
        # The goodbye is the syncer's only proof that the cut arrived (a FINAL sent into a link that
        # was already dead looks sent): said now, not when the trainer gets round to `close`.
        self.link.send(Bye(FINAL_INSTALLED))
        log.info("learner %d: final cut installed after %d rounds at step %d", self.settings.learner_id, rounds,
                 self.stats.steps)

    def rounds_owed(self) -> int:
        """Rounds this island's steps reached that no push of it answered yet: those its syncer has
        not launched, when at most one per fragment, plus one if a PULL of such a round is held.
        A syncer paces rounds by H steps of the fleet's measured step time, so a start that took
        longer than a round (the first merge, a slow first push) leaves it a few rounds behind for
        the rest of the run; an island that said DONE then would lose each lagging fragment's last
        round of training. More than P behind is an island ahead of its fleet's pace (a faster one
        beside a slower), which the syncer rightly does not follow: nothing is owed then.

        (Answering on arrival, round r goes out about r·H/P steps in rather than (r + 1)·H/P, so
        each fragment ends with up to H/P − 1 more steps that no round carries. Owing one more
        round for them was measured and lost in five cells of six: LEARNING.md.)"""
        s = self.settings
        if not self._paced or self.layout is None or s.lockstep or s.sweeps or s.final_flush:
            return 0
        due = self.stats.steps // self.boundary_every  # rounds 0 .. due - 1 had their boundary here
        behind = due - 1 - self.sync.latest_round
        if behind > self.layout.num_fragments:
            return 0
        return max(behind, 0) + int(self.sync.pulls_to_answer(before=due))

    def finish(self) -> bool:
        """Local training ended: push what each fragment trained since its last push (the final
        flush, `final_flush`), then ask for the final cut and install it; `final_timeout_s` bounds
        it all, and the flush gets at most half of it. Without the flush, the island first answers
        the rounds its steps reached that no push answered yet (`rounds_owed`), then
        waits until the pushes it sent are merged (or their rounds committed without them), so its
        DONE never overtakes its own last push; both within that half."""
        s = self.settings
        if self.stats.final_installed:
            return True
        if stop_if_refused(s, self.link.refused) or self.layout is None:
            return False
        if s.lockstep and not s.final_flush:  # the syncer must not drop the last push
            self._lockstep_wait(self.sync.pushes_merged, "the merge of this island's last push")
        started = self.clock()
        deadline = started + s.final_timeout_s
        flushing = s.final_flush
        # The last pushes may still be streaming (pushes go on the data streams, DONE on the control
        # stream, so DONE can arrive first): the syncer would then drop this island from their
        # rounds, and DONE from every island would let it finalize without them.
        settling = not flushing
        # Owed rounds are this connection's syncer's: one that restarts (resumed or not) repulls
        # what it lost and paces its own rounds, so a new connection ends the catching up.
        self.pump(0.0)  # a link lost meanwhile is known before deciding
        on_link = self.sync.links
        catching_up = self._generation is not None and self.rounds_owed() > 0
        patience = max(OWED_ROUND_PATIENCE_S, 4 * self.boundary_every * (self._step_s or 0.0))
        seen_round, seen_at = self.sync.latest_round, self.clock()  # the last round seen, and when it first was
        if catching_up:
            log.info("learner %d: %d rounds its steps reached are not answered yet (the syncer's rounds lag); "
                     "answering them before DONE", s.learner_id, self.rounds_owed())
        while self.clock() < deadline:
            if stop_if_refused(s, self.link.refused):
                return False
            if flushing and (self.sync.flushed() or self.clock() > started + s.final_timeout_s / 2):
                if not self.sync.flushed():
                    log.warning("learner %d: the last steps of some fragments were not merged in time; asking for "
                                "the final cut without them", s.learner_id)
                flushing = False
            if self.sync.latest_round != seen_round:
                seen_round, seen_at = self.sync.latest_round, self.clock()
            if catching_up and (not self.rounds_owed() or self.sync.links != on_link or self._generation is None
                                or self.clock() > min(seen_at + patience, started + s.final_timeout_s / 2)):
                if self.rounds_owed() and self.sync.links == on_link:
                    log.warning("learner %d: the syncer did not reach this island's last rounds in time; asking "
                                "for the final cut without them", s.learner_id)
                catching_up = False
            if settling and not catching_up and (
                    self.sync.pushes_merged() or self.clock() > started + s.final_timeout_s / 2):
                if not self.sync.pushes_merged():
                    log.warning("learner %d: the last pushes were not merged in time; asking for the final "
                                "cut without them", s.learner_id)
                settling = False
            needs_done = self._generation is not None and self._done_sent_on != self.sync.links
            if not flushing and not settling and needs_done and self.link.send(Done(self.stats.steps)):
                self._done_sent_on = self.sync.links
                self.sync.release_anchors()
            self._tick(0.05 if flushing or settling else 0.5)
            if self.final_ready:
                self._install_final()
                return True
            if flushing or (catching_up and self._generation is not None):  # every pull is a boundary now
                self.sync.install_bcasts()
                self._boundary()
        log.warning("learner %d: the final cut did not arrive within %.0f s; keeping local weights",
                    s.learner_id, s.final_timeout_s)
        return False

    def sweep(self) -> bool:
        """A boundary for every fragment at once, for trainers whose steps come in phases (RL:
        rollouts, then updates): install what merged since the last sweep (rebasing), answer every
        PULL this learner holds, the pushes streaming back to back, then wait for those rounds'
        merges and install them. With `rl_mode` sweep or overlap every fragment trained since its
        last push is pushed: a PULL not in yet is waited for (unless the fragment's rounds are
        over), so each iteration's progress goes into one round. It returns as soon as the pushes
        are computed and queued instead with `rl_mode` overlap (or, in stream mode, with `overlap`):
        the link streams them while training goes on, and their merges are rebased in at the next
        sweep, even one that comes in while this sweep still waits. `blocking_timeout_s` bounds
        it, after which training goes on. True when the final cut was installed."""
        started = self.clock()
        try:
            return self._sweep()
        finally:
            self.stats.in_yeto_s += self.clock() - started

    def _sweep(self) -> bool:
        s = self.settings
        wait = s.link.rl_mode == "sweep" or (s.link.rl_mode == "stream" and not s.link.overlap)
        if self.stats.final_installed:
            return True
        if stop_if_refused(s, self.link.refused) or self.layout is None:
            return False
        deadline = self.clock() + s.blocking_timeout_s
        swept: list[PushJob] = []
        # Without waiting, the merges of this sweep's pushes go in at the next sweep, however soon
        # one comes: installed now, the next iteration would train from it or not as timing has it.
        held: set[int] = set()
        while self.clock() < deadline and self.link.refused is None:
            self.pump(0.0)
            if self.final_ready:
                self._install_final()
                return True
            self.sync.install_bcasts(hold=held)
            while (job := self.sync.boundary(self._step_s, queue=True)) is not None:
                swept.append(job)  # every pull answered now: the sender streams them back to back
                if not wait:
                    held.add(job.pull.fragment)
            if not self.sync.pulls_to_answer(skip=held) and not (s.sweeps and self.sync.owed()):
                if not wait:
                    return False  # every delta is computed and queued: the link streams them as training goes on
                if all(self.fragments[j.pull.fragment].version > j.base_version for j in swept):
                    return False
            # The sweep's end may be its last push's end: the link says so (`PushEnded`).
            self._tick(min(0.05, max(0.0, deadline - self.clock())))
        if self.link.refused is None:
            log.warning("learner %d: sweep not done within %.0f s; training on", s.learner_id, s.blocking_timeout_s)
        return False

    def close(self) -> None:
        self.link.close(FINAL_INSTALLED if self.stats.final_installed else "learner stopped")

    # -- waits -------------------------------------------------------------------------------
    def _lockstep_wait(self, ready: Callable[[], bool], what: str) -> None:
        """Take in what the syncer sends, without installing it, until `ready()` (or the final
        cut is here). Past `lockstep_timeout_s` the island trains on and the miss is counted."""
        deadline = self.clock() + self.settings.lockstep_timeout_s
        while not ready() and not self.final_ready:
            if self.link.refused is not None:
                return
            if self.clock() > deadline:
                self.stats.lockstep_misses += 1
                log.warning("learner %d: lockstep: no %s within %.0f s; training on, the schedule is no longer "
                            "pinned to steps", self.settings.learner_id, what, self.settings.lockstep_timeout_s)
                return
            self._tick(0.05)

    def _wait_for_merge(self, job: PushJob) -> None:
        """Mix2 (DESIGN §3.4): block this step until the round of a blocking fragment is merged and installed
        (or the final cut is here, or `blocking_timeout_s` passed: then train on)."""
        f = job.pull.fragment
        started = self.clock()
        deadline = started + self.settings.blocking_timeout_s
        while self.fragments[f].version <= job.base_version and not self.final_ready:
            if self.clock() > deadline or self.link.refused is not None:
                log.warning("learner %d: blocking fragment %d not merged within %.0f s; training on",
                            self.settings.learner_id, f, self.settings.blocking_timeout_s)
                break
            self._tick(0.05)
            self.sync.install_bcasts()
        self.stats.blocked_s += self.clock() - started
