"""yeto wire messages: frozen dataclasses with pure `encode`/`decode` (docs/PROTOCOL.md).

A frame is a 12-byte header followed by a body:

    magic b"YETO" | version u8 | type u8 | flags u16 | body length u32      (little-endian)

Bulk tensor bytes never travel inside a control frame. A message that carries bulk bytes
(MANIFEST is small and inline; INIT, PUSH, BCAST and FINAL are bulk) names a `transfer` id and
its byte count; the bytes follow as CHUNK frames of at most 4 MiB striped over the data
streams and are reassembled into one preallocated buffer (see `transport.py`).
"""

from __future__ import annotations

import abc
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

from yeto_core.consensus import MAX_SUMMARY_BYTES
from yeto_core.layout import TensorSpec
from yeto_core.wire.codec import BodyReader, BodyWriter
from yeto_core.wire.errors import ErrorCode, ProtocolError

MAGIC = b"YETO"
PROTOCOL_VERSION = 3
HEADER = struct.Struct("<4sBBHI")
CHUNK_HEADER = struct.Struct("<QQQ")  # transfer id, total bytes, offset of this chunk
CHUNK_BYTES = 4 * 1024 * 1024
MAX_CONTROL_BODY = 64 * 1024 * 1024  # bound for any inline body (the manifest is the largest)
NONCE_BYTES = 32
MAC_BYTES = 32
TOKEN_BYTES = 16
INSTANCE_BYTES = 16
FINGERPRINT_BYTES = 32


class MsgType(IntEnum):
    CHALLENGE = 1
    HELLO = 2
    WELCOME = 3
    ATTACH = 4
    ERROR = 5
    CHUNK = 6
    MANIFEST = 7
    INIT = 8
    PULL = 9
    PUSH = 10
    BCAST = 11
    FINAL = 12
    HEARTBEAT = 13
    BYE = 14
    DONE = 15
    BW_PROBE = 16
    PROBE_REPORT = 17
    CONSENSUS = 18


class Message(abc.ABC):
    """Base of all messages: `TYPE` is the frame type; BULK ones carry `transfer` and `nbytes`."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]
    BULK: ClassVar[bool] = False

    @abc.abstractmethod
    def encode(self) -> bytes: ...

    @classmethod
    @abc.abstractmethod
    def decode(cls, body: bytes | memoryview) -> Message: ...


def _bulk_fields(w: BodyWriter, transfer: int, nbytes: int, codec: int) -> None:
    w.u64(transfer).u64(nbytes).u8(codec)


@dataclass(frozen=True, slots=True)
class Challenge(Message):
    """Syncer → new stream, first frame: a fresh nonce and the schedule the learners follow, the
    syncer's alone: P, the fragment pattern, and H (`sync_interval`, learner steps per fragment
    round trip; 0: the syncer does not pace rounds by steps)."""

    TYPE: ClassVar[MsgType] = MsgType.CHALLENGE
    nonce: bytes
    num_fragments: int
    pattern: str
    sync_interval: int

    def encode(self) -> bytes:
        w = BodyWriter().fixed(self.nonce, NONCE_BYTES).u32(self.num_fragments).string(self.pattern)
        return w.u32(self.sync_interval).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Challenge:
        r = BodyReader(body, "CHALLENGE")
        msg = cls(r.fixed(NONCE_BYTES, "nonce"), r.u32("num_fragments"), r.string("pattern"), r.u32("sync_interval"))
        r.end()
        return msg


HELLO_SENDS_MANIFEST = 0x1  # flag: a MANIFEST frame follows WELCOME on the control stream
HELLO_CONSENSUS = 0x4  # flag: this learner takes CONSENSUS messages (DESIGN §8)
HELLO_OVERLAP = 0x8  # flag: this learner rebases on merged pushes (DESIGN §3.3, §4.6): never carry its late pushes
HELLO_SWEEPS = 0x10  # flag: it pushes every fragment at once per RL iteration (DESIGN §3.4): rounds must be unpaced
HELLO_SWEEP_OVERLAP = 0x20  # flag: ... and trains on while they merge: all its rounds must be in flight at once


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Learner → syncer on the control stream: who it is, its layout and session contract.

    `mac` = HMAC-SHA256(key, b"yeto-hello-v1" | len | server nonce | len | body-without-mac),
    each part prefixed by its 4-byte little-endian length (see `auth.sign`).
    """

    TYPE: ClassVar[MsgType] = MsgType.HELLO
    learner_id: int
    data_streams: int
    fingerprint: bytes
    wire_dtype: int
    chunk_bytes: int
    flags: int
    client_nonce: bytes
    mac: bytes = b"\0" * MAC_BYTES
    push_block: int = 0  # block size of a block-quantized wire dtype (part of the contract; 0 otherwise)
    # Random per learner process, the same on every redial: tells a redial of the holder of an id
    # from a second process claiming it. All zeros: a peer that names no instance.
    instance: bytes = b"\0" * INSTANCE_BYTES
    # The codec of the downlink deltas this learner takes (DESIGN §7.4); F32's id: exact broadcasts.
    downlink_dtype: int = 1

    def signed_part(self) -> bytes:
        return (
            BodyWriter()
            .u32(self.learner_id)
            .u8(self.data_streams)
            .fixed(self.fingerprint, FINGERPRINT_BYTES)
            .u8(self.wire_dtype)
            .u32(self.chunk_bytes)
            .u32(self.flags)
            .fixed(self.client_nonce, NONCE_BYTES)
            .u32(self.push_block)
            .fixed(self.instance, INSTANCE_BYTES)
            .u8(self.downlink_dtype)
            .getvalue()
        )

    def encode(self) -> bytes:
        return self.signed_part() + BodyWriter().fixed(self.mac, MAC_BYTES).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Hello:
        r = BodyReader(body, "HELLO")
        msg = cls(
            learner_id=r.u32("learner_id"),
            data_streams=r.u8("data_streams"),
            fingerprint=r.fixed(FINGERPRINT_BYTES, "fingerprint"),
            wire_dtype=r.u8("wire_dtype"),
            chunk_bytes=r.u32("chunk_bytes"),
            flags=r.u32("flags"),
            client_nonce=r.fixed(NONCE_BYTES, "client_nonce"),
            push_block=r.u32("push_block"),
            instance=r.fixed(INSTANCE_BYTES, "instance"),
            downlink_dtype=r.u8("downlink_dtype"),
            mac=r.fixed(MAC_BYTES, "mac"),
        )
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """Syncer → learner: accepted. `mac` proves the syncer knows the key too (mutual auth)."""

    TYPE: ClassVar[MsgType] = MsgType.WELCOME
    token: bytes
    generation: int
    initial_cut_ready: bool
    mac: bytes = b"\0" * MAC_BYTES

    def encode(self) -> bytes:
        return (
            BodyWriter()
            .fixed(self.token, TOKEN_BYTES)
            .u32(self.generation)
            .u8(int(self.initial_cut_ready))
            .fixed(self.mac, MAC_BYTES)
            .getvalue()
        )

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Welcome:
        r = BodyReader(body, "WELCOME")
        msg = cls(r.fixed(TOKEN_BYTES, "token"), r.u32("generation"), bool(r.u8("initial_cut_ready")),
                  r.fixed(MAC_BYTES, "mac"))
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Attach(Message):
    """Learner → syncer on a data stream: join connection group `token` as data stream `index`."""

    TYPE: ClassVar[MsgType] = MsgType.ATTACH
    token: bytes
    index: int
    mac: bytes = b"\0" * MAC_BYTES

    def encode(self) -> bytes:
        return BodyWriter().fixed(self.token, TOKEN_BYTES).u8(self.index).fixed(self.mac, MAC_BYTES).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Attach:
        r = BodyReader(body, "ATTACH")
        msg = cls(r.fixed(TOKEN_BYTES, "token"), r.u8("index"), r.fixed(MAC_BYTES, "mac"))
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Error(Message):
    TYPE: ClassVar[MsgType] = MsgType.ERROR
    code: ErrorCode
    reason: str

    def encode(self) -> bytes:
        return BodyWriter().u16(int(self.code)).string(self.reason).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Error:
        r = BodyReader(body, "ERROR")
        raw = r.u16("code")
        reason = r.string("reason")
        r.end()
        try:
            code = ErrorCode(raw)
        except ValueError:
            code = ErrorCode.PROTOCOL
            reason = f"(unknown error code {raw}) {reason}"
        return cls(code, reason)


@dataclass(frozen=True, slots=True)
class Manifest(Message):
    """Learner 0 → syncer: the trainable tensors in canonical order (names, shapes, dtypes)."""

    TYPE: ClassVar[MsgType] = MsgType.MANIFEST
    num_fragments: int
    pattern: str
    specs: tuple[TensorSpec, ...]

    def encode(self) -> bytes:
        w = BodyWriter().u32(self.num_fragments).string(self.pattern).u32(len(self.specs))
        for s in self.specs:
            w.string(s.name).u8(len(s.shape))
            for d in s.shape:
                w.u64(d)
            w.string(s.dtype).u8(int(s.embedding))
        return w.getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Manifest:
        r = BodyReader(body, "MANIFEST")
        p = r.u32("num_fragments")
        pattern = r.string("pattern")
        specs = []
        for _ in range(r.count("specs")):
            name = r.string("name")
            shape = tuple(r.u64("shape") for _ in range(r.u8("rank")))
            dtype, embedding = r.string("dtype"), bool(r.u8("embedding"))
            try:
                specs.append(TensorSpec(name, shape, dtype, embedding))
            except ValueError as exc:
                raise ProtocolError(f"MANIFEST: tensor {name!r}: {exc}") from exc
        r.end()
        return cls(p, pattern, tuple(specs))


@dataclass(frozen=True, slots=True)
class Init(Message):
    """Learner 0 → syncer: initial f32 values of one fragment (bulk)."""

    TYPE: ClassVar[MsgType] = MsgType.INIT
    BULK: ClassVar[bool] = True
    fragment: int
    transfer: int
    nbytes: int
    codec: int

    def encode(self) -> bytes:
        w = BodyWriter().u32(self.fragment)
        _bulk_fields(w, self.transfer, self.nbytes, self.codec)
        return w.getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Init:
        r = BodyReader(body, "INIT")
        msg = cls(r.u32("fragment"), r.u64("transfer"), r.u64("nbytes"), r.u8("codec"))
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Pull(Message):
    """Syncer → learner: answer round `round` (attempt `attempt`) with a delta of `fragment`,
    measured against the fragment's global `version` (install that version first)."""

    TYPE: ClassVar[MsgType] = MsgType.PULL
    round: int
    attempt: int
    fragment: int
    version: int

    def encode(self) -> bytes:
        return BodyWriter().u64(self.round).u32(self.attempt).u32(self.fragment).u32(self.version).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Pull:
        r = BodyReader(body, "PULL")
        msg = cls(r.u64("round"), r.u32("attempt"), r.u32("fragment"), r.u32("version"))
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Push(Message):
    """Learner → syncer: d = θ − anchor for `fragment`, with the tokens and steps since the anchor
    and the learner's smoothed wall time per inner step (µs; the syncer sizes grace and pacing by it)."""

    TYPE: ClassVar[MsgType] = MsgType.PUSH
    BULK: ClassVar[bool] = True
    round: int
    attempt: int
    fragment: int
    base_version: int
    tokens: int
    steps: int
    step_us: int
    transfer: int
    nbytes: int
    codec: int

    def encode(self) -> bytes:
        w = BodyWriter().u64(self.round).u32(self.attempt).u32(self.fragment).u32(self.base_version)
        w.u64(self.tokens).u32(self.steps).u32(self.step_us)
        _bulk_fields(w, self.transfer, self.nbytes, self.codec)
        return w.getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Push:
        r = BodyReader(body, "PUSH")
        msg = cls(
            round=r.u64("round"),
            attempt=r.u32("attempt"),
            fragment=r.u32("fragment"),
            base_version=r.u32("base_version"),
            tokens=r.u64("tokens"),
            steps=r.u32("steps"),
            step_us=r.u32("step_us"),
            transfer=r.u64("transfer"),
            nbytes=r.u64("nbytes"),
            codec=r.u8("codec"),
        )
        r.end()
        return msg


PUSH_MOMENT = 0x80  # PUSH codec bit: the delta is followed by the model's first moment (yeto_core.moments)
BCAST_FULL = 0x1  # payload is the full fragment, f32
BCAST_DELTA = 0x2  # payload is code(Θ − downlink anchor) in the codec the learner's HELLO.downlink_dtype names
BCAST_MERGED = 0x4  # this version merged the receiving learner's push for `round` (overlap rebasing)
BCAST_LAST = 0x8  # `round` was the fragment's last (the run's total rounds): no PULL for it will follow
BCAST_MOMENT = 0x10  # the values are followed by the model's merged first moment (DESIGN §3.9)


@dataclass(frozen=True, slots=True)
class Bcast(Message):
    """Syncer → learner: the merged global value of `fragment` at `version` (bulk). FULL: the f32
    values; DELTA: code(Θ − downlink anchor), `codec` the learner's downlink codec.
    `digest` is the SHA-256 of the anchor it leads to."""

    TYPE: ClassVar[MsgType] = MsgType.BCAST
    BULK: ClassVar[bool] = True
    fragment: int
    version: int
    round: int
    flags: int
    transfer: int
    nbytes: int
    codec: int
    digest: bytes = b"\0" * 32

    def encode(self) -> bytes:
        w = BodyWriter().u32(self.fragment).u32(self.version).u64(self.round).u32(self.flags)
        _bulk_fields(w, self.transfer, self.nbytes, self.codec)
        return w.fixed(self.digest, 32).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Bcast:
        r = BodyReader(body, "BCAST")
        msg = cls(r.u32("fragment"), r.u32("version"), r.u64("round"), r.u32("flags"), r.u64("transfer"),
                  r.u64("nbytes"), r.u8("codec"), r.fixed(32, "digest"))
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Final(Message):
    """Syncer → learner: the exact final value of `fragment` (one of `num_fragments` cuts)."""

    TYPE: ClassVar[MsgType] = MsgType.FINAL
    BULK: ClassVar[bool] = True
    fragment: int
    version: int
    num_fragments: int
    rounds: int
    transfer: int
    nbytes: int
    codec: int

    def encode(self) -> bytes:
        w = BodyWriter().u32(self.fragment).u32(self.version).u32(self.num_fragments).u64(self.rounds)
        _bulk_fields(w, self.transfer, self.nbytes, self.codec)
        return w.getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Final:
        r = BodyReader(body, "FINAL")
        msg = cls(r.u32("fragment"), r.u32("version"), r.u32("num_fragments"), r.u64("rounds"),
                  r.u64("transfer"), r.u64("nbytes"), r.u8("codec"))
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    seq: int
    step: int

    def encode(self) -> bytes:
        return BodyWriter().u64(self.seq).u64(self.step).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Heartbeat:
        r = BodyReader(body, "HEARTBEAT")
        msg = cls(r.u64("seq"), r.u64("step"))
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Bye(Message):
    """Either side: this connection group ends on purpose (after FINAL, or when leaving)."""

    TYPE: ClassVar[MsgType] = MsgType.BYE
    reason: str

    def encode(self) -> bytes:
        return BodyWriter().string(self.reason).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Bye:
        r = BodyReader(body, "BYE")
        msg = cls(r.string("reason"))
        r.end()
        return msg


@dataclass(frozen=True, slots=True)
class Done(Message):
    """Learner → syncer: local training reached its own limit; send the final cut."""

    TYPE: ClassVar[MsgType] = MsgType.DONE
    step: int

    def encode(self) -> bytes:
        return BodyWriter().u64(self.step).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Done:
        r = BodyReader(body, "DONE")
        msg = cls(r.u64("step"))
        r.end()
        return msg


MAX_PROBE_BYTES = 1 << 30  # per direction


@dataclass(frozen=True, slots=True)
class BwProbe(Message):
    """A bandwidth probe on a connection of its own (never part of a session). The learner sends
    it, sealed with HMAC(key, b"yeto-probe-v1" | nonce | up | down), then `up` raw bytes; the
    syncer answers BW_PROBE (its own seal over the same fields) once they arrived, then sends
    `down` raw bytes. Each side is bounded by MAX_PROBE_BYTES."""

    TYPE: ClassVar[MsgType] = MsgType.BW_PROBE
    up: int
    down: int
    mac: bytes = b"\0" * MAC_BYTES

    def encode(self) -> bytes:
        return BodyWriter().u64(self.up).u64(self.down).fixed(self.mac, MAC_BYTES).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> BwProbe:
        r = BodyReader(body, "BW_PROBE")
        msg = cls(r.u64("up"), r.u64("down"), r.fixed(MAC_BYTES, "mac"))
        r.end()
        if msg.up > MAX_PROBE_BYTES or msg.down > MAX_PROBE_BYTES:
            raise ProtocolError(f"BW_PROBE asks for {msg.up}/{msg.down} bytes (bound {MAX_PROBE_BYTES} each way)")
        return msg


@dataclass(frozen=True, slots=True)
class ProbeReport(Message):
    """Learner → syncer (DESIGN §8.1): its output distribution on the fixed probe batch, summarized
    (`yeto_core.consensus` wire form, at most MAX_SUMMARY_BYTES), taken at optimizer step `step`
    right after installing merged fragments; `installed` is the sum of the fragment versions it
    held then (how many committed rounds its weights reflect), so the syncer compares only
    summaries of learners that are about as far along."""

    TYPE: ClassVar[MsgType] = MsgType.PROBE_REPORT
    step: int
    installed: int
    summary: bytes

    def encode(self) -> bytes:
        return BodyWriter().u64(self.step).u64(self.installed).blob(self.summary, MAX_SUMMARY_BYTES).getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> ProbeReport:
        r = BodyReader(body, "PROBE_REPORT")
        msg = cls(r.u64("step"), r.u64("installed"), r.blob(MAX_SUMMARY_BYTES, "summary"))
        r.end()
        return msg


MAX_CONSENSUS_FRAGMENTS = 1 << 16
UNKNOWN = -1.0  # CONSENSUS: a value not measured yet


@dataclass(frozen=True, slots=True)
class Consensus(Message):
    """Syncer → learner after a commit (DESIGN §8.2): the mean pairwise Jensen–Shannon distance of the
    learners' latest probe summaries (over `learners` learners; `js` is UNKNOWN while fewer than
    two are comparable) and, per fragment, the mean L2 norm of the learners' last merged deltas
    θ − anchor (UNKNOWN for a fragment not merged yet)."""

    TYPE: ClassVar[MsgType] = MsgType.CONSENSUS
    round: int
    learners: int
    js: float
    fragment_l2: tuple[float, ...]

    def encode(self) -> bytes:
        w = BodyWriter().u64(self.round).u32(self.learners).f64(self.js)
        if len(self.fragment_l2) > MAX_CONSENSUS_FRAGMENTS:
            raise ValueError(f"CONSENSUS for {len(self.fragment_l2)} fragments exceeds {MAX_CONSENSUS_FRAGMENTS}")
        w.u32(len(self.fragment_l2))
        for v in self.fragment_l2:
            w.f64(v)
        return w.getvalue()

    @classmethod
    def decode(cls, body: bytes | memoryview) -> Consensus:
        r = BodyReader(body, "CONSENSUS")
        rnd, learners, js = r.u64("round"), r.u32("learners"), r.f64("js")
        l2 = tuple(r.f64("fragment_l2") for _ in range(r.count("fragment_l2", MAX_CONSENSUS_FRAGMENTS)))
        r.end()
        if not (js == UNKNOWN or 0.0 <= js <= 1.0):
            raise ProtocolError(f"CONSENSUS: field 'js' is {js!r}, not a distance in [0, 1]")
        bad = [v for v in l2 if not (v == UNKNOWN or 0.0 <= v < float("inf"))]
        if bad:
            raise ProtocolError(f"CONSENSUS: field 'fragment_l2' holds {bad[0]!r}, not a finite norm")
        return cls(rnd, learners, js, l2)


MESSAGE_TYPES: dict[MsgType, type[Message]] = {
    cls.TYPE: cls
    for cls in (Challenge, Hello, Welcome, Attach, Error, Manifest, Init, Pull, Push, Bcast, Final, Heartbeat,
                Bye, Done, BwProbe, ProbeReport, Consensus)
}


def encode_frame(msg: Message) -> bytes:
    """Header + body of one control frame."""
    body = msg.encode()
    if len(body) > MAX_CONTROL_BODY:
        raise ValueError(f"{msg.TYPE.name} body of {len(body)} bytes exceeds {MAX_CONTROL_BODY}")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(msg.TYPE), 0, len(body)) + body


def parse_header(raw: bytes | memoryview, max_body: int = MAX_CONTROL_BODY) -> tuple[MsgType, int]:
    """Validate a frame header; returns (type, body length). Raises ProtocolError."""
    if len(raw) != HEADER.size:
        raise ProtocolError(f"a frame header is {HEADER.size} bytes, got {len(raw)}")
    magic, version, mtype, _flags, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (not a yeto peer?)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})")
    try:
        kind = MsgType(mtype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {mtype}") from None
    limit = CHUNK_HEADER.size + CHUNK_BYTES if kind is MsgType.CHUNK else max_body
    if length > limit:
        raise ProtocolError(f"{kind.name} frame of {length} bytes exceeds the {limit}-byte bound")
    return kind, length


def decode_body(kind: MsgType, body: bytes | memoryview) -> Message:
    if kind is MsgType.CHUNK:
        raise ProtocolError("CHUNK frames are only valid on data streams")
    return MESSAGE_TYPES[kind].decode(body)
