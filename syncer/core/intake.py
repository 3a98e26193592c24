"""Push intake (DESIGN §4.3, §4.6): what the coordinator does with each PUSH it receives.

A push is checked (size, codec, steps), judged by `rounds.judge_push` (answer, carry or refuse,
with a reason), and then either decoded and stored as an answer of its open attempt, or kept
still encoded until its fragment's next round. The shell decodes (`effects.Decode`): a quantized
push on its decode pool, whenever that is done; an f32 one (a view of the payload, screened as it
landed) and a carried one joining its fragment's next round as asks, answered at once. The
intake owns the late pushes it holds and each learner's step-time estimate; the rounds they join
are the run's.
"""

from __future__ import annotations

import logging

from syncer.core import records
from syncer.core.effects import Decode, FaultPoint, Send
from syncer.core.events import Decoded
from syncer.core.links import Carried, Link
from syncer.core.payload import payload_problem
from syncer.core.rounds import Answer, PushFate, SchedulerConfig, fragment_of_round, judge_push, smoothed
from syncer.core.run_state import RunState
from yeto_core.codecs import F32
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import Error, Push

log = logging.getLogger("yeto.syncer")


class PushIntake:
    def __init__(self, run: RunState, *, sched: SchedulerConfig) -> None:
        self.shared = run
        self.sched = sched
        self.carried: dict[int, dict[int, Carried]] = {}  # fragment -> learner -> late push
        self.step_s: dict[int, float] = {}  # ξ_step per learner (EMA of reported step times)

    def on_push(self, link: Link, msg: Push, payload: memoryview | None, screened: bool | None = None) -> None:
        assert self.shared.state is not None and self.shared.layout is not None
        self.shared.emit(FaultPoint("before-push"))
        lid = link.learner_id
        if msg.step_us:  # ξ_step: EMA of each learner's reported time per inner step
            self.step_s[lid] = smoothed(self.step_s.get(lid), msg.step_us / 1e6)
        problem = payload_problem(self.shared.layout, msg, payload, link.codec)
        if problem is None and screened is False:  # known bad: refused now, never carried
            problem = f"delta for fragment {msg.fragment} contains NaN or Inf"
        if problem is None:
            fate, problem = self._judge(link, msg)
        else:
            fate = PushFate.REFUSE
        if fate is PushFate.CARRY and link.overlap:
            # An overlapping learner rebases on the version its push was merged into; a carried
            # push would be merged later, unflagged, and counted twice. Its progress stays local.
            fate, problem = PushFate.REFUSE, f"{problem}; not carried for a learner that overlaps (it pushes it again)"
        if fate is PushFate.REFUSE:
            self.refuse_push(link, msg, problem)
            return
        self.shared.lives[lid].trained = True  # a push taken in (a refused one trains nothing)
        assert payload is not None
        if fate is PushFate.CARRY:
            # Waits still encoded; decoded only when it joins the fragment's next round.
            self.carried.setdefault(msg.fragment, {})[lid] = Carried(msg, payload, link.generation, link.codec,
                                                                     screened)
            log.info("learner %d: push for round %d carried (%s)", lid, msg.round, problem)
            self.shared.record(records.Carry(lid, msg.round, msg.fragment, msg.base_version, problem))
            self.attach_carried(msg.fragment)
            return
        # A quantized push is checked on the decode pool, beside this thread and off the read loops
        # (held in its wire encoding on a CPU merge device, its norms taken: `held.py`; decoded
        # elsewhere); the answer is stored when `Decoded` comes back, if its attempt is still
        # open. An f32 one has nothing to decode, and the transport screened every chunk for NaN/Inf
        # as it landed (`payload_screen`): the shell views it at once, without the pool.
        self.shared.emit(Decode(lid, link.generation, msg.attempt, msg, payload, link.codec, inline=link.codec is F32,
                                screened=screened))

    def on_decoded(self, ev: Decoded) -> None:
        link = self.shared.links.get(ev.learner_id)
        delta = ev.delta
        if isinstance(delta, str):
            if link is not None and link.generation == ev.generation:
                self.refuse_push(link, ev.msg, f"carried push dropped: {delta}" if ev.carried else delta)
            elif ev.carried:
                log.warning("learner %d: carried push for round %d dropped: %s", ev.learner_id, ev.msg.round, delta)
            return
        if ev.carried:
            attempt = self.shared.rounds.collecting_on(ev.msg.fragment)
            if attempt is not None and attempt.attempt == ev.attempt:  # else it closed meanwhile: dropped
                held = attempt.answers.get(ev.learner_id)
                if held is None or held.carried:  # a fresh answer from the same learner wins
                    attempt.answers[ev.learner_id] = Answer(ev.learner_id, ev.generation, ev.msg.tokens,
                                                            ev.msg.steps, delta, ev.msg.base_version, carried=True,
                                                            origin=ev.msg.round, moment=ev.moment,
                                                            nbytes=self._values_bytes(ev))
            return
        attempt = self.shared.rounds.attempt_of(ev.msg.round)
        if attempt is None or attempt.attempt != ev.attempt:
            log.info("learner %d: push for round %d decoded after the attempt closed; dropped", ev.learner_id,
                     ev.msg.round)
            return
        attempt.answers[ev.learner_id] = Answer(ev.learner_id, ev.generation, ev.msg.tokens, ev.msg.steps, delta,
                                                ev.msg.base_version, at=self.shared.now, origin=ev.msg.round,
                                                moment=ev.moment, nbytes=self._values_bytes(ev))

    def _values_bytes(self, ev: Decoded) -> int:
        """The bytes of the push's delta on the wire: its payload, less a shared moment's."""
        return ev.msg.nbytes - (len(ev.moment) if ev.moment is not None else 0)

    def _judge(self, link: Link, msg: Push) -> tuple[PushFate, str]:
        state, layout, rounds = self.shared.state, self.shared.layout, self.shared.rounds
        assert state is not None and layout is not None
        r = msg.round
        return judge_push(learner_id=link.learner_id, generation=link.generation, round_id=r, attempt_id=msg.attempt,
                          fragment=msg.fragment, base_version=msg.base_version,
                          round_fragment=fragment_of_round(r, layout.num_fragments),
                          round_state=rounds.state_of(r, state.next_round), attempt=rounds.attempt_of(r),
                          version_now=state.versions[msg.fragment], cfg=self.sched,
                          merged=link.learner_id in self.shared.merged_rounds.get(r, ()))

    def refuse_push(self, link: Link, msg: Push, reason: str) -> None:
        log.warning("learner %d: push for round %d refused: %s", link.learner_id, msg.round, reason)
        self.shared.record(records.Refused(link.learner_id, round=msg.round, reason=reason))
        self.shared.emit(Send(link.peer, Error(ErrorCode.REFUSED, reason)))

    def attach_carried(self, fragment: int) -> None:
        """Carried pushes join the fragment's open round (a fresh answer from the same learner wins),
        decoded by the shell as they join (asks, answered by `Decoded`)."""
        attempt = self.shared.rounds.collecting_on(fragment)
        held = self.carried.get(fragment)
        if attempt is None or not held:
            return
        for lid, c in sorted(held.items()):
            if lid in attempt.answers and not attempt.answers[lid].carried:
                continue
            self.shared.emit(Decode(lid, c.generation, attempt.attempt, c.msg, c.payload, c.codec, inline=True,
                                    screened=c.screened, carried=True))
        del self.carried[fragment]
