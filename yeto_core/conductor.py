"""`Conductor`: rank 0 of a multi-process island leads, the other ranks follow, op by op.

Only an island's rank 0 talks to the syncer (it runs the ordinary `LearnerSession`). When that
session reads or writes a fragment, every rank must take part in the same collectives, in the
same order. So each call that may touch the tensors (`start`, `step`, `finish`) runs as

    rank 0:  fn()  — every read/write first broadcasts a header [op, a, b, c], then runs its
                     collective — and finally END with the call's `Outcome`
    others:  receive headers and run the matching collective, until END (or ERROR)

over a dedicated gloo group (host memory, whatever the training backend is). A failure on rank 0
is broadcast as ERROR with its message and raised on every rank as `IslandError`, instead of
leaving the others waiting in a collective: stores check their inputs before they announce an
op. While rank 0 waits on the network (the initial or the final cut) it sends NOP every
`heartbeat_s`, so the others' deadline (the group's timeout) measures silence, not the wait.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from yeto_core.sections import DEFAULT_ISLAND, IslandSettings

NOP, PLAN, END, ERROR, PROBE = 0, 1, 2, 3, 4
FIRST_STORE_OP = 8  # stores number their own ops from here
_RETIRED: list[Any] = []  # closed islands' gloo groups, kept open until the process exits (`Conductor.close`)


class IslandError(RuntimeError):
    """Rank 0 of the island failed; raised on every other rank with rank 0's message."""


@dataclass(frozen=True)
class Outcome:
    """What a collective call ends with on every rank: rank 0's answer to the call and its session's counters.
    It travels in END's header as [END, answer | final_installed << 1, pushes, installs]."""

    answer: bool = False
    final_installed: bool = False
    pushes: int = 0
    installs: int = 0

    def header(self) -> tuple[int, int, int]:
        return int(self.answer) | int(self.final_installed) << 1, self.pushes, self.installs

    @classmethod
    def from_header(cls, flags: int, pushes: int, installs: int) -> Outcome:
        return cls(bool(flags & 1), bool(flags & 2), pushes, installs)


class Conductor:
    def __init__(self, *, timeout_s: float = 300.0, heartbeat_s: float = 5.0) -> None:
        if not dist.is_initialized():
            raise RuntimeError("a multi-process island needs torch.distributed initialized on every rank")
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.heartbeat_s = heartbeat_s
        self.handlers: dict[int, Callable[[int, int, int], None]] = {}
        self._plans: dict[int, Any] = {}
        self._plan_ids: dict[Any, int] = {}
        self._last_op = time.monotonic()
        self._closed = False

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def run(self, fn: Callable[[], object] | None) -> Outcome:
        """Rank 0 runs `fn` (the others pass None and follow); every rank returns the `Outcome` that `fn`
        returned, or an empty one when it returned something else."""
        if not self.leads:
            return self._follow()
        assert fn is not None
        try:
            returned = fn()
            result = returned if isinstance(returned, Outcome) else Outcome()
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}".encode()[:65536]
            self.announce(ERROR, len(message))
            dist.broadcast(torch.frombuffer(bytearray(message), dtype=torch.uint8), 0, group=self.group)
            raise
        self.announce(END, *result.header())
        return result

    def announce(self, op: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        """Rank 0: tell the others which collective comes next."""
        dist.broadcast(torch.tensor([op, a, b, c], dtype=torch.int64), 0, group=self.group)
        self._last_op = time.monotonic()

    def island_probe(self, probe: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """The consensus probe for rank 0's session, run by every rank together: a sharded
        forward pass (FSDP2, ZeRO-3, tensor or pipeline parallel) needs every rank, so rank 0
        alone would hang in it. Every rank calls this (the others register the follower side);
        rank 0 uses the result."""

        def follow(_a: int, _b: int, _c: int) -> None:
            with torch.no_grad():
                probe()  # the same batch, the same collectives; only rank 0 reports the logits

        self.handlers[PROBE] = follow

        def lead() -> torch.Tensor:
            self.announce(PROBE)
            return probe()

        return lead

    def plan(self, key: Any, make: Callable[[], Any]) -> tuple[int, Any]:
        """Rank 0: a numbered plan (e.g. a fragment's tensors), sent to the others on first use."""
        plan_id = self._plan_ids.get(key)
        if plan_id is None:
            plan_id = self._plan_ids[key] = len(self._plans)
            self._plans[plan_id] = make()
            self.announce(PLAN, plan_id)
            dist.broadcast_object_list([self._plans[plan_id]], 0, group=self.group)
        return plan_id, self._plans[plan_id]

    def plan_of(self, plan_id: int) -> Any:
        return self._plans[plan_id]

    def tick(self) -> None:
        if self.leads and time.monotonic() - self._last_op > self.heartbeat_s:
            self.announce(NOP)

    def _follow(self) -> Outcome:
        header = torch.empty(4, dtype=torch.int64)
        while True:
            dist.broadcast(header, 0, group=self.group)
            op, a, b, c = (int(x) for x in header)
            if op == END:
                return Outcome.from_header(a, b, c)
            if op == ERROR:
                message = torch.empty(a, dtype=torch.uint8)
                dist.broadcast(message, 0, group=self.group)
                raise IslandError(f"rank 0 of the island failed: {bytes(message.numpy()).decode(errors='replace')}")
            if op == PLAN:
                box: list[Any] = [None]
                dist.broadcast_object_list(box, 0, group=self.group)
                self._plans[a] = box[0]
            elif op in self.handlers:
                self.handlers[op](a, b, c)
            elif op != NOP:
                raise IslandError(f"unknown op {op} from rank 0 of the island")

    def close(self) -> None:
        """Every rank calls it: a barrier, so no rank leaves while another still uses the group.

        The group itself is not shut down: a gloo shutdown resets its sockets (SO_LINGER 0), and a
        rank whose side is still open when the reset lands can abort in gloo's error path
        (pytorch/gloo#514: SIGABRT formatting the error of a connection the peer reset). The
        ranks leave the barrier at different moments, so one rank's shutdown could always find
        the other's side open. Kept until the process exits, the sockets close gracefully."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # a peer already gone: nothing left to wait for
            dist.barrier(group=self.group)
        _RETIRED.append(self.group)


class ConductedStore:
    """The collective half of a multi-rank store: a `Conductor` and the calls every rank makes
    (`yeto_core.island.CollectiveStore`). A store adds `specs`, `gather` and `install`."""

    def __init__(self, island: IslandSettings = DEFAULT_ISLAND) -> None:
        self.conductor = Conductor(timeout_s=island.collective_timeout_s, heartbeat_s=island.heartbeat_s)
        self.rank, self.world = self.conductor.rank, self.conductor.world

    def run(self, fn: Callable[[], object] | None) -> Outcome:
        """See `Conductor.run`: rank 0 runs `fn`, the others follow its reads and writes."""
        return self.conductor.run(fn)

    def island_probe(self, probe: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return self.conductor.island_probe(probe)

    def tick(self) -> None:
        self.conductor.tick()

    def close(self) -> None:
        self.conductor.close()
