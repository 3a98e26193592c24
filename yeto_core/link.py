"""The learner session's only door to the network: the `Link` protocol and what crosses it.

`LearnerSession` holds no socket, thread or wall clock of its own. It takes a link (the real one
is `yeto_core.client.SyncerClient`; unit tests use an in-memory one) and a clock, hands the link
pushes and control messages, and takes in the link's events one by one between steps. So every
decision of the session is a function of the events it was given and the time it was told.

Events (what the link delivers, in order):

* `Connected` / `Lost`: a connection group to the syncer came up / went down.
* `Received`: a syncer message, with BCAST and FINAL payloads decoded to float32.
* `InitWanted`: learner 0 must upload the initial values (a syncer without model state). The
  training thread answers with `Link.provide_init` at its next tick, because reading the
  weights can be a collective operation across the island's ranks; the link waits for it.
* `PushEnded`: a push handed to `submit` went out or failed (its `done` is set), so a session
  that waits for its last push wakes on an event like any other.

The session reads no clock of its own: `MONOTONIC` is the one a production session is given.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from yeto_core.layout import Layout
from yeto_core.probe import ProbeResult
from yeto_core.sections import Schedule
from yeto_core.wire.errors import Refused
from yeto_core.wire.messages import Message, Pull

Clock = Callable[[], float]  # seconds, monotonic
MONOTONIC: Clock = time.monotonic
LayoutFor = Callable[[Schedule], Layout]  # the schedule the syncer announced → the layout to fingerprint


@dataclasses.dataclass(frozen=True)
class Connected:
    generation: int
    initial_cut_ready: bool


@dataclasses.dataclass(frozen=True)
class Lost:
    reason: str


@dataclasses.dataclass(frozen=True)
class Received:
    """A syncer message, with its payload decoded to float32 for BCAST and FINAL."""

    msg: Message
    values: torch.Tensor | None = None
    moment: memoryview | None = None  # a BCAST's merged first moment, wire form (DESIGN §3.9)


@dataclasses.dataclass(frozen=True)
class InitWanted:
    """The syncer has no model state; `reseed` when it had a cut before (it lost its state)."""

    reseed: bool


@dataclasses.dataclass(frozen=True)
class PushEnded:
    """The push last submitted went out, or failed: its `done` is set."""


Inbound = Connected | Lost | Received | InitWanted | PushEnded


@dataclasses.dataclass
class PushJob:
    """One push handed to the link's sender; `done` is set when it went out or failed."""

    pull: Pull
    base_version: int
    tokens: int
    steps: int
    step_s: float | None
    delta: torch.Tensor
    moment: memoryview | None = None  # the optimizer's first moment at the push, wire form, sent after the delta
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: str | None = None
    nbytes: int = 0  # wire bytes, once sent


class Link(Protocol):
    """What a learner session needs from its connection to the syncer. No method blocks longer
    than the timeout it is given; none raises a network error (the link redials on its own)."""

    @property
    def refused(self) -> Refused | None:
        """The permanent refusal that ended this link, if any (it redials no more)."""

    def start(self, layout_for: LayoutFor, step: Callable[[], int]) -> None:
        """Begin dialing. `layout_for` is asked on every CHALLENGE (it may refuse the syncer's
        schedule with a permanent `Refused`), `step` feeds heartbeats."""

    def next_event(self, timeout_s: float) -> Inbound | None:
        """The next event, waiting at most `timeout_s` (0: do not wait); None when there is none."""

    def submit(self, job: PushJob) -> None:
        """Queue a push; never blocks. The link sets `job.done` (and `job.error` on failure)."""

    def send(self, msg: Message) -> bool:
        """Queue a control message; False when there is no live connection."""

    def send_probe(self, msg: Message) -> bool:
        """A PROBE_REPORT, sent only to a syncer that speaks the consensus messages."""

    def provide_init(self, values: list[torch.Tensor] | None) -> None:
        """Answer an `InitWanted`: every fragment's initial values, or None for no INIT."""

    def measure(self, nbytes: int) -> ProbeResult:
        """Measure the link's rate with `nbytes` up and down (raises OSError or WireError)."""

    def close(self, reason: str) -> None:
        """Say goodbye (after what is queued) and stop."""
