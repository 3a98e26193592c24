"""Downlink deltas (DESIGN §7.4): broadcasts as bf16(Θ − anchor) instead of the full f32 fragment.

Both ends keep, per fragment, a bit-identical f32 *downlink anchor*: the value the learner holds
for the fragment. A delta broadcast carries bf16(Θ − anchor); both ends then compute
anchor ← anchor + f32(that bf16) with the same float32 ops, so their anchors stay equal bit for
bit while tracking Θ to within bf16 rounding of each step. A FULL broadcast resets the anchor to
Θ exactly: every `full_every` versions, for a fragment's last version, and whenever a learner
(re)connects (it then gets the current shared anchor, joining the chain everyone else is on).

Every broadcast names the SHA-256 of the anchor it leads to. A learner whose anchor hashes
differently (a lost or corrupt update, a bug) raises `AnchorMismatch`; the client drops the
connection, and the reconnect restores the anchor with a FULL send. A wrong model is never kept
silently.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from yeto_core.codecs import BF16, F32, tensor_bytes
from yeto_core.layout import Layout
from yeto_core.wire.errors import ProtocolError
from yeto_core.wire.messages import BCAST_DELTA, Bcast, Final

FULL = 0x1
DELTA = 0x2


class AnchorMismatch(Exception):
    """The learner's downlink anchor no longer equals the syncer's: resync with a FULL send."""


def anchor_digest(anchor: torch.Tensor) -> bytes:
    return hashlib.sha256(tensor_bytes(anchor)).digest()


@dataclass(frozen=True)
class Broadcast:
    flags: int  # FULL or DELTA
    codec: int  # F32 (FULL) or BF16 (DELTA)
    payload: memoryview
    digest: bytes  # SHA-256 of the anchor after applying this broadcast


class DownlinkEncoder:
    """The syncer's side: one shared anchor per fragment for every delta-mode learner."""

    def __init__(self, num_fragments: int, full_every: int) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.full_every = full_every
        self.anchors: list[torch.Tensor | None] = [None] * num_fragments
        self.digests: list[bytes] = [b""] * num_fragments

    def commit(self, fragment: int, version: int, theta: torch.Tensor, *, last: bool = False) -> Broadcast:
        """The broadcast of `theta` (f32, CPU) as `fragment`'s `version`; advances the shared anchor."""
        anchor = self.anchors[fragment]
        if anchor is None or last or version % self.full_every == 0:
            new = theta.detach().to("cpu", dtype=torch.float32, copy=True)
            self.anchors[fragment] = new
            self.digests[fragment] = anchor_digest(new)
            return Broadcast(FULL, F32.wire_id, tensor_bytes(new.clone()), self.digests[fragment])
        diff = theta.detach().to("cpu", dtype=torch.float32) - anchor
        encoded = bytearray(BF16.encoded_nbytes(diff.numel()))
        BF16.encode(diff, memoryview(encoded))
        apply_delta(anchor, memoryview(encoded))
        self.digests[fragment] = anchor_digest(anchor)
        return Broadcast(DELTA, BF16.wire_id, memoryview(encoded), self.digests[fragment])

    def full(self, fragment: int) -> Broadcast:
        """A FULL resend of the shared anchor (for a learner that joins or reconnects)."""
        anchor = self.anchors[fragment]
        if anchor is None:
            raise ValueError(f"fragment {fragment} has no downlink anchor yet")
        return Broadcast(FULL, F32.wire_id, tensor_bytes(anchor.clone()), self.digests[fragment])


def apply_delta(anchor: torch.Tensor, encoded: memoryview) -> None:
    """anchor ← anchor + f32(bf16 delta), in place; the same ops on both ends give the same bits."""
    step = torch.empty_like(anchor)
    BF16.decode(encoded, step)
    anchor.add_(step)


class DownlinkDecoder:
    """The learner's side: rebuilds each fragment's value from FULL and DELTA broadcasts."""

    def __init__(self, num_fragments: int) -> None:
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
            apply_delta(anchor, payload)
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
    the downlink anchor it keeps (`AnchorMismatch` when they do not follow it)."""

    def __init__(self, layout: Layout, *, bcast_delta: bool) -> None:
        self.layout = layout
        self.bcast_delta = bcast_delta
        self.downlink = DownlinkDecoder(layout.num_fragments) if bcast_delta else None

    def values(self, msg: Bcast | Final, payload: memoryview | None) -> torch.Tensor:
        """The values, as a tensor over `payload` itself for a full f32 send (the caller's buffer,
        not copied) or a fresh one."""
        kind = type(msg).__name__
        if msg.fragment >= self.layout.num_fragments:
            raise ProtocolError(f"syncer sent {kind} for fragment {msg.fragment} of {self.layout.num_fragments}")
        numel = self.layout.fragments[msg.fragment].numel
        delta = isinstance(msg, Bcast) and bool(msg.flags & BCAST_DELTA)
        codec = BF16 if delta else F32
        expected = codec.encoded_nbytes(numel)
        unasked = delta and not self.bcast_delta
        if payload is None or len(payload) != expected or msg.codec != codec.wire_id or unasked:
            raise ProtocolError(f"syncer sent {kind} of {0 if payload is None else len(payload)} bytes for fragment "
                                f"{msg.fragment}; expected {expected} {codec.name} bytes")
        if isinstance(msg, Bcast) and self.downlink is not None:
            return self.downlink.apply(msg.fragment, msg.version, msg.flags, payload, msg.digest)
        return torch.frombuffer(payload, dtype=torch.float32) if expected else torch.empty(0)
