"""What a HELLO must prove before the syncer answers WELCOME (DESIGN §7.2), without a socket.

`check_hello` is the whole admission rule for one learner's connection: the key (the HELLO's MAC
over the syncer's challenge nonce), the wire contract (chunk size, codec, block size, stream
count), the schedule its flags ask for, the model's fingerprint once one is pinned, and who holds
the learner id. The socket server calls it on every HELLO; the simulation (`tests/sim/`) calls it
on every simulated dial, so both refuse exactly alike.
"""

from __future__ import annotations

from collections.abc import Callable

from syncer.core.links import layout_mismatch
from yeto_core.codecs import CODECS, F32, WIRE_CODEC_NAMES
from yeto_core.downlink import DOWNLINK_WIRE_IDS
from yeto_core.wire import auth
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import CHUNK_BYTES, Hello

MAX_PUSH_BLOCK = 1 << 20
MAX_DATA_STREAMS = 64


class HandshakeRefused(Exception):
    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def check_hello(hello: Hello, *, key: bytes, nonce: bytes, who: str, pinned: bytes | None,
                schedule_problem: Callable[[int], str | None],
                id_conflict: Callable[[int, bytes], str | None]) -> None:
    """Raise `HandshakeRefused` (its code and one line naming the learner) unless `hello`, answering
    the challenge `nonce`, may join; `pinned`: the model's fingerprint, once the syncer has one."""
    if not auth.verify(key, hello.mac, auth.HELLO_LABEL, nonce, hello.signed_part()):
        raise HandshakeRefused(ErrorCode.AUTH, f"HMAC check failed for {who}: it does not hold the syncer's key")
    if hello.chunk_bytes != CHUNK_BYTES:
        raise HandshakeRefused(ErrorCode.CONTRACT, f"{who} uses {hello.chunk_bytes}-byte chunks; "
                               f"this syncer uses {CHUNK_BYTES}")
    if hello.wire_dtype not in WIRE_CODEC_NAMES:
        raise HandshakeRefused(ErrorCode.CONTRACT, f"{who} asks for unknown wire dtype {hello.wire_dtype}")
    quantized = WIRE_CODEC_NAMES[hello.wire_dtype] not in CODECS
    if quantized and not 1 <= hello.push_block <= MAX_PUSH_BLOCK:
        raise HandshakeRefused(ErrorCode.CONTRACT, f"{who} asks for push block size {hello.push_block} "
                               f"(1..{MAX_PUSH_BLOCK})")
    if hello.downlink_dtype not in (F32.wire_id, *DOWNLINK_WIRE_IDS):
        raise HandshakeRefused(ErrorCode.CONTRACT, f"{who} asks for unknown downlink dtype {hello.downlink_dtype}")
    if not 1 <= hello.data_streams <= MAX_DATA_STREAMS:
        raise HandshakeRefused(ErrorCode.CONTRACT, f"{who} asks for {hello.data_streams} data streams "
                               f"(1..{MAX_DATA_STREAMS})")
    unfit = schedule_problem(hello.flags)
    if unfit is not None:
        raise HandshakeRefused(ErrorCode.CONTRACT, f"{who}: {unfit}")
    if pinned is not None and pinned != hello.fingerprint:
        raise HandshakeRefused(ErrorCode.LAYOUT, layout_mismatch(hello.learner_id, hello.fingerprint, pinned))
    conflict = id_conflict(hello.learner_id, hello.instance)
    if conflict is not None:
        raise HandshakeRefused(ErrorCode.DUPLICATE, conflict)
