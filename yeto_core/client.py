"""The learner's link to the syncer: dial, authenticate, redial, and a background sender.

`SyncerClient` owns one thread that keeps a connection group alive (exponential backoff between
dials, up to `reconnect_max_s`) and one sender thread that encodes and streams pushes, so the
training thread never touches a socket. Everything the syncer sends lands, decoded, in
`inbox`; the learner session drains it between steps. No network error ever propagates to the
caller: the client records it, logs it, and redials. Only a permanent refusal (wrong key,
layout, contract, or an id another live process holds) stops redialing, and its reason is
printed once; the session decides what the island does then.
"""

from __future__ import annotations

import logging
import queue
import random
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch

from yeto_core.codecs import BF16, F32, Bf16Parts, Codec, tensor_bytes
from yeto_core.downlink import AnchorMismatch, BroadcastReader
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.layout import Layout
from yeto_core.link import Connected, Inbound, InitWanted, LayoutFor, Lost, PushEnded, PushJob, Received
from yeto_core.probe import ProbeResult, measure_link
from yeto_core.sections import LinkSettings
from yeto_core.wire.buffers import receive_buffer
from yeto_core.wire.connection import Event, Handshake, LearnerHandshake, Refusal, Welcomed
from yeto_core.wire.errors import ConnectionClosed, ProtocolError, Refused
from yeto_core.wire.messages import (
    INSTANCE_BYTES,
    Bcast,
    Bye,
    Consensus,
    Done,
    Error,
    Final,
    Init,
    Message,
    Pull,
    Push,
)
from yeto_core.wire.transport import ConnectionGroup, SendTicket, Stream, tune_socket

log = logging.getLogger("yeto.client")

MAX_DOWNLINK_MARGIN = 1 << 20


class SyncerClient:
    def __init__(self, link: LinkSettings, *, codec: Codec = F32, sends_init: bool = False,
                 faults: FaultInjector = NO_FAULTS) -> None:
        """`sends_init`: this is learner 0, which describes the model and uploads the initial
        values to a syncer that has none."""
        self.link = link
        self.address = link.address
        self.learner_id = link.learner_id
        self.bcast_delta = link.bcast_delta
        # Who this process is, the same on every redial: the syncer tells a redial of the id's
        # holder from a second process started with the same id.
        self.instance = secrets.token_bytes(INSTANCE_BYTES)
        self.codec = codec
        self._layout_for: LayoutFor | None = None
        self.codec = codec
        self._reader: BroadcastReader | None = None
        self._sends_init = sends_init
        self._faults = faults
        self._init_answers: queue.SimpleQueue[list[torch.Tensor] | None] = queue.SimpleQueue()
        self._step: Callable[[], int] = lambda: 0
        self.inbox: queue.SimpleQueue[Inbound] = queue.SimpleQueue()
        self.layout: Layout | None = None
        self.refused: Refused | None = None
        self.initial_cut_received = threading.Event()
        self._group: ConnectionGroup | None = None
        self._group_lock = threading.Lock()
        self._stop = threading.Event()
        self._jobs: queue.SimpleQueue[PushJob | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"yeto-learner{link.learner_id}-link", daemon=True),
            threading.Thread(target=self._sender, name=f"yeto-learner{link.learner_id}-push", daemon=True),
        ]
        self._encode_buffers: dict[int, memoryview] = {}
        self.pushes_sent = 0
        # The syncer of the current group sent CONSENSUS, so it speaks PROBE_REPORT too (an older
        # syncer would close the group on a frame type it does not know).
        self.syncer_consensus = False
        self.bytes_pushed = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, layout_for: LayoutFor, step: Callable[[], int]) -> None:
        self._layout_for, self._step = layout_for, step
        for t in self._threads:
            t.start()

    def next_event(self, timeout_s: float) -> Inbound | None:
        try:
            return self.inbox.get(block=timeout_s > 0, timeout=timeout_s if timeout_s > 0 else None)
        except queue.Empty:
            return None

    def provide_init(self, values: list[torch.Tensor] | None) -> None:
        self._init_answers.put(values)

    def measure(self, nbytes: int) -> ProbeResult:
        return measure_link(self.address, self.link.key, up_bytes=nbytes, down_bytes=nbytes)

    @property
    def connected(self) -> bool:
        group = self._group
        return group is not None and not group.closed

    def close(self, reason: str = "learner closing", *, bye: bool = True) -> None:
        self._stop.set()
        self._jobs.put(None)
        with self._group_lock:
            group = self._group
        if group is not None and not group.closed:
            group.close(reason, last=Bye(reason) if bye else None)  # BYE after whatever is queued
        for t in self._threads:
            if t.ident is not None:  # a client closed before `start` has no threads running
                t.join(timeout=5.0)
        if group is not None:
            group.join(timeout=5.0)

    def send(self, msg: Message) -> bool:
        """Send a control message if connected; False when there is no live link."""
        with self._group_lock:
            group = self._group
        if group is None or group.closed:
            return False
        group.send(msg)
        return not group.closed

    def send_probe(self, msg: Message) -> bool:
        """A PROBE_REPORT, only to a syncer that showed it speaks the consensus messages."""
        return self.syncer_consensus and self.send(msg)

    def send_done(self, step: int) -> bool:
        return self.send(Done(step))

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def submit(self, job: PushJob) -> None:
        """Queue a push for the background sender (never blocks)."""
        self._jobs.put(job)

    # -- the link thread -------------------------------------------------------------------
    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                group = self._dial()
            except Refused as exc:
                if exc.code.permanent:
                    self._refused_for_good(exc)
                    self.inbox.put(Lost(f"refused: {exc.reason}"))
                    return
                log.warning("learner %d: syncer refused the connection (%s); retrying", self.learner_id, exc)
            except (OSError, ConnectionClosed, ProtocolError) as exc:
                log.info("learner %d: cannot reach syncer %s:%d (%s)", self.learner_id, *self.address, exc)
            else:
                backoff = 0.2
                while not group.wait_closed(1.0) and not self._stop.is_set():
                    pass  # wakes when the link dies or on close()
                if self._stop.is_set():
                    return
                group.join(timeout=5.0)
                if self.refused is not None:  # the syncer refused this group for good (an ERROR on it)
                    self.inbox.put(Lost(f"refused: {self.refused.reason}"))
                    return
                self.inbox.put(Lost(group.close_reason or "link closed"))
                log.warning("learner %d: link to syncer lost (%s); redialing", self.learner_id, group.close_reason)
            # Full jitter: islands that lost the syncer together do not all redial in the same instant.
            self._stop.wait(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self.link.reconnect_max_s)

    def _refused_for_good(self, exc: Refused) -> None:
        if self.refused is None:
            self.refused = exc
            print(f"yeto learner {self.learner_id}: refused by syncer: {exc.reason}", file=sys.stderr)
            log.error("learner %d refused by syncer: %s", self.learner_id, exc.reason)

    def _dial(self) -> ConnectionGroup:
        """Connect and authenticate a group: `LearnerHandshake` decides, this only moves its bytes."""
        assert self._layout_for is not None, "SyncerClient.start() gives the layout"
        deadline = time.monotonic() + self.link.connect_timeout_s  # of the whole dial, every stream
        hs = LearnerHandshake(self.link, self.codec, sends_init=self._sends_init, instance=self.instance,
                              layout_for=self._layout_for, deadline=deadline)
        streams: list[Stream] = []
        try:
            streams.append(self._connect("ctl", deadline, bulk=False))
            welcome = self._settle(streams[0], hs)
            for i in range(self.link.data_streams):
                streams.append(self._connect(f"data{i}", deadline, bulk=True))
                self._settle(streams[-1], hs.attach(i))
        except BaseException:
            for s in streams:
                s.close()
            raise
        assert isinstance(welcome, Welcomed) and hs.layout is not None
        layout = self.layout = hs.layout
        max_payload = max(f.numel for f in layout.fragments) * 4 + MAX_DOWNLINK_MARGIN
        self.syncer_consensus = False
        group = ConnectionGroup(
            streams[0], streams[1:], name=f"learner{self.learner_id}", on_message=self._on_message,
            on_close=lambda reason: None, max_payload=lambda: max_payload, heartbeat_s=self.link.heartbeat_s,
            peer_timeout_s=self.link.peer_timeout_s, heartbeat_step=self._step,
            stall_timeout_s=self.link.stall_timeout_s, schedule=self.link.stream_schedule, faults=self._faults,
        )
        if self.initial_cut_received.is_set():
            group.set_user_timeout(self.link.stall_timeout_s)
        with self._group_lock:
            self._group = group
        group.start()
        log.info("learner %d connected to syncer %s:%d (generation %d)", self.learner_id, *self.address,
                 welcome.generation)
        self.inbox.put(Connected(welcome.generation, welcome.initial_cut_ready))
        if self._sends_init and not welcome.initial_cut_ready:
            self._send_init(group, layout)
        return group

    def _connect(self, tag: str, deadline: float, *, bulk: bool) -> Stream:
        sock = socket.create_connection(self.address, timeout=max(0.001, deadline - time.monotonic()))
        tune_socket(sock, bulk=bulk)
        return Stream(sock, f"learner{self.learner_id}/{tag}")

    @staticmethod
    def _settle(stream: Stream, hs: Handshake) -> Event:
        """Run one stream's handshake; a refusal (an ERROR, or a WELCOME that does not verify) raises."""
        last = stream.handshake(hs)[-1]
        if isinstance(last, Refusal):
            raise Refused(last.code, last.reason)
        return last

    def _send_init(self, group: ConnectionGroup, layout: Layout) -> None:
        """Learner 0 uploads the manifest and every fragment's initial values (replayed on each
        new connection group until the initial cut arrives; the syncer ignores repeats)."""
        values = self._ask_init()
        if values is None:
            return
        from tqdm import tqdm  # local import: only learner 0 ever shows this bar

        total = sum(v.numel() * 4 for v in values)
        with tqdm(total=total, unit="B", unit_scale=True, desc="yeto INIT upload", disable=None,
                  leave=False) as bar:
            for frag, vals in zip(layout.fragments, values, strict=True):
                payload = tensor_bytes(vals)
                ticket = group.send(Init(frag.index, 0, 0, F32.wire_id), payload)
                while not ticket.done.wait(0.5):
                    if self._stop.is_set():
                        return
                if not ticket.ok:
                    log.warning("learner 0: INIT upload interrupted (%s)", ticket.error)
                    return
                bar.update(len(payload))
                if frag.index + 1 < len(values):
                    self._faults.point("mid-init")
        log.info("learner 0: INIT of %d fragments (%.1f MB) uploaded", len(values), total / 1e6)

    def _ask_init(self) -> list[torch.Tensor] | None:
        """Ask the training thread for the INIT values (`InitWanted`) and wait for its answer."""
        while True:  # an answer left over from a connection that died meanwhile is stale
            try:
                self._init_answers.get_nowait()
            except queue.Empty:
                break
        reseed = self.initial_cut_received.is_set()
        if reseed:
            log.warning("learner 0: the syncer has no model state; seeding it from this learner's current weights")
        self.inbox.put(InitWanted(reseed))
        while not self._stop.is_set():
            try:
                return self._init_answers.get(timeout=0.2)
            except queue.Empty:
                continue
        return None

    def _on_message(self, msg: Message, payload: memoryview | None) -> None:
        values = None
        if isinstance(msg, Bcast | Final):
            if self._reader is None:  # kept across connections: so is the downlink anchor
                assert self.layout is not None
                self._reader = BroadcastReader(self.layout, bcast_delta=self.bcast_delta)
            try:  # the reassembled buffer is ours alone: a full send is viewed as float32 without a copy
                values = self._reader.values(msg, payload)
            except AnchorMismatch as exc:  # never train on a silently wrong model: resync by redialing
                log.warning("learner %d: %s; reconnecting for a full resend", self.learner_id, exc)
                raise ConnectionClosed(f"downlink anchor mismatch: {exc}") from exc
            if not self.initial_cut_received.is_set():
                self.initial_cut_received.set()
                with self._group_lock:
                    if self._group is not None:
                        self._group.set_user_timeout(self.link.stall_timeout_s)
        elif isinstance(msg, Error) and msg.code.permanent:  # e.g. a second process won its id after all
            self._refused_for_good(Refused(msg.code, msg.reason))
        elif isinstance(msg, Error):
            print(f"yeto learner {self.learner_id}: syncer reports {msg.code.name.lower()}: {msg.reason}",
                  file=sys.stderr)
            log.warning("learner %d: syncer reports %s: %s", self.learner_id, msg.code.name, msg.reason)
        elif isinstance(msg, Consensus):
            self.syncer_consensus = True
        elif not isinstance(msg, Pull | Bye):
            raise ProtocolError(f"unexpected {type(msg).__name__} from the syncer")
        self.inbox.put(Received(msg, values))

    # -- the sender thread -----------------------------------------------------------------
    def _sender(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._send_push(job)
            except Exception as exc:  # never let a push failure escape into training
                job.error = f"push failed: {exc}"
                log.exception("learner %d: push failed", self.learner_id)
            finally:
                job.done.set()
                self.inbox.put(PushEnded())

    def _push_buffer(self, nbytes: int) -> memoryview:
        """One reusable encode buffer per size: a single push is in flight at a time."""
        buf = self._encode_buffers.get(nbytes)
        if buf is None:
            buf = self._encode_buffers[nbytes] = receive_buffer(nbytes)
        return buf

    def _send_push(self, job: PushJob) -> None:
        self._faults.point("before-push")
        with self._group_lock:
            group = self._group
        if group is None or group.closed:
            job.error = "no link to the syncer"
            return
        nbytes = self.codec.encoded_nbytes(job.delta.numel())
        payload: memoryview | Bf16Parts
        if self.codec is F32:
            payload = tensor_bytes(job.delta)  # f32 deltas are their own wire bytes: no copy
        elif self.codec is BF16:
            payload = Bf16Parts(job.delta)  # rounded chunk by chunk by the streams' sender threads
        else:
            payload = self._push_buffer(nbytes)
            self.codec.encode(job.delta, payload)
        step_us = 0 if job.step_s is None else min(int(job.step_s * 1e6), 2**32 - 1)
        msg = Push(job.pull.round, job.pull.attempt, job.pull.fragment, job.base_version, job.tokens, job.steps,
                   step_us, 0, 0, self.codec.wire_id)
        ticket: SendTicket = group.send(msg, payload)
        while not ticket.done.wait(0.5):
            if self._stop.is_set():
                job.error = "client closing"
                return
        if not ticket.ok:
            job.error = ticket.error
            return
        job.nbytes = nbytes
        self.pushes_sent += 1
        self.bytes_pushed += nbytes
