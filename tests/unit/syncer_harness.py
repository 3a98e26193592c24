"""The syncer's coordinator with the test as every learner: in-memory connection groups, a tape in
memory and a clock that moves only when the test says so. Each event is handed to the
coordinator's `handle`, the one entry point of the actor (the protocol's turn and its effects
performed), so a test reads exactly what the syncer decided (the tape records carry the
reasons) without a socket, a thread or a sleep."""

from __future__ import annotations

from typing import Any

import torch

from syncer.core.events import Connected, Got, Joined, Left
from syncer.core.rounds import RoundState
from syncer.service.coordinator import Coordinator
from yeto_core.codecs import F32, tensor_bytes
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.net.tickets import SendTicket
from yeto_core.settings import SyncerSettings
from yeto_core.wire.messages import HELLO_OVERLAP, Bcast, Done, Final, Init, Manifest, Message, Pull, Push

SPECS = (TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32"))


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class MemoryGroup:
    """What a learner's connection group would have put on the wire, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[Message, Any]] = []
        self.closed = False
        self.close_reason: str | None = None
        self.silent_s = 0.0

    def send(self, msg: Message, payload: Any = None) -> SendTicket:
        ticket = SendTicket(0)  # "handed to the kernel" at once
        if self.closed:
            ticket.fail("closed")
        else:
            self.sent.append((msg, None if payload is None else bytes(payload)))
        return ticket

    def close(self, reason: str, last: Message | None = None) -> None:
        if not self.closed and last is not None:
            self.sent.append((last, None))
        self.closed, self.close_reason = True, reason

    def set_user_timeout(self, seconds: float) -> None:
        pass

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> bool:
        return True

    def of(self, kind: type[Any]) -> list[Any]:
        return [m for m, _ in self.sent if isinstance(m, kind)]


class RecordingTape:
    enabled = True
    held = 0

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass

    def of(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]


class SyncerUnderTest:
    def __init__(self, **settings: Any) -> None:
        config: dict[str, Any] = {"learners": 2, "fragments": 2, "grace_s": 0.0, "device": "cpu"}
        self.settings = SyncerSettings(**{**config, **settings})
        self.clock = FakeClock()
        self.tape = RecordingTape()
        self.co = Coordinator(self.settings, device=torch.device("cpu"), tape=self.tape,  # type: ignore[arg-type]
                              clock=self.clock)
        self.layout = build_layout(SPECS, self.settings.fragments, self.settings.pattern)
        self.groups: dict[int, MemoryGroup] = {}
        self.generations: dict[int, int] = {}

    # -- learners' side ----------------------------------------------------------------------
    def join(self, lid: int, *, overlap: bool = False, instance: bytes | None = None) -> MemoryGroup:
        """A new connection group of learner `lid`; `instance`: the process's HELLO.instance (by
        default one of its own per learner id, the same on every join, as a real learner's)."""
        instance = bytes([lid + 1]) * 16 if instance is None else instance
        generation = self.generations[lid] = self.generations.get(lid, 0) + 1
        group = self.groups[lid] = MemoryGroup()
        manifest = Manifest(self.layout.num_fragments, self.layout.pattern, SPECS) if lid == 0 else None
        self.co.handle(Connected(group, Joined(lid, generation, self.layout.fingerprint, F32.wire_id, manifest,
                                               HELLO_OVERLAP if overlap else 0, instance=instance, peer=f"test:{lid}")))
        return group

    def start(self, *learners: int, overlap: bool = False) -> None:
        """Join `learners` (0 first), and learner 0 uploads the initial values (zeros)."""
        for lid in sorted(learners):
            self.join(lid, overlap=overlap)
        for f in self.layout.fragments:
            self.got(0, Init(f.index, 0, 0, F32.wire_id), tensor_bytes(torch.zeros(f.numel)))

    def got(self, lid: int, msg: Message, payload: memoryview | bytes | None = None) -> None:
        view = None if payload is None else memoryview(bytearray(payload))
        self.co.handle(Got(lid, self.generations[lid], msg, view))

    def pulls(self, lid: int) -> list[Pull]:
        return self.groups[lid].of(Pull)

    def push(self, lid: int, pull: Pull, value: float, *, tokens: int = 100, steps: int = 4, step_s: float = 0.0,
             base_version: int | None = None) -> None:
        numel = self.layout.fragments[pull.fragment].numel
        delta = torch.full((numel,), value)
        base = pull.version if base_version is None else base_version
        msg = Push(pull.round, pull.attempt, pull.fragment, base, tokens, steps, int(step_s * 1e6), 0, numel * 4,
                   F32.wire_id)
        self.got(lid, msg, tensor_bytes(delta))

    def done(self, lid: int, step: int = 10) -> None:
        self.got(lid, Done(step))

    def leave(self, lid: int, reason: str = "test: link dropped") -> None:
        self.groups[lid].closed = True
        self.co.handle(Left(lid, self.generations[lid], reason))

    # -- time and what the syncer did -----------------------------------------------------------
    def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        self.co.handle(None)

    def round_state(self, round_id: int) -> RoundState:
        state = self.co.protocol.state
        assert state is not None
        return self.co.protocol.rounds.state_of(round_id, state.next_round)

    def bcasts(self, lid: int) -> list[Bcast]:
        return self.groups[lid].of(Bcast)

    def finals(self, lid: int) -> list[Final]:
        return self.groups[lid].of(Final)

    def params(self, fragment: int) -> torch.Tensor:
        state = self.co.protocol.state
        assert state is not None
        return state.params[fragment]
