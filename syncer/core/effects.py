"""What the syncer's protocol asks the world to do: the effects `SyncerProtocol.handle` returns.

The protocol decides; the shell (`coordinator.Coordinator`) performs, in the order given, and
reports back what only the world knows (a merge's outcome, as a `Merged` event). Learners are
addressed by `Peer`, their id and connection generation: a send to a connection that has closed
meanwhile goes nowhere, as a send on a closed socket would.

The protocol does no tensor work itself. What it needs computed from payloads or tensors is an
**ask** (`is_ask`: `CheckInit`, an inline `Decode`, `Encode`): the shell computes it at once and
hands the answer back (`events.is_answer`) before any other event. An ask is always the last
effect of the list `handle` returns; what the protocol decided after it comes with the turn that
takes the answer in, so the effects still reach the world in the order they were decided
(`run_state.RunState.emit`).

Order is the contract: a commit's effects come as fault point, checkpoint, tape record, its
broadcasts, then its log line, so the checkpoint is durable before any learner hears of the
version it holds, and the user reads of a commit only once it is all done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from syncer.core.records import TapeRecord
from syncer.core.rounds import Answer
from syncer.merge.merge import Segment
from syncer.merge.round_merge import FragmentTensors
from yeto_core.codecs import Codec
from yeto_core.wire.messages import Message, Push


@dataclass(frozen=True, slots=True)
class Peer:
    learner_id: int
    generation: int


@dataclass(frozen=True, slots=True)
class Send:
    """`msg` to `to`, queued on its connection's sender threads. The payload is `payload`, or with
    `committed`, fragment `committed`'s committed values as they are when the send is performed
    (read without a copy; the shell leases them until the send is done), or with `anchor`
    (fragment, codec's wire id), a copy of that fragment's downlink anchor of that codec taken
    when the send is performed (the next delta moves the anchor in place)."""

    to: Peer
    msg: Message
    payload: bytes | memoryview | None = None
    committed: int | None = None
    anchor: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Close:
    """Close `to`'s connection, sending `last` first when given (a refusal's ERROR)."""

    to: Peer
    reason: str
    last: Message | None = None


@dataclass(frozen=True, slots=True)
class StallTimeout:
    """From now on, fail `to`'s connection when its streams stop moving for `seconds` (DESIGN §7.6)."""

    to: Peer
    seconds: float


@dataclass(frozen=True, slots=True)
class Record:
    """Append `record` to the event tape. With `checkpoint_ms`, the shell adds how long the
    checkpoint written just before held the coordinator, as `record["checkpoint_ms"]`."""

    record: TapeRecord
    checkpoint_ms: bool = False


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Make the committed state durable (durable or stop: `checkpointing.py`). `wait`: even with
    background checkpoints, the write is on disk before the next effect."""

    wait: bool = False


@dataclass(frozen=True, slots=True)
class Merge:
    """Merge `answers` into fragment `fragment`'s tensors, which the protocol lends (`lent`: written
    in place on the merge device, or a fresh copy of one that a reader still reads); the shell
    hands them back in `events.Merged` before it takes any other event. `prepared`: the attempt
    whose `Prepare` is done, its heavy half to use."""

    round: int
    fragment: int
    answers: tuple[Answer, ...]
    segments: tuple[Segment, ...]
    lent: FragmentTensors  # the fragment's committed tensors: the shell writes these and hands them back
    prepared: int | None = None
    finished_weight: float = 0.0  # what the learners that finished stand for, as zero deltas (`rounds.py`)


@dataclass(frozen=True, slots=True)
class Prepare:
    """Start the heavy half of attempt `attempt`'s merge (RDA and the SVDs of `--merge iso`, in the
    worker pool) off the coordinator's thread, ahead of the commit order; it reads the deltas and
    the fragment's momentum, writes nothing of the state, and comes back as `events.Prepared`."""

    round: int
    attempt: int
    fragment: int
    answers: tuple[Answer, ...]
    segments: tuple[Segment, ...]
    finished_weight: float = 0.0  # as Merge's


@dataclass(frozen=True, slots=True)
class Decode:
    """Decode a push's payload into its f32 delta on the merge device, checked finite (a quantized
    or bf16 one on a CPU merge device is held in its payload instead, its norms taken:
    `merge/held.py`); the delta, or why it is unusable, comes back as `events.Decoded` for
    attempt `attempt`. A fresh
    quantized push is decoded on the decode pool, off the coordinator's thread, and comes back
    whenever it is done. `inline` makes it an ask (an f32 push, whose payload the transport
    screened and a view of which is the delta; a carried push joining the fragment's open
    attempt): the shell decodes it at once and hands `Decoded` back before any other event.
    `screened`: the transport's finiteness verdict on an f32 payload (`payload.payload_screen`);
    `carried`: a late push, still encoded, that joins attempt `attempt` of its fragment."""

    learner_id: int
    generation: int
    attempt: int
    msg: Push
    payload: memoryview
    codec: Codec
    inline: bool = False
    screened: bool | None = None
    carried: bool = False


@dataclass(frozen=True, slots=True)
class CheckInit:
    """An ask: fragment `fragment` of learner 0's INIT, `payload` (exactly its f32 values), as
    the fragment's committed values on the merge device, checked finite unless the transport
    screened it (`screened` True). The answer is `events.InitChecked`."""

    to: Peer
    fragment: int
    payload: memoryview
    screened: bool | None = None


@dataclass(frozen=True, slots=True)
class Encode:
    """An ask: move fragment `fragment`'s downlink anchor (DESIGN §7.4) to its committed values
    `values` as version `version`, and make the broadcast that says so. `full`: the anchor becomes
    those values exactly (a FULL, f32); otherwise it moves by the decoded `codec`(values − anchor)
    (a DELTA). `codec`: the delta codec whose chain this anchor is.
    `lent`: the anchor, lent like a merge's tensors (None when there is none: a FULL); the shell
    writes it in place or makes a new one, and hands it back with the broadcast in
    `events.Encoded`."""

    fragment: int
    version: int
    full: bool
    values: torch.Tensor
    codec: Codec
    lent: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class ExpectInit:
    """The model is pinned and learner 0's INIT is on its way: one f32 payload per fragment, of
    `sizes` bytes, in this order. The shell readies the memory they will be received into, which
    becomes the global parameters (`yeto_core.buffers.BufferPool.reserve`)."""

    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Log:
    """A line for the user that says what the effects before it did (a commit, the final cut going
    out), so it is written only once they are done."""

    message: str
    level: int = logging.INFO


@dataclass(frozen=True, slots=True)
class FaultPoint:
    """A named fault point (`yeto_core.faults`) is reached. With `drain`, an armed point first
    waits for the sends performed before it to leave, so that "sent to some learners" holds."""

    name: str
    drain: bool = False


Effect = (Send | Close | StallTimeout | Record | Checkpoint | Merge | Prepare | Decode | CheckInit | Encode
          | ExpectInit | Log | FaultPoint)


def is_ask(effect: Effect) -> bool:
    """Whether the shell answers `effect` at once, before any other event (module docstring)."""
    return isinstance(effect, CheckInit | Encode) or (isinstance(effect, Decode) and effect.inline)
