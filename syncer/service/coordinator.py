"""The coordinator: the thin shell around the syncer's protocol (DESIGN §4.1).

Server threads and the decode pool post events into one queue. The coordinator's thread takes
them one at a time, hands each to `SyncerProtocol.handle` with the time, and performs the
effects it returns, in order (`effects.py`):

* sends are queued on the learner's connection group, whose own sender threads write them: this
  thread never waits on a peer. A send of committed values reads them without a copy and holds
  a lease on them until it is done (`leases.py`);
* closes, stall timeouts, tape records, log lines and fault points act at once;
* checkpoints are written durably or the syncer stops (`checkpointing.py`);
* fresh quantized pushes are checked on the decode pool (their norms taken; a CPU merge holds
  them in their wire encoding until merged, `held.py`), and come back as `Decoded` events;
* the protocol's asks (`effects.is_ask`: an INIT fragment to check, an f32 or carried push to
  decode, a downlink broadcast to encode) are computed here, at once, and the answer goes back
  to the protocol before any other event (`answer`); a send of a downlink anchor copies it;
* merges run here, on the merge device (`round_merge.RoundMerger`), and their outcome goes back
  to the protocol as `Merged` before any other event, followed by `Synced` with the time the
  commit held this thread (up to its last send, which may come after an ask's answer).

It also answers the server's questions about the run (from the server's threads), and at the
end closes every connection and joins its threads.

A signal (`request_stop`) is obeyed within a second wherever this thread waits: the stop request
(`stopping.py`) ends checkpoint retries and writes, iso drains and merges, and the joins at exit;
each raises `Stopped`, and the run stops as the signal asked, its last checkpoint as it was.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import torch

from syncer.core.effects import (
    CheckInit,
    Checkpoint,
    Close,
    Decode,
    Effect,
    Encode,
    ExpectInit,
    FaultPoint,
    Log,
    Merge,
    Peer,
    Prepare,
    Record,
    Send,
    StallTimeout,
    is_ask,
)
from syncer.core.events import (
    Connected,
    Decoded,
    Encoded,
    Event,
    Got,
    InitChecked,
    Joined,
    Left,
    Merged,
    Prepared,
    Stop,
    Synced,
)
from syncer.core.leases import Leases
from syncer.core.links import Phase, id_conflict
from syncer.core.payload import decode_push, init_values
from syncer.core.protocol import SyncerProtocol
from syncer.durability.checkpoint import CheckpointError, SyncerState, downlink_kind
from syncer.durability.checkpointing import DURABILITY_EXIT_CODE, Checkpointing, DurabilityLost
from syncer.durability.stopping import POLL_S, Stopped, StopRequest
from syncer.durability.tape import EventTape
from syncer.merge.held import HeldDelta, holds
from syncer.merge.iso_pool import ISO_EXIT_CODE, IsoPool, IsoPoolError
from syncer.merge.round_merge import PreparedMerge, RoundMerger
from syncer.service.moments import MomentRelay, merged_moment
from syncer.service.traffic import BroadcastTimer, ShellObserver, wire_size
from yeto_core.buffers import RECEIVE_POOL, BufferPool
from yeto_core.codecs import tensor_bytes
from yeto_core.downlink import encode_broadcast
from yeto_core.faults import FAULT_SEND_WAIT_S, NO_FAULTS, FaultInjector
from yeto_core.layout import Layout
from yeto_core.moments import max_bulk_bytes
from yeto_core.net.group import ConnectionGroup
from yeto_core.net.tickets import Payload, SendTicket, payload_nbytes
from yeto_core.settings import SyncerSettings
from yeto_core.wire.messages import Bcast, Bye, Push

log = logging.getLogger("yeto.syncer")

SNAPSHOT_POOL = BufferPool()  # host copies of fragments for cuda sends, recycled once unused
JOIN_TIMEOUT_S = 5.0  # for every connection group's last messages and threads together, at exit
STOP_GRACE_S = 0.5  # the same after a signal; then the sockets of groups still sending are cut
CUT_JOIN_S = 1.0  # for the threads of groups whose sockets were cut


def decoded(effect: Decode, layout: Layout, device: torch.device) -> Decoded:
    """A push decoded (`effects.Decode`): its f32 delta on `device` (an f32 one a view of its payload
    on the CPU), or why it is unusable; a decoder that raises is a refusal, not a dead coordinator."""
    moment = None
    try:
        parts = decode_push(layout, effect.msg, effect.payload, effect.codec, effect.screened,
                            hold=holds(effect.codec, device))
        if isinstance(parts, str):
            delta: torch.Tensor | HeldDelta | str = parts
        else:  # the moment stays in its wire form until merged, and so does a held delta
            delta = parts[0] if isinstance(parts[0], HeldDelta) else parts[0].to(device)
            moment = parts[1]
    except Exception as exc:
        delta = f"decode failed: {exc}"
    return Decoded(effect.learner_id, effect.generation, effect.attempt, effect.msg, delta, inline=effect.inline,
                   carried=effect.carried, moment=moment)


def answer(ask: CheckInit | Decode | Encode, layout: Layout, device: torch.device) -> Event:
    """The answer to one of the protocol's asks (`effects.is_ask`), computed here and now."""
    if isinstance(ask, CheckInit):
        values = init_values(ask.payload, ask.screened, device)
        return InitChecked(ask.to.learner_id, ask.to.generation, ask.fragment, values)
    if isinstance(ask, Encode):
        anchor, broadcast = encode_broadcast(None if ask.full else ask.lent, ask.values, ask.codec)
        return Encoded(ask.fragment, ask.version, ask.codec.wire_id, anchor, broadcast)
    return decoded(ask, layout, device)


class Coordinator:
    def __init__(
        self,
        settings: SyncerSettings,
        *,
        device: torch.device,
        tape: EventTape,
        state: SyncerState | None = None,
        clock: Callable[[], float] = time.monotonic,
        faults: FaultInjector = NO_FAULTS,
        observer: ShellObserver | None = None,
        iso: IsoPool | None = None,
        executor: Callable[[int, str], Executor] = ThreadPoolExecutor,
    ) -> None:
        # `faults` is built once from the settings by the caller (`cli.main`); `observer` (the
        # metrics) hears of the bytes on the wire and the broadcasts' durations; `iso` (the caller
        # starts and closes it) runs the SVDs of `--merge iso` in worker processes. `executor(workers,
        # name)` makes the decode and prepare pools (the simulation's runs their work inline).
        self.settings = settings
        self.observer = observer
        self.clock = clock
        self.tape = tape
        self.faults = faults
        self.device = device
        self.protocol = SyncerProtocol(settings, device=device, state=state, now=clock())
        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.groups: dict[Peer, ConnectionGroup] = {}  # every connection the protocol may address
        self._closed_groups: list[ConnectionGroup] = []  # gone from the protocol; joined before exit
        self.leases = Leases()  # readers of committed tensors on other threads
        self.stopping = StopRequest()  # set by a signal: every wait of this thread gives up (`Stopped`)
        self.checkpoints = Checkpointing(settings.checkpoint, background=settings.background_checkpoint,
                                         retry_s=settings.checkpoint_retry_s, leases=self.leases, tape=tape,
                                         faults=faults, stop=self.stopping)
        self.merger = RoundMerger(settings.merging, iso=iso)
        self.iso = iso
        if iso is not None:
            iso.abandon_on(self.stopping)
        self._decoders = executor(settings.decode_threads, "syncer-decode")
        # The heavy halves of merges run ahead here (`effects.Prepare`): one thread per round in flight.
        self._preparers = executor(settings.pipeline, "syncer-prepare")
        self._prepared: dict[int, tuple[int, Future[PreparedMerge]]] = {}  # attempt -> (round, its heavy half)
        self._merge_started = 0.0
        self.moments = MomentRelay()  # the learners' first moments, averaged and broadcast back (DESIGN §3.9)
        self._committing: int | None = None  # the round whose commit's effects are being performed
        self._init_reserved = False  # receive memory readied for learner 0's INIT, not yet settled

    # -- read by server threads (immutable references, safe to read without a lock) -----------
    def pinned_fingerprint(self) -> bytes | None:
        layout = self.protocol.layout
        return layout.fingerprint if layout is not None else None

    def id_conflict(self, learner_id: int, instance: bytes) -> str | None:
        """Why a HELLO from process `instance` may not take `learner_id`, or None (any thread)."""
        holder = self.protocol.links.get(learner_id)
        group = self.groups.get(holder.peer) if holder is not None else None
        return id_conflict(holder, instance, holder_closed=group is None or group.closed,
                           holder_silent_s=group.silent_s if group is not None else 0.0)

    def max_payload(self) -> int:
        layout = self.protocol.layout
        return max_bulk_bytes(layout) if layout is not None else 0

    def initial_cut_ready(self) -> bool:
        return self.protocol.phase in (Phase.RUNNING, Phase.FINALIZING)

    def post(self, event: Any) -> None:
        self.events.put(event)

    def request_stop(self) -> None:
        """Stop without finalizing (a signal): committed state is already on disk. Safe in a signal
        handler: it takes no lock (`StopRequest`, `SimpleQueue.put`)."""
        self.stopping.set()
        self.post(Stop(reason="signal"))

    @property
    def exit_code(self) -> int:
        return self.protocol.exit_code

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        while self.protocol.phase is not Phase.DONE:
            try:
                event = self.events.get(timeout=self.protocol.wakeup(self.clock()))
            except queue.Empty:
                event = None
            self.handle(event)
        stopping = self.stopping.is_set()  # a signal: what has not started yet never will
        self._decoders.shutdown(wait=True, cancel_futures=stopping)
        # Each ends within the pool's deadlines (or on its poison, or within a moment of a stop).
        self._preparers.shutdown(wait=True, cancel_futures=stopping)
        self._prepared.clear()
        if self.checkpoints.writer is not None:  # never exit in the middle of a background write
            try:
                self.checkpoints.writer.wait()
            except CheckpointError as exc:
                log.error("%s", exc)
            except Stopped as exc:  # its temporary file is gone; the previous checkpoint stands
                log.warning("%s", exc)
        self._close_groups(list(self.groups.values()) + self._closed_groups)
        return self.protocol.exit_code

    def _close_groups(self, groups: list[ConnectionGroup]) -> None:
        """Close every group, what is queued going out first, and join its threads: within
        JOIN_TIMEOUT_S in all, or STOP_GRACE_S once a stop is requested. The sockets of groups
        still sending then are cut, so their threads end at once."""
        for group in groups:
            group.close("syncer stopped", last=Bye("syncer stopped"))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        stop_seen = False
        left = groups
        while True:
            left = [g for g in left if not g.join(0.0)]
            if not left or time.monotonic() >= deadline:
                break
            if not stop_seen and self.stopping.is_set():
                stop_seen = True
                deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
            time.sleep(POLL_S)
        if not left:
            return
        log.warning("cutting %d connection(s) that did not finish sending in time", len(left))
        for group in left:
            group.close("syncer stopped")  # without a last message: its streams are closed now
        cut_deadline = time.monotonic() + CUT_JOIN_S
        for group in left:
            group.join(max(0.0, cut_deadline - time.monotonic()))

    def handle(self, event: Any | None) -> None:
        """One turn of the actor: `event` (None: only time passed) through the protocol, its effects
        performed, and whatever they bring back (a merge's outcome) before any other event."""
        pending: collections.deque[Event | Connected | None] = collections.deque([event])
        while pending:
            ev = pending.popleft()
            if isinstance(ev, Connected):
                ev = self._connected(ev)
            elif isinstance(ev, Prepared) and (failure := self._prepare_failure(ev.attempt)) is not None:
                if isinstance(failure, Stopped):  # a signal ended its wait on the pool
                    ev = Stop(reason="signal")
                elif isinstance(failure, IsoPoolError):
                    log.critical("%s", failure)  # nothing of the fragment was written: the last checkpoint stands
                    print(f"yeto syncer: {failure}", file=sys.stderr, flush=True)
                    ev = Stop(ISO_EXIT_CODE, "the iso worker pool failed")
                else:
                    raise RuntimeError(f"the merge of round {ev.round} failed") from failure
            elif isinstance(ev, Left):
                self._retire(self.groups.pop(Peer(ev.learner_id, ev.generation), None))
            elif isinstance(ev, Got):
                if isinstance(ev.msg, Push):
                    self.moments.heard(ev.learner_id, ev.msg)
                if self.observer is not None:
                    codec, nbytes = wire_size(ev.msg, len(ev.payload) if ev.payload is not None else None)
                    self.observer.traffic("in", ev.learner_id, codec, nbytes)
            effects = self.protocol.handle(self.clock(), ev)
            if self._init_reserved and self.protocol.phase is not Phase.WAIT_INIT:
                RECEIVE_POOL.settle()  # the initial cut is in: what the INIT did not use goes
                self._init_reserved = False
            if isinstance(ev, Merged):
                self._committing = ev.round
            try:
                pending.extend(self._perform(effects))
            except DurabilityLost as exc:
                log.critical("%s", exc)
                print(f"yeto syncer: {exc}", file=sys.stderr, flush=True)
                self._committing = None  # nothing of the commit after this is performed
                pending = collections.deque([Stop(DURABILITY_EXIT_CODE, "no durable checkpoint")])
            except IsoPoolError as exc:  # the merge wrote nothing of the fragment: the last checkpoint stands
                log.critical("%s", exc)
                print(f"yeto syncer: {exc}", file=sys.stderr, flush=True)
                self._committing = None  # nothing of the commit after this is performed
                pending = collections.deque([Stop(ISO_EXIT_CODE, "the iso worker pool failed")])
            except Stopped as exc:  # a signal ended a wait: nothing of this turn after it is performed
                log.warning("%s", exc)
                self._committing = None  # nothing of the commit after this is performed
                pending = collections.deque([Stop(reason="signal")])

    def _connected(self, ev: Connected) -> Joined:
        """A new connection group: kept for the protocol's sends; its id checked against the holder's."""
        joined = ev.joined
        conflict = self.id_conflict(joined.learner_id, joined.instance)
        self.groups[Peer(joined.learner_id, joined.generation)] = ev.group
        return dataclasses.replace(joined, conflict=conflict)

    def _retire(self, group: ConnectionGroup | None) -> None:
        """Keep a closed group until its threads have ended (they are joined before exit)."""
        self._closed_groups = [g for g in self._closed_groups if not g.join(0.0)]
        if group is not None:
            self._closed_groups.append(group)

    # -- performing effects --------------------------------------------------------------------
    def _perform(self, effects: list[Effect]) -> list[Event]:
        """Perform `effects` in order; returns the events they bring back. While a commit's effects
        are performed (`_committing`), a `Synced` follows them: after the last, unless that is an
        ask, whose answer's turn goes on with the commit."""
        back: list[Event] = []
        tickets: list[SendTicket] = []  # the sends handed over so far
        broadcasts: list[SendTicket] = []  # those of the commit's new version (not a join's full state)
        commit = self._committing is not None
        committed: dict[int, memoryview] = {}  # fragments' committed bytes, read once per turn
        held_ms: float | None = None  # how long the last checkpoint held this thread
        for effect in effects:
            if isinstance(effect, Send):
                ticket = self._send(effect, committed)
                if ticket is not None:
                    tickets.append(ticket)
                    if commit and isinstance(effect.msg, Bcast):
                        broadcasts.append(ticket)
            elif isinstance(effect, Record):
                record = effect.record.as_dict()
                if effect.checkpoint_ms and held_ms is not None:
                    record = {**record, "checkpoint_ms": round(held_ms, 1)}
                self.tape.append(record)
            elif isinstance(effect, Checkpoint):
                if self.iso is not None:  # nothing of the pool's may be outstanding at a durable cut
                    self.iso.drain()
                held_ms = self.checkpoints.save(self.protocol.checkpoint_state(), wait=effect.wait)
            elif isinstance(effect, FaultPoint):
                if effect.drain and self.faults.armed(effect.name):
                    for ticket in tickets:  # so that "sent to some learners" holds when the point fires
                        ticket.wait(FAULT_SEND_WAIT_S)
                self.faults.point(effect.name)
            elif isinstance(effect, Close):
                group = self.groups.get(effect.to)
                if group is not None:
                    group.close(effect.reason, last=effect.last)
            elif isinstance(effect, StallTimeout):
                group = self.groups.get(effect.to)
                if group is not None:
                    group.set_user_timeout(effect.seconds)
            elif isinstance(effect, Log):
                log.log(effect.level, "%s", effect.message)
            elif isinstance(effect, ExpectInit):
                if self.device.type == "cpu":  # the received buffers become the parameters
                    RECEIVE_POOL.reserve(effect.sizes)
                    self._init_reserved = True
            elif isinstance(effect, CheckInit | Encode) or (isinstance(effect, Decode) and effect.inline):
                layout = self.protocol.layout
                assert layout is not None
                if isinstance(effect, Encode) and effect.lent is not None:  # a checkpoint may still read it
                    kind = downlink_kind(effect.codec.wire_id)
                    effect = dataclasses.replace(effect, lent=self.leases.fresh(effect.fragment, kind, effect.lent))
                back.append(answer(effect, layout, self.device))
            elif isinstance(effect, Decode):
                self._decode(effect)
            elif isinstance(effect, Prepare):
                self._prepare(effect)
            elif isinstance(effect, Merge):
                if self._committing is not None:
                    back.append(Synced(self._committing, self.clock() - self._merge_started))
                    self._committing = None
                back.append(self._merge(effect))
        if self._committing is not None and not (effects and is_ask(effects[-1])):
            back.append(Synced(self._committing, self.clock() - self._merge_started))
            self._committing = None
        if broadcasts and self.observer is not None:
            BroadcastTimer(broadcasts, self.observer.broadcast_done)
        return back

    def _send(self, effect: Send, committed: dict[int, memoryview]) -> SendTicket | None:
        group = self.groups.get(effect.to)
        if group is None:
            return None  # the connection is gone: so is the send, as on a closed socket
        f = effect.committed
        if f is not None and f not in committed:
            committed[f] = self.committed_bytes(f)
        payload: Payload | None = effect.payload if f is None else committed[f]
        if effect.anchor is not None:  # a copy: the anchor moves in place with the next delta
            anchor = self.protocol.anchor(*effect.anchor)
            payload = tensor_bytes(anchor.clone())
        msg = effect.msg
        if isinstance(msg, Bcast) and payload is not None:
            msg, payload = self.moments.attach(effect.to.learner_id, msg, payload)
        ticket = group.send(msg, payload)
        if self.observer is not None:
            codec, nbytes = wire_size(msg, None if payload is None else payload_nbytes(payload))
            self.observer.traffic("out", effect.to.learner_id, codec, nbytes)
        if f is None:
            return ticket
        state = self.protocol.state
        assert state is not None
        if state.params[f].device.type == "cpu" and not ticket.done.is_set():
            self.leases.take(f, "param", lambda: not ticket.done.is_set())  # it reads the params themselves
        return ticket

    def committed_bytes(self, index: int) -> memoryview:
        """Fragment `index`'s committed values for the sender threads of every learner.

        On the CPU these are the parameters' own bytes, with no copy: the send takes a lease on
        them, so the next commit of the fragment writes a copy if a send still reads them
        (`leases.py`). Elsewhere (cuda) they are copied to host memory, into a recycled buffer: a
        fresh 64 MiB one faults in every page during the copy (20–25 ms against 4 ms into a warm
        one, here).
        """
        state = self.protocol.state
        assert state is not None
        params = state.params[index].detach()
        if params.numel() == 0:
            return memoryview(b"")
        if params.device.type == "cpu":
            return tensor_bytes(params)
        snapshot = SNAPSHOT_POOL.take(params.numel() * 4)
        torch.frombuffer(snapshot, dtype=torch.float32).copy_(params.reshape(-1))
        return snapshot

    def _decode(self, effect: Decode) -> None:
        layout = self.protocol.layout
        assert layout is not None
        future = self._decoders.submit(decoded, effect, layout, self.device)

        def done(fut: Future[Decoded]) -> None:
            try:
                back = fut.result()
            except Exception as exc:  # cancelled at exit: nobody reads it, but the event says so
                back = Decoded(effect.learner_id, effect.generation, effect.attempt, effect.msg,
                               f"decode failed: {exc}")
            self.post(back)

        future.add_done_callback(done)

    def _prepare_failure(self, attempt: int) -> BaseException | None:
        held = self._prepared.get(attempt)  # gone: its round was merged or abandoned meanwhile
        return held[1].exception() if held is not None else None

    def _prepare(self, effect: Prepare) -> None:
        state = self.protocol.state
        assert state is not None
        future = self._preparers.submit(self.merger.prepare, state.momentum[effect.fragment], list(effect.answers),
                                        list(effect.segments), effect.finished_weight)
        self._prepared[effect.attempt] = (effect.round, future)
        future.add_done_callback(lambda _: self.post(Prepared(effect.round, effect.attempt)))

    def _merge(self, effect: Merge) -> Merged:
        self._merge_started = self.clock()  # ξ_sync is a decision's input: the injected clock's
        f = effect.fragment
        # A send or a background checkpoint still reading fragment f keeps the values it reads.
        lent = effect.lent
        lent = dataclasses.replace(lent, params=self.leases.fresh(f, "param", lent.params),
                                   momentum=self.leases.fresh(f, "momentum", lent.momentum),
                                   accum=None if lent.accum is None else self.leases.fresh(f, "accum", lent.accum))
        prepared = None
        if effect.prepared is not None:
            prepared = self._prepared.pop(effect.prepared)[1].result()  # done: the protocol saw its Prepared
            # Rounds up to this one are over (committed in order, or abandoned): their halves are not
            # needed. A later round's is kept whatever its attempt number (a relaunch has a higher one).
            for stale in [a for a, (r, fut) in self._prepared.items() if r <= effect.round and fut.done()]:
                del self._prepared[stale]
        outcome, back = self.merger.merge(lent, list(effect.answers), list(effect.segments), prepared=prepared,
                                          finished=effect.finished_weight)
        if outcome.answers:  # the commit makes the fragment's next version, and its broadcasts carry this
            layout = self.protocol.layout
            assert layout is not None
            moment = merged_moment(layout.fragments[f], outcome.answers, outcome.weights)
            self.moments.merged(f, lent.outer_steps + 1, moment)
        return Merged(effect.round, outcome, back)
