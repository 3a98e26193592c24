"""A simulated learner process: the real `LearnerSession` over a `SimLink`, on an actor's thread.

`SimLink` is the `Link` the session would get from `yeto_core.client.SyncerClient`, with the
socket work replaced by the simulated network: it dials the live syncer (the real HELLO, checked
by the syncer's real `check_hello`), redials with jittered backoff after a loss, streams pushes one
at a time at the link's byte rate, uploads learner 0's INIT when asked, and hands the session
what arrives, decoded, waking its actor. Everything runs on the scheduler's thread except the
calls the session makes from its own (`next_event`, `submit`, `send`, `provide_init`, `close`).
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
from yeto_core.downlink import AnchorMismatch, BroadcastReader
from yeto_core.layout import Layout
from yeto_core.learner import LearnerSession
from yeto_core.link import Connected, Inbound, InitWanted, LayoutFor, Lost, PushEnded, PushJob, Received
from yeto_core.probe import ProbeResult
from yeto_core.settings import LearnerSettings
from yeto_core.wire import auth
from yeto_core.wire.connection import hello_for
from yeto_core.wire.errors import Refused
from yeto_core.wire.messages import INSTANCE_BYTES, Bcast, Bye, Consensus, Error, Final, Init, Message, Push

if TYPE_CHECKING:
    from tests.sim.syncer_node import SyncerNode

REDIAL_FIRST_S = 0.2


class SimLink:
    def __init__(self, sim: Scheduler, latency: Latency, rng: random.Random, settings: LearnerSettings,
                 codec: Codec, syncer: Callable[[], SyncerNode | None], process: int) -> None:
        self.sim, self.latency, self.rng = sim, latency, rng
        self.settings = settings
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
        self.conn: Connection | None = None
        self.closed = False
        self.reached = False  # it dialed a syncer that was listening
        self.duplicate_next_push = False  # a fault: the next push goes out twice
        self.initial_cut_received = False
        self.syncer_consensus = False
        self._layout_for: LayoutFor | None = None
        self._init_asked_on: Connection | None = None
        self._reader: BroadcastReader | None = None
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
        if self.conn is not None:
            self.conn.close_after("up", Bye(reason), reason)

    # -- dialing (the scheduler's thread) ---------------------------------------------------------
    def _dial(self) -> None:
        if self.closed or self.refused is not None or (self.actor is not None and self.actor.finished):
            return
        node = self._syncer()
        if node is None or not node.listening:
            self._redial_later()
            return
        assert self._layout_for is not None
        self.reached = True
        try:
            layout = self._layout_for(node.settings.fragments, node.settings.pattern)
            self.layout = layout
            hello = hello_for(self.link, layout, self.codec, sends_init=self.link.learner_id == 0,
                              instance=self.instance, challenge_nonce=(nonce := auth.new_nonce()),
                              client_nonce=auth.new_nonce())
            conn, initial_cut_ready = node.accept(hello, nonce, self)
        except Refused as exc:
            if exc.code.permanent:
                self.refused = exc
                self.inbox.append(Lost(f"refused: {exc.reason}"))
                self._poke()
            else:
                self._redial_later()
            return
        self._backoff = REDIAL_FIRST_S
        self.conn = conn
        self.generations.append((node.incarnation, conn.generation))
        conn.to_learner = self._receive
        conn.on_learner_lost = lambda reason: self._lost(conn, reason)
        self.inbox.append(Connected(conn.generation, initial_cut_ready))
        if self.link.learner_id == 0 and not initial_cut_ready:
            self._init_asked_on = conn
            self.inbox.append(InitWanted(self.initial_cut_received))
        self._poke()

    def _redial_later(self) -> None:
        delay = self._backoff * self.rng.uniform(0.5, 1.0)
        self._backoff = min(self._backoff * 2, self.link.reconnect_max_s)
        self.sim.after(delay, self._dial)

    def _lost(self, conn: Connection, reason: str) -> None:
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
        values = None
        if isinstance(msg, Bcast | Final):
            if self._reader is None:  # kept across connections, as the client keeps it
                assert self.layout is not None
                self._reader = BroadcastReader(self.layout, bcast_delta=self.link.bcast_delta)
            try:
                values = self._reader.values(msg, None if payload is None else memoryview(bytearray(payload)))
            except AnchorMismatch:  # the client redials for a full resend
                if self.conn is not None:
                    self.conn.cut("downlink anchor mismatch", quick=True)
                return
            self.initial_cut_received = True
        elif isinstance(msg, Error) and msg.code.permanent:
            self.refused = self.refused or Refused(msg.code, msg.reason)
        elif isinstance(msg, Consensus):
            self.syncer_consensus = True
        self.inbox.append(Received(msg, values))
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
    reached: bool = False  # it dialed a listening syncer at least once
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
