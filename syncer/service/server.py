"""The syncer's sockets: accept, authenticate, assemble connection groups, post events.

Every accepted stream is greeted with a CHALLENGE; a control stream answers HELLO, a data stream
ATTACH with the token from WELCOME. What is accepted when is `SyncerHandshake`
(`yeto_core/wire/connection.py`), whether a HELLO may join is `admission.Admission`, and which
groups wait for which data streams is `pending.PendingGroups`: this module moves their bytes and
acts on their verdicts. It touches no global state: a finished group becomes a `Connected` event
for the coordinator, and what it receives `Got` / `Left` events. A refusal (wrong key, layout,
contract, malformed first frame) gets one ERROR frame with the reason before the socket closes;
the listener keeps serving everyone else. Until a connection proves the key, `gate.HandshakeGate`
bounds it in number and time, and the accept loop outlives descriptor and thread exhaustion
(retrying with backoff, logging once per burst).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from syncer.core.events import Connected
from syncer.service.admission import Admission, ProbeSlots, broken_off
from syncer.service.gate import ACCEPT_BACKOFF_MAX_S, AcceptPace, GateLogs, HandshakeGate, Unauthenticated
from syncer.service.pending import LATE, PendingGroup, PendingGroups
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.net.group import ConnectionGroup
from yeto_core.net.stream import Stream, tune_socket
from yeto_core.probe import check_probe, serve_probe
from yeto_core.sections import DEFAULT_STREAMS, Schedule, StreamSettings
from yeto_core.wire.connection import Admitted, Attached, OutOfTurn, ProbeRequested, Refusal, SyncerHandshake
from yeto_core.wire.errors import ErrorCode, Refused
from yeto_core.wire.messages import BwProbe, Error, Hello
from yeto_core.wire.reassembly import Screen

log = logging.getLogger("yeto.syncer.server")

HOUSEKEEPING_S = 0.25  # how often the accept loop cuts late handshakes and expires pending groups


class SyncerServer:
    def __init__(
        self, *, host: str, port: int, key: bytes, announced: Schedule, post: Callable[[Any], None],
        pinned_fingerprint: Callable[[], bytes | None], max_payload: Callable[[], int],
        initial_cut_ready: Callable[[], bool],
        id_conflict: Callable[[int, bytes], str | None] = lambda learner_id, instance: None,
        schedule_problem: Callable[[int], str | None] = lambda flags: None,
        handshake_timeout_s: float = 10.0, max_handshakes: int = 64, streams: StreamSettings = DEFAULT_STREAMS,
        generations: dict[int, int] | None = None, screen: Screen | None = None, faults: FaultInjector = NO_FAULTS,
        on_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self._key, self._announced, self._post = key, announced, post  # the schedule every CHALLENGE names
        self._on_refused = on_refused  # each connection turned away before it joined, by reason (the metrics)
        self._screen, self._max_payload, self._initial_cut_ready = screen, max_payload, initial_cut_ready
        self._admission = Admission(key, pinned_fingerprint=pinned_fingerprint, schedule_problem=schedule_problem,
                                    id_conflict=id_conflict)
        # Every group's settings but its streams and callbacks (`screen`: `payload.payload_screen`).
        self._new_group = functools.partial(ConnectionGroup, screen=screen, heartbeat_s=streams.heartbeat_s,
                                            peer_timeout_s=streams.peer_timeout_s,
                                            stall_timeout_s=streams.stall_timeout_s,
                                            schedule=streams.stream_schedule, faults=faults)
        self._pending: PendingGroups[Stream] = PendingGroups(handshake_timeout_s, generations)
        self._probes = ProbeSlots()
        self._gate = HandshakeGate(max_handshakes, handshake_timeout_s)
        self._trouble = GateLogs(log, self._gate)
        self._stop = threading.Event()
        self._listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, name="syncer-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        for group in self._pending.drain():
            for s in group.streams():
                s.close()

    # -- accept / handshake --------------------------------------------------------------------
    def _accept_loop(self) -> None:
        self._listener.settimeout(HOUSEKEEPING_S)
        pace = AcceptPace(HOUSEKEEPING_S)
        while not self._stop.is_set():
            if pace.housekeeping_due(time.monotonic()):
                self._housekeeping()
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED...: never give up
                if self._stop.is_set():
                    return
                self._trouble.accept.hit(f"{exc}")
                self._stop.wait(pace.failed())
                continue
            pace.accepted()
            self._admit(sock, str(peer[0]), f"{peer[0]}:{peer[1]}")

    def _housekeeping(self) -> None:
        for group in self._pending.expired(time.monotonic()):
            log.warning("learner %d: data streams did not attach within %.0f s", group.learner_id,
                        self._pending.timeout_s)
            with contextlib.suppress(OSError):
                group.control.send_frame(Error(ErrorCode.PROTOCOL, LATE))
            for s in group.streams():
                s.close()
        late = self._gate.expire()
        if late:
            self._trouble.late.hit(f"{len(late)} connection(s), first from {late[0].peer}")
        self._trouble.tick()

    def _admit(self, sock: socket.socket, host: str, peer: str) -> None:
        entry, evicted = self._gate.admit(sock, peer, host)
        if evicted is not None:
            self._on_refused("crowd")
            self._trouble.crowd.hit(f"cut {evicted.peer} (open {self._gate.age(evicted):.1f} s) to admit {peer}")
        if entry is None:
            self._on_refused("crowd")
            self._trouble.crowd.hit(f"closed {peer} at once")
            sock.close()
            return
        try:
            threading.Thread(target=self._handshake, args=(entry,), name=f"syncer-hs-{peer}", daemon=True).start()
        except RuntimeError as exc:  # "can't start new thread": out of memory or a task limit
            self._gate.release(entry)
            sock.close()
            self._trouble.thread.hit(f"{exc} ({peer})")
            self._stop.wait(ACCEPT_BACKOFF_MAX_S)

    def _handshake(self, entry: Unauthenticated) -> None:
        """Serve one new connection's handshake: `SyncerHandshake` decides, this moves its bytes and
        acts on its verdict (a group's control or data stream, a probe, or a refusal)."""
        stream = Stream(entry.sock, entry.peer)
        opened: list[PendingGroup[Stream]] = []  # the group this connection's WELCOME opened, if any

        def welcome(hello: Hello) -> tuple[int, bytes, bool]:
            opened.append(self._pending.open(hello, stream, time.monotonic()))
            return opened[0].generation, opened[0].token, self._initial_cut_ready()

        hs = SyncerHandshake(self._key, self._announced, welcome=welcome,
                             check=lambda hello, nonce: self._admission.check(hello, nonce, stream.name),
                             pending=self._pending.pending_learner,
                             deadline=entry.started + self._gate.deadline_s)
        try:
            try:
                event = stream.handshake(hs)[-1]
                if isinstance(event, Admitted):
                    tune_socket(entry.sock, bulk=False)
                    self._gate.hand_over(entry)
                    opened[0].admitted(event.manifest, event.payload_bound)
                elif isinstance(event, Attached):
                    tune_socket(entry.sock, bulk=True)
                    self._on_attach(stream, event, entry)
                elif isinstance(event, ProbeRequested):
                    self._on_probe(stream, hs.nonce, event.request, entry)
            except Refused as exc:  # a verdict of our own, after the machine's
                event = hs.reject(exc.code, exc.reason)
            except OutOfTurn as exc:  # a well-formed frame that the handshake does not take now
                event = hs.reject(ErrorCode.PROTOCOL, str(exc))
            if isinstance(event, Refusal):
                self._on_refused(event.code.name.lower())
                log.warning("refused %s: %s", stream.name, event.reason)
                with contextlib.suppress(OSError):
                    stream.sock.sendall(hs.data_to_send())  # the ERROR, unless the handshake sent it already
                linger_close(stream)
        except Exception as exc:  # broken, cut by the gate, or a bug here: answer if it can, free the socket
            reason, answer = broken_off(exc, cut=entry.cut)
            self._on_refused(reason)
            if reason == "error":
                log.exception("handshake with %s failed", stream.name)
            elif reason == "deadline":  # the gate closed it; the gate's burst log has said so
                log.debug("handshake with %s cut: %s", stream.name, exc)
            else:
                log.debug("handshake with %s failed: %s", stream.name, exc)
                self._trouble.failed.hit(f"handshake with {stream.name} failed: {exc}")
            if answer is not None:
                with contextlib.suppress(OSError):
                    stream.send_frame(Error(ErrorCode.PROTOCOL, answer))
            stream.close()
        finally:
            self._gate.release(entry)
            if opened:  # unless its control stream was admitted, no stream may attach to its group
                self._pending.abandon(opened[0])

    def _on_probe(self, stream: Stream, nonce: bytes, request: BwProbe, entry: Unauthenticated) -> None:
        """A bandwidth probe: bounded in size (per message), count and time, never part of a session."""
        check_probe(self._key, nonce, request)
        self._gate.hand_over(entry)
        with self._probes.slot():
            up, down = serve_probe(stream, self._key, nonce, request)
            log.info("bandwidth probe from %s: %d bytes up, %d bytes down", stream.name, up, down)
            stream.close()

    def _on_attach(self, stream: Stream, attach: Attached, entry: Unauthenticated) -> None:
        self._gate.hand_over(entry)
        group = self._pending.attach(attach.token, attach.index, stream)
        if group is None:  # more data streams to come; the last one starts the group
            return
        if not group.ready.wait(self._pending.timeout_s):
            raise Refused(ErrorCode.PROTOCOL, f"learner {group.learner_id}'s handshake did not finish in time")
        connection = self._new_group(group.control, group.streams()[1:], **group.wiring(
            self._post, screened=self._screen is not None, max_payload=self._max_payload))
        self._post(Connected(connection, group.joined(group.control.name)))
        connection.start()


def linger_close(stream: Stream, *, seconds: float = 2.0, limit: int = 64 << 20) -> None:
    """Close after an ERROR so the peer can read it: half-close, then drain what the peer is still
    sending (bounded in time and bytes). Closing with unread input would reset the connection and
    could destroy the ERROR frame before the peer reads it."""
    with contextlib.suppress(OSError):
        stream.sock.shutdown(socket.SHUT_WR)
        stream.sock.settimeout(0.2)
        deadline = time.monotonic() + seconds
        drained = 0
        while drained < limit and time.monotonic() < deadline:
            try:
                chunk = stream.sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not chunk:
                break
            drained += len(chunk)
    stream.close()
