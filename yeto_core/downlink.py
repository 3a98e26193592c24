"""Downlink deltas (DESIGN §7.4): broadcasts as a code of (Θ − anchor) instead of the full f32 fragment.

Both ends keep, per fragment and per downlink codec, a bit-identical f32 *downlink anchor*: the
value the learner holds for the fragment. A delta broadcast carries code(Θ − anchor) (bf16, or a
block-quantized code: int8, int4, the 4-bit level codecs, int2); both ends then compute
anchor ← anchor + decode(code) with the same float32 ops, so their anchors stay equal bit for bit.
This is error feedback by construction: what the code could not carry is still in Θ − anchor and
goes out with the fragment's next broadcast, so the anchor trails Θ by one code's error, never by
an accumulated drift. A FULL broadcast resets the anchor to Θ exactly: for a fragment's last
version, whenever a learner (re)connects (it then gets the current shared anchor, joining the
chain everyone else is on), and, when asked for, every `full_every` versions.

Every broadcast names the SHA-256 of the anchor it leads to. A learner whose anchor hashes
differently (a lost or corrupt update, a bug) raises `AnchorMismatch`; the client drops the
connection, and the reconnect restores the anchor with a FULL send. A wrong model is never kept
silently.

`Downlink` says what each message from the syncer means to a learner's link (the values a
broadcast carries, a refusal, a notice), the same for the socket client and the simulation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from yeto_core.codecs import BF16, F32, Codec, codec_by_id, tensor_bytes
from yeto_core.layout import Layout
from yeto_core.moments import moment_nbytes, moment_problem
from yeto_core.quant import QUANT_WIRE_IDS, quant_codec
from yeto_core.wire.errors import ProtocolError, Refused
from yeto_core.wire.messages import BCAST_DELTA, BCAST_MOMENT, Bcast, Bye, Consensus, Error, Final, Message, Pull

FULL = 0x1
DELTA = 0x2

DOWNLINK_DTYPES = ("f32", "bf16", *QUANT_WIRE_IDS)  # f32: every broadcast the exact fragment, no anchor
DOWNLINK_BLOCK = 128  # values per scale of a block-quantized downlink code
DOWNLINK_WIRE_IDS = (BF16.wire_id, *QUANT_WIRE_IDS.values())  # the delta codecs HELLO.downlink_dtype may name


def downlink_codec(name: str) -> Codec | None:
    """The delta codec a learner asking for downlink `name` takes; None for `f32` (exact broadcasts)."""
    if name == "f32":
        return None
    if name == "bf16":
        return BF16
    if name in QUANT_WIRE_IDS:
        return quant_codec(name, DOWNLINK_BLOCK)
    raise ValueError(f"unknown downlink dtype {name!r}; accepted: {', '.join(DOWNLINK_DTYPES)}")


def downlink_codec_by_id(wire_id: int) -> Codec | None:
    """The delta codec named on the wire by `wire_id` (HELLO.downlink_dtype); None for f32 (or 0,
    a learner that names none). ValueError for an id that is no downlink codec."""
    if wire_id in (0, F32.wire_id):
        return None
    return codec_by_id(wire_id, block=DOWNLINK_BLOCK)


class AnchorMismatch(Exception):
    """The learner's downlink anchor no longer equals the syncer's: resync with a FULL send."""


def anchor_digest(anchor: torch.Tensor) -> bytes:
    return hashlib.sha256(tensor_bytes(anchor)).digest()


@dataclass(frozen=True)
class Broadcast:
    flags: int  # FULL or DELTA
    codec: int  # F32's wire id (FULL) or the delta codec's
    payload: memoryview
    digest: bytes  # SHA-256 of the anchor after applying this broadcast


class DownlinkAnchors:
    """The sending side's anchors of one delta codec: one shared f32 anchor per fragment for every
    learner that takes that codec, and the SHA-256 each leads to. The syncer's protocol keeps them
    as its own state and decides which a broadcast is; its shell runs `encode_broadcast`. A
    fragment whose commit reached no learner of the codec drops its anchor, so its chain starts
    again with a FULL."""

    def __init__(self, num_fragments: int, full_every: int, codec: Codec = BF16) -> None:
        if codec.wire_id not in DOWNLINK_WIRE_IDS:
            raise ValueError(f"{codec.name} is not a downlink delta codec")
        if full_every < 0:
            raise ValueError(f"full_every must be >= 0, got {full_every}")
        self.full_every = full_every
        self.codec = codec
        self.anchors: list[torch.Tensor | None] = [None] * num_fragments
        self.digests: list[bytes] = [b""] * num_fragments
        self.versions: list[int] = [-1] * num_fragments  # the fragment version each anchor stands for

    def held(self, fragment: int) -> bool:
        return self.anchors[fragment] is not None

    def full_at(self, fragment: int, version: int, *, last: bool) -> bool:
        """Whether `version` of `fragment` goes out FULL: no anchor yet, a fragment's last
        version, or every `full_every` versions when that is set (0: never for that reason; the
        anchor trails Θ by one code's error whatever the run's length)."""
        periodic = self.full_every > 0 and version % self.full_every == 0
        return self.anchors[fragment] is None or last or periodic

    def install(self, fragment: int, anchor: torch.Tensor, digest: bytes, version: int) -> None:
        self.anchors[fragment] = anchor
        self.digests[fragment] = digest
        self.versions[fragment] = version

    def drop(self, fragment: int) -> None:
        """Nobody follows the chain: restart it with a FULL later."""
        self.anchors[fragment] = None
        self.digests[fragment] = b""
        self.versions[fragment] = -1


class DownlinkChains:
    """The syncer's anchors of every downlink codec in use, one `DownlinkAnchors` each, made when a
    learner first needs that codec's chain: learners that ask for different codecs are each
    served their own chain, and learners of one codec share one."""

    def __init__(self, num_fragments: int, full_every: int) -> None:
        self.num_fragments = num_fragments
        self.full_every = full_every
        self.by_id: dict[int, DownlinkAnchors] = {}

    def of(self, codec: Codec) -> DownlinkAnchors:
        chain = self.by_id.get(codec.wire_id)
        if chain is None:
            chain = self.by_id[codec.wire_id] = DownlinkAnchors(self.num_fragments, self.full_every, codec)
        return chain

    def whole(self) -> tuple[dict[int, list[torch.Tensor]], dict[int, list[int]]]:
        """The chains that hold an anchor of every fragment, and their versions: what a checkpoint
        keeps (a chain missing a fragment starts again with FULLs after a resume anyway)."""
        anchors: dict[int, list[torch.Tensor]] = {}
        versions: dict[int, list[int]] = {}
        for wire_id, chain in self.by_id.items():
            held = [a for a in chain.anchors if a is not None]
            if len(held) == self.num_fragments:
                anchors[wire_id], versions[wire_id] = held, list(chain.versions)
        return anchors, versions

    def restore(self, anchors: dict[int, list[torch.Tensor]], versions: dict[int, list[int]],
                params: list[torch.Tensor], fragment_versions: list[int]) -> None:
        """A resumed syncer's chains, from its checkpoint. An anchor saved between a commit and its
        broadcast stands for the version before its fragment's: it is brought forward by the very
        encode that broadcast made, so the chain holds the bits an uninterrupted run would have. An
        anchor further behind (a checkpoint no yeto writes) leaves its fragment to a FULL."""
        for wire_id, saved in anchors.items():
            chain = self.of(codec_by_id(wire_id, block=DOWNLINK_BLOCK))
            for f, anchor in enumerate(saved):
                behind = fragment_versions[f] - versions[wire_id][f]
                if behind == 1:
                    encode_broadcast(anchor, params[f], chain.codec)
                elif behind != 0:
                    continue
                chain.install(f, anchor, anchor_digest(anchor), fragment_versions[f])


class DownlinkEncoder(DownlinkAnchors):
    """The anchors with the arithmetic done in place: each commit moves the shared anchor."""

    def commit(self, fragment: int, version: int, theta: torch.Tensor, *, last: bool = False) -> Broadcast:
        """The broadcast of `theta` (f32, CPU) as `fragment`'s `version`; advances the shared anchor."""
        full = self.full_at(fragment, version, last=last)
        anchor, out = encode_broadcast(None if full else self.anchors[fragment], theta, self.codec)
        self.install(fragment, anchor, out.digest, version)
        return out

    def full(self, fragment: int) -> Broadcast:
        """A FULL resend of the shared anchor (for a learner that joins or reconnects)."""
        anchor = self.anchors[fragment]
        if anchor is None:
            raise ValueError(f"fragment {fragment} has no downlink anchor yet")
        return Broadcast(FULL, F32.wire_id, tensor_bytes(anchor.clone()), self.digests[fragment])


def encode_broadcast(anchor: torch.Tensor | None, theta: torch.Tensor,
                     codec: Codec = BF16) -> tuple[torch.Tensor, Broadcast]:
    """The broadcast that takes a downlink anchor to `theta` (f32, any device), and the anchor it
    leads to: with no `anchor`, a FULL (the new anchor is a copy of `theta` on the CPU, the
    payload another copy, so the anchor may move later while a send still reads the payload);
    otherwise a DELTA, codec(theta − anchor), and `anchor` moved by its decoded value in place."""
    if anchor is None:
        new = theta.detach().to("cpu", dtype=torch.float32, copy=True)
        return new, Broadcast(FULL, F32.wire_id, tensor_bytes(new.clone()), anchor_digest(new))
    diff = theta.detach().to("cpu", dtype=torch.float32) - anchor
    encoded = bytearray(codec.encoded_nbytes(diff.numel()))
    codec.encode(diff, memoryview(encoded))
    apply_delta(anchor, memoryview(encoded), codec, step=diff)
    return anchor, Broadcast(DELTA, codec.wire_id, memoryview(encoded), anchor_digest(anchor))


def apply_delta(anchor: torch.Tensor, encoded: memoryview, codec: Codec = BF16,
                step: torch.Tensor | None = None) -> None:
    """anchor ← anchor + decode(delta), in place; the same ops on both ends give the same bits.
    `step`: a scratch tensor of the anchor's size to decode into (else one is made)."""
    step = torch.empty_like(anchor) if step is None else step
    codec.decode(encoded, step)
    anchor.add_(step)


class DownlinkDecoder:
    """The learner's side: rebuilds each fragment's value from FULL and DELTA broadcasts."""

    def __init__(self, num_fragments: int, codec: Codec = BF16) -> None:
        self.codec = codec
        self.anchors: list[torch.Tensor | None] = [None] * num_fragments
        self.versions: list[int] = [-1] * num_fragments

    def apply(self, fragment: int, version: int, flags: int, payload: memoryview, digest: bytes) -> torch.Tensor:
        """The fragment's new value (a tensor the caller may keep), or AnchorMismatch."""
        if flags & FULL:
            anchor = torch.frombuffer(bytearray(payload), dtype=torch.float32) if len(payload) else torch.empty(0)
        else:
            held = self.anchors[fragment]
            if held is None or version != self.versions[fragment] + 1:
                raise AnchorMismatch(f"delta broadcast of fragment {fragment} v{version} does not follow the "
                                     f"anchor held (v{self.versions[fragment]})")
            anchor = held.clone()
            apply_delta(anchor, payload, self.codec)
        if anchor_digest(anchor) != digest:
            self.anchors[fragment] = None
            raise AnchorMismatch(f"fragment {fragment} v{version}: the downlink anchor's SHA-256 differs from the "
                                 "syncer's")
        self.anchors[fragment] = anchor
        self.versions[fragment] = version
        return anchor.clone()


class BroadcastReader:
    """What a learner makes of a BCAST or FINAL, socket or not: the fragment's f32 values, checked
    against its layout (a wrong size or codec is a `ProtocolError`), delta broadcasts applied to
    the downlink anchor it keeps (`AnchorMismatch` when they do not follow it). `delta_codec`:
    the downlink codec this learner asked for (None: exact f32 broadcasts only)."""

    def __init__(self, layout: Layout, *, delta_codec: Codec | None) -> None:
        self.layout = layout
        self.delta_codec = delta_codec
        self.downlink = DownlinkDecoder(layout.num_fragments, delta_codec) if delta_codec is not None else None

    def moment_of(self, msg: Bcast | Final,
                  payload: memoryview | None) -> tuple[memoryview | None, memoryview | None]:
        """A BCAST_MOMENT payload split into its values' bytes and the fragment's merged first moment
        (its last `moment_nbytes`, checked and kept in its wire form, DESIGN §3.9); any other
        payload as it is, with no moment."""
        if not isinstance(msg, Bcast) or not msg.flags & BCAST_MOMENT:
            return payload, None
        if msg.fragment >= self.layout.num_fragments:
            raise ProtocolError(f"syncer sent BCAST for fragment {msg.fragment} of {self.layout.num_fragments}")
        fragment = self.layout.fragments[msg.fragment]
        nbytes = moment_nbytes(fragment)
        if payload is None or len(payload) < nbytes:
            raise ProtocolError(f"syncer sent BCAST of {0 if payload is None else len(payload)} bytes for fragment "
                                f"{msg.fragment} with a first moment of {nbytes} bytes")
        cut = len(payload) - nbytes
        moment = payload[cut:]
        problem = moment_problem(fragment, moment)
        if problem is not None:
            raise ProtocolError(f"syncer sent BCAST for fragment {msg.fragment} with a bad first moment: {problem}")
        return payload[:cut], moment

    def values(self, msg: Bcast | Final, payload: memoryview | None) -> torch.Tensor:
        """The values, as a tensor over `payload` itself for a full f32 send (the caller's buffer,
        not copied) or a fresh one."""
        kind = type(msg).__name__
        if msg.fragment >= self.layout.num_fragments:
            raise ProtocolError(f"syncer sent {kind} for fragment {msg.fragment} of {self.layout.num_fragments}")
        numel = self.layout.fragments[msg.fragment].numel
        delta = isinstance(msg, Bcast) and bool(msg.flags & BCAST_DELTA)
        if delta and self.delta_codec is None:
            raise ProtocolError(f"syncer sent a delta {kind} for fragment {msg.fragment} to a learner that takes "
                                "exact f32 broadcasts")
        codec = self.delta_codec if delta and self.delta_codec is not None else F32
        expected = codec.encoded_nbytes(numel)
        if payload is None or len(payload) != expected or msg.codec != codec.wire_id:
            raise ProtocolError(f"syncer sent {kind} of {0 if payload is None else len(payload)} bytes (codec id "
                                f"{msg.codec}) for fragment {msg.fragment}; expected {expected} {codec.name} bytes")
        if isinstance(msg, Bcast) and self.downlink is not None:
            return self.downlink.apply(msg.fragment, msg.version, msg.flags, payload, msg.digest)
        return torch.frombuffer(payload, dtype=torch.float32) if expected else torch.empty(0)


@dataclass(frozen=True, slots=True)
class Routed:
    """What one message from the syncer means to the learner's link."""

    values: torch.Tensor | None = None  # a BCAST's or FINAL's fragment values
    moment: memoryview | None = None  # a BCAST's merged first moment in wire form, when it carries one (§3.9)
    refusal: Refused | None = None  # a permanent ERROR: this learner is refused for good
    notice: Error | None = None  # any other ERROR: reported, and the link goes on
    consensus: bool = False  # the syncer speaks the consensus messages (it sent CONSENSUS)


class Downlink:
    """The learner's reading of the syncer's messages. Its broadcast reader, and so the downlink
    anchor, is kept across connections."""

    def __init__(self, *, delta_codec: Codec | None) -> None:
        self.delta_codec = delta_codec
        self.reader: BroadcastReader | None = None  # made at the first broadcast

    def route(self, msg: Message, payload: memoryview | None, layout: Layout | None) -> Routed:
        """Raises AnchorMismatch for a broadcast that does not lead to the anchor it names, and
        ProtocolError for a message a syncer never sends a learner."""
        if isinstance(msg, Bcast | Final):
            if self.reader is None:
                assert layout is not None, "a broadcast comes after WELCOME, which gives the layout"
                self.reader = BroadcastReader(layout, delta_codec=self.delta_codec)
            payload, moment = self.reader.moment_of(msg, payload)
            return Routed(values=self.reader.values(msg, payload), moment=moment)
        if isinstance(msg, Error):
            return Routed(refusal=Refused(msg.code, msg.reason)) if msg.code.permanent else Routed(notice=msg)
        if isinstance(msg, Consensus):
            return Routed(consensus=True)
        if not isinstance(msg, Pull | Bye):
            raise ProtocolError(f"unexpected {type(msg).__name__} from the syncer")
        return Routed()
