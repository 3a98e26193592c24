"""What the syncer's protocol is told: every event it handles, and who produces it.

The server's threads post `Connected` (a connection group passed its handshake; the shell keeps
the group and hands the protocol its `Joined`), `Got` (a message from a learner, with its
payload) and `Left` (a group closed); the decode pool posts `Decoded`, the prepare threads
`Prepared`. The shell itself produces `Merged` and `Synced` when it has performed a merge the
protocol asked for, the answers to the protocol's asks (`is_answer`: `InitChecked`, an inline
`Decoded`, `Encoded`) before any other event, and `Stop` when the run must end without
finalizing (a signal, a lost checkpoint disk, a failed iso worker). The protocol handles them one
at a time, in the order they come (`protocol.SyncerProtocol.handle`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from syncer.merge.held import HeldDelta
from syncer.merge.round_merge import FragmentTensors, MergeOutcome
from yeto_core.downlink import Broadcast
from yeto_core.wire.messages import Manifest, Message, Push


@dataclass(frozen=True)
class Joined:
    """A learner's connection group passed its handshake. `conflict`: why its id is taken by
    another live process (the shell's view of the holder's group), or None."""

    learner_id: int
    generation: int
    fingerprint: bytes
    wire_dtype: int
    manifest: Manifest | None
    flags: int = 0
    push_block: int = 0
    instance: bytes = b""
    peer: str = ""
    conflict: str | None = None
    downlink_dtype: int = 1  # the codec of the downlink deltas it takes; F32's id: exact broadcasts


@dataclass(frozen=True)
class Connected:
    """From the server: a new connection group (the shell's, for sending) and what it said."""

    group: Any  # a `ConnectionGroup`, or an in-memory one in tests
    joined: Joined


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
    """A push's delta (on the merge device), or the reason it is unusable: back from the decode
    pool, or, `inline`, the answer to an inline `effects.Decode` (`carried`: a late push joining
    attempt `attempt` of its fragment)."""

    learner_id: int
    generation: int
    attempt: int
    msg: Push
    delta: torch.Tensor | HeldDelta | str  # a quantized or bf16 push is held in its payload (held.py)
    inline: bool = False
    carried: bool = False
    moment: memoryview | None = None  # the learner's optimizer first moment, when the push carried it


@dataclass(frozen=True)
class InitChecked:
    """The answer to `effects.CheckInit`: the INIT fragment's values on the merge device (the
    payload's own buffer on the CPU), or None when they hold NaN or Inf."""

    learner_id: int
    generation: int
    fragment: int
    values: torch.Tensor | None


@dataclass(frozen=True)
class Encoded:
    """The answer to `effects.Encode`: fragment `fragment`'s downlink anchor of the codec with wire
    id `codec` as version `version` (the lent one, moved in place, or a new one) and the broadcast
    that leads to it."""

    fragment: int
    version: int
    codec: int
    anchor: torch.Tensor
    broadcast: Broadcast


@dataclass(frozen=True)
class Merged:
    """The merge of `round` that the protocol asked for (`effects.Merge`) is done: its outcome,
    and the fragment's tensors it lent, handed back (with the merged values)."""

    round: int
    outcome: MergeOutcome
    tensors: FragmentTensors


@dataclass(frozen=True)
class Prepared:
    """The heavy half of attempt `attempt`'s merge (`effects.Prepare`) is done; the shell keeps the
    result for the `Merge` that names it. A failure never reaches the protocol: the shell stops."""

    round: int
    attempt: int


@dataclass(frozen=True)
class Synced:
    """The commit of `round` held the coordinator `seconds`: its merge, checkpoint and the hand-over
    of its sends (ξ_sync of the grace window)."""

    round: int
    seconds: float


@dataclass(frozen=True)
class Stop:
    """End the run now, without finalizing: committed state is already on disk."""

    exit_code: int = 0
    reason: str = "stop requested"


Event = Joined | Got | Left | Decoded | InitChecked | Encoded | Merged | Prepared | Synced | Stop


def is_answer(event: Event) -> bool:
    """Whether `event` answers an ask (`effects.is_ask`): the shell hands it back before any other."""
    return isinstance(event, InitChecked | Encoded) or (isinstance(event, Decoded) and event.inline)
