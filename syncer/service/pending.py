"""Connection groups waiting for their data streams (DESIGN §7.1, §7.2), kept without a socket.

WELCOME opens a learner's group and hands the learner a token; each of its data streams then
attaches by that token at its own index, in any order, and possibly before the control stream's
MANIFEST has been read. `PendingGroups` is the table of such groups. It numbers each learner's
connections (a resumed syncer's numbering goes on from its ledger, so a (learner, generation)
pair names one connection across restarts), refuses an ATTACH that names no group or an index
that is out of range or taken, hands a group over once its last data stream is in, and gives up
on a group whose streams did not all attach within the deadline. Time is an argument and streams
are opaque handles, so the tests drive the table in memory; the server moves the bytes, waits for
the control stream's handshake, and closes whatever the table gives up.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, Generic, TypedDict, TypeVar

from syncer.core.events import Got, Joined, Left
from yeto_core.wire import auth
from yeto_core.wire.errors import ErrorCode, Refused
from yeto_core.wire.messages import Hello, Manifest, Message

S = TypeVar("S")  # a stream handle: the server's `Stream`, anything in the tests

NO_GROUP = "ATTACH names no pending connection group"
LATE = "data streams did not attach in time"  # the ERROR a given-up group's control stream gets


class Wiring(TypedDict):
    """A finished group's name and callbacks: `ConnectionGroup`'s keyword arguments."""

    name: str
    on_message: Callable[[Message, memoryview | None], None]
    on_screened: Callable[[Message, memoryview, bool], None] | None
    on_close: Callable[[str], None]
    max_payload: Callable[[], int]


@dataclasses.dataclass(eq=False)
class PendingGroup(Generic[S]):
    """One learner's connection between WELCOME and its last ATTACH."""

    hello: Hello
    generation: int
    token: bytes
    control: S
    data: list[S | None]  # by ATTACH index; None until that stream attaches
    created: float
    manifest: Manifest | None = None
    bound: int = 0  # transfer bound implied by the manifest (learner 0 before the initial cut)
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)  # control handshake done

    @property
    def learner_id(self) -> int:
        return self.hello.learner_id

    @property
    def complete(self) -> bool:
        return all(s is not None for s in self.data)

    def admitted(self, manifest: Manifest | None, bound: int) -> None:
        """The control stream's handshake finished (its MANIFEST, if any, read): only from now on
        may the group's reader threads own it, or a control reader would race the handshake for bytes."""
        self.manifest, self.bound = manifest, bound
        self.ready.set()

    def streams(self) -> list[S]:
        """The control stream, then every data stream attached so far, in index order."""
        return [self.control, *(s for s in self.data if s is not None)]

    def wiring(self, post: Callable[[Any], None], *, screened: bool, max_payload: Callable[[], int]) -> Wiring:
        """How the connection group it becomes reports to the coordinator: each message as `Got`
        (with the screen's verdict, when bulk payloads are `screened` as they land), its end as
        `Left`, all for this learner and generation. Its payloads are bounded by what the manifest
        implies, or by `max_payload` without one."""
        lid, gen, bound = self.learner_id, self.generation, self.bound
        return Wiring(
            name=f"syncer<-learner{lid}.{gen}",
            on_message=lambda msg, payload: post(Got(lid, gen, msg, payload)),
            on_screened=(lambda msg, payload, passed: post(Got(lid, gen, msg, payload, passed))) if screened else None,
            on_close=lambda reason: post(Left(lid, gen, reason)),
            max_payload=(lambda: bound) if bound else max_payload)

    def joined(self, peer: str) -> Joined:
        """What the coordinator learns of the finished group; `peer`: its control stream's name."""
        h = self.hello
        return Joined(h.learner_id, self.generation, h.fingerprint, h.wire_dtype, self.manifest, h.flags,
                      h.push_block, h.instance, peer, downlink_dtype=h.downlink_dtype)


class PendingGroups(Generic[S]):
    """The pending groups by token, and the last generation of each learner; thread-safe (the
    handshake threads open, attach and abandon groups while the accept loop expires them)."""

    def __init__(self, timeout_s: float, generations: dict[int, int] | None = None, *,
                 new_token: Callable[[], bytes] = auth.new_token) -> None:
        self.timeout_s = timeout_s  # from WELCOME to the last ATTACH
        self._generations: dict[int, int] = dict(generations or {})
        self._new_token = new_token
        self._groups: dict[bytes, PendingGroup[S]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)

    def generation(self, learner_id: int) -> int:
        """The last generation numbered for `learner_id` (0 before its first)."""
        with self._lock:
            return self._generations.get(learner_id, 0)

    def open(self, hello: Hello, control: S, now: float) -> PendingGroup[S]:
        """Number the group WELCOME opens for `hello` and wait for its data streams."""
        with self._lock:
            generation = self._generations.get(hello.learner_id, 0) + 1
            self._generations[hello.learner_id] = generation
            data: list[S | None] = [None] * hello.data_streams
            group = PendingGroup(hello, generation, self._new_token(), control, data, now)
            self._groups[group.token] = group
        return group

    def pending_learner(self, token: bytes) -> int | None:
        """The learner whose pending group `token` names, or None."""
        with self._lock:
            group = self._groups.get(token)
        return None if group is None else group.learner_id

    def attach(self, token: bytes, index: int, stream: S) -> PendingGroup[S] | None:
        """Put `stream` at `index` of group `token`: the group, out of the table, once that was its
        last data stream; None while others are still missing. Raises `Refused` for a token that
        names no group (never, or no longer: it expired) and for an index out of range or taken."""
        with self._lock:
            group = self._groups.get(token)
            if group is None:
                raise Refused(ErrorCode.PROTOCOL, NO_GROUP)
            if index >= len(group.data) or group.data[index] is not None:
                raise Refused(ErrorCode.PROTOCOL, f"data stream index {index} is invalid or taken")
            group.data[index] = stream
            if not group.complete:
                return None
            del self._groups[token]
        return group

    def abandon(self, group: PendingGroup[S]) -> None:
        """The control stream's handshake ended without admission: no stream may attach to its
        group any more. A group already admitted stays."""
        if not group.ready.is_set():
            with self._lock:
                if self._groups.get(group.token) is group:
                    del self._groups[group.token]

    def expired(self, now: float) -> list[PendingGroup[S]]:
        """Take out every group whose data streams did not all attach within `timeout_s` of WELCOME."""
        with self._lock:
            stale = [t for t, g in self._groups.items() if now - g.created > self.timeout_s]
            return [self._groups.pop(t) for t in stale]

    def drain(self) -> list[PendingGroup[S]]:
        """Take out every group (the server is closing)."""
        with self._lock:
            groups, self._groups = list(self._groups.values()), {}
        return groups
