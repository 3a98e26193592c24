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
import sys
import threading
import time
from collections.abc import Callable

import torch

from yeto_core.codecs import F32, Codec
from yeto_core.downlink import AnchorMismatch, Downlink
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.layout import Layout
from yeto_core.link import Connected, Inbound, LayoutFor, Lost, PushJob, Received
from yeto_core.moments import max_bulk_bytes
from yeto_core.net.dial import dial
from yeto_core.net.group import ConnectionGroup
from yeto_core.probe import ProbeResult, measure_link
from yeto_core.sections import Endpoint, LinkSettings
from yeto_core.uplink import InitRequest, PushSender, upload_init
from yeto_core.wire.connection import LearnerHandshake
from yeto_core.wire.errors import ConnectionClosed, ProtocolError, Refused
from yeto_core.wire.messages import (
    INSTANCE_BYTES,
    Bye,
    Done,
    Message,
)

log = logging.getLogger("yeto.client")

MAX_DOWNLINK_MARGIN = 1 << 20


class SyncerClient:
    def __init__(self, me: Endpoint, link: LinkSettings, *, codec: Codec = F32, sends_init: bool = False,
                 faults: FaultInjector = NO_FAULTS) -> None:
        """`me`: who this learner is, where its syncer is and the key; `sends_init`: this is learner
        0, which describes the model and uploads the initial values to a syncer that has none."""
        self.me = me
        self.link = link
        self.address = me.address
        self.learner_id = me.learner_id
        # Who this process is, the same on every redial: the syncer tells a redial of the id's
        # holder from a second process started with the same id.
        self.instance = secrets.token_bytes(INSTANCE_BYTES)
        self.codec = codec
        self._layout_for: LayoutFor | None = None
        self.downlink = Downlink(delta_codec=link.delta_codec)
        self._sends_init = sends_init
        self._faults = faults
        self._init = InitRequest()
        self._step: Callable[[], int] = lambda: 0
        self.inbox: queue.SimpleQueue[Inbound] = queue.SimpleQueue()
        self.layout: Layout | None = None
        self.refused: Refused | None = None
        self.initial_cut_received = threading.Event()
        self._group: ConnectionGroup | None = None
        self._group_lock = threading.Lock()
        self._stop = threading.Event()
        self._pusher = PushSender(codec, group=self._live_group, post=self.inbox.put, stop=self._stop, faults=faults,
                                  learner_id=me.learner_id)
        self._threads = [
            threading.Thread(target=self._run, name=f"yeto-learner{me.learner_id}-link", daemon=True),
            threading.Thread(target=self._pusher.run, name=f"yeto-learner{me.learner_id}-push", daemon=True),
        ]
        # The syncer of the current group sent CONSENSUS, so it speaks PROBE_REPORT too (an older
        # syncer would close the group on a frame type it does not know).
        self.syncer_consensus = False

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
        self._init.answer(values)

    def measure(self, nbytes: int) -> ProbeResult:
        return measure_link(self.address, self.me.key, up_bytes=nbytes, down_bytes=nbytes)

    @property
    def connected(self) -> bool:
        group = self._group
        return group is not None and not group.closed

    def close(self, reason: str = "learner closing", *, bye: bool = True) -> None:
        self._stop.set()
        self._pusher.close()
        with self._group_lock:
            group = self._group
        if group is not None and not group.closed:
            group.close(reason, last=Bye(reason) if bye else None)  # BYE after whatever is queued
        for t in self._threads:
            if t.ident is not None:  # a client closed before `start` has no threads running
                t.join(timeout=5.0)
        if group is not None:
            group.join(timeout=5.0)

    def _live_group(self) -> ConnectionGroup | None:
        with self._group_lock:
            group = self._group
        return None if group is None or group.closed else group

    def send(self, msg: Message) -> bool:
        """Send a control message if connected; False when there is no live link."""
        group = self._live_group()
        if group is None:
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
        self._pusher.submit(job)

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
        assert self._layout_for is not None, "SyncerClient.start() gives the layout"
        deadline = time.monotonic() + self.link.connect_timeout_s  # of the whole dial, every stream
        hs = LearnerHandshake(self.me, self.link, self.codec, sends_init=self._sends_init, instance=self.instance,
                              layout_for=self._layout_for, deadline=deadline)
        welcome, control, data = dial(self.address, hs, data_streams=self.link.data_streams, deadline=deadline,
                                      name=f"learner{self.learner_id}")
        assert hs.layout is not None
        layout = self.layout = hs.layout
        max_payload = max_bulk_bytes(layout) + MAX_DOWNLINK_MARGIN
        self.syncer_consensus = False
        group = ConnectionGroup(
            control, data, name=f"learner{self.learner_id}", on_message=self._on_message,
            on_close=lambda reason: None, max_payload=lambda: max_payload, heartbeat_s=self.link.heartbeat_s,
            peer_timeout_s=self.link.peer_timeout_s, heartbeat_step=self._step,
            stall_timeout_s=self.link.stall_timeout_s, schedule=self.link.stream_schedule, faults=self._faults,
        )
        if self.initial_cut_received.is_set():
            group.set_user_timeout(self.link.stall_timeout_s)
        with self._group_lock:
            self._group = group
        # Connected goes into the inbox before the group's first message can: a PULL read ahead of it
        # would be taken for one of the old connection's, and an older attempt, and ignored.
        self.inbox.put(Connected(welcome.generation, welcome.initial_cut_ready))
        group.start()
        log.info("learner %d connected to syncer %s:%d (generation %d)", self.learner_id, *self.address,
                 welcome.generation)
        if self._sends_init and not welcome.initial_cut_ready and (
                values := self._init.ask(self.inbox.put, reseed=self.initial_cut_received.is_set(),
                                         stop=self._stop)) is not None:
            upload_init(group, layout, values, stop=self._stop, faults=self._faults)
        return group

    def _on_message(self, msg: Message, payload: memoryview | None) -> None:
        try:  # the reassembled buffer is ours alone: a full send is viewed as float32 without a copy
            routed = self.downlink.route(msg, payload, self.layout)
        except AnchorMismatch as exc:  # never train on a silently wrong model: resync by redialing
            log.warning("learner %d: %s; reconnecting for a full resend", self.learner_id, exc)
            raise ConnectionClosed(f"downlink anchor mismatch: {exc}") from exc
        if routed.values is not None and not self.initial_cut_received.is_set():
            self.initial_cut_received.set()
            if (group := self._live_group()) is not None:
                group.set_user_timeout(self.link.stall_timeout_s)
        if routed.refusal is not None:  # e.g. a second process won its id after all
            self._refused_for_good(routed.refusal)
        if (e := routed.notice) is not None:
            print(f"yeto learner {self.learner_id}: syncer reports {e.code.name.lower()}: {e.reason}", file=sys.stderr)
            log.warning("learner %d: syncer reports %s: %s", self.learner_id, e.code.name, e.reason)
        self.syncer_consensus |= routed.consensus
        self.inbox.put(Received(msg, routed.values, routed.moment))
