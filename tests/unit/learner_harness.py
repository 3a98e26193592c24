"""A learner session with the test as its syncer: an in-memory `Link` and a clock that moves only
when the session waits, so every schedule is exact and every deadline passes in microseconds."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from yeto_core.layout import Layout
from yeto_core.learner import LearnerSession
from yeto_core.link import Connected, Inbound, InitWanted, LayoutFor, Lost, PushJob, Received
from yeto_core.moments import encode_moment
from yeto_core.probe import ProbeResult
from yeto_core.sections import Schedule
from yeto_core.settings import LearnerSettings
from yeto_core.wire.errors import Refused
from yeto_core.wire.messages import BCAST_FULL, BCAST_LAST, BCAST_MERGED, BCAST_MOMENT, Bcast, Final, Message, Pull


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class MemoryLink:
    """Events the test queues come out in order. A wait on an empty queue first lets the
    test's `on_wait` act (the syncer answering while the learner waits), then passes the
    whole timeout on the fake clock. Pushes are "sent" at once unless `send_pushes` is off. Its
    syncer announces `sync_interval` as H (0: it does not pace by steps, the learner keeps its own)."""

    def __init__(self, clock: FakeClock, *, fragments: int = 1, pattern: str = "binpack",
                 sync_interval: int = 0) -> None:
        self.clock = clock
        self.num_fragments, self.pattern, self.sync_interval = fragments, pattern, sync_interval
        self.events: deque[Inbound] = deque()
        self.jobs: list[PushJob] = []
        self.sent: list[Message] = []
        self.init_answers: list[list[torch.Tensor] | None] = []
        self.refused: Refused | None = None
        self.layout: Layout | None = None
        self.on_wait: Callable[[], None] | None = None
        self.send_pushes = True
        self.measured = ProbeResult(1000.0, 1000.0)
        self.closed: str | None = None
        self.generation = 0

    # -- the syncer's side, driven by the test -------------------------------------------------
    def connect(self) -> None:
        self.generation += 1
        self.events.append(Connected(self.generation, False))

    def lose(self) -> None:
        self.events.append(Lost("test: link dropped"))

    def ask_init(self, *, reseed: bool = False) -> None:
        self.events.append(InitWanted(reseed))

    def pull(self, round_id: int, fragment: int, version: int, attempt: int = 1) -> None:
        self.events.append(Received(Pull(round_id, attempt, fragment, version)))

    def bcast(self, fragment: int, version: int, round_id: int, values: torch.Tensor, *, merged: bool = False,
              last: bool = False, moment: torch.Tensor | None = None) -> None:
        flags = BCAST_FULL | (BCAST_MERGED if merged else 0) | (BCAST_LAST if last else 0)
        flags |= BCAST_MOMENT if moment is not None else 0
        wire = None
        if moment is not None:
            assert self.layout is not None, "a moment comes with a broadcast after the session started"
            wire = encode_moment(moment.contiguous())
        self.events.append(Received(Bcast(fragment, version, round_id, flags, 0, 0, 0), values.clone(), wire))

    def final(self, fragment: int, version: int, values: torch.Tensor, rounds: int = 1) -> None:
        self.events.append(Received(Final(fragment, version, self.num_fragments, rounds, 0, 0, 0), values.clone()))

    # -- the Link protocol -----------------------------------------------------------------------
    def start(self, layout_for: LayoutFor, step: Callable[[], int]) -> None:
        self.layout = layout_for(Schedule(self.num_fragments, self.pattern, self.sync_interval))  # the first CHALLENGE
        self.connect()

    def next_event(self, timeout_s: float) -> Inbound | None:
        if not self.events and timeout_s > 0:
            if self.on_wait is not None:
                self.on_wait()
            if not self.events:
                self.clock.advance(timeout_s)
                return None
        return self.events.popleft() if self.events else None

    def submit(self, job: PushJob) -> None:
        self.jobs.append(job)
        if self.send_pushes:
            job.nbytes = job.delta.numel() * 4
            job.done.set()

    def send(self, msg: Message) -> bool:
        self.sent.append(msg)
        return True

    def send_probe(self, msg: Message) -> bool:
        return self.send(msg)

    def provide_init(self, values: list[torch.Tensor] | None) -> None:
        self.init_answers.append(None if values is None else [v.clone() for v in values])

    def measure(self, nbytes: int) -> ProbeResult:
        return self.measured

    def close(self, reason: str) -> None:
        self.closed = reason


def hand_fed(tensors: list[tuple[str, torch.Tensor]], *, fragments: int = 1, **settings: Any,
             ) -> tuple[LearnerSession, MemoryLink, FakeClock, list[str]]:
    """A session over `tensors` whose syncer is the returned link; `said` collects its messages."""
    clock = FakeClock()
    link = MemoryLink(clock, fragments=fragments)
    said: list[str] = []
    defaults: dict[str, Any] = {"syncer": "127.0.0.1:9", "key": "k" * 32, "sync_interval": 2, "merge_alpha": 0.0}
    config = LearnerSettings(**{**defaults, **settings})
    return LearnerSession(config, tensors, link=link, clock=clock, say=said.append), link, clock, said
