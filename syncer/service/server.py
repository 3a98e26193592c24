"""The syncer's sockets: accept, authenticate, assemble connection groups, post events.

Every accepted stream is greeted with a CHALLENGE (fresh nonce, fragment count, pattern). A
control stream answers HELLO; a data stream answers ATTACH with the token from WELCOME. What is
accepted when, and every check on the handshake's own frames, is `SyncerHandshake`
(`yeto_core/wire/connection.py`); this module moves its bytes and keeps the pending groups. Nothing
here touches global state: a finished group becomes a `Connected` event for the coordinator, and
everything it receives becomes `Got` / `Left` events. Refusals (wrong key, layout, contract,
malformed first frame) get one ERROR frame with the reason, then the socket is closed; the
listener keeps serving everyone else. Until a connection proves the key, `gate.HandshakeGate`
bounds it in number and time, and the accept loop outlives descriptor and thread exhaustion
(retrying with backoff, logging once per burst).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from syncer.core.events import Connected, Got, Joined, Left
from syncer.core.handshake import HandshakeRefused, check_hello
from syncer.service.gate import ACCEPT_BACKOFF_MAX_S, ACCEPT_BACKOFF_MIN_S, BurstLog, HandshakeGate, Unauthenticated
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.probe import probe_authentic, serve_probe
from yeto_core.wire import auth
from yeto_core.wire.connection import Admitted, Attached, OutOfTurn, ProbeRequested, Refusal, SyncerHandshake
from yeto_core.wire.errors import ErrorCode, Refused, WireError
from yeto_core.wire.messages import BwProbe, Error, Hello, Manifest
from yeto_core.wire.transport import ConnectionGroup, Screen, Stream, tune_socket

log = logging.getLogger("yeto.syncer.server")

MAX_PROBES = 64
PROBE_TIMEOUT_S = 300.0
HOUSEKEEPING_S = 0.25  # how often the accept loop cuts late handshakes and expires pending groups


@dataclasses.dataclass
class _Pending:
    hello: Hello
    generation: int
    token: bytes
    control: Stream
    data: list[Stream | None]
    created: float
    manifest: Manifest | None = None
    bound: int = 0  # transfer bound implied by the manifest (learner 0 before the initial cut)
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)  # control handshake done


class SyncerServer:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        key: bytes,
        num_fragments: int,
        pattern: str,
        post: Callable[[Any], None],
        pinned_fingerprint: Callable[[], bytes | None],
        max_payload: Callable[[], int],
        initial_cut_ready: Callable[[], bool],
        id_conflict: Callable[[int, bytes], str | None] = lambda learner_id, instance: None,
        schedule_problem: Callable[[int], str | None] = lambda flags: None,
        handshake_timeout_s: float = 10.0,
        max_handshakes: int = 64,
        heartbeat_s: float = 2.0,
        peer_timeout_s: float = 30.0,
        stall_timeout_s: float = 0.0,
        schedule: str = "rr",
        generations: dict[int, int] | None = None,
        screen: Screen | None = None,
        faults: FaultInjector = NO_FAULTS,
        on_refused: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self._key = key
        self._on_refused = on_refused  # each connection turned away before it joined, by reason (the metrics)
        self._faults = faults  # passed to every connection group (the mid-stripe point)
        self._screen = screen  # checks bulk payloads chunk by chunk as they land (`payload.payload_screen`)
        self._schedule = schedule
        self._stall_timeout_s = stall_timeout_s
        self._num_fragments = num_fragments
        self._pattern = pattern
        self._post = post
        self._pinned = pinned_fingerprint
        self._max_payload = max_payload
        self._initial_cut_ready = initial_cut_ready
        self._id_conflict = id_conflict
        self._schedule_problem = schedule_problem  # why a HELLO's flags do not fit the round schedule
        self._handshake_timeout_s = handshake_timeout_s
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._lock = threading.Lock()
        # Connection generations per learner, numbered on from a resumed checkpoint's ledger so a
        # (learner, generation) pair names one connection across syncer restarts.
        self._generations: dict[int, int] = dict(generations or {})
        self._pending: dict[bytes, _Pending] = {}
        self._probes = 0
        self._gate = HandshakeGate(max_handshakes, handshake_timeout_s)
        self._crowd = BurstLog(log, f"too many unauthenticated connections ({self._gate.cap} at once, "
                               f"{self._gate.per_host} per address; --max-handshakes); closing the excess")
        self._late = BurstLog(log, f"handshakes cut at their {handshake_timeout_s:g} s deadline")
        self._accept_trouble = BurstLog(log, "accept() failing; retrying with backoff")
        self._thread_trouble = BurstLog(log, "cannot start a handshake thread; closing the connection")
        # Unauthenticated peers may be anyone: a crowd that hangs up at once must cost a line, not one each.
        self._failed = BurstLog(log, "handshakes failed before authentication")
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
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            for s in [p.control, *p.data]:
                if s is not None:
                    s.close()

    # -- accept / handshake --------------------------------------------------------------------
    def _accept_loop(self) -> None:
        self._listener.settimeout(HOUSEKEEPING_S)
        backoff = 0.0
        next_housekeeping = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_housekeeping:
                next_housekeeping = time.monotonic() + HOUSEKEEPING_S
                self._housekeeping()
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED...: never give up
                if self._stop.is_set():
                    return
                backoff = min(ACCEPT_BACKOFF_MAX_S, max(ACCEPT_BACKOFF_MIN_S, 2 * backoff))
                self._accept_trouble.hit(f"{exc}")
                self._stop.wait(backoff)
                continue
            backoff = 0.0
            self._admit(sock, str(peer[0]), f"{peer[0]}:{peer[1]}")

    def _housekeeping(self) -> None:
        self._expire_pending()
        late = self._gate.expire()
        if late:
            self._late.hit(f"{len(late)} connection(s), first from {late[0].peer}")
        for trouble in (self._crowd, self._late, self._accept_trouble, self._thread_trouble, self._failed):
            trouble.tick()

    def _admit(self, sock: socket.socket, host: str, peer: str) -> None:
        entry, evicted = self._gate.admit(sock, peer, host)
        if evicted is not None:
            self._on_refused("crowd")
            self._crowd.hit(f"cut {evicted.peer} (open {time.monotonic() - evicted.started:.1f} s) to admit {peer}")
        if entry is None:
            self._on_refused("crowd")
            self._crowd.hit(f"closed {peer} at once")
            sock.close()
            return
        try:
            threading.Thread(target=self._handshake, args=(entry,), name=f"syncer-hs-{peer}", daemon=True).start()
        except RuntimeError as exc:  # "can't start new thread": out of memory or a task limit
            self._gate.release(entry)
            sock.close()
            self._thread_trouble.hit(f"{exc} ({peer})")
            self._stop.wait(ACCEPT_BACKOFF_MAX_S)

    def _handshake(self, entry: Unauthenticated) -> None:
        """Serve one new connection's handshake: `SyncerHandshake` decides, this moves its bytes and
        acts on its verdict (a group's control or data stream, a probe, or a refusal)."""
        stream = Stream(entry.sock, entry.peer)
        opened: list[_Pending] = []  # the group this connection's WELCOME opened, if any

        def welcome(hello: Hello) -> tuple[int, bytes, bool]:
            opened.append(self._open_pending(hello, stream))
            return opened[0].generation, opened[0].token, self._initial_cut_ready()

        hs = SyncerHandshake(self._key, self._num_fragments, self._pattern, welcome=welcome,
                             check=lambda hello, nonce: self._check(hello, nonce, stream.name),
                             pending=self._pending_learner, deadline=entry.started + self._handshake_timeout_s)
        try:
            try:
                event = stream.handshake(hs)[-1]
                if isinstance(event, Admitted):
                    tune_socket(entry.sock, bulk=False)
                    self._hand_over(entry)
                    opened[0].manifest, opened[0].bound = event.manifest, event.payload_bound
                    # Only now may the group's reader threads own the control stream: until the MANIFEST
                    # was read here, a control reader started by the last ATTACH would race us for bytes.
                    opened[0].ready.set()
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
        except (WireError, OSError) as exc:
            self._on_refused("deadline" if entry.cut else "broken")
            if entry.cut:  # the gate closed it; the gate's burst log has said so
                log.debug("handshake with %s cut: %s", stream.name, exc)
            else:
                log.debug("handshake with %s failed: %s", stream.name, exc)
                self._failed.hit(f"handshake with {stream.name} failed: {exc}")
                with contextlib.suppress(OSError):
                    stream.send_frame(Error(ErrorCode.PROTOCOL, f"handshake failed: {exc}"))
            stream.close()
        except Exception as exc:  # a bug here must still answer the peer and free the socket
            self._on_refused("error")
            log.exception("handshake with %s failed", stream.name)
            with contextlib.suppress(OSError):
                stream.send_frame(Error(ErrorCode.PROTOCOL, f"syncer error during handshake: {exc}"))
            stream.close()
        finally:
            self._gate.release(entry)
            if opened and not opened[0].ready.is_set():  # its control stream failed: no group to attach to
                with self._lock:
                    self._pending.pop(opened[0].token, None)

    def _hand_over(self, entry: Unauthenticated) -> None:
        """The connection is authenticated: the gate stops timing it, unless it already cut it."""
        if not self._gate.release(entry):
            raise WireError(f"handshake did not finish within {self._handshake_timeout_s:g} s")

    def _on_probe(self, stream: Stream, nonce: bytes, request: BwProbe, entry: Unauthenticated) -> None:
        """A bandwidth probe: bounded in size (per message), count and time, never part of a session."""
        if not probe_authentic(self._key, nonce, request):
            raise Refused(ErrorCode.AUTH, "HMAC check failed on a bandwidth probe: wrong key")
        self._hand_over(entry)
        with self._lock:
            if self._probes >= MAX_PROBES:
                raise Refused(ErrorCode.REFUSED, f"more than {MAX_PROBES} bandwidth probes at once")
            self._probes += 1
        try:
            stream.sock.settimeout(PROBE_TIMEOUT_S)
            up, down = serve_probe(stream, self._key, nonce, request)
            log.info("bandwidth probe from %s: %d bytes up, %d bytes down", stream.name, up, down)
            stream.close()
        finally:
            with self._lock:
                self._probes -= 1

    def _check(self, hello: Hello, nonce: bytes, peer: str) -> None:
        try:
            check_hello(hello, key=self._key, nonce=nonce, who=f"learner {hello.learner_id} ({peer})",
                        pinned=self._pinned(), schedule_problem=self._schedule_problem, id_conflict=self._id_conflict)
        except HandshakeRefused as exc:
            raise Refused(exc.code, exc.reason) from exc

    def _open_pending(self, hello: Hello, control: Stream) -> _Pending:
        """Number the group WELCOME opens and wait for its data streams (which may attach before its
        MANIFEST is read)."""
        with self._lock:
            generation = self._generations.get(hello.learner_id, 0) + 1
            self._generations[hello.learner_id] = generation
            pending = _Pending(hello, generation, auth.new_token(), control, [None] * hello.data_streams,
                               time.monotonic())
            self._pending[pending.token] = pending
        return pending

    def _pending_learner(self, token: bytes) -> int | None:
        with self._lock:
            pending = self._pending.get(token)
        return None if pending is None else pending.hello.learner_id

    def _on_attach(self, stream: Stream, attach: Attached, entry: Unauthenticated) -> None:
        self._hand_over(entry)
        with self._lock:
            pending = self._pending.get(attach.token)
            if pending is None:  # expired since the ATTACH was checked
                raise Refused(ErrorCode.PROTOCOL, "ATTACH names no pending connection group")
            if attach.index >= len(pending.data) or pending.data[attach.index] is not None:
                raise Refused(ErrorCode.PROTOCOL, f"data stream index {attach.index} is invalid or taken")
            pending.data[attach.index] = stream
            complete = all(s is not None for s in pending.data)
            if complete:
                del self._pending[attach.token]
        if complete:
            if not pending.ready.wait(self._handshake_timeout_s):
                raise Refused(ErrorCode.PROTOCOL, f"learner {pending.hello.learner_id}'s handshake did not finish "
                              "in time")
            self._start_group(pending)

    def _start_group(self, p: _Pending) -> None:
        lid, gen = p.hello.learner_id, p.generation
        data = [s for s in p.data if s is not None]
        bound = p.bound
        group = ConnectionGroup(
            p.control, data, name=f"syncer<-learner{lid}.{gen}",
            on_message=lambda msg, payload: self._post(Got(lid, gen, msg, payload)),
            screen=self._screen,
            on_screened=None if self._screen is None else (
                lambda msg, payload, passed: self._post(Got(lid, gen, msg, payload, passed))),
            on_close=lambda reason: self._post(Left(lid, gen, reason)),
            max_payload=(lambda: bound) if bound else self._max_payload,
            heartbeat_s=self._heartbeat_s, peer_timeout_s=self._peer_timeout_s, stall_timeout_s=self._stall_timeout_s,
            schedule=self._schedule, faults=self._faults,
        )
        self._post(Connected(group, Joined(lid, gen, p.hello.fingerprint, p.hello.wire_dtype, p.manifest,
                                           p.hello.flags, p.hello.push_block, p.hello.instance, p.control.name)))
        group.start()

    def _expire_pending(self) -> None:
        now = time.monotonic()
        with self._lock:
            stale = [t for t, p in self._pending.items() if now - p.created > self._handshake_timeout_s]
            gone = [self._pending.pop(t) for t in stale]
        for p in gone:
            log.warning("learner %d: data streams did not attach within %.0f s", p.hello.learner_id,
                        self._handshake_timeout_s)
            with contextlib.suppress(OSError):
                p.control.send_frame(Error(ErrorCode.PROTOCOL, "data streams did not attach in time"))
            for s in [p.control, *p.data]:
                if s is not None:
                    s.close()


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

