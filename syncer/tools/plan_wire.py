"""The planner's bytes: what a push, a broadcast and a shared moment weigh on the wire and on the
line (PROTOCOL §2–§3, yeto_core/codecs.py, yeto_core/quant.py), for `syncer/tools/plan.py`."""

from __future__ import annotations

import math


class PlanError(ValueError):
    """An input or a plan that cannot work; the message names the input and the reason."""


# yeto_core/quant.py: DEFAULT_BLOCK values per f32 scale, a u32 block-size header per payload;
# yeto_core/downlink.py codes its deltas in blocks of DOWNLINK_BLOCK.
DEFAULT_BLOCK = DOWNLINK_BLOCK = 128
# Push codecs from the most precise to the least (yeto_core/quant.py ERROR_BOUNDS); e3m0 and
# int4-log cost int4's bytes with larger errors, so the planner never prefers them.
PUSH_CODECS = ("f32", "bf16", "int8", "int4", "int2")
ALL_PUSH_CODECS = (*PUSH_CODECS, "e3m0", "int4-log")
# The syncer's broadcasts (syncer/core/outbox.py): the exact f32 fragment, or a code of
# (Θ − anchor) in a delta codec (yeto_core/downlink.py, blocks of 128), with a FULL f32 refresh
# every `--bcast-delta-full-every` versions when set (none by default); the same order and the
# same two the planner never prefers.
DOWNLINKS = ("f32", "bf16", "int8", "int4", "int2")
ALL_DOWNLINKS = (*DOWNLINKS, "e3m0", "int4-log")
BCAST_FULL_EVERY = 0

# PROTOCOL §2–§3: a 12-byte frame header; PULL, PUSH and BCAST bodies; payloads cut into
# 4 MiB CHUNK frames of 36 bytes of headers each (yeto_core/wire/messages.py).
FRAME_HEADER = 12
PULL_BODY, PUSH_BODY, BCAST_BODY = 20, 53, 69
CHUNK_BYTES = 4 << 20
CHUNK_OVERHEAD = FRAME_HEADER + 24

# TCP over Ethernet at MTU 1500 with timestamps: 1448 payload bytes in a 1514-byte frame, and
# Linux acknowledges every second segment with a 66-byte frame (delayed ACK).
MSS, ETHERNET_FRAME, ACK_FRAME = 1448, 1514, 66


def payload_bytes(codec: str, numel: int, block: int = DEFAULT_BLOCK) -> int:
    """Encoded bytes of `numel` f32 values (yeto_core/codecs.py, yeto_core/quant.py encoded_nbytes)."""
    if codec == "f32":
        return 4 * numel
    if codec == "bf16":
        return 2 * numel
    if codec not in ALL_PUSH_CODECS:
        raise PlanError(f"--codec {codec!r}: not a push codec; accepted: {', '.join(ALL_PUSH_CODECS)}")
    full, last = divmod(numel, block)

    def codes(n: int) -> int:
        return n if codec == "int8" else (n + 3) // 4 if codec == "int2" else (n + 1) // 2

    return 4 + full * (4 + codes(block)) + (4 + codes(last) if last else 0)


def bulk_frames(payload: int, body: int) -> int:
    """A bulk message on the wire: its announcement frame, the payload, a CHUNK header per 4 MiB."""
    return FRAME_HEADER + body + payload + math.ceil(payload / CHUNK_BYTES) * CHUNK_OVERHEAD


def push_wire_bytes(codec: str, numel: int, block: int = DEFAULT_BLOCK) -> int:
    return bulk_frames(payload_bytes(codec, numel, block), PUSH_BODY)


def moment_bytes(numel: int) -> int:
    """A fragment's first moment on the wire (yeto_core/moments.py moment_nbytes): one int4 payload
    at the default block, carried by the fragment's pushes and broadcasts when moments are shared."""
    return payload_bytes("int4", numel, DEFAULT_BLOCK)


def bcast_wire_bytes(downlink: str, numel: int, full_every: int = BCAST_FULL_EVERY) -> float:
    """One broadcast of a fragment to one learner, with the PULL of the next round (small, same
    direction). Deltas: with `full_every` set, the mean over versions of full_every − 1 deltas
    and one FULL (the FULLs of joins and of a fragment's last version are left out: one each)."""
    pull = FRAME_HEADER + PULL_BODY
    full = bulk_frames(4 * numel, BCAST_BODY)
    if downlink == "f32":
        return full + pull
    if downlink not in ALL_DOWNLINKS:
        raise PlanError(f"--downlink {downlink!r}: accepted: {', '.join(ALL_DOWNLINKS)}")
    delta = bulk_frames(downlink_payload_bytes(downlink, numel), BCAST_BODY)
    if full_every > 1:
        return ((full_every - 1) * delta + full) / full_every + pull
    return delta + pull


def downlink_payload_bytes(downlink: str, numel: int) -> int:
    """A broadcast's payload: the exact fragment, or its delta code (yeto_core/downlink.py)."""
    return payload_bytes(downlink, numel, DOWNLINK_BLOCK)


def on_the_wire(forward: float, reverse: float, efficiency: float) -> float:
    """Line bytes of one direction: its TCP payload in full frames, and the ACKs of the other's."""
    return forward / efficiency + reverse / (2 * MSS) * ACK_FRAME
