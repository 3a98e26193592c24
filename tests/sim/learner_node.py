"""A simulated learner process: the real `LearnerSession` over a `SimLink`, on an actor's thread.

`SimLink` is the `Link` the session would get from `yeto_core.client.SyncerClient`, with the
socket work replaced by the simulated network: it dials the live syncer and runs the real
`LearnerHandshake` against the syncer's real `SyncerHandshake`, the bytes each writes carried on
the connection's control lane (CHALLENGE, HELLO, WELCOME or ERROR, learner 0's MANIFEST), with
nonces from the seeded random source so a seed replays exactly; it redials with jittered backoff
after a loss or a refusal that is not for good, streams pushes one at a time at the link's byte
rate, uploads learner 0's INIT when asked, and hands the session what arrives, decoded, waking
its actor. Data streams are implicit (one data lane stands for them all, see `syncer_node`): no
`LearnerAttach` runs. Everything runs on the scheduler's thread except the calls the session
makes from its own (`next_event`, `submit`, `send`, `provide_init`, `close`).
"""

from __future__ import annotations

import dataclasses
import random
import secrets
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tests.sim.network import Connection, Latency
from tests.sim.scheduler import Actor, Scheduler
from yeto_core.codecs import F32, Codec, tensor_bytes
from yeto_core.downlink import AnchorMismatch, Downlink
from yeto_core.layout import Layout
from yeto_core.learner import LearnerSession
from yeto_core.link import Connected, Inbound, InitWanted, LayoutFor, Lost, PushEnded, PushJob, Received
from yeto_core.probe import ProbeResult
from yeto_core.settings import LearnerSettings
from yeto_core.wire.connection import LearnerHandshake, Refusal, Welcomed
from yeto_core.wire.errors import Refused
from yeto_core.wire.messages import INSTANCE_BYTES, NONCE_BYTES, Bye, Init, Message, Push

if TYPE_CHECKING:
    from tests.sim.syncer_node import SyncerNode

REDIAL_FIRST_S = 0.2


class SimLink:
    def __init__(self, sim: Scheduler, latency: Latency, rng: random.Random, settings: LearnerSettings,
                 codec: Codec, syncer: Callable[[], SyncerNode | None], process: int) -> None:
        self.sim, self.latency, self.rng = sim, latency, rng
        self.settings = settings
        self.me = settings.endpoint()
        self.link = settings.link
        self.codec = codec
        self._syncer = syncer
        self.process = process  # which simulated process this is (a restart is a new one)
        self.instance = secrets.token_bytes(INSTANCE_BYTES) if process < 0 else process.to_bytes(INSTANCE_BYTES,
                                                                                                  "little")
        self.actor: Actor | None = None
        self.inbox: deque[Inbound] = deque()
        self.refused: Refused | None = None
        self.layout: Layout | None = None
        self.conn: Connection | None = None  # the connection group, once WELCOMEd
        self.dialing: Connection | None = None  # a connection in its handshake
        self.closed = False
        self.reached = False  # a syncer answered its HELLO (WELCOME or ERROR)
        self.duplicate_next_push = False  # a fault: the next push goes out twice
        self.initial_cut_received = False
        self.syncer_consensus = False
        self._layout_for: LayoutFor | None = None
        self._init_asked_on: Connection | None = None
        self._downlink = Downlink(delta_codec=self.link.delta_codec)
        self._backoff = REDIAL_FIRST_S
        self._sender_free_at = 0.0
        self.generations: list[tuple[int, int]] = []  # (syncer incarnation, generation) of every group

    # -- the Link protocol (the session's thread) --------------------------------------------------
    def start(self, layout_for: LayoutFor, step: Callable[[], int]) -> None:
        self._layout_for = layout_for
        self.sim.after(self.latency.one_way(), self._dial)

    def next_event(self, timeout_s: float) -> Inbound | None:
        if not self.inbox and timeout_s > 0:
            assert self.actor is not None
            self.actor.wait(timeout_s)
        return self.inbox.popleft() if self.inbox else None

    def submit(self, job: PushJob) -> None:
        """The sender streams pushes one after another; the job is done when its last byte left."""
        conn = self.conn
        nbytes = self.codec.encoded_nbytes(job.delta.numel())
        if conn is None or not conn.open:
            job.error = "no link to the syncer"
            job.done.set()
            return
        encoded = bytearray(nbytes)  # encoded now: the delta buffer is the session's
        self.codec.encode(job.delta, memoryview(encoded))
        payload = bytes(encoded)
        step_us = 0 if job.step_s is None else min(int(job.step_s * 1e6), 2**32 - 1)
        msg = Push(job.pull.round, job.pull.attempt, job.pull.fragment, job.base_version, job.tokens, job.steps,
                   step_us, 0, 0, self.codec.wire_id)
        start = max(self.sim.now, self._sender_free_at)
        self._sender_free_at = start + nbytes / self.latency.bytes_per_s

        def sent() -> None:
            if conn is self.conn and conn.carry("up", msg, payload):
                job.nbytes = nbytes
                if self.duplicate_next_push:
                    self.duplicate_next_push = False
                    conn.carry("up", msg, payload)
            else:
                job.error = "link lost while pushing"
            job.done.set()
            self.inbox.append(PushEnded())
            self._poke()

        self.sim.at(self._sender_free_at, sent)

    def send(self, msg: Message) -> bool:
        conn = self.conn
        return conn is not None and conn.carry("up", msg, None)

    def send_probe(self, msg: Message) -> bool:
        return self.syncer_consensus and self.send(msg)

    def provide_init(self, values: list[torch.Tensor] | None) -> None:
        conn, self._init_asked_on = self._init_asked_on, None
        if values is None or conn is None or conn is not self.conn:
            return  # asked on a connection that died meanwhile: the next one asks again
        for index, part in enumerate(values):
            conn.carry("up", Init(index, 0, 0, F32.wire_id), bytes(tensor_bytes(part)))

    def measure(self, nbytes: int) -> ProbeResult:
        return ProbeResult(self.latency.bytes_per_s * 8e-6, self.latency.bytes_per_s * 8e-6)

    def close(self, reason: str) -> None:
        self.closed = True
        if self.dialing is not None:
            self.dialing.cut(reason, quick=True)
            self.dialing = None
        if self.conn is not None:
            self.conn.close_after("up", Bye(reason), reason)

    def cut(self, reason: str, *, quick: bool, detect_s: float = 0.0) -> None:
        """Cut this process's connection, the live one or one in its handshake (a fault)."""
        for conn in (self.conn, self.dialing):
            if conn is not None:
                conn.cut(reason, quick=quick, detect_s=detect_s)

    # -- dialing (the scheduler's thread) ---------------------------------------------------------
    def _dial(self) -> None:
        if self._gone():
            return
        node = self._syncer()
        if node is None or not node.listening:
            self._redial_later()
            return
        assert self._layout_for is not None
        deadline = self.sim.now + self.link.connect_timeout_s  # of the whole dial
        hs = LearnerHandshake(self.me, self.link, self.codec, sends_init=self.me.learner_id == 0,
                              instance=self.instance, layout_for=self._layout_for, deadline=deadline,
                              nonce=lambda: self.rng.randbytes(NONCE_BYTES))
        conn = self.dialing = node.accept(self)
        conn.bytes_to_learner = lambda data: self._handshake(conn, hs, node, data)
        conn.on_learner_lost = lambda reason: self._lost(conn, reason)
        self.sim.at(deadline, lambda: self._dial_late(conn, hs))

    def _gone(self) -> bool:
        """Closed, refused for good, or its process ended: it dials no more."""
        return self.closed or self.refused is not None or (self.actor is not None and self.actor.finished)

    def _handshake(self, conn: Connection, hs: LearnerHandshake, node: SyncerNode, data: bytes) -> None:
        """The syncer's handshake bytes: the machine reads them, and what it writes goes back up."""
        if conn is not self.dialing:
            return
        if self._gone():
            self._dial_failed(conn, None)
            return
        try:
            events = hs.receive_data(data)  # a malformed or out-of-turn frame is a bug here: the seed fails
        except Refused as exc:  # this learner's own verdict on the schedule the CHALLENGE announced
            self._dial_failed(conn, exc)
            return
        if out := hs.data_to_send():  # HELLO, or learner 0's MANIFEST after WELCOME
            conn.send_bytes("up", out)
        for event in events:
            if isinstance(event, Refusal):  # the syncer's ERROR, or a WELCOME that does not verify
                self.reached = True
                self._dial_failed(conn, Refused(event.code, event.reason))
            elif isinstance(event, Welcomed):
                self.reached = True
                assert hs.layout is not None
                self._connected(conn, node, event, hs.layout)

    def _connected(self, conn: Connection, node: SyncerNode, welcome: Welcomed, layout: Layout) -> None:
        self.dialing = None
        self._backoff = REDIAL_FIRST_S
        self.layout = layout
        self.conn = conn
        self.generations.append((node.incarnation, welcome.generation))
        self.inbox.append(Connected(welcome.generation, welcome.initial_cut_ready))
        if self.me.learner_id == 0 and not welcome.initial_cut_ready:
            self._init_asked_on = conn
            self.inbox.append(InitWanted(self.initial_cut_received))
        conn.deliver("down", self._receive)
        self._poke()

    def _dial_failed(self, conn: Connection, refused: Refused | None) -> None:
        """The dial ended without a group: its connection is closed; a refusal for good stops
        dialing (the session hears it as `Lost`), anything else is retried after a backoff."""
        self.dialing = None
        conn.cut(f"refused: {refused.reason}" if refused is not None else "dial given up", quick=True)
        if refused is not None and refused.code.permanent:
            self.refused = exc = refused
            self.inbox.append(Lost(f"refused: {exc.reason}"))
            self._poke()
        elif not self._gone():
            self._redial_later()

    def _dial_late(self, conn: Connection, hs: LearnerHandshake) -> None:
        if conn is self.dialing and hs.timed_out(self.sim.now):
            self._dial_failed(conn, None)

    def _redial_later(self) -> None:
        delay = self._backoff * self.rng.uniform(0.5, 1.0)
        self._backoff = min(self._backoff * 2, self.link.reconnect_max_s)
        self.sim.after(delay, self._dial)

    def _lost(self, conn: Connection, reason: str) -> None:
        if conn is self.dialing:  # lost in its handshake: the dial failed
            self._dial_failed(conn, None)
            return
        if conn is not self.conn:
            return
        self.conn = None
        if self.actor is not None and self.actor.finished:
            return
        self.inbox.append(Lost(reason))
        self._poke()
        if not self.closed and self.refused is None:
            self._redial_later()

    def _receive(self, msg: Message, payload: bytes | None) -> None:
        try:
            routed = self._downlink.route(msg, None if payload is None else memoryview(bytearray(payload)),
                                          self.layout)
        except AnchorMismatch:  # the client redials for a full resend
            if self.conn is not None:
                self.conn.cut("downlink anchor mismatch", quick=True)
            return
        self.initial_cut_received |= routed.values is not None
        self.refused = self.refused or routed.refusal
        self.syncer_consensus |= routed.consensus
        self.inbox.append(Received(msg, routed.values, routed.moment))
        self._poke()

    def _poke(self) -> None:
        if self.actor is not None:
            self.actor.poke()


@dataclasses.dataclass
class Trained:
    """What one learner process did: its tokens and steps, and how it ended."""

    process: int
    learner_id: int
    tokens: int = 0
    steps: int = 0
    final_installed: bool = False
    refused: str | None = None
    reached: bool = False  # a syncer answered its HELLO at least once
    crashed: bool = False
    ended: bool = False
    finals: list[torch.Tensor] | None = None  # its fragments' values at the end, once the final cut is in


def train(actor: Actor, session: LearnerSession, link: SimLink, out: Trained, weights: list[torch.Tensor], *,
          steps: int, step_s: float,
          tokens_per_step: int, rng: random.Random, freeze: tuple[int, float] | None) -> None:
    """The training loop of a simulated trainer: a step of compute, a change of the weights, the
    session's `step`; at its step limit `finish`, then `close`."""
    link.actor = actor
    noise = torch.Generator().manual_seed(rng.getrandbits(31))
    target = [torch.randn(t.shape, generator=noise) for t in weights]
    try:
        session.start()
        final = False
        for n in range(steps):
            actor.sleep(step_s * rng.uniform(0.8, 1.25))
            if freeze is not None and n == freeze[0]:
                actor.sleep(freeze[1])  # frozen: no steps, nothing read, its link stays up
            with torch.no_grad():  # a step towards this island's own optimum, with noise
                for t, goal in zip(weights, target, strict=True):
                    t.add_(0.05 * (goal - t) + 0.01 * torch.randn(t.shape, generator=noise))
            out.tokens += tokens_per_step
            out.steps += 1
            if session.step(tokens_per_step):
                final = True
                break
        if not final:
            final = session.finish()
        out.final_installed = final
        if final and session.layout is not None:
            out.finals = [session.sync.gather(i).clone() for i in range(session.layout.num_fragments)]
        session.close()
    except Exception as exc:
        refusal = getattr(exc, "refusal", None)
        if refusal is None:
            raise
        out.refused = str(exc)
    finally:
        out.reached = link.reached
        out.ended = True
