"""The learner's per-fragment rules, without time or I/O: what to push, replay and install
(DESIGN §3.1–3.3, §3.6–3.7).

`FragmentSync` holds one `FragmentState` per fragment and applies the syncer's messages to
them. The learner session decides *when* (at which step, after which wait); this module
decides *what*, from the records alone:

* **Pushing** (`boundary`). A held PULL is answered with d = θ − anchor, plus the tokens and
  steps trained since the anchor, once its BCAST is installed and something trained since. One
  push streams at a time; a delta holding NaN or Inf is never sent.
* **Replaying** (`take` of a PULL). A round pulled again (the connection dropped, or the syncer
  restarted before committing it) gets the very delta it was sent before, so it merges what it
  would have merged undisturbed, and the steps trained since stay in θ − anchor.
* **Installing** (`install_bcasts`). In place, optimizer moments untouched: by rebasing,
  θ ← Θ + (θ − base) (overlap: steps trained while the round was in flight are kept), or by
  blending, θ ← α·θ + (1 − α)·Θ. The first cut always overwrites. The anchor becomes Θ.
* **The final cut** (`install_final`): every fragment's FINAL, installed exactly, all or nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence

import torch

from yeto_core.codecs import Codec
from yeto_core.layout import Layout
from yeto_core.learner_state import FragmentState, LearnerStats
from yeto_core.link import PushJob
from yeto_core.moments import OptimizerMoments
from yeto_core.store import TensorStore, check_fragment_values, fragment_buffer, nonfinite_tensor
from yeto_core.wire.messages import BCAST_MERGED, Bcast, Final, Message, Pull

log = logging.getLogger("yeto.learner")


class FragmentSync:
    def __init__(self, *, learner_id: int, store: TensorStore, codec: Codec, stats: LearnerStats, overlap: bool,
                 merge_alpha: float, submit: Callable[[PushJob], None], say: Callable[[str], None]) -> None:
        self.learner_id = learner_id
        self.store = store
        self.codec = codec
        self.stats = stats
        self.overlap = overlap
        self.merge_alpha = merge_alpha
        self._submit = submit
        self._say = say
        self.layout: Layout | None = None
        self.fragments: list[FragmentState] = []
        self.blocking: frozenset[int] = frozenset()  # fragments waited for at their boundary (Mix2)
        self.queued: list[PushJob] = []  # pushes handed to the link and not yet accounted for, oldest first
        self.links = 0  # connections made so far (the syncer's attempt numbers restart with each)
        self.moments: OptimizerMoments | None = None  # the optimizer's first moment, when shared (§3.9)
        self.latest_round = -1  # the highest round a PULL or BCAST named: how far the syncer's rounds are

    def begin(self, layout: Layout, blocking: frozenset[int]) -> None:
        self.layout, self.blocking = layout, blocking
        self.fragments = [FragmentState() for _ in range(layout.num_fragments)]

    def gather(self, index: int) -> torch.Tensor:
        assert self.layout is not None
        return self.store.gather(self.layout.fragments[index])

    # -- what the syncer sent ----------------------------------------------------------------
    def take(self, msg: Message, values: torch.Tensor | None, moment: memoryview | None = None) -> None:
        if isinstance(msg, Pull):
            self.latest_round = max(self.latest_round, msg.round)
            if self.fragments[msg.fragment].take_pull(msg, self.links):
                self._replay(msg.fragment)
        elif isinstance(msg, Bcast):
            assert values is not None
            if msg.version > 0:  # a commit's round (the initial cut's names the next round, not launched yet)
                self.latest_round = max(self.latest_round, msg.round)
            self.fragments[msg.fragment].take_bcast(msg, values, moment)
        elif isinstance(msg, Final):
            assert values is not None
            state = self.fragments[msg.fragment]
            state.final = (msg, values)
            # The run is final: no push of this fragment will be merged again, so its anchor is
            # let go now, and the next FINAL can be received into its buffer (the end's peak holds
            # one copy of the model beside the weights, not the anchors and the cut both).
            state.anchor = None

    # -- questions the session's waits ask ---------------------------------------------------
    @property
    def initial_cut_installed(self) -> bool:
        return bool(self.fragments) and all(f.version >= 0 for f in self.fragments)

    @property
    def final_ready(self) -> bool:
        return bool(self.fragments) and all(f.final is not None for f in self.fragments)

    def pending_pulls(self) -> list[Pull]:
        return sorted((f.pull for f in self.fragments if f.pull is not None), key=lambda p: (p.round, p.attempt))

    @property
    def push(self) -> PushJob | None:
        """The push last handed to the link, until it is found done and accounted for."""
        return self.queued[-1] if self.queued else None

    def push_in_flight(self) -> bool:
        """Whether a push is still streaming; those that ended (they end in order) are accounted for."""
        while self.queued and self.queued[0].done.is_set():
            job = self.queued.pop(0)
            if job.error:
                self.stats.push_failures += 1
                log.info("learner %d: push of fragment %d failed (%s)", self.learner_id, job.pull.fragment,
                         job.error)
            else:
                self.stats.pushes += 1
                self.stats.bytes_pushed += job.nbytes
        return bool(self.queued)

    def pushes_merged(self, skip: Collection[int] = ()) -> bool:
        """Every push sent has had its round's BCAST arrive (or installed), those of `skip` aside."""
        return all(f.sent is None or f.bcast_arrived_after(f.sent.base_version)
                   for i, f in enumerate(self.fragments) if i not in skip)

    def recent_pushes(self, steps: int) -> set[int]:
        """The fragments whose push in flight was computed fewer than `steps` steps ago."""
        return {i for i, f in enumerate(self.fragments)
                if f.sent is not None and f.sent_marks is not None and self.stats.steps - f.sent_marks[1] < steps}

    def pull_answerable(self) -> bool:
        """No push is streaming and a held PULL can be answered with the installed anchors."""
        if self.push_in_flight():
            return False
        return any(f.pull is not None and f.version == f.pull.version for f in self.fragments)

    def pulls_to_answer(self, skip: Collection[int] = (), before: int | None = None) -> bool:
        """A PULL is held that a boundary can answer now, or once the BCAST it names is in (the
        fragments in `skip` aside; only rounds before `before`, if given)."""
        for i, f in enumerate(self.fragments):
            if f.pull is None or i in skip or (before is not None and f.pull.round >= before):
                continue
            if f.version < f.pull.version:
                return True
            if f.version == f.pull.version and f.anchor is not None and self.stats.steps > f.steps_mark:
                return True
        return False

    def owed(self) -> list[int]:
        """Fragments holding trained steps that no push carries yet, whose next round will come (a
        sweep waits for its PULL: every fragment's progress of an iteration goes into one round)."""
        return [i for i, f in enumerate(self.fragments) if not f.closed and f.unpushed(self.stats.steps)]

    def flushed(self) -> bool:
        """Every fragment's anchor was installed after the last trained step: each step is in a
        merged round (DONE only then, so the syncer never drops an answer it has not decoded)."""
        return all(f.steps_mark == self.stats.steps or f.anchor is None for f in self.fragments)

    # -- pushing -----------------------------------------------------------------------------
    def boundary(self, step_s: float | None, *, queue: bool = False) -> PushJob | None:
        """Answer the oldest answerable PULL; the job, if one went out. One push streams at a time,
        so a boundary reached while one streams holds its pulls; a sweep (`queue`) hands every push
        to the link's sender at once, which streams them one after another while the next is read."""
        if self.push_in_flight() and not queue:
            return None  # pulls stay held
        for pull in self.pending_pulls():
            state = self.fragments[pull.fragment]
            if state.version > pull.version:
                state.pull = None  # that round was already committed without us
                continue
            steps = self.stats.steps - state.steps_mark
            if state.version < pull.version or steps == 0 or state.anchor is None:
                continue  # its BCAST is not installed yet, or nothing trained since
            delta = self.gather(pull.fragment).sub_(state.anchor)
            state.pull = None
            if not self._finite(pull, delta):
                continue
            job = PushJob(pull, state.version, self.stats.tokens - state.tokens_mark, steps, step_s, delta,
                          self._moment_to_push(pull.fragment))
            state.sent = job
            self.queued.append(job)
            state.sent_link = self.links
            state.sent_marks = (self.stats.tokens, self.stats.steps)
            self._submit(job)
            return job
        return None

    def _replay(self, index: int) -> None:
        state = self.fragments[index]
        sent, pull = state.sent, state.pull
        if sent is None or pull is None or pull.round != sent.pull.round:
            return
        if pull.attempt == sent.pull.attempt and state.sent_link == self.links:
            return  # the very pull it answered
        if pull.version != sent.base_version or state.version != sent.base_version:
            state.forget_push()  # the base moved on: the old delta no longer applies
            return
        # Queued behind a push still streaming, if any: the link's sender streams them in order. A
        # replay must not wait for a boundary: a trainer between sweeps reaches none for a while.
        job = PushJob(pull, sent.base_version, sent.tokens, sent.steps, sent.step_s, sent.delta, sent.moment)
        state.pull = None
        state.sent = job
        self.queued.append(job)
        state.sent_link = self.links
        self.stats.replays += 1
        log.info("learner %d: round %d pulled again (attempt %d); pushing the same delta", self.learner_id,
                 pull.round, pull.attempt)
        self._submit(job)

    def _finite(self, pull: Pull, delta: torch.Tensor) -> bool:
        """A delta holding NaN or Inf is not sent: the syncer would refuse it after it crossed
        the link, and re-pulls would send it again. The round goes on without this learner; the
        fragment's next broadcast replaces the diverged values (with merge_alpha 0)."""
        assert self.layout is not None
        name = nonfinite_tensor(self.layout.fragments[pull.fragment], delta)
        if name is None:
            return True
        self.stats.nonfinite_deltas += 1
        message = (f"yeto learner {self.learner_id}: the delta of fragment {pull.fragment} holds NaN or Inf "
                   f"(first in {name!r}); round {pull.round} is not answered: this island's training diverged")
        if self.stats.nonfinite_deltas == 1:  # said once to the user; every time in the log
            self._say(message)
        log.error("%s", message)
        return False

    # -- installing --------------------------------------------------------------------------
    def install_bcasts(self, hold: Collection[int] = ()) -> None:
        """Install every BCAST that came in, but those of the fragments in `hold` (kept for later)."""
        for index, state in enumerate(self.fragments):
            if state.bcast is None or index in hold:
                continue
            msg, values = state.bcast
            if state.sent is not None and msg.version < state.sent.base_version:
                # The syncer holds less than the push was based on (it restarted without its state,
                # or from a checkpoint older than what was installed): that push's round is gone, and
                # the steps it carried are this island's to push again.
                state.forget_push()
            sent, marks, moment = state.sent, state.sent_marks, state.bcast_moment
            if msg.version != state.version:
                first = state.version < 0
                # A released anchor (DONE sent, or this fragment's FINAL in) leaves nothing to rebase
                # onto: this island pushes no more, so Θ goes in as an overwrite.
                if self.overlap and not first and state.anchor is not None:
                    if not self._rebase(state, index, msg, values):
                        marks = None  # the progress before the push is still ours to push: keep the marks
                else:
                    self._install(index, values, alpha=0.0 if first else self.merge_alpha)
                state.version = msg.version
                self.stats.installs += 1
            if sent is not None and state.version > sent.base_version:
                if moment is not None and sent.moment is not None and state.sent_marks is not None:
                    self._share_moment(index, moment, sent.moment, self.stats.steps - state.sent_marks[1])
                if state.sent_marks is not None:  # how far training ran ahead of this round
                    self.stats.round_trips += 1
                    self.stats.round_trip_steps += self.stats.steps - state.sent_marks[1]
                state.forget_push()  # its round committed
                # Steps trained between the push and this install belong to the next push of this
                # fragment: each step is counted once per fragment, however long the round took.
                if marks is not None:
                    state.tokens_mark, state.steps_mark = marks
            state.bcast, state.bcast_moment = None, None

    def _rebase(self, state: FragmentState, index: int, msg: Bcast, values: torch.Tensor) -> bool:
        """Overlap (DESIGN §3.3, Mix1): θ ← Θ + (θ − base), and Θ becomes the anchor. `base` is θ at the push
        when Θ merged that push (the syncer flags it), else the old anchor: the progress Θ
        already holds is dropped once, the rest is kept for the next push. True when Θ merged
        this learner's push.

        A Θ more than one version past the push's base followed commits this learner never saw,
        and the flag speaks of the last of them only: the push counts as merged then, so at worst
        it is dropped (as an overwrite drops it), never added twice."""
        assert self.layout is not None and state.anchor is not None
        sent = state.sent
        merged = sent is not None and sent.base_version == state.version and (
            (bool(msg.flags & BCAST_MERGED) and msg.round == sent.pull.round) or msg.version > sent.base_version + 1)
        fragment = self.layout.fragments[index]
        trained = state.sent_marks is None or state.sent_marks[1] != self.stats.steps
        if merged and not trained and self.codec.name == "f32":
            # Nothing trained since an exact push (a sweep that waits, a blocking fragment): θ is θ at
            # the push, and θ − base is zero but for the rounding of anchor + delta. Θ goes in exactly,
            # so every island that waited holds the same bits. (A lossy push's rounding error is
            # θ − base here, and goes out with the next push instead.)
            self.store.install(fragment, values.clone(), 0.0)
            state.anchor = values
            self.stats.rebases += 1
            return True
        base = state.anchor
        if merged:
            assert sent is not None
            base = torch.add(state.anchor, self._as_merged(sent.delta), out=fragment_buffer(fragment.numel))
        ahead = self.gather(index).sub_(base)
        if nonfinite_tensor(fragment, ahead) is not None:
            ahead.zero_()  # training diverged here: Θ replaces the diverged values, as an overwrite does
        self.store.install(fragment, ahead.add_(values), 0.0)
        state.anchor = values
        self.stats.rebases += int(merged)
        return merged

    def _moment_to_push(self, index: int) -> memoryview | None:
        """The fragment's first moment in its wire form (DESIGN §3.9), or None: kept with the push
        as the syncer will decode it, so an install replaces exactly what the fleet's average was
        made of, and the sender streams the bytes as they are."""
        if self.moments is None:
            return None
        assert self.layout is not None
        return self.moments.encode(self.layout.fragments[index])

    def _share_moment(self, index: int, merged: memoryview, pushed: memoryview, steps: int) -> None:
        """Take the fleet's first moment of the fragment in place of the one this island pushed,
        keeping the `steps` trained since (DESIGN §3.9)."""
        assert self.layout is not None
        if self.moments is None or len(merged) != len(pushed):
            return
        self.moments.rebase_wire(self.layout.fragments[index], merged, pushed, steps)
        self.stats.moments_shared += 1

    def _as_merged(self, delta: torch.Tensor) -> torch.Tensor:
        """The delta as the syncer decoded it: with a lossy push codec the rounding error stays in
        θ − base and goes out with the next push (error feedback) instead of being lost."""
        if self.codec.name == "f32":
            return delta
        wire = bytearray(self.codec.encoded_nbytes(delta.numel()))
        self.codec.encode(delta, memoryview(wire))
        out = torch.empty_like(delta)
        self.codec.decode(memoryview(wire), out)
        return out

    def _install(self, index: int, values: torch.Tensor, *, alpha: float) -> None:
        assert self.layout is not None
        self.store.install(self.layout.fragments[index], values, alpha)
        state = self.fragments[index]
        state.anchor = values
        state.tokens_mark = self.stats.tokens
        state.steps_mark = self.stats.steps

    def reseeded(self, values: Sequence[torch.Tensor]) -> None:
        """Learner 0 seeded a syncer that had lost its state with `values`, its weights as they are
        now: that syncer's history starts at version 0 from exactly these bits, and every step
        trained so far is in it. They become each fragment's anchor at version 0, so the new initial
        cut needs no install and the next push carries only the steps trained after the seed (the
        old anchor would push, and rebase in, the steps since it a second time). The pushes, pulls
        and broadcasts of the lost history go: none of them can be merged now."""
        for state, anchor in zip(self.fragments, values, strict=True):
            state.anchor, state.version = anchor, 0
            state.forget_push()
            state.pull, state.bcast, state.bcast_moment, state.closed = None, None, None, False
            state.tokens_mark, state.steps_mark = self.stats.tokens, self.stats.steps

    def release_anchors(self) -> None:
        """DONE is sent: this island pushes nothing more, so its anchors are let go, and the final cut
        is received into their memory (the end's peak is one copy of the model beside the weights)."""
        for state in self.fragments:
            state.anchor = None

    def install_final(self) -> int:
        """Install every fragment's final cut exactly; the syncer's round count."""
        assert self.layout is not None and self.final_ready
        finals = [f.final for f in self.fragments]
        for index, final in enumerate(finals):  # all or nothing: check every cut first
            assert final is not None
            check_fragment_values(self.layout.fragments[index], final[1])
        for index, final in enumerate(finals):
            assert final is not None
            self._install(index, final[1], alpha=0.0)
            self.fragments[index].version = final[0].version
        self.stats.final_installed = True
        first = finals[0]
        assert first is not None
        return first[0].rounds
