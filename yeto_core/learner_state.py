"""What a learner session knows: one record per fragment, and the session's counters.

Everything about a fragment lives in its `FragmentState` (its anchor and version, the pull it
holds, the broadcast or final cut waiting to be installed, the push not yet confirmed), so the
replay and rebase rules read and change one record instead of keeping parallel tables in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from yeto_core.link import PushJob
from yeto_core.probe import ProbeResult
from yeto_core.wire.messages import BCAST_LAST, Bcast, Final, Pull


@dataclass
class FragmentState:
    anchor: torch.Tensor | None = None  # the f32 global value last installed
    version: int = -1  # the anchor's version; -1: nothing installed yet
    tokens_mark: int = 0  # learner-wide token / step counters when the anchor was installed
    steps_mark: int = 0
    pull: Pull | None = None  # the newest PULL not answered yet
    pull_link: int = 0  # the connection it came on (attempt numbers restart with a syncer)
    bcast: tuple[Bcast, torch.Tensor] | None = None  # the newest BCAST not installed yet
    bcast_moment: memoryview | None = None  # the merged first moment that BCAST carried, wire form (§3.9)
    final: tuple[Final, torch.Tensor] | None = None  # the final cut, installed when all are in
    sent: PushJob | None = None  # pushed; its round's BCAST not installed yet (replayed on a re-pull)
    sent_link: int = 0  # the connection `sent` last went out on
    sent_marks: tuple[int, int] | None = None  # (tokens, steps) counters when `sent` was computed
    closed: bool = False  # the newest BCAST merged the fragment's last round: no PULL will follow

    def take_pull(self, pull: Pull, link: int) -> bool:
        """Hold `pull` if it is newer than the one held (or came on a newer connection)."""
        held = self.pull
        if held is None or self.pull_link != link or (pull.round, pull.attempt) > (held.round, held.attempt):
            self.pull, self.pull_link = pull, link
            return True
        return False

    def take_bcast(self, msg: Bcast, values: torch.Tensor, moment: memoryview | None = None) -> None:
        if self.bcast is None or msg.version >= self.bcast[0].version:
            self.bcast = (msg, values)
            self.bcast_moment = moment
            self.closed = bool(msg.flags & BCAST_LAST)

    def unpushed(self, steps: int) -> bool:
        """Steps up to `steps` trained on this fragment that no push carries: since the anchor was
        installed, or since the push in flight (a push whose round committed without it is forgotten,
        and its steps are unpushed again)."""
        if self.anchor is None:
            return False
        covered = self.sent_marks[1] if self.sent_marks is not None else self.steps_mark
        return steps > covered

    def forget_push(self) -> None:
        """Nothing is left to replay: the push's round committed (with it or without it), or the
        base it was computed on moved on."""
        self.sent, self.sent_marks = None, None

    def bcast_arrived_after(self, version: int) -> bool:
        """A version past `version` is installed, or has arrived and waits to be installed."""
        return self.version > version or (self.bcast is not None and self.bcast[0].version > version)


@dataclass
class LearnerStats:
    steps: int = 0
    tokens: int = 0
    pushes: int = 0
    push_failures: int = 0
    bytes_pushed: int = 0  # wire bytes of the pushes that went out
    replays: int = 0  # pushes sent again, unchanged, when the syncer re-pulled their round
    nonfinite_deltas: int = 0  # pulls not answered: θ − anchor held NaN or Inf
    installs: int = 0
    round_trips: int = 0  # pushes whose round's BCAST was installed (committed with or without them)
    round_trip_steps: int = 0  # summed over those: steps trained from the push to that install
    rebases: int = 0  # overlap installs that dropped a merged push from θ (Mix1)
    moments_shared: int = 0  # installs that moved the optimizer's first moment to the fleet's (DESIGN §3.9)
    blocked_s: float = 0.0  # time steps waited for blocking fragments (Mix2)
    in_yeto_s: float = 0.0  # the training thread's time inside `step` and `sweep`, waits included
    lockstep_misses: int = 0  # lockstep waits that ran out of time: the schedule was no longer pinned
    init_answers: int = 0  # INIT requests answered (learner 0)
    final_installed: bool = False
    connected_generations: list[int] = field(default_factory=list)
    probe: ProbeResult | None = None
    consensus_js: float | None = None  # the syncer's latest JS distance between learners (DESIGN §8.2)
    fragment_l2: list[float | None] = field(default_factory=list)  # per fragment: mean |θ − anchor| merged
