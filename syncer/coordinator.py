"""The single coordinator actor (DESIGN §4.1): it alone mutates global state.

Reader threads post events (`events.py`); `handle` takes them one at a time, asks the pure
functions in `rounds.py` what to do, moves rounds through their lifecycle (`round_table.py`),
runs the merge of a round (`round_merge.py`), and then, strictly in round order, commits:
Nesterov outer step, fragment version, token ledger, event tape, checkpoint (durable before the
broadcast that announces it), BCAST to every learner, and one log line. Its parts are objects of
their own over the shared `RunState`: taking pushes in (`intake.py`), what goes out to the
learners (`outbox.py`), checkpoint writes (`checkpointing.py`) and the end of a run
(`finale.py`). Sends are queued on each learner's connection group, never written from here.
"""

from __future__ import annotations

import logging
import queue
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from syncer.checkpoint import CheckpointError, SyncerState, ledger_key, tokens_by_learner
from syncer.checkpointing import DURABILITY_EXIT_CODE, Checkpointing, DurabilityLost
from syncer.consensus import ConsensusBoard
from syncer.correction import HelocoConfig
from syncer.events import Decoded, Got, Joined, Left
from syncer.finale import Finale
from syncer.intake import PushIntake
from syncer.leases import Leases
from syncer.links import InitProgress, Link, Phase, backend_id, id_conflict, scheduler_config
from syncer.merge import Segment, check_finite
from syncer.outbox import Outbox
from syncer.outer import ACCUM_KEY, COUNT_KEY, outer_optimizer
from syncer.round_merge import MergeWorkspace, merge_round
from syncer.round_table import RoundTable
from syncer.rounds import (
    Attempt,
    RoundState,
    Verdict,
    attempt_quorum,
    decide_round,
    fragment_of_round,
    pipeline_depth,
    round_interval,
    should_finalize,
    should_launch,
)
from syncer.run_state import RunState
from syncer.server import layout_mismatch
from syncer.tape import EventTape
from yeto_core.codecs import F32, codec_by_id
from yeto_core.downlink import DownlinkEncoder
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.layout import Layout, build_layout
from yeto_core.quant import DEFAULT_BLOCK
from yeto_core.settings import SyncerSettings
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import (
    HELLO_BCAST_DELTA,
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
from yeto_core.wire.transport import ConnectionGroup

log = logging.getLogger("yeto.syncer")


EMA = 0.3  # weight of the newest sample in the ξ estimates


def lazy_zeros(numel: int, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until written. On the CPU, numpy's calloc maps the kernel's zero
    pages, where torch.zeros would fault in and clear every page while learner 0's INIT streams
    in (150 ms for a 256 MiB model here); a fragment's pages are faulted in by its first merge."""
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(numel, dtype=np.float32))
    return torch.zeros(numel, dtype=torch.float32, device=device)


class Coordinator:
    """The actor. Its parts, each a class of its own over the shared `RunState`: `intake` (pushes
    in), `outbox` (what goes out), `checkpoints` (durable or stop) and `finale` (the end)."""

    def __init__(
        self,
        settings: SyncerSettings,
        *,
        device: torch.device,
        tape: EventTape,
        state: SyncerState | None = None,
        clock: Callable[[], float] = time.monotonic,
        faults: FaultInjector = NO_FAULTS,
    ) -> None:
        # `faults` is built once from the settings by the caller (`cli.main`).
        self.shared = RunState(settings, tape, clock, faults, state=state)
        self.settings = settings
        self.device = device
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._holders: dict[int, tuple[bytes, int, str]] = {}  # id -> (instance, generation, peer) last joined
        self.workspace = MergeWorkspace()  # merge scratch, reused round after round
        self._closed_groups: list[ConnectionGroup] = []  # joined before exit, see ConnectionGroup.join
        self.segments: list[list[Segment]] = []
        self.sched = scheduler_config(settings)
        self._decoders = ThreadPoolExecutor(max_workers=settings.decode_threads, thread_name_prefix="syncer-decode")
        self.leases = Leases()  # readers of committed tensors on other threads (leases.py)
        self.outbox = Outbox(self.shared, self.leases)
        self.checkpoints = Checkpointing(self.shared, self.leases)
        self.intake = PushIntake(self.shared, sched=self.sched, device=device, decoders=self._decoders, post=self.post)
        self.finale = Finale(self.shared, self.outbox, self.checkpoints)
        self.merging = settings.merging  # what every round's merge is made of
        self.outer = outer_optimizer(self.merging)
        self.outer_state: list[dict[str, Any]] = []  # per fragment, kept in the checkpoint
        # HeLoCo's confidence compares against an averaged momentum; ours is a 1/(1−μ)-longer sum.
        self.heloco = (HelocoConfig(momentum_scale=1.0 - self.merging.outer_momentum)
                       if self.merging.delta_correction == "heloco" else None)
        self.sync_s = 0.0  # ξ_sync: EMA of merge + commit + broadcast time
        self._last_launch: float | None = None
        self._attempts = 0
        self._init = InitProgress()
        self._started = clock()
        self._last_wait_reason = ""
        self.exit_code = 0
        self._stop_requested = False
        self.next_launch = state.next_round if state is not None else 0
        if state is not None:
            if not state.merged_by:  # a checkpoint from before merges were recorded: nothing known
                state.merged_by = [(-1, []) for _ in range(state.num_fragments)]
            self._adopt_layout(build_layout(state.specs, state.num_fragments, state.pattern))
            self.shared.phase = Phase.RUNNING
            if state.finalized:
                self.finale.expected = set(tokens_by_learner(state.ledger))
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

    # -- read by server threads (immutable references, safe to read without a lock) -----------
    def pinned_fingerprint(self) -> bytes | None:
        return self.shared.layout.fingerprint if self.shared.layout is not None else None

    def id_conflict(self, learner_id: int, instance: bytes) -> str | None:
        """Why a HELLO from process `instance` may not take `learner_id`, or None (any thread)."""
        return id_conflict(self.shared.links.get(learner_id), instance)

    def max_payload(self) -> int:
        return max(f.numel for f in self.shared.layout.fragments) * 4 if self.shared.layout is not None else 0

    def initial_cut_ready(self) -> bool:
        return self.shared.phase in (Phase.RUNNING, Phase.FINALIZING)

    def post(self, event: Any) -> None:
        self.events.put(event)

    def request_stop(self) -> None:
        """Stop without finalizing (a signal): committed state is already on disk."""
        self._stop_requested = True

    # -- the actor loop ------------------------------------------------------------------------
    def run(self) -> int:
        while self.shared.phase is not Phase.DONE:
            try:
                event = self.events.get(timeout=self._wakeup())
            except queue.Empty:
                event = None
            try:
                self.handle(event)
            except DurabilityLost as exc:
                log.critical("%s", exc)
                print(f"yeto syncer: {exc}", file=sys.stderr, flush=True)
                self.exit_code, self.shared.phase = DURABILITY_EXIT_CODE, Phase.DONE
        self._decoders.shutdown(wait=True)
        if self.checkpoints.writer is not None:  # never exit in the middle of a background write
            try:
                self.checkpoints.writer.wait()
            except CheckpointError as exc:
                log.error("%s", exc)
        groups = [link.group for link in self.shared.links.values()] + self._closed_groups
        for group in groups:
            group.close("syncer stopped", last=Bye("syncer stopped"))  # what is queued goes out first
        for group in groups:
            group.join(timeout=5.0)
        return self.exit_code

    def _wakeup(self) -> float:
        now = self.shared.clock()
        collecting = self.shared.rounds.collecting()
        soon = [a.deadline for a in collecting]
        soon += [a.quorum_at + a.grace_s for a in collecting if a.quorum_at is not None]
        if self._last_launch is not None and self._last_wait_reason.startswith("throttled"):
            soon.append(now + 0.02)
        return max(0.005, min([0.25, *(t - now for t in soon)]))

    def handle(self, event: Any | None) -> None:
        """One turn of the actor: take in `event` (None: only time passed), then move every round
        on as far as the clock allows. Everything the syncer decides happens in here."""
        if event is not None:
            self._dispatch(event)
        self._advance()

    def _dispatch(self, event: Any) -> None:
        if isinstance(event, Joined):
            self._on_joined(event)
        elif isinstance(event, Left):
            link = self.shared.links.get(event.learner_id)
            if link is not None and link.generation == event.generation:
                del self.shared.links[event.learner_id]
                self._retire(link.group)
                if self.shared.consensus is not None:
                    self.shared.consensus.forget(event.learner_id)
                self.finale.note_departure(link)
                log.info("learner %d left (%s)", event.learner_id, event.reason)
                self.shared.tape.append({"event": "left", "learner": event.learner_id, "generation": event.generation,
                                  "reason": event.reason})
        elif isinstance(event, Decoded):
            self.intake.on_decoded(event)
        elif isinstance(event, Got):
            link = self.shared.links.get(event.learner_id)
            if link is None or link.generation != event.generation:
                return  # a message from a replaced connection group
            self._on_message(link, event.msg, event.payload, event.screened)

    # -- joins ---------------------------------------------------------------------------------
    def _on_joined(self, ev: Joined) -> None:
        link = Link(ev.learner_id, ev.generation, ev.group, ev.fingerprint,
                    codec=codec_by_id(ev.wire_dtype, block=ev.push_block or DEFAULT_BLOCK),
                    bcast_delta=bool(ev.flags & HELLO_BCAST_DELTA), consensus=bool(ev.flags & HELLO_CONSENSUS),
                    overlap=bool(ev.flags & HELLO_OVERLAP), instance=ev.instance, peer=ev.peer)
        conflict = self.id_conflict(ev.learner_id, ev.instance)
        if conflict is not None:  # two processes passed the handshake's check at once: the holder stays
            self._refuse(link, ErrorCode.DUPLICATE, conflict)
            return
        old = self.shared.links.get(ev.learner_id)
        if old is not None:
            old.group.close(f"replaced by generation {ev.generation}")
            self._retire(old.group)
        before = self._holders.get(ev.learner_id)
        self._holders[ev.learner_id] = (ev.instance, ev.generation, ev.peer)
        if before is not None and before[0] != ev.instance and any(ev.instance):
            log.warning("learner %d replaced: a new process (generation %d, from %s) takes the id over from "
                        "generation %d (from %s)", ev.learner_id, ev.generation, ev.peer, before[1], before[2])
            self.shared.tape.append({"event": "replaced", "learner": ev.learner_id, "generation": before[1],
                              "by": ev.generation})
        if ev.manifest is not None and self.shared.layout is None:
            layout = build_layout(ev.manifest.specs, ev.manifest.num_fragments, ev.manifest.pattern)
            self._pin(layout)
        if self.shared.layout is not None and ev.fingerprint != self.shared.layout.fingerprint:
            reason = layout_mismatch(ev.learner_id, ev.fingerprint, self.shared.layout.fingerprint)
            self._refuse(link, ErrorCode.LAYOUT, reason)
            return
        self.shared.links[ev.learner_id] = link
        self.shared.finished.discard(ev.learner_id)
        log.info("learner %d joined (generation %d, %d connected)", ev.learner_id, ev.generation,
                 len(self.shared.links))
        self.shared.tape.append({"event": "join", "learner": ev.learner_id, "generation": ev.generation})
        if self.shared.phase is Phase.RUNNING:
            link.group.set_user_timeout(self.settings.wan_stall_timeout_s)
            self.outbox.send_full_state(link)
            if link.consensus and self.shared.consensus is not None and self.shared.state is not None:
                link.group.send(self.shared.consensus.message(self.shared.state.next_round))  # it may report probes now
        elif self.shared.phase is Phase.FINALIZING:
            self.outbox.send_final(link)

    def _pin(self, layout: Layout) -> None:
        """Learner 0's manifest defines the model: allocate global state, refuse mismatches."""
        self._adopt_layout(layout)
        p = layout.num_fragments
        # INIT supplies every fragment's params (adopting its buffer); only the momentum starts at zero
        params = [torch.empty(0, dtype=torch.float32, device=self.device) for _ in layout.fragments]
        momentum = [lazy_zeros(f.numel, self.device) for f in layout.fragments]
        delayed = self.merging.outer_optimizer == "delayed-nesterov"
        self.shared.state = SyncerState(
            specs=list(layout.specs), num_fragments=p, pattern=layout.pattern, fingerprint=layout.fingerprint,
            backend=backend_id(self.merging), params=params, momentum=momentum, versions=[0] * p,
            next_round=0, ledger={}, finalized=False,
            outer_accum=[lazy_zeros(m.numel(), self.device) for m in momentum] if delayed else None,
            outer_count=[0] * p if delayed else [], merged_by=[(-1, []) for _ in range(p)],
            extra={"outer_lr": self.merging.outer_lr, "outer_momentum": self.merging.outer_momentum},
        )
        log.info("model pinned: %d tensors, %d parameters in %d %s fragments (fingerprint %s…)",
                 len(layout.specs), layout.total_numel, p, layout.pattern, layout.fingerprint.hex()[:16])
        for other in list(self.shared.links.values()):
            if other.fingerprint != layout.fingerprint:
                del self.shared.links[other.learner_id]
                self._refuse(other, ErrorCode.LAYOUT,
                             layout_mismatch(other.learner_id, other.fingerprint, layout.fingerprint))

    def _adopt_layout(self, layout: Layout) -> None:
        self.shared.layout = layout
        self.shared.consensus = ConsensusBoard(layout.num_fragments)
        self.shared.downlink = DownlinkEncoder(layout.num_fragments, self.settings.bcast_delta_full_every)
        self.outer_state = [{} for _ in layout.fragments]
        state = self.shared.state
        if state is not None and state.outer_accum is not None:
            for f, st in enumerate(self.outer_state):
                st[ACCUM_KEY] = state.outer_accum[f].to(self.device)
                st[COUNT_KEY] = state.outer_count[f]
        self.segments = [
            [Segment(s.offset, s.numel, rda=self.merging.merge == "rda" and not s.embedding) for s in frag.slots]
            for frag in layout.fragments
        ]

    def _retire(self, group: ConnectionGroup) -> None:
        """Keep a closed group until its threads have ended (they are joined before exit)."""
        self._closed_groups = [g for g in self._closed_groups if not g.join(0.0)]
        self._closed_groups.append(group)

    def _refuse(self, link: Link, code: ErrorCode, reason: str) -> None:
        log.warning("refusing learner %d: %s", link.learner_id, reason)
        self.shared.tape.append({"event": "refused", "learner": link.learner_id, "code": code.name, "reason": reason})
        link.group.close(reason, last=Error(code, reason))  # the ERROR goes out first, then the group closes
        self._retire(link.group)

    # -- messages ------------------------------------------------------------------------------
    def _on_message(self, link: Link, msg: Message, payload: memoryview | None,
                    screened: bool | None = None) -> None:
        if isinstance(msg, Init):
            self._on_init(link, msg, payload, screened)
        elif isinstance(msg, Push):
            self.intake.on_push(link, msg, payload, screened)
        elif isinstance(msg, Done):
            if link.learner_id not in self.shared.finished:
                self.shared.finished.add(link.learner_id)
                log.info("learner %d finished training at its step %d", link.learner_id, msg.step)
                self.shared.tape.append({"event": "done", "learner": link.learner_id, "step": msg.step})
        elif isinstance(msg, Bye):
            self.finale.on_bye(link)
            log.info("learner %d says goodbye (%s)", link.learner_id, msg.reason)
        elif isinstance(msg, ProbeReport):
            self._on_probe_report(link, msg)
        elif isinstance(msg, Error):
            log.warning("learner %d reports %s: %s", link.learner_id, msg.code.name, msg.reason)
        else:
            self._refuse(link, ErrorCode.PROTOCOL, f"unexpected {msg.TYPE.name} from a learner")

    def _on_probe_report(self, link: Link, msg: ProbeReport) -> None:
        """A learner's probe summary (DESIGN §8.1); a bad one is refused and the link stays open."""
        if self.shared.consensus is None:
            return  # no model pinned yet: nothing to compare it with
        problem = self.shared.consensus.observe(link.learner_id, msg)
        if problem is not None:
            log.warning("learner %d: %s", link.learner_id, problem)
            link.group.send(Error(ErrorCode.REFUSED, problem))

    def _on_init(self, link: Link, msg: Init, payload: memoryview | None, screened: bool | None = None) -> None:
        if self.shared.phase is not Phase.WAIT_INIT or self.shared.layout is None or self.shared.state is None:
            return  # a replayed INIT after the initial cut: ignored by design
        if link.learner_id != 0:
            self._refuse(link, ErrorCode.PROTOCOL, "only learner 0 sends INIT")
            return
        if msg.fragment >= self.shared.layout.num_fragments or msg.codec != F32.wire_id:
            self._refuse(link, ErrorCode.PROTOCOL, f"INIT names fragment {msg.fragment} with codec {msg.codec}")
            return
        numel = self.shared.layout.fragments[msg.fragment].numel
        if payload is None or len(payload) != numel * 4:
            self._refuse(link, ErrorCode.PROTOCOL, f"INIT of fragment {msg.fragment} has "
                         f"{0 if payload is None else len(payload)} bytes, expected {numel * 4}")
            return
        values = torch.frombuffer(payload, dtype=torch.float32)
        # Screened chunk by chunk as it landed (`payload.payload_screen`); checked here otherwise.
        if screened is False or (screened is None and check_finite(values.view(1, -1)) is not None):
            self._refuse(link, ErrorCode.REFUSED, f"INIT of fragment {msg.fragment} contains NaN or Inf")
            return
        # The reassembled buffer is this message's alone: on CPU it becomes the fragment, no copy.
        self.shared.state.params[msg.fragment] = values.to(self.device)
        self._init.received.add(msg.fragment)
        if len(self._init.received) == self.shared.layout.num_fragments:
            self._initial_cut()
        else:
            self.shared.faults.point("mid-init")

    def _initial_cut(self) -> None:
        assert self.shared.state is not None
        self.shared.phase = Phase.RUNNING
        self.checkpoints.save()
        self.shared.tape.append({"event": "init", "fragments": self.shared.state.num_fragments,
                          "fingerprint": self.shared.state.fingerprint.hex()})
        log.info("initial cut ready: broadcasting %d fragments to %d learners", self.shared.state.num_fragments,
                 len(self.shared.links))
        for link in list(self.shared.links.values()):
            link.group.set_user_timeout(self.settings.wan_stall_timeout_s)
            self.outbox.send_full_state(link)

    # -- advancing -----------------------------------------------------------------------------
    def _live(self) -> dict[int, int]:
        return {lid: link.generation for lid, link in self.shared.links.items() if lid not in self.shared.finished}

    def _fleet_step_s(self, learners: Iterable[int]) -> float | None:
        """ξ_step of a set of learners: the median of their smoothed step times."""
        times = sorted(self.intake.step_s[lid] for lid in learners if lid in self.intake.step_s)
        return times[len(times) // 2] if times else None

    def _advance(self) -> None:
        now = self.shared.clock()
        if self._stop_requested:
            self.shared.phase = Phase.DONE
            return
        if self.shared.phase is Phase.WAIT_INIT:
            if now - self._started > self.settings.init_timeout_s:
                log.error("no complete INIT from learner 0 within %.0f s; giving up", self.settings.init_timeout_s)
                self.exit_code = 3
                self.shared.phase = Phase.DONE
            return
        if self.shared.phase is Phase.FINALIZING:
            if self.finale.wait_over(now):
                self.shared.phase = Phase.DONE
            return
        if self.shared.phase is not Phase.RUNNING:
            return
        assert self.shared.state is not None
        live = self._live()
        done, why = should_finalize(next_round=self.shared.state.next_round, total_rounds=self.settings.total_rounds,
                                    training=len(live), finished=len(self.shared.finished))
        if done:
            self.finale.begin(why)
            return
        for attempt in self.shared.rounds.collecting():
            r = attempt.round
            step_s = self._fleet_step_s(attempt.answers)
            decision = decide_round(now, attempt, live, cfg=self.sched, step_s=step_s, sync_s=self.sync_s)
            if decision.quorum_at is not None:
                self.shared.rounds.enter_grace(r, quorum_at=decision.quorum_at, grace_s=decision.grace_s,
                                        reason=decision.reason)
            if decision.verdict is Verdict.COMMIT:
                self.shared.rounds.close(r, decision.reason, live)
            elif decision.verdict is Verdict.RETRY:
                self._discard(attempt, decision.reason)
        quorum = self._quorum()
        for parked in self.shared.rounds.in_state(RoundState.PARKED):  # a retry waits for a quorum of learners
            if len(live) < quorum:
                break
            self._launch(parked.round, now, live, f"relaunched: {len(live)} learners live, quorum {quorum}")
        while True:  # commits strictly in round order
            closed = self.shared.rounds.entry(self.shared.state.next_round)
            if closed is None or closed.state is not RoundState.CLOSED:
                break
            assert closed.attempt is not None
            self._commit(closed.attempt, closed.reason, closed.live)
        self._maybe_launch(now, live)

    def _discard(self, attempt: Attempt, reason: str) -> None:
        """The attempt is over without a commit: its round is parked, to be launched again."""
        log.warning("round %d attempt %d discarded: %s", attempt.round, attempt.attempt, reason)
        self.shared.tape.append({"event": "retry", "round": attempt.round, "attempt": attempt.attempt,
                          "fragment": attempt.fragment, "reason": reason, "answered": sorted(attempt.answers)})
        self.shared.rounds.park(attempt.round, reason)

    def _overflowed(self, attempt: Attempt, learner_id: int, largest: float) -> None:
        """A finite delta that would still have made the merged fragment Inf: left out, said."""
        reason = (f"delta for fragment {attempt.fragment} (largest |value| {largest:.3g}) would overflow the merged "
                  f"fragment; round {attempt.round} merged without it")
        log.warning("learner %d: push for round %d refused: %s", learner_id, attempt.round, reason)
        self.shared.tape.append({"event": "refused", "learner": learner_id, "round": attempt.round, "reason": reason,
                          "overflow": True})
        link = self.shared.links.get(learner_id)
        answer = attempt.answers[learner_id]
        if link is not None and link.generation == answer.generation:
            link.group.send(Error(ErrorCode.REFUSED, reason))

    def _quorum(self) -> int:
        return attempt_quorum(self.settings.effective_quorum, self.settings.learners, len(self.shared.finished))

    def _maybe_launch(self, now: float, live: dict[int, int]) -> None:
        assert self.shared.state is not None and self.shared.layout is not None
        depth = pipeline_depth(self.sched.pipeline, self.shared.layout.num_fragments)
        interval = round_interval(self._fleet_step_s(live), self.shared.layout.num_fragments, self.sched)
        in_flight = len(self.shared.rounds)
        go, reason = should_launch(now, cfg=self.sched, next_round=self.next_launch, in_flight=in_flight,
                                   depth=depth, eligible=len(live), quorum=self._quorum(),
                                   last_launch=self._last_launch, interval_s=interval)
        if not go:
            if reason != self._last_wait_reason and not reason.startswith(("throttled", "all ")):
                log.info("waiting: %s", reason)
            self._last_wait_reason = reason
            return
        self._last_wait_reason = ""
        self._launch(self.next_launch, now, live, reason)
        self.next_launch += 1

    def _launch(self, r: int, now: float, live: dict[int, int], reason: str) -> None:
        assert self.shared.state is not None and self.shared.layout is not None
        self._attempts += 1
        self._last_launch = now
        f = fragment_of_round(r, self.shared.layout.num_fragments)
        version = self.shared.state.versions[f]
        attempt = Attempt(round=r, attempt=self._attempts, fragment=f, version=version, members=dict(live),
                          quorum=self._quorum(), launched_at=now, deadline=now + self.settings.round_timeout_s)
        self.shared.rounds.launch(attempt, reason)
        self.shared.tape.append({"event": "launch", "round": r, "attempt": attempt.attempt, "fragment": f,
                          "version": version, "members": sorted(live), "quorum": attempt.quorum, "reason": reason})
        self.intake.attach_carried(f)
        pull = Pull(r, self._attempts, f, version)
        for lid in live:
            self.shared.links[lid].group.send(pull)

    def _commit(self, attempt: Attempt, reason: str, live: dict[int, int]) -> None:
        state = self.shared.state
        assert state is not None
        t0 = time.perf_counter()
        f = attempt.fragment
        # A send or a background checkpoint still reading fragment f keeps the values it reads.
        moved = self.leases.writable(f, {"param": state.params, "momentum": state.momentum,
                                         "accum": state.outer_accum})
        if "accum" in moved:  # the optimizer's state holds the accumulator it writes too
            self.outer_state[f][ACCUM_KEY] = moved["accum"]
        out = merge_round(list(attempt.answers.values()), params=state.params[f],
                          momentum=state.momentum[f], outer_state=self.outer_state[f],
                          segments=self.segments[f], outer=self.outer, heloco=self.heloco,
                          threads=self.merging.merge_threads, workspace=self.workspace)
        for lid, largest in out.overflowed.items():
            self._overflowed(attempt, lid, largest)
        if not out.answers:  # nothing was written: the round goes round again
            self._discard(attempt, f"every delta would overflow fragment {f} (learners {sorted(out.overflowed)})")
            return
        self.shared.faults.point("mid-merge")
        if state.outer_accum is not None:
            state.outer_accum[f] = self.outer_state[f].get(ACCUM_KEY, state.outer_accum[f])
            state.outer_count[f] = int(self.outer_state[f].get(COUNT_KEY, 0))
        answers, weights, grad_norm, merge_ms = out.answers, out.weights, out.outer_grad_norm, out.merge_ms
        state.versions[f] += 1
        state.next_round = attempt.round + 1
        self.shared.rounds.commit(attempt.round, reason)
        state.merged_by[f] = (attempt.round, sorted(a.learner_id for a in answers))
        for a in answers:
            key = ledger_key(a.learner_id, a.generation)
            state.ledger[key] = state.ledger.get(key, 0) + a.tokens
        fresh = [a.learner_id for a in answers if not a.carried]
        record: dict[str, Any] = {
            "event": "commit", "round": attempt.round, "attempt": attempt.attempt, "fragment": f,
            "version": state.versions[f], "learners": [a.learner_id for a in answers],
            "generations": [a.generation for a in answers], "answered": fresh,
            "carried": [a.learner_id for a in answers if a.carried],
            "waited_for": sorted(a.learner_id for a in answers if attempt.quorum_at is not None
                                 and not a.carried and a.at > attempt.quorum_at),
            "not_waited_for": sorted(lid for lid in attempt.members if lid not in attempt.answers and lid in live),
            "dropped": sorted(lid for lid in attempt.members if lid not in attempt.answers and lid not in live),
            "base_versions": [a.base_version for a in answers], "grace_ms": round(attempt.grace_s * 1000, 1),
            "weights": [round(w, 6) for w in weights], "tokens": [a.tokens for a in answers],
            "steps": [a.steps for a in answers], "delta_norms": [round(n, 6) for n in out.delta_norms],
            "outer_grad_norm": grad_norm, "merge_ms": round(merge_ms, 3),
            "wait_ms": round((self.shared.clock() - attempt.launched_at) * 1000, 1), "reason": reason,
        }
        if out.overflowed:
            record["overflowed"] = sorted(out.overflowed)
        if self.shared.consensus is not None:  # DESIGN §8: the learners' JS distance, each fragment's L2 drift
            record.update(self.shared.consensus.on_commit(f, out.delta_norms))
        total = self.settings.total_rounds
        last = bool(total) and state.next_round >= total  # finalization writes that cut, once
        if state.next_round % self.settings.checkpoint_every == 0 and not last:
            ckpt_ms = self.checkpoints.save()
            if ckpt_ms is not None:
                record["checkpoint_ms"] = round(ckpt_ms, 1)
        self.shared.tape.append(record)
        self.outbox.broadcast(attempt.round, f, merged=set(record["learners"]))
        self.outbox.send_consensus(attempt.round)
        took = time.perf_counter() - t0
        self.sync_s = took if self.sync_s == 0.0 else (1 - EMA) * self.sync_s + EMA * took  # ξ_sync
        log.info("round %d committed: fragment %d -> v%d, learners %s%s, weights %s, |outer grad| %.4g, "
                 "merge %.1f ms (%s)%s", attempt.round, f, state.versions[f], record["learners"],
                 f" (carried {record['carried']})" if record["carried"] else "",
                 [f"{w:.2f}" for w in weights], grad_norm, merge_ms, reason,
                 self.shared.consensus.log_suffix() if self.shared.consensus is not None else "")
