"""What the coordinator is told: every event its actor thread handles, and who posts it.

The server's threads post `Joined` (a connection group passed its handshake), `Got` (a message
from a learner, with its payload) and `Left` (a group closed); the decode pool posts `Decoded`.
The coordinator handles them one at a time, in the order they were posted.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from yeto_core.wire.messages import Manifest, Message, Push
from yeto_core.wire.transport import ConnectionGroup


@dataclass(frozen=True)
class Joined:
    learner_id: int
    generation: int
    group: ConnectionGroup
    fingerprint: bytes
    wire_dtype: int
    manifest: Manifest | None
    flags: int = 0
    push_block: int = 0
    instance: bytes = b""
    peer: str = ""


@dataclass(frozen=True)
class Got:
    learner_id: int
    generation: int
    msg: Message
    payload: memoryview | None
    screened: bool | None = None  # the screen's verdict on a bulk payload, if it screened it


@dataclass(frozen=True)
class Left:
    learner_id: int
    generation: int
    reason: str


@dataclass(frozen=True)
class Decoded:
    """A push's delta (or the reason it is unusable), back from the decode pool."""

    learner_id: int
    generation: int
    attempt: int
    msg: Push
    future: Future[torch.Tensor | str]


Event = Joined | Got | Left | Decoded
