"""A simulated syncer process: the real `Coordinator` (and in it the real `SyncerProtocol`, merge and
checkpoint writer) on the scheduler's thread, with simulated connection groups.

One `SyncerNode` is one process: a crash drops it with every connection (its checkpoint file
stays), and a restart is a new node resumed from that file, as `python -m syncer --resume` is.
The decode and prepare pools run their work inline and their results come back as events after a
seeded delay, as the real pools' would: after other events, in an order the seed picks.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

import torch

from syncer.core.events import Connected, Got, Joined, Left
from syncer.core.handshake import HandshakeRefused, check_hello
from syncer.core.links import Phase, sweep_problem
from syncer.durability.checkpoint import SyncerState, last_generations
from syncer.service.coordinator import Coordinator
from tests.sim.network import Connection, Latency, payload_bytes
from tests.sim.scheduler import Scheduler
from tests.unit.syncer_harness import RecordingTape
from yeto_core.settings import SyncerSettings
from yeto_core.wire.errors import Refused
from yeto_core.wire.messages import Hello, Manifest, Message
from yeto_core.wire.transport import SendTicket

if TYPE_CHECKING:
    from tests.sim.learner_node import SimLink


class InlineExecutor(Executor):
    """A pool that runs each task at once: its done callback posts the result event right away."""

    def __init__(self, workers: int = 1, name: str = "") -> None:
        pass

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


class SimGroup:
    """The syncer's side of one simulated connection group, as the coordinator uses it."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.silent_s = 0.0

    @property
    def closed(self) -> bool:
        return not self.conn.open or self.conn.closing

    def send(self, msg: Message, payload: Any = None) -> Any:
        ticket = SendTicket(1)
        if self.conn.carry("down", msg, payload_bytes(payload)):
            ticket.chunk_sent()  # copied into the kernel's buffer at once
        else:
            ticket.fail("closed")
        return ticket

    def close(self, reason: str, last: Message | None = None) -> None:
        self.conn.close_after("down", last, reason)

    def set_user_timeout(self, seconds: float) -> None:
        pass

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> bool:
        return True


def _received(payload: bytes | None) -> memoryview | None:
    """A payload as the reader threads hand it over: a buffer of its own."""
    return None if payload is None else memoryview(bytearray(payload))


class SyncerNode:
    def __init__(self, sim: Scheduler, latency: Latency, rng: random.Random, settings: SyncerSettings, *,
                 key: bytes, incarnation: int, state: SyncerState | None,
                 on_commit: Callable[[SyncerNode], None]) -> None:
        self.sim, self.latency, self.rng = sim, latency, rng
        self.settings = settings
        self.key = key
        self.incarnation = incarnation
        self.tape = RecordingTape()
        self.co = Coordinator(settings, device=torch.device("cpu"), tape=self.tape,  # type: ignore[arg-type]
                              state=state, clock=sim.clock, executor=InlineExecutor)
        self.generations: dict[int, int] = last_generations(state.ledger) if state is not None else {}
        self.conns: list[Connection] = []
        self.alive = True
        self.listening = True
        self.processes: dict[int, int] = {}  # generation's (learner, generation) -> process, as a flat key
        self._on_commit = on_commit
        # Whom the syncer waited for when it began to finalize (DESIGN §4.7): a learner away then
        # that had not pushed yet is not waited for, and misses the cut if it is back too late.
        self.finalizing_waits_for: set[int] | None = None
        self._held: int | None = state.next_round if state is not None else None  # the round last reported
        self._tick_token = 0
        self._schedule_tick()

    @property
    def done(self) -> bool:
        return self.co.protocol.phase is Phase.DONE

    # -- the handshake -----------------------------------------------------------------------------
    def accept(self, hello: Hello, nonce: bytes, link: SimLink) -> tuple[Connection, bool]:
        """Admit `link`'s HELLO (raising `Refused` as the real server answers ERROR) and open its group."""
        s = self.settings
        try:
            check_hello(hello, key=self.key, nonce=nonce, who=f"learner {hello.learner_id} (sim)",
                        pinned=self.co.pinned_fingerprint(), id_conflict=self.co.id_conflict,
                        schedule_problem=lambda flags: sweep_problem(flags, fragments=s.fragments, pipeline=s.pipeline,
                                                                     sync_interval_steps=s.sync_interval_steps))
        except HandshakeRefused as exc:
            raise Refused(exc.code, exc.reason) from exc
        lid = hello.learner_id
        generation = self.generations[lid] = self.generations.get(lid, 0) + 1
        self.processes[lid << 32 | generation] = link.process
        conn = Connection(self.sim, self.latency, learner_id=lid, generation=generation)
        conn.to_syncer = lambda msg, payload: self.post(Got(lid, generation, msg, _received(payload)))
        conn.on_syncer_left = lambda reason: self.post(Left(lid, generation, reason))
        self.conns.append(conn)
        ready = self.co.initial_cut_ready()
        manifest = None
        if lid == 0 and link.layout is not None:
            layout = link.layout
            manifest = Manifest(layout.num_fragments, layout.pattern, layout.specs)
        self.post(Connected(SimGroup(conn), Joined(lid, generation, hello.fingerprint, hello.wire_dtype, manifest,
                                                   hello.flags, hello.push_block, hello.instance,
                                                   f"sim:{link.process}")))
        return conn, ready

    # -- the coordinator's turns -----------------------------------------------------------------
    def post(self, event: Any) -> None:
        """One turn of the coordinator for `event`; what its pools post comes back later."""
        if not self.alive or self.done:
            return
        self.co.handle(event)
        while not self.co.events.empty():
            later = self.co.events.get_nowait()
            self.sim.after(self.rng.uniform(0.0, 0.02), functools.partial(self.post, later))
        state = self.co.protocol.state
        if self.co.initial_cut_ready() and state is not None and state.next_round != self._held:  # a cut, or a commit
            self._held = state.next_round
            self._on_commit(self)
        if self.finalizing_waits_for is None and self.co.protocol.phase in (Phase.FINALIZING, Phase.DONE):
            self.finalizing_waits_for = set(self.co.protocol.shared.lives.waited_for())
        if self.done:
            self._exit()
        else:
            self._schedule_tick()

    def _schedule_tick(self) -> None:
        self._tick_token += 1
        token = self._tick_token
        self.sim.after(self.co.protocol.wakeup(self.sim.now), lambda: self._tick(token))

    def _tick(self, token: int) -> None:
        if token == self._tick_token and self.alive and not self.done:
            self.post(None)

    def _exit(self) -> None:
        """The run is over: every group gets BYE after what is queued, as `Coordinator.run` ends."""
        self.listening = False
        for conn in self.conns:
            conn.close_after("down", None, "syncer stopped")

    def crash(self) -> None:
        """The process dies: nothing more is handled, every connection is reset."""
        self.alive = False
        self.listening = False
        for conn in self.conns:
            conn.cut("syncer crashed", quick=True)

    @property
    def state(self) -> SyncerState | None:
        return self.co.protocol.state
