"""Push intake (DESIGN §4.3, §4.6): what the coordinator does with each PUSH it receives.

A push is checked (size, codec, steps), judged by `rounds.judge_push` (answer, carry or refuse,
with a reason), and then either decoded on the decode pool and stored as an answer of its open
attempt, or kept still encoded until its fragment's next round. The intake owns the late pushes
it holds and each learner's step-time estimate; the rounds they join are the run's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from syncer.events import Decoded
from syncer.links import Carried, Link
from syncer.payload import decode_delta, payload_problem
from syncer.rounds import Answer, PushFate, SchedulerConfig, fragment_of_round, judge_push
from syncer.run_state import RunState
from yeto_core.codecs import F32
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import Error, Push

log = logging.getLogger("yeto.syncer")
EMA = 0.3  # weight of the newest sample in the ξ estimates


class PushIntake:
    def __init__(self, run: RunState, *, sched: SchedulerConfig, device: torch.device,
                 decoders: ThreadPoolExecutor, post: Callable[[Any], None]) -> None:
        self.shared = run
        self.sched = sched
        self.device = device
        self._decoders = decoders
        self.post = post  # hands a `Decoded` back to the coordinator's queue (from a pool thread)
        self.carried: dict[int, dict[int, Carried]] = {}  # fragment -> learner -> late push
        self.step_s: dict[int, float] = {}  # ξ_step per learner (EMA of reported step times)

    def on_push(self, link: Link, msg: Push, payload: memoryview | None, screened: bool | None = None) -> None:
        assert self.shared.state is not None and self.shared.layout is not None
        self.shared.faults.point("before-push")
        lid = link.learner_id
        if msg.step_us:  # ξ_step: EMA of each learner's reported time per inner step
            step_s = msg.step_us / 1e6
            old = self.step_s.get(lid)
            self.step_s[lid] = step_s if old is None else (1 - EMA) * old + EMA * step_s
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
        assert payload is not None
        if fate is PushFate.CARRY:
            # Waits still encoded; decoded only when it joins the fragment's next round.
            self.carried.setdefault(msg.fragment, {})[lid] = Carried(msg, payload, link.generation, link.codec,
                                                                     screened)
            log.info("learner %d: push for round %d carried (%s)", lid, msg.round, problem)
            self.shared.tape.append({"event": "carry", "learner": lid, "round": msg.round, "fragment": msg.fragment,
                              "base_version": msg.base_version, "reason": problem})
            self.attach_carried(msg.fragment)
            return
        # Decode (dequantize, check finiteness) on the decode pool, beside this thread and off the
        # read loops; the answer is stored when `Decoded` comes back, if its attempt is still open.
        layout, codec, attempt_id = self.shared.layout, link.codec, msg.attempt
        if codec is F32:
            # Nothing to decode, and the transport screened every chunk for NaN/Inf as it landed
            # (`payload_screen`): handled here, without the two thread hand-offs to the pool and back.
            done: Future[torch.Tensor | str] = Future()
            try:
                done.set_result(decode_delta(layout, msg, payload, codec, screened))
            except Exception as exc:  # reported as a refusal by `_on_decoded`, as from the pool
                done.set_exception(exc)
            self.on_decoded(Decoded(lid, link.generation, attempt_id, msg, done))
            return
        future = self._decoders.submit(decode_delta, layout, msg, payload, codec)
        future.add_done_callback(lambda f: self.post(Decoded(lid, link.generation, attempt_id, msg, f)))

    def on_decoded(self, ev: Decoded) -> None:
        link = self.shared.links.get(ev.learner_id)
        try:
            delta = ev.future.result()
        except Exception as exc:  # a decoder bug must not take the coordinator down
            delta = f"decode failed: {exc}"
        if isinstance(delta, str):
            if link is not None and link.generation == ev.generation:
                self.refuse_push(link, ev.msg, delta)
            return
        attempt = self.shared.rounds.attempt_of(ev.msg.round)
        if attempt is None or attempt.attempt != ev.attempt:
            log.info("learner %d: push for round %d decoded after the attempt closed; dropped", ev.learner_id,
                     ev.msg.round)
            return
        attempt.answers[ev.learner_id] = Answer(ev.learner_id, ev.generation, ev.msg.tokens, ev.msg.steps,
                                                delta.to(self.device), ev.msg.base_version, at=self.shared.clock())

    def _judge(self, link: Link, msg: Push) -> tuple[PushFate, str]:
        state, layout, rounds = self.shared.state, self.shared.layout, self.shared.rounds
        assert state is not None and layout is not None
        r = msg.round
        return judge_push(learner_id=link.learner_id, generation=link.generation, round_id=r, attempt_id=msg.attempt,
                          fragment=msg.fragment, base_version=msg.base_version,
                          round_fragment=fragment_of_round(r, layout.num_fragments),
                          round_state=rounds.state_of(r, state.next_round), attempt=rounds.attempt_of(r),
                          version_now=state.versions[msg.fragment], cfg=self.sched)

    def refuse_push(self, link: Link, msg: Push, reason: str) -> None:
        log.warning("learner %d: push for round %d refused: %s", link.learner_id, msg.round, reason)
        self.shared.tape.append({"event": "refused", "learner": link.learner_id, "round": msg.round, "reason": reason})
        link.group.send(Error(ErrorCode.REFUSED, reason))

    def attach_carried(self, fragment: int) -> None:
        """Carried pushes join the fragment's open round (a fresh answer from the same learner wins)."""
        assert self.shared.layout is not None
        attempt = self.shared.rounds.collecting_on(fragment)
        held = self.carried.get(fragment)
        if attempt is None or not held:
            return
        for lid, c in sorted(held.items()):
            if lid in attempt.answers and not attempt.answers[lid].carried:
                continue
            delta = decode_delta(self.shared.layout, c.msg, c.payload, c.codec, c.screened)
            if isinstance(delta, str):
                link = self.shared.links.get(lid)
                if link is not None and link.generation == c.generation:
                    self.refuse_push(link, c.msg, f"carried push dropped: {delta}")
                else:
                    log.warning("learner %d: carried push for round %d dropped: %s", lid, c.msg.round, delta)
                continue
            attempt.answers[lid] = Answer(lid, c.generation, c.msg.tokens, c.msg.steps, delta.to(self.device),
                                          c.msg.base_version, carried=True)
        del self.carried[fragment]
