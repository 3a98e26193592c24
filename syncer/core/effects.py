"""What the syncer's protocol asks the world to do: the effects `SyncerProtocol.handle` returns.

The protocol decides; the shell (`coordinator.Coordinator`) performs, in the order given, and
reports back what only the world knows (a merge's outcome, as a `Merged` event). Learners are
addressed by `Peer`, their id and connection generation: a send to a connection that has closed
meanwhile goes nowhere, as a send on a closed socket would.

Order is the contract: a commit's effects come as fault point, checkpoint, tape record, its
broadcasts, then its log line, so the checkpoint is durable before any learner hears of the
version it holds, and the user reads of a commit only once it is all done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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
    (read without a copy; the shell leases them until the send is done)."""

    to: Peer
    msg: Message
    payload: bytes | memoryview | None = None
    committed: int | None = None


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


@dataclass(frozen=True, slots=True)
class Decode:
    """Decode a quantized push off the coordinator's thread; the result comes back as `Decoded`."""

    learner_id: int
    generation: int
    attempt: int
    msg: Push
    payload: memoryview
    codec: Codec


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


Effect = Send | Close | StallTimeout | Record | Checkpoint | Merge | Prepare | Decode | Log | FaultPoint
