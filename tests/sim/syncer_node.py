"""A simulated syncer process: the real `Coordinator` (and in it the real `SyncerProtocol`, merge and
checkpoint writer) on the scheduler's thread, with simulated connection groups.

One `SyncerNode` is one process: a crash drops it with every connection (its checkpoint file
stays), and a restart is a new node resumed from that file, as `python -m syncer --resume` is.

Each dial is greeted as `syncer/service/server.py` greets one: the real `SyncerHandshake` reads the
learner's bytes and writes its own (CHALLENGE, WELCOME or ERROR), its HELLO is judged by the real
`Admission` (the server's rule, over this coordinator's live view), and the real `PendingGroups`
numbers the group and builds what the coordinator learns of it (`Joined`, `Got`, `Left`). Data
streams are implicit: one data lane each way stands for all of them, so the syncer attaches a
group's data streams itself once its control stream is admitted, and no ATTACH is exchanged
(only a key-holder gets a token, no fault targets one data stream, and an ATTACH can be refused
for nothing else, so its round trips would change no outcome).
The decode and prepare pools run their work inline and their results come back as events after a
seeded delay, as the real pools' would: after other events, in an order the seed picks.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

import torch

from syncer.core.events import Connected
from syncer.core.links import Phase, sweep_problem
from syncer.durability.checkpoint import SyncerState, last_generations
from syncer.service.admission import Admission
from syncer.service.coordinator import Coordinator
from syncer.service.pending import PendingGroup, PendingGroups
from tests.sim.network import Connection, Latency, payload_bytes
from tests.sim.scheduler import Scheduler
from tests.unit.syncer_harness import RecordingTape
from yeto_core.net.tickets import SendTicket
from yeto_core.settings import SyncerSettings
from yeto_core.wire.connection import Admitted, Refusal, SyncerHandshake
from yeto_core.wire.messages import NONCE_BYTES, TOKEN_BYTES, Hello, Message

if TYPE_CHECKING:
    from tests.sim.learner_node import SimLink

log = logging.getLogger("yeto.sim.syncer")


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


class CommitTape(RecordingTape):
    """The tape, telling `on_commit` of each commit record as it is written: a turn may commit more
    than one round (a prepared merge lands right behind the last), and a checkpoint taken at the
    first of them is one the syncer held."""

    def __init__(self, on_commit: Callable[[], None]) -> None:
        super().__init__()
        self._on_commit = on_commit

    def append(self, record: dict[str, Any]) -> None:
        super().append(record)
        if record.get("event") == "commit":
            self._on_commit()


class SyncerNode:
    def __init__(self, sim: Scheduler, latency: Latency, rng: random.Random, settings: SyncerSettings, *,
                 key: bytes, incarnation: int, state: SyncerState | None,
                 on_commit: Callable[[SyncerNode], None]) -> None:
        self.sim, self.latency, self.rng = sim, latency, rng
        self.settings = settings
        self.key = key
        self.incarnation = incarnation
        self.tape = CommitTape(lambda: self._on_commit(self))
        self.co = Coordinator(settings, device=torch.device("cpu"), tape=self.tape,  # type: ignore[arg-type]
                              state=state, clock=sim.clock, executor=InlineExecutor)
        s = settings
        self.admission = Admission(key, pinned_fingerprint=self.co.pinned_fingerprint,
                                   schedule_problem=functools.partial(sweep_problem, fragments=s.fragments,
                                                                      pipeline=s.pipeline,
                                                                      sync_interval_steps=s.sync_interval_steps),
                                   id_conflict=self.co.id_conflict)
        self.pending: PendingGroups[Connection] = PendingGroups(
            s.handshake_timeout_s, last_generations(state.ledger) if state is not None else None,
            new_token=lambda: self.rng.randbytes(TOKEN_BYTES))
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
    def accept(self, link: SimLink) -> Connection:
        """A new connection from `link`, greeted with the CHALLENGE: as `SyncerServer._handshake`,
        the machine decides, this moves its bytes and acts on its verdict."""
        conn = Connection(self.sim, self.latency)
        self.conns.append(conn)
        peer = f"sim:{link.process}"
        opened: list[PendingGroup[Connection]] = []  # the group this connection's WELCOME opened, if any

        def welcome(hello: Hello) -> tuple[int, bytes, bool]:
            group = self.pending.open(hello, conn, self.sim.now)
            opened.append(group)
            return group.generation, group.token, self.co.initial_cut_ready()

        deadline_at = self.sim.now + self.settings.handshake_timeout_s
        hs = SyncerHandshake(self.key, self.settings.schedule, welcome=welcome,
                             check=lambda hello, nonce: self.admission.check(hello, nonce, peer),
                             pending=self.pending.pending_learner, deadline=deadline_at,
                             nonce=lambda: self.rng.randbytes(NONCE_BYTES))

        def abandon(reason: str = "") -> None:
            if opened:  # unless its control stream was admitted, no stream may attach to its group
                self.pending.abandon(opened[0])

        def receive(data: bytes) -> None:
            if not self.alive or self.done:
                return
            events = hs.receive_data(data)  # a malformed or out-of-turn frame is a bug here: the seed fails
            if out := hs.data_to_send():
                conn.send_bytes("down", out)
            for event in events:
                if isinstance(event, Admitted):
                    self._admitted(conn, opened[0], event, link.process)
                elif isinstance(event, Refusal):
                    log.warning("refused %s: %s", peer, event.reason)
                    abandon()
                    conn.close_after("down", None, f"refused: {event.reason}")  # after the ERROR
                else:
                    raise AssertionError(f"a dial ended its handshake with {event}")

        def deadline() -> None:
            if hs.timed_out(self.sim.now):  # the gate cuts a handshake that passed its deadline
                conn.cut("handshake passed its deadline", quick=True)

        conn.bytes_to_syncer = receive
        conn.on_syncer_left = abandon
        conn.send_bytes("down", hs.data_to_send())  # the CHALLENGE
        self.sim.at(deadline_at, deadline)
        return conn

    def _admitted(self, conn: Connection, group: PendingGroup[Connection], event: Admitted, process: int) -> None:
        """The control stream joined: its (implicit) data streams attach, and the group goes to the coordinator."""
        group.admitted(event.manifest, event.payload_bound)
        self.processes[group.learner_id << 32 | group.generation] = process
        whole = None
        for index in range(len(group.data)):
            whole = self.pending.attach(group.token, index, conn)
        assert whole is group
        wiring = group.wiring(self.post, screened=False, max_payload=self.co.max_payload)
        on_message = wiring["on_message"]
        conn.on_syncer_left = wiring["on_close"]
        self.post(Connected(SimGroup(conn), group.joined(f"sim:{process}")))
        conn.deliver("up", lambda msg, payload: on_message(msg, _received(payload)))

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
