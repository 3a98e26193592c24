"""The syncer as a protocol with no I/O in it (DESIGN §4.1): `handle(now, event) -> effects`.

`SyncerProtocol` alone holds and changes the run's global state: the committed model, each
learner's link, the rounds in flight (`round_table.py`), the downlink anchors, the phase of the
run. Each call takes one event (`events.py`) at the time `now` and returns what the world must do
about it (`effects.py`), in order: sends, closes, tape records, checkpoints, merges, decodes,
fault points. It never touches a socket, a clock, a thread or a file, and it does no tensor work:
what it needs computed it asks the shell for (an INIT fragment checked, a push decoded, a
broadcast encoded), and takes the answer in when the shell hands it back. The shell
(`coordinator.Coordinator`) pumps events in and performs the effects, so everything the syncer
decides can be driven, and read, by a test in memory.

A turn takes the event in, then moves every round on as far as `now` allows: decides the
attempts collecting answers (`rounds.decide_round`), relaunches parked rounds, and, strictly in
round order, commits closed ones. An event whose handling asks the shell for something decides
nothing more until the answer is in: the turn that takes the last answer in moves the rounds on.
A commit is two turns: the first asks for the merge (`effects.Merge`); the shell performs it
before any other event and hands back `Merged`, and that turn records it: outer state, version,
token ledger, checkpoint, tape record, broadcasts (`commit.py`). Until the merge is back nothing
else is decided, so commits, checkpoints and broadcasts stay in round order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from syncer.core import records
from syncer.core.commit import Commit
from syncer.core.consensus import ConsensusBoard
from syncer.core.effects import Close, Effect, ExpectInit, Merge, Prepare, Send, StallTimeout
from syncer.core.events import (
    Decoded,
    Encoded,
    Event,
    Got,
    InitChecked,
    Joined,
    Left,
    Merged,
    Prepared,
    Stop,
    Synced,
    is_answer,
)
from syncer.core.finale import Finale
from syncer.core.initial_cut import INIT_EXIT_CODE, InitialCut, initial_state
from syncer.core.intake import PushIntake
from syncer.core.lifecycle import Life
from syncer.core.links import Link, Phase, layout_mismatch, scheduler_config
from syncer.core.memory import add_members, members, merged_rounds_of
from syncer.core.outbox import Outbox
from syncer.core.round_table import RoundTable
from syncer.core.rounds import (
    Answer,
    Attempt,
    Hold,
    Launch,
    RoundState,
    Verdict,
    answer_ages,
    answer_steps,
    attempt_quorum,
    decide_round,
    finished_weight,
    fragment_of_round,
    pipeline_depth,
    round_interval,
    should_finalize,
    should_launch,
)
from syncer.core.run_state import RunState
from syncer.durability.checkpoint import SyncerState, tokens_by_learner
from syncer.merge.merge import Segment
from syncer.merge.round_merge import FragmentTensors, fragment_segments
from yeto_core.codecs import codec_by_id
from yeto_core.downlink import DownlinkChains, downlink_codec_by_id
from yeto_core.layout import Layout, build_layout
from yeto_core.quant import DEFAULT_BLOCK
from yeto_core.settings import SyncerSettings
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import (
    HELLO_CONSENSUS,
    HELLO_OVERLAP,
    Bye,
    Done,
    Error,
    Init,
    Message,
    ProbeReport,
    Pull,
    Push,
)

__all__ = ["INIT_EXIT_CODE", "SyncerProtocol"]

log = logging.getLogger("yeto.syncer")


class SyncerProtocol:
    """The round lifecycle and everything it decides. Its parts, each a class of its own over the
    shared `RunState`: `cut` (the initial cut), `intake` (pushes in), `outbox` (what goes out),
    `commits` (what a merged round becomes) and `finale` (the end). `device`: where the model
    state lives (the shell puts what it computes there)."""

    def __init__(self, settings: SyncerSettings, *, device: torch.device, state: SyncerState | None = None,
                 now: float = 0.0) -> None:
        self.shared = RunState(settings, now=now)
        self.settings = settings
        self.device = device
        self.sched = scheduler_config(settings)
        self.merging = settings.merging  # what every round's merge is made of
        self.outbox = Outbox(self.shared)
        self.cut = InitialCut(self.shared, self.outbox, now=now)
        self.intake = PushIntake(self.shared, sched=self.sched)
        self.commits = Commit(self.shared, self.outbox)
        self.finale = Finale(self.shared, self.outbox)
        self.segments: list[list[Segment]] = []  # per fragment: which spans RDA merges
        self.exit_code = 0
        self._holders: dict[int, tuple[bytes, int, str]] = {}  # id -> (instance, generation, address) last joined
        self._advance_owed = False  # an event was taken in whose turn waits for answers to move the rounds on
        self._attempts = 0
        self._last_launch: float | None = None
        self._held: Launch | None = None  # why the last launch check launched nothing
        self._merging: int | None = None  # the round whose merge the shell is performing
        # With iso workers the heavy half of each merge runs ahead (`effects.Prepare`): the SVDs of
        # rounds on different fragments overlap in the pool while commits stay in round order.
        self._prepares = bool(settings.merging.iso_devices)
        self._preparing: set[int] = set()  # attempts whose Prepare is out
        self._prepared: set[int] = set()  # attempts whose Prepare is done
        self._finale_wait = ""  # why the run waits to finalize, as last logged
        self.next_launch = state.next_round if state is not None else 0
        if state is not None:
            if not state.merged_by:  # a checkpoint from before merges were recorded: nothing known
                state.merged_by = [(-1, []) for _ in range(state.num_fragments)]
            self.shared.state = state
            self._adopt_layout(build_layout(state.specs, state.num_fragments, state.pattern))
            assert self.shared.downlinks is not None
            self.shared.downlinks.restore(state.downlink, state.downlink_versions, state.params, state.versions)
            self.shared.phase = Phase.RUNNING
            self.shared.merged_rounds = merged_rounds_of(state)  # a push sent twice is still refused
            trained = set(tokens_by_learner(state.ledger)) | set(members(state))
            # Every learner in the ledger trained for this run and lost its link with the syncer that
            # stopped: like one that left while training, it is waited for (`--rejoin-wait-s`), and a
            # finalizing syncer expects it until its final timeout, so it still gets the final cut.
            for lid in trained:
                self.shared.lives.expect(lid, Life.LOST if state.finalized else Life.AWAY, now)
            if state.finalized:
                # Its effects (the final cut to nobody yet) are returned by the first turn.
                self.finale.begin("the resumed checkpoint is already final", save=False)

    # -- the run as others see it (read-only) ---------------------------------------------------
    @property
    def state(self) -> SyncerState | None:
        return self.shared.state

    @property
    def layout(self) -> Layout | None:
        return self.shared.layout

    @property
    def links(self) -> dict[int, Link]:
        return self.shared.links

    @property
    def rounds(self) -> RoundTable:
        return self.shared.rounds

    @property
    def phase(self) -> Phase:
        return self.shared.phase

    def checkpoint_state(self) -> SyncerState | None:
        """The committed state as a checkpoint keeps it: with the downlink's whole chains."""
        state, downlinks = self.shared.state, self.shared.downlinks
        if state is None or downlinks is None:
            return state
        state.downlink, state.downlink_versions = downlinks.whole()
        return state

    def anchor(self, fragment: int, codec: int) -> torch.Tensor:
        """Fragment `fragment`'s downlink anchor of the codec with wire id `codec`, for a
        `Send(anchor=...)` (the shell copies it)."""
        downlinks = self.shared.downlinks
        chain = downlinks.by_id.get(codec) if downlinks is not None else None
        anchor = chain.anchors[fragment] if chain is not None else None
        assert anchor is not None, f"fragment {fragment} has no downlink anchor of codec {codec}"
        return anchor

    def wakeup(self, now: float) -> float:
        """Seconds until the protocol wants a turn with no event (a deadline, a grace window's end,
        a throttled launch), at most 0.25 s."""
        collecting = self.shared.rounds.collecting()
        soon = [a.deadline for a in collecting]
        soon += [a.quorum_at + a.grace_s for a in collecting if a.quorum_at is not None]
        if self._last_launch is not None and self._held is not None and self._held.hold is Hold.THROTTLED:
            soon.append(now + 0.02)
        return max(0.005, min([0.25, *(t - now for t in soon)]))

    # -- the one entry point ---------------------------------------------------------------------
    def handle(self, now: float, event: Event | None) -> list[Effect]:
        """One turn: take in `event` (None: only time passed), then move every round on as far as
        `now` allows. Returns the effects decided, in the order they must be performed; the last
        may be an ask (`effects.is_ask`), whose answer the shell hands back before any other event.
        A turn whose event asked for something moves the rounds on once the last answer is in."""
        run = self.shared
        run.now = now
        if event is not None and is_answer(event):
            run.answered(lambda: self._dispatch(event))
        else:
            if event is not None:
                self._dispatch(event)
            self._advance_owed = True
        if self._advance_owed and not run.asked:
            self._advance_owed = False
            self._advance()
        effects, run.effects = run.effects, []
        return effects

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, Got):
            link = self.shared.links.get(event.learner_id)
            if link is not None and link.generation == event.generation:  # else: a replaced connection's
                self._on_message(link, event.msg, event.payload, event.screened)
        elif isinstance(event, Decoded):
            self.intake.on_decoded(event)
        elif isinstance(event, InitChecked):
            self.cut.checked(event)
        elif isinstance(event, Encoded):
            self.outbox.encoded(event)
        elif isinstance(event, Merged):
            assert event.round == self._merging, (event.round, self._merging)
            self._merging = None
            state = self.shared.state
            assert state is not None
            entry = self.shared.rounds.entry(event.round)
            assert entry is not None and entry.attempt is not None
            event.tensors.install(state, entry.attempt.fragment)  # the lent tensors come back
            self.commits.merged(event.round, event.outcome)
        elif isinstance(event, Prepared):
            if event.attempt in self._preparing:  # else: a round abandoned meanwhile
                self._prepared.add(event.attempt)
        elif isinstance(event, Synced):
            self.commits.synced(event.round, event.seconds)
        elif isinstance(event, Joined):
            self._on_joined(event)
        elif isinstance(event, Left):
            self._on_left(event)
        elif isinstance(event, Stop):
            if event.exit_code:
                self.exit_code = event.exit_code
            log.warning("stopping: %s", event.reason)
            self.shared.phase = Phase.DONE

    # -- joins and departures --------------------------------------------------------------------
    def _on_joined(self, ev: Joined) -> None:
        run = self.shared
        link = Link(ev.learner_id, ev.generation, ev.fingerprint,
                    codec=codec_by_id(ev.wire_dtype, block=ev.push_block or DEFAULT_BLOCK),
                    downlink=downlink_codec_by_id(ev.downlink_dtype), consensus=bool(ev.flags & HELLO_CONSENSUS),
                    overlap=bool(ev.flags & HELLO_OVERLAP), instance=ev.instance, address=ev.peer)
        if ev.conflict is not None:  # two processes passed the handshake's check at once: the holder stays
            run.refuse(link, ErrorCode.DUPLICATE, ev.conflict)
            return
        old = run.links.get(ev.learner_id)
        if old is not None:
            run.emit(Close(old.peer, f"replaced by generation {ev.generation}"))
        before = self._holders.get(ev.learner_id)
        self._holders[ev.learner_id] = (ev.instance, ev.generation, ev.peer)
        if before is not None and before[0] != ev.instance and any(ev.instance):
            log.warning("learner %d replaced: a new process (generation %d, from %s) takes the id over from "
                        "generation %d (from %s)", ev.learner_id, ev.generation, ev.peer, before[1], before[2])
            run.record(records.Replaced(ev.learner_id, before[1], ev.generation))
        if ev.manifest is not None and run.layout is None:
            self._pin(build_layout(ev.manifest.specs, ev.manifest.num_fragments, ev.manifest.pattern))
        if run.layout is not None and ev.fingerprint != run.layout.fingerprint:
            run.refuse(link, ErrorCode.LAYOUT, layout_mismatch(ev.learner_id, ev.fingerprint, run.layout.fingerprint))
            return
        run.links[ev.learner_id] = link
        if run.state is not None and (before is None or before[0] != ev.instance):
            # A new process starts from the current state: its first answers are fresh.
            for f, version in enumerate(run.state.versions):
                run.merged_versions.setdefault(f, {})[ev.learner_id] = version
        run.lives.joined(ev.learner_id, run.now)
        log.info("learner %d joined (generation %d, %d connected)", ev.learner_id, ev.generation, len(run.links))
        run.record(records.Join(ev.learner_id, ev.generation))
        if run.phase is Phase.RUNNING:
            assert run.state is not None
            add_members(run.state, [ev.learner_id])  # a resumed syncer waits for it too
            run.emit(StallTimeout(link.peer, self.settings.streams.stall_timeout_s))
            self.outbox.send_full_state(link)
            if link.consensus and run.consensus is not None:
                run.emit(Send(link.peer, run.consensus.message(run.state.next_round)))  # it may report probes now
        elif run.phase is Phase.FINALIZING:
            self.outbox.send_final(link)

    def _on_left(self, ev: Left) -> None:
        link = self.shared.links.get(ev.learner_id)
        if link is None or link.generation != ev.generation:
            return  # a replaced or refused connection
        del self.shared.links[ev.learner_id]
        if self.shared.consensus is not None:
            self.shared.consensus.forget(ev.learner_id)
        # Only a goodbye says a learner stopped, or has the cut: without one it may come back
        # (a crash, a stall, a cut link), to train on or for the final cut.
        self.shared.lives.left(ev.learner_id, self.shared.now, trained=self.shared.state is not None)
        log.info("learner %d left (%s)", ev.learner_id, ev.reason)
        self.shared.record(records.Left(ev.learner_id, ev.generation, ev.reason))

    def _pin(self, layout: Layout) -> None:
        """Learner 0's manifest defines the model: allocate global state, refuse mismatches."""
        # INIT supplies every fragment's params (adopting its buffer); only the momentum starts at zero
        self.shared.state = initial_state(layout, self.merging, self.device)
        self._adopt_layout(layout)
        log.info("model pinned: %d tensors, %d parameters in %d %s fragments (fingerprint %s…)",
                 len(layout.specs), layout.total_numel, layout.num_fragments, layout.pattern,
                 layout.fingerprint.hex()[:16])
        self.shared.emit(ExpectInit(tuple(f.numel * 4 for f in layout.fragments)))
        for other in list(self.shared.links.values()):
            if other.fingerprint != layout.fingerprint:
                del self.shared.links[other.learner_id]
                # It never trained this model: forgotten, as one that left before a model is, so the
                # finale does not wait for it (its `Left` finds no link and changes nothing).
                self.shared.lives.left(other.learner_id, self.shared.now, trained=False)
                self.shared.refuse(other, ErrorCode.LAYOUT,
                                   layout_mismatch(other.learner_id, other.fingerprint, layout.fingerprint))

    def _adopt_layout(self, layout: Layout) -> None:
        self.shared.layout = layout
        self.shared.consensus = ConsensusBoard(layout.num_fragments)
        self.shared.downlinks = DownlinkChains(layout.num_fragments, self.settings.bcast_delta_full_every)
        self.segments = fragment_segments(layout, self.merging.merge)

    # -- messages ------------------------------------------------------------------------------
    def _on_message(self, link: Link, msg: Message, payload: memoryview | None, screened: bool | None) -> None:
        if isinstance(msg, Init):
            self.cut.on_init(link, msg, payload, screened)
        elif isinstance(msg, Push):
            self.intake.on_push(link, msg, payload, screened)
        elif isinstance(msg, Done):
            self._on_done(link, msg)
        elif isinstance(msg, Bye):
            if self.shared.lives.get(link.learner_id) not in (Life.HAS_CUT, Life.QUIT):  # said once the cut
                log.info("learner %d says goodbye (%s)", link.learner_id, msg.reason)  # is in, again at close
            self.finale.on_bye(link)
        elif isinstance(msg, ProbeReport):
            self._on_probe_report(link, msg)
        elif isinstance(msg, Error):
            log.warning("learner %d reports %s: %s", link.learner_id, msg.code.name, msg.reason)
        else:
            self.shared.refuse(link, ErrorCode.PROTOCOL, f"unexpected {msg.TYPE.name} from a learner")

    def _on_done(self, link: Link, msg: Done) -> None:
        life = self.shared.lives[link.learner_id]
        if life.done:
            return
        life.done = life.trained = True
        if life.state is Life.TRAINING:
            life.move(Life.FINISHED, self.shared.now, link.learner_id)
        log.info("learner %d finished training at its step %d", link.learner_id, msg.step)
        self.shared.record(records.Done(link.learner_id, msg.step))

    def _on_probe_report(self, link: Link, msg: ProbeReport) -> None:
        """A learner's probe summary (DESIGN §8.1); a bad one is refused and the link stays open."""
        if self.shared.consensus is None:
            return  # no model pinned yet: nothing to compare it with
        problem = self.shared.consensus.observe(link.learner_id, msg)
        if problem is not None:
            log.warning("learner %d: %s", link.learner_id, problem)
            self.shared.emit(Send(link.peer, Error(ErrorCode.REFUSED, problem)))

    # -- advancing -----------------------------------------------------------------------------
    def _live(self) -> dict[int, int]:
        """Connected learners still training: learner id -> its connection's generation."""
        lives = self.shared.lives
        return {lid: link.generation for lid, link in self.shared.links.items() if lives.get(lid) is Life.TRAINING}

    def _fleet_step_s(self, learners: Iterable[int]) -> float | None:
        """ξ_step of a set of learners: the median of their smoothed step times."""
        step_s = self.intake.step_s
        times = sorted(step_s[lid] for lid in learners if lid in step_s)
        return times[len(times) // 2] if times else None

    def _quorum(self) -> int:
        return attempt_quorum(self.settings.effective_quorum, self.settings.learners,
                              len(self.shared.lives.finished()))

    def _advance(self) -> None:
        run, now = self.shared, self.shared.now
        if run.phase is Phase.WAIT_INIT:
            if self.cut.timed_out(now):
                self.exit_code = INIT_EXIT_CODE
                run.phase = Phase.DONE
            return
        if run.phase is Phase.FINALIZING:
            if self.finale.wait_over(now):
                run.phase = Phase.DONE
            return
        if run.phase is not Phase.RUNNING or self._merging is not None:
            return  # nothing is decided while a merge is out: its commit comes first
        assert run.state is not None
        live = self._live()
        done, why = should_finalize(next_round=run.state.next_round, total_rounds=self.settings.total_rounds,
                                    training=len(live), finished=len(run.lives.finished()),
                                    away=run.lives.away(), now=now, rejoin_wait_s=self.settings.rejoin_wait_s)
        if done:
            self.finale.begin(why)
            return
        if why != self._finale_wait:  # said once, not every turn of the wait
            self._finale_wait = why
            if why:
                log.info("%s", why)
        assert run.layout is not None
        answering = answer_steps(self.sched.sync_interval_steps, run.layout.num_fragments, self.sched.pipeline)
        for attempt in run.rounds.collecting():
            r = attempt.round
            decision = decide_round(now, attempt, live, cfg=self.sched, step_s=self._fleet_step_s(attempt.answers),
                                    sync_s=self.commits.sync_s or 0.0, answer_steps=answering,
                                    member_step_s=self.intake.step_s)
            if decision.quorum_at is not None:
                run.rounds.enter_grace(r, quorum_at=decision.quorum_at, grace_s=decision.grace_s,
                                       reason=decision.reason)
            if decision.verdict is Verdict.COMMIT:
                # frozen now, so the round's Prepare and Merge weigh it alike
                attempt.finished_weight = finished_weight(attempt.answers.values(), run.lives.finished(),
                                                          run.merged_weights)
                run.rounds.close(r, decision.reason, live)
            elif decision.verdict is Verdict.RETRY:
                self.commits.discard(attempt, decision.reason)
        quorum = self._quorum()
        for parked in run.rounds.in_state(RoundState.PARKED):  # a retry waits for a quorum of learners
            if len(live) < quorum:
                break
            self._launch(parked.round, live, f"relaunched: {len(live)} learners live, quorum {quorum}")
        if self._prepares:
            self._prepare_ahead()
        closed = run.rounds.entry(run.state.next_round)  # commits strictly in round order
        if closed is not None and closed.state is RoundState.CLOSED:
            last = closed.attempt
            assert last is not None
            if not self._prepares or last.attempt in self._prepared:
                self._merging = closed.round
                f = last.fragment
                prepared = None
                if self._prepares:
                    prepared = last.attempt
                    self._preparing.discard(prepared)
                    self._prepared.discard(prepared)
                run.emit(Merge(closed.round, f, self._aged(f, last.answers.values()), tuple(self.segments[f]),
                               FragmentTensors.of(run.state, f), prepared=prepared,
                               finished_weight=last.finished_weight))
                return  # the rest of the turn comes when the merge is back
        self._maybe_launch(live)

    def _aged(self, fragment: int, answers: Iterable[Answer]) -> tuple[Answer, ...]:
        """The answers of a round about to merge, with their ages (the same for its Prepare and its
        Merge: no commit of the fragment comes between them)."""
        state = self.shared.state
        assert state is not None
        return answer_ages(answers, state.versions[fragment], self.shared.merged_versions.get(fragment, {}))

    def _prepare_ahead(self) -> None:
        """Ask for the heavy half of every closed round's merge as soon as it closes, unless a
        round before it on the same fragment is not committed yet (its commit moves the momentum
        this half reads)."""
        run = self.shared
        assert run.layout is not None
        busy: set[int] = set()  # fragments with an earlier round in flight
        for entry in run.rounds.in_state(RoundState.OPEN, RoundState.GRACE, RoundState.PARKED, RoundState.CLOSED):
            a = entry.attempt
            f = a.fragment if a is not None else fragment_of_round(entry.round, run.layout.num_fragments)
            ready = entry.state is RoundState.CLOSED and a is not None and f not in busy
            if ready and a is not None and a.attempt not in self._preparing:
                self._preparing.add(a.attempt)
                run.emit(Prepare(entry.round, a.attempt, f, self._aged(f, a.answers.values()), tuple(self.segments[f]),
                                 finished_weight=a.finished_weight))
            busy.add(f)

    def _maybe_launch(self, live: dict[int, int]) -> None:
        run, now = self.shared, self.shared.now
        assert run.state is not None and run.layout is not None
        depth = pipeline_depth(self.sched.pipeline, run.layout.num_fragments)
        interval = round_interval(self._fleet_step_s(live), run.layout.num_fragments, self.sched)
        check = should_launch(now, cfg=self.sched, next_round=self.next_launch, in_flight=len(run.rounds),
                              depth=depth, eligible=len(live), quorum=self._quorum(),
                              last_launch=self._last_launch, interval_s=interval)
        if check.hold is not None:
            said = check.hold in (Hold.THROTTLED, Hold.BUDGET_SPENT)  # the pace and the budget are no news
            if not said and (self._held is None or check.reason != self._held.reason):
                log.info("waiting: %s", check.reason)
            self._held = check
            return
        self._held = None
        self._launch(self.next_launch, live, check.reason)
        self.next_launch += 1

    def _launch(self, r: int, live: dict[int, int], reason: str) -> None:
        run, now = self.shared, self.shared.now
        assert run.state is not None and run.layout is not None
        self._attempts += 1
        self._last_launch = now
        f = fragment_of_round(r, run.layout.num_fragments)
        version = run.state.versions[f]
        attempt = Attempt(round=r, attempt=self._attempts, fragment=f, version=version, members=dict(live),
                          quorum=self._quorum(), launched_at=now, deadline=now + self.settings.round_timeout_s)
        run.rounds.launch(attempt, reason)
        run.record(records.Launch(r, attempt.attempt, f, version, sorted(live), attempt.quorum, reason))
        self.intake.attach_carried(f)
        pull = Pull(r, self._attempts, f, version)
        for lid in live:
            run.emit(Send(run.links[lid].peer, pull))
