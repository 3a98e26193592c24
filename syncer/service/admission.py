"""The syncer's verdicts on a new connection that need no socket (DESIGN §7.2, §7.6).

`Admission.check` is the admission rule `SyncerHandshake` calls on every HELLO: `check_hello`
with this syncer's key and what it knows now (the pinned fingerprint, the round schedule, who
holds each learner id), its refusal turned into the `Refused` that the machine answers with an
ERROR. `ProbeSlots` bounds the bandwidth probes served at once: each holds a thread and moves up
to its requested bytes, and a probe is never part of a session, so a crowd of them must not
starve the learners. `broken_off` says how a handshake that broke off is counted and answered.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from syncer.core.handshake import HandshakeRefused, check_hello
from yeto_core.wire.errors import ErrorCode, Refused, WireError
from yeto_core.wire.messages import Hello

MAX_PROBES = 64


class Admission:
    """`check_hello` over the syncer's live view; the callables are read at each HELLO."""

    def __init__(self, key: bytes, *, pinned_fingerprint: Callable[[], bytes | None],
                 schedule_problem: Callable[[int], str | None],
                 id_conflict: Callable[[int, bytes], str | None]) -> None:
        self._key = key
        self._pinned = pinned_fingerprint
        self._schedule_problem = schedule_problem  # why a HELLO's flags do not fit the round schedule
        self._id_conflict = id_conflict

    def check(self, hello: Hello, nonce: bytes, peer: str) -> None:
        """Raise `Refused` unless `hello`, answering the challenge `nonce` on the connection from
        `peer`, may join."""
        try:
            check_hello(hello, key=self._key, nonce=nonce, who=f"learner {hello.learner_id} ({peer})",
                        pinned=self._pinned(), schedule_problem=self._schedule_problem, id_conflict=self._id_conflict)
        except HandshakeRefused as exc:
            raise Refused(exc.code, exc.reason) from exc


class ProbeSlots:
    """At most `limit` bandwidth probes at once; thread-safe."""

    def __init__(self, limit: int = MAX_PROBES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._taken = 0

    def __len__(self) -> int:
        with self._lock:
            return self._taken

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a slot for the block; raises `Refused` (before the block) when all are held."""
        with self._lock:
            if self._taken >= self.limit:
                raise Refused(ErrorCode.REFUSED, f"more than {self.limit} bandwidth probes at once")
            self._taken += 1
        try:
            yield
        finally:
            with self._lock:
                self._taken -= 1


def broken_off(exc: BaseException, *, cut: bool) -> tuple[str, str | None]:
    """How a handshake that raised `exc` ends: (the refusal's reason for the metrics, the text of the
    ERROR the peer is sent, or None). A connection the gate `cut` is closed already and gets none;
    a broken read or a malformed frame is answered "handshake failed"; anything else is a bug of
    the syncer's, which the peer is told of as well."""
    if isinstance(exc, (WireError, OSError)):
        return ("deadline", None) if cut else ("broken", f"handshake failed: {exc}")
    return "error", f"syncer error during handshake: {exc}"
