"""The handshake (PROTOCOL §4), written once, without I/O: one state machine per role.

Bytes go in (`receive_data`), typed events come out, and `data_to_send` says what to write back;
time comes in as an argument (`timed_out(now)`). The socket code of either side is a shell that
feeds the machine what it reads and writes what it is told (`Stream.handshake`), so every step,
refusal and out-of-turn frame can be driven in memory, byte by byte.

Each role has an explicit transition table: which frame each state accepts and the states it may
lead to. A frame the table does not list is a `ProtocolError` naming the state and the frame,
raised on its header, before its body is read. The machine asks for no more bytes than complete
the frame in hand (`bytes_wanted`), so a shell that reads that much never takes a byte that
belongs to the connection group after the handshake.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from yeto_core.codecs import F32
from yeto_core.layout import Layout, build_layout
from yeto_core.moments import max_bulk_bytes
from yeto_core.sections import Endpoint, LinkSettings, Schedule
from yeto_core.wire import auth
from yeto_core.wire.errors import ErrorCode, ProtocolError, Refused
from yeto_core.wire.framing import FrameReader
from yeto_core.wire.messages import (
    CHUNK_BYTES,
    HELLO_CONSENSUS,
    HELLO_OVERLAP,
    HELLO_SENDS_MANIFEST,
    HELLO_SWEEP_OVERLAP,
    HELLO_SWEEPS,
    MAX_CONTROL_BODY,
    Attach,
    BwProbe,
    Challenge,
    Error,
    Hello,
    Manifest,
    Message,
    MsgType,
    Welcome,
    decode_body,
    encode_frame,
)

if TYPE_CHECKING:
    from yeto_core.codecs import Codec

FIRST_FRAME_BOUND = 64 * 1024  # the syncer's bound on the first frame of a connection nobody has vouched for
SWEEP_FLAGS = {"stream": 0, "sweep": HELLO_SWEEPS, "overlap": HELLO_SWEEPS | HELLO_SWEEP_OVERLAP}  # by rl_mode


def hello_for(me: Endpoint, link: LinkSettings, layout: Layout, codec: Codec, *, sends_init: bool, instance: bytes,
              challenge_nonce: bytes, client_nonce: bytes) -> Hello:
    """The signed HELLO answering a CHALLENGE: who this learner is (`me`) and its session contract."""
    # Learner 0 describes the model (MANIFEST, right after WELCOME) on every connection, so a
    # syncer without state can build the layout and bound every transfer before any bulk byte.
    flags = HELLO_SENDS_MANIFEST if sends_init else 0
    flags |= HELLO_CONSENSUS | (HELLO_OVERLAP if link.overlap else 0)
    flags |= SWEEP_FLAGS[link.rl_mode]
    block = int(getattr(codec, "block", 0))  # the quantized codecs' block size is contract too
    downlink = link.delta_codec or F32
    hello = Hello(me.learner_id, link.data_streams, layout.fingerprint, codec.wire_id, CHUNK_BYTES, flags,
                  client_nonce, push_block=block, instance=instance, downlink_dtype=downlink.wire_id)
    return dataclasses.replace(hello, mac=auth.sign(me.key, auth.HELLO_LABEL, challenge_nonce, hello.signed_part()))


class OutOfTurn(ProtocolError):
    """A well-formed frame that the handshake's state does not accept (its table has no entry)."""


class HandshakeState(enum.Enum):
    AWAIT_CHALLENGE = enum.auto()  # learner, either stream: connected, the syncer speaks first
    AWAIT_WELCOME = enum.auto()  # learner: HELLO sent
    WELCOMED = enum.auto()  # learner: WELCOME verified (and MANIFEST written, for learner 0); ends
    CHALLENGED = enum.auto()  # syncer: CHALLENGE sent; HELLO, ATTACH or BW_PROBE may answer
    AWAIT_MANIFEST = enum.auto()  # syncer: WELCOME sent to a HELLO that announced a MANIFEST
    JOINED = enum.auto()  # syncer: the control stream is authenticated (and its manifest checked); ends
    ATTACHED = enum.auto()  # either: a data stream proved it belongs to a WELCOMEd group; ends
    PROBING = enum.auto()  # syncer: a bandwidth probe, whose raw bytes the shell serves; ends
    REFUSED = enum.auto()  # either: one side refused the other with an ERROR; ends


S = HandshakeState
ENDS = frozenset({S.WELCOMED, S.JOINED, S.ATTACHED, S.PROBING, S.REFUSED})

Table = dict[tuple[HandshakeState, MsgType], tuple[HandshakeState, ...]]
"""(state, frame type) → the states that frame may lead to (REFUSED where a check can fail)."""

LEARNER_TABLE: Table = {
    (S.AWAIT_CHALLENGE, MsgType.CHALLENGE): (S.AWAIT_WELCOME,),
    (S.AWAIT_CHALLENGE, MsgType.ERROR): (S.REFUSED,),
    (S.AWAIT_WELCOME, MsgType.WELCOME): (S.WELCOMED, S.REFUSED),  # REFUSED: its MAC does not verify
    (S.AWAIT_WELCOME, MsgType.ERROR): (S.REFUSED,),
}
ATTACH_TABLE: Table = {
    (S.AWAIT_CHALLENGE, MsgType.CHALLENGE): (S.ATTACHED,),
    (S.AWAIT_CHALLENGE, MsgType.ERROR): (S.REFUSED,),
}
SYNCER_TABLE: Table = {
    (S.CHALLENGED, MsgType.HELLO): (S.AWAIT_MANIFEST, S.JOINED, S.REFUSED),
    (S.AWAIT_MANIFEST, MsgType.MANIFEST): (S.JOINED, S.REFUSED),
    (S.CHALLENGED, MsgType.ATTACH): (S.ATTACHED, S.REFUSED),
    (S.CHALLENGED, MsgType.BW_PROBE): (S.PROBING,),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Challenged:
    """Learner: the syncer's CHALLENGE came, and `layout` is what its schedule (fragment count and
    pattern) makes of the model; the HELLO answering it (with the layout's fingerprint) is in
    `data_to_send`."""

    layout: Layout


@dataclasses.dataclass(frozen=True, slots=True)
class Welcomed:
    """Learner: the syncer accepted the HELLO and proved it holds the key."""

    generation: int
    token: bytes
    initial_cut_ready: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """The handshake ended refused: on a learner, by the syncer's ERROR (or a WELCOME whose MAC
    fails, taken as AUTH); on the syncer, by its own verdict, whose ERROR is in `data_to_send`."""

    code: ErrorCode
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Attached:
    """A data stream joins group `token` at `index` (the learner sent ATTACH; the syncer verified it)."""

    token: bytes
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class Admitted:
    """Syncer: a control stream proved the key and passed every check; `manifest` (learner 0's, or
    None) implies `payload_bound`, the largest payload its group may send (0 without a manifest)."""

    hello: Hello
    token: bytes
    generation: int
    manifest: Manifest | None
    payload_bound: int


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeRequested:
    """Syncer: the connection is a bandwidth probe; the shell checks its seal and serves it."""

    request: BwProbe


Event = Challenged | Welcomed | Refusal | Attached | Admitted | ProbeRequested


class Handshake(abc.ABC):
    """Frames in, events and bytes out, as the role's `TABLE` allows."""

    TABLE: ClassVar[Table]
    ROLE: ClassVar[str]

    def __init__(self, state: HandshakeState, deadline: float) -> None:
        self.state = state
        self._deadline = deadline
        self._frames = FrameReader()
        self._outbox = bytearray()

    @property
    def finished(self) -> bool:
        return self.state in ENDS

    def next_deadline(self) -> float | None:
        return None if self.finished else self._deadline

    def timed_out(self, now: float) -> bool:
        return not self.finished and now >= self._deadline

    def data_to_send(self) -> bytes:
        out = bytes(self._outbox)
        self._outbox.clear()
        return out

    @property
    def trailing_data(self) -> bytes:
        """Bytes received after the frame that ended the handshake: the connection group's."""
        return self._frames.rest() if self.finished else b""

    def bytes_wanted(self) -> int:
        """How many more bytes complete the header or frame in hand (0 once the handshake ended)."""
        return 0 if self.finished else self._frames.bytes_wanted()

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        self._frames.feed(data)
        events: list[Event] = []
        while not self.finished:
            frame = self._frames.next_frame(max_body=self._max_body(), accept=self._in_turn)
            if frame is None:
                break
            kind, body = frame
            allowed = self.TABLE[(self.state, kind)]
            state, new = self._handle(decode_body(kind, body))
            assert state in allowed, f"{self.ROLE}: {self.state.name} --{kind.name}--> {state.name} is not in the table"
            self.state = state
            events += new
        return events

    def _in_turn(self, kind: MsgType) -> None:
        if (self.state, kind) not in self.TABLE:
            accepted = " or ".join(k.name for s, k in self.TABLE if s is self.state)
            raise OutOfTurn(f"{self.ROLE} handshake in state {self.state.name}: expected {accepted}, got {kind.name}")

    def _max_body(self) -> int:
        return MAX_CONTROL_BODY

    def _send(self, msg: Message) -> None:
        self._outbox += encode_frame(msg)

    @abc.abstractmethod
    def _handle(self, msg: Message) -> tuple[HandshakeState, list[Event]]:
        """A frame the table allows in the current state: the next state and the events it makes."""


class LearnerHandshake(Handshake):
    """The learner's control stream: CHALLENGE → HELLO, WELCOME (verified) → MANIFEST for learner 0."""

    TABLE = LEARNER_TABLE
    ROLE = "learner"

    def __init__(self, me: Endpoint, link: LinkSettings, codec: Codec, *, sends_init: bool, instance: bytes,
                 layout_for: Callable[[Schedule], Layout], deadline: float,
                 nonce: Callable[[], bytes] = auth.new_nonce) -> None:
        super().__init__(S.AWAIT_CHALLENGE, deadline)
        self._me, self._link, self._codec, self._sends_init, self._instance = me, link, codec, sends_init, instance
        self._layout_for, self._nonce = layout_for, nonce
        self.schedule: Schedule | None = None  # what the CHALLENGE announced
        self.layout: Layout | None = None  # built for the schedule (it may refuse it: `Refused`)
        self.hello: Hello | None = None
        self.welcome: Welcome | None = None

    def attach(self, index: int, deadline: float | None = None) -> LearnerAttach:
        """The handshake of data stream `index` of the group WELCOME opened."""
        assert self.welcome is not None, "a data stream attaches after WELCOME"
        return LearnerAttach(self._me.key, self.welcome.token, index,
                             self._deadline if deadline is None else deadline)

    def _handle(self, msg: Message) -> tuple[HandshakeState, list[Event]]:
        if isinstance(msg, Error):
            return S.REFUSED, [Refusal(msg.code, msg.reason)]
        if isinstance(msg, Challenge):
            self.schedule = Schedule(msg.num_fragments, msg.pattern, msg.sync_interval)
            self.layout = self._layout_for(self.schedule)
            self.hello = hello_for(self._me, self._link, self.layout, self._codec, sends_init=self._sends_init,
                                   instance=self._instance, challenge_nonce=msg.nonce, client_nonce=self._nonce())
            self._send(self.hello)
            return S.AWAIT_WELCOME, [Challenged(self.layout)]
        assert isinstance(msg, Welcome) and self.hello is not None and self.layout is not None
        if not auth.verify(self._me.key, msg.mac, auth.WELCOME_LABEL, self.hello.client_nonce, msg.token,
                           msg.generation.to_bytes(4, "little")):
            return S.REFUSED, [Refusal(ErrorCode.AUTH, "the syncer could not prove it holds the same key")]
        self.welcome = msg
        if self.hello.flags & HELLO_SENDS_MANIFEST:
            self._send(Manifest(self.layout.num_fragments, self.layout.pattern, self.layout.specs))
        return S.WELCOMED, [Welcomed(msg.generation, msg.token, msg.initial_cut_ready)]


class LearnerAttach(Handshake):
    """A learner's data stream: CHALLENGE → ATTACH, signed over this stream's nonce and the token."""

    TABLE = ATTACH_TABLE
    ROLE = "learner data stream"

    def __init__(self, key: bytes, token: bytes, index: int, deadline: float) -> None:
        super().__init__(S.AWAIT_CHALLENGE, deadline)
        self._key, self._token, self._index = key, token, index

    def _handle(self, msg: Message) -> tuple[HandshakeState, list[Event]]:
        if isinstance(msg, Error):
            return S.REFUSED, [Refusal(msg.code, msg.reason)]
        assert isinstance(msg, Challenge)
        mac = auth.sign(self._key, auth.ATTACH_LABEL, msg.nonce, self._token, bytes([self._index]))
        self._send(Attach(self._token, self._index, mac))
        return S.ATTACHED, [Attached(self._token, self._index)]


class SyncerHandshake(Handshake):
    """The syncer's side of any new connection: CHALLENGE, then a HELLO (→ WELCOME, and the MANIFEST
    it announces), an ATTACH or a bandwidth probe.

    `check(hello, nonce)` is the admission rule and raises `Refused` to turn the learner away;
    `welcome(hello)` opens its pending group and returns (generation, token, initial_cut_ready);
    `pending(token)` names the learner whose pending group `token` is, or None. The CHALLENGE
    announces the syncer's `schedule`: P, the pattern and H (0: the syncer does not pace rounds
    by learner steps, and each learner keeps its own H).
    """

    TABLE = SYNCER_TABLE
    ROLE = "syncer"

    def __init__(self, key: bytes, schedule: Schedule, *, check: Callable[[Hello, bytes], None],
                 welcome: Callable[[Hello], tuple[int, bytes, bool]], pending: Callable[[bytes], int | None],
                 deadline: float, nonce: Callable[[], bytes] = auth.new_nonce) -> None:
        super().__init__(S.CHALLENGED, deadline)
        self._key, self._num_fragments, self._pattern = key, schedule.num_fragments, schedule.pattern
        self._check, self._welcome, self._pending = check, welcome, pending
        self.nonce = nonce()
        self.hello: Hello | None = None
        self.token: bytes | None = None  # of the group WELCOME opened
        self._generation = 0
        self._send(Challenge(self.nonce, schedule.num_fragments, schedule.pattern, schedule.sync_interval))

    def reject(self, code: ErrorCode, reason: str) -> Refusal:
        """Refuse the peer: its ERROR goes to `data_to_send`, and the handshake ends. The machine
        refuses on its own checks; the shell calls this for a verdict of its own."""
        self.state = S.REFUSED
        self._send(Error(code, reason))
        return Refusal(code, reason)

    def _max_body(self) -> int:
        return FIRST_FRAME_BOUND if self.state is S.CHALLENGED else MAX_CONTROL_BODY

    def _handle(self, msg: Message) -> tuple[HandshakeState, list[Event]]:
        try:
            if isinstance(msg, Hello):
                return self._on_hello(msg)
            if isinstance(msg, Manifest):
                return self._on_manifest(msg)
            if isinstance(msg, Attach):
                return self._on_attach(msg)
        except Refused as exc:
            return S.REFUSED, [self.reject(exc.code, exc.reason)]
        assert isinstance(msg, BwProbe)
        return S.PROBING, [ProbeRequested(msg)]

    def _on_hello(self, hello: Hello) -> tuple[HandshakeState, list[Event]]:
        self._check(hello, self.nonce)
        self.hello = hello
        self._generation, self.token, ready = self._welcome(hello)
        mac = auth.sign(self._key, auth.WELCOME_LABEL, hello.client_nonce, self.token,
                        self._generation.to_bytes(4, "little"))
        self._send(Welcome(self.token, self._generation, ready, mac))
        if hello.flags & HELLO_SENDS_MANIFEST:
            return S.AWAIT_MANIFEST, []
        return S.JOINED, [Admitted(hello, self.token, self._generation, None, 0)]

    def _on_manifest(self, manifest: Manifest) -> tuple[HandshakeState, list[Event]]:
        """Learner 0's model description: the layout it implies must match its own fingerprint."""
        assert self.hello is not None and self.token is not None
        lid = self.hello.learner_id
        if (manifest.num_fragments, manifest.pattern) != (self._num_fragments, self._pattern):
            raise Refused(ErrorCode.LAYOUT, f"manifest asks for {manifest.num_fragments} {manifest.pattern} "
                          f"fragments; the syncer uses {self._num_fragments} {self._pattern}")
        try:
            layout = build_layout(manifest.specs, manifest.num_fragments, manifest.pattern)
        except ValueError as exc:
            raise Refused(ErrorCode.LAYOUT, f"manifest of learner {lid}: {exc}") from exc
        if layout.fingerprint != self.hello.fingerprint:
            raise Refused(ErrorCode.LAYOUT, f"learner {lid}'s manifest does not produce the fingerprint it sent "
                          "in HELLO")
        bound = max_bulk_bytes(layout)
        return S.JOINED, [Admitted(self.hello, self.token, self._generation, manifest, bound)]

    def _on_attach(self, attach: Attach) -> tuple[HandshakeState, list[Event]]:
        learner = self._pending(attach.token)
        if learner is None:
            raise Refused(ErrorCode.PROTOCOL, "ATTACH names no pending connection group")
        if not auth.verify(self._key, attach.mac, auth.ATTACH_LABEL, self.nonce, attach.token,
                           bytes([attach.index])):
            raise Refused(ErrorCode.AUTH, f"HMAC check failed on a data stream of learner {learner}")
        return S.ATTACHED, [Attached(attach.token, attach.index)]
