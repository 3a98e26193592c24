"""Push intake (DESIGN §4.3, §4.6): what the coordinator does with each PUSH it receives.

A push is checked (size, codec, steps), judged by `rounds.judge_push` (answer, carry or refuse,
with a reason), and then either decoded on the decode pool and stored as an answer of its open
attempt, or kept still encoded until its fragment's next round. This mixin holds only those
steps; the state it reads and writes belongs to the `Coordinator` that inherits it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from syncer.commit import decode_delta, payload_problem
from syncer.links import Carried, Decoded, Link
from syncer.round_table import RoundTable
from syncer.rounds import Answer, PushFate, SchedulerConfig, fragment_of_round, judge_push
from syncer.tape import EventTape
from yeto_core.codecs import F32
from yeto_core.faults import FaultInjector
from yeto_core.layout import Layout
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import Error, Push

log = logging.getLogger("yeto.syncer")
EMA = 0.3  # weight of the newest sample in the ξ estimates


class PushIntake:
    # Provided by the Coordinator.
    layout: Layout | None
    state: Any
    rounds: RoundTable
    carried: dict[int, dict[int, Carried]]
    step_s: dict[int, float]
    links: dict[int, Link]
    sched: SchedulerConfig
    tape: EventTape
    device: torch.device
    _decoders: ThreadPoolExecutor
    clock: Callable[[], float]
    post: Callable[[Any], None]
    faults: FaultInjector

    def _on_push(self, link: Link, msg: Push, payload: memoryview | None, screened: bool | None = None) -> None:
        assert self.state is not None and self.layout is not None
        self.faults.point("before-push")
        lid = link.learner_id
        if msg.step_us:  # ξ_step: EMA of each learner's reported time per inner step
            step_s = msg.step_us / 1e6
            old = self.step_s.get(lid)
            self.step_s[lid] = step_s if old is None else (1 - EMA) * old + EMA * step_s
        problem = payload_problem(self.layout, msg, payload, link.codec)
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
            self._refuse_push(link, msg, problem)
            return
        assert payload is not None
        if fate is PushFate.CARRY:
            # Waits still encoded; decoded only when it joins the fragment's next round.
            self.carried.setdefault(msg.fragment, {})[lid] = Carried(msg, payload, link.generation, link.codec,
                                                                     screened)
            log.info("learner %d: push for round %d carried (%s)", lid, msg.round, problem)
            self.tape.append({"event": "carry", "learner": lid, "round": msg.round, "fragment": msg.fragment,
                              "base_version": msg.base_version, "reason": problem})
            self._attach_carried(msg.fragment)
            return
        # Decode (dequantize, check finiteness) on the decode pool, beside this thread and off the
        # read loops; the answer is stored when `Decoded` comes back, if its attempt is still open.
        layout, codec, attempt_id = self.layout, link.codec, msg.attempt
        if codec is F32:
            # Nothing to decode, and the transport screened every chunk for NaN/Inf as it landed
            # (`payload_screen`): handled here, without the two thread hand-offs to the pool and back.
            done: Future[torch.Tensor | str] = Future()
            try:
                done.set_result(decode_delta(layout, msg, payload, codec, screened))
            except Exception as exc:  # reported as a refusal by `_on_decoded`, as from the pool
                done.set_exception(exc)
            self._on_decoded(Decoded(lid, link.generation, attempt_id, msg, done))
            return
        future = self._decoders.submit(decode_delta, layout, msg, payload, codec)
        future.add_done_callback(lambda f: self.post(Decoded(lid, link.generation, attempt_id, msg, f)))

    def _on_decoded(self, ev: Decoded) -> None:
        link = self.links.get(ev.learner_id)
        try:
            delta = ev.future.result()
        except Exception as exc:  # a decoder bug must not take the coordinator down
            delta = f"decode failed: {exc}"
        if isinstance(delta, str):
            if link is not None and link.generation == ev.generation:
                self._refuse_push(link, ev.msg, delta)
            return
        attempt = self.rounds.attempt_of(ev.msg.round)
        if attempt is None or attempt.attempt != ev.attempt:
            log.info("learner %d: push for round %d decoded after the attempt closed; dropped", ev.learner_id,
                     ev.msg.round)
            return
        attempt.answers[ev.learner_id] = Answer(ev.learner_id, ev.generation, ev.msg.tokens, ev.msg.steps,
                                                delta.to(self.device), ev.msg.base_version, at=self.clock())

    def _judge(self, link: Link, msg: Push) -> tuple[PushFate, str]:
        assert self.state is not None and self.layout is not None
        r = msg.round
        state = self.rounds.state_of(r, self.state.next_round)
        return judge_push(learner_id=link.learner_id, generation=link.generation, round_id=r, attempt_id=msg.attempt,
                          fragment=msg.fragment, base_version=msg.base_version,
                          round_fragment=fragment_of_round(r, self.layout.num_fragments), round_state=state,
                          attempt=self.rounds.attempt_of(r), version_now=self.state.versions[msg.fragment],
                          cfg=self.sched)

    def _refuse_push(self, link: Link, msg: Push, reason: str) -> None:
        log.warning("learner %d: push for round %d refused: %s", link.learner_id, msg.round, reason)
        self.tape.append({"event": "refused", "learner": link.learner_id, "round": msg.round, "reason": reason})
        link.group.send(Error(ErrorCode.REFUSED, reason))

    def _attach_carried(self, fragment: int) -> None:
        """Carried pushes join the fragment's open round (a fresh answer from the same learner wins)."""
        assert self.layout is not None
        attempt = self.rounds.collecting_on(fragment)
        held = self.carried.get(fragment)
        if attempt is None or not held:
            return
        for lid, c in sorted(held.items()):
            if lid in attempt.answers and not attempt.answers[lid].carried:
                continue
            delta = decode_delta(self.layout, c.msg, c.payload, c.codec, c.screened)
            if isinstance(delta, str):
                link = self.links.get(lid)
                if link is not None and link.generation == c.generation:
                    self._refuse_push(link, c.msg, f"carried push dropped: {delta}")
                else:
                    log.warning("learner %d: carried push for round %d dropped: %s", lid, c.msg.round, delta)
                continue
            attempt.answers[lid] = Answer(lid, c.generation, c.msg.tokens, c.msg.steps, delta.to(self.device),
                                          c.msg.base_version, carried=True)
        del self.carried[fragment]
