"""The event tape's records, as the protocol decides them (DESIGN §6.4): one type per event.

Each record is a frozen dataclass whose fields are the JSON object the tape writes, in order, under
the `event` name its class declares (`as_dict`). The types are what the protocol and its tests
work with; the JSON is what users read, plot and replay, so its keys and their order are kept
exactly as they are written.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


@dataclasses.dataclass(frozen=True, slots=True)
class TapeRecord:
    EVENT: ClassVar[str]

    def as_dict(self) -> dict[str, Any]:
        """The tape's JSON object: `event` first, then the fields (an `extra` mapping flattened)."""
        out: dict[str, Any] = {"event": self.EVENT}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                out.update(value)
            elif value is not None or not f.metadata.get("optional"):
                out[f.name] = value
        return out


OPTIONAL = {"optional": True}  # a field's metadata: left out of the JSON while it is None


@dataclasses.dataclass(frozen=True, slots=True)
class Join(TapeRecord):
    EVENT: ClassVar[str] = "join"
    learner: int
    generation: int


@dataclasses.dataclass(frozen=True, slots=True)
class Left(TapeRecord):
    EVENT: ClassVar[str] = "left"
    learner: int
    generation: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Replaced(TapeRecord):
    """A new process took a learner id over from generation `generation`."""

    EVENT: ClassVar[str] = "replaced"
    learner: int
    generation: int
    by: int


@dataclasses.dataclass(frozen=True, slots=True)
class Refused(TapeRecord):
    """A learner refused: at its join (`code`), or one push of it (`round`; `overflow` when it
    would have overflowed the merge)."""

    EVENT: ClassVar[str] = "refused"
    learner: int
    round: int | None = dataclasses.field(default=None, metadata=OPTIONAL)
    code: str | None = dataclasses.field(default=None, metadata=OPTIONAL)
    reason: str = ""
    overflow: bool | None = dataclasses.field(default=None, metadata=OPTIONAL)


@dataclasses.dataclass(frozen=True, slots=True)
class Done(TapeRecord):
    EVENT: ClassVar[str] = "done"
    learner: int
    step: int


@dataclasses.dataclass(frozen=True, slots=True)
class Init(TapeRecord):
    """The initial cut is made."""

    EVENT: ClassVar[str] = "init"
    fragments: int
    fingerprint: str


@dataclasses.dataclass(frozen=True, slots=True)
class Launch(TapeRecord):
    EVENT: ClassVar[str] = "launch"
    round: int
    attempt: int
    fragment: int
    version: int
    members: list[int]
    quorum: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Carry(TapeRecord):
    """A late push kept, encoded, for its fragment's next round."""

    EVENT: ClassVar[str] = "carry"
    learner: int
    round: int
    fragment: int
    base_version: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Retry(TapeRecord):
    """An attempt over without a commit: its round is parked, to be launched again."""

    EVENT: ClassVar[str] = "retry"
    round: int
    attempt: int
    fragment: int
    reason: str
    answered: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class Abandon(TapeRecord):
    EVENT: ClassVar[str] = "abandon"
    round: int
    attempt: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Commit(TapeRecord):
    """A round merged into its fragment: who, with what weights, tokens and staleness, and why then."""

    EVENT: ClassVar[str] = "commit"
    round: int
    attempt: int
    fragment: int
    version: int
    learners: list[int]
    generations: list[int]
    answered: list[int]
    carried: list[int]
    waited_for: list[int]
    not_waited_for: list[int]
    dropped: list[int]
    base_versions: list[int]
    grace_ms: float
    weights: list[float]
    tokens: list[int]
    steps: list[int]
    ages: list[int]
    delta_norms: list[float]
    outer_grad_norm: float
    merge_ms: float
    wait_ms: float
    reason: str
    # The wire: the merged pushes' payload bytes (the deltas as encoded, without a shared first
    # moment), the payload bytes of this version's broadcast to the `receivers` learners then
    # connected, and the fragment's parameter count (`wire_bits`: bits per parameter each way).
    bytes_in: int
    bytes_out: int
    receivers: int
    numel: int
    overflowed: list[int] | None = dataclasses.field(default=None, metadata=OPTIONAL)
    moments: list[int] | None = dataclasses.field(default=None, metadata=OPTIONAL)  # pushes with a moment (§3.9)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # the consensus fields (DESIGN §8)


def wire_bits(record: dict[str, Any]) -> tuple[float, float] | None:
    """A commit record's bits per parameter per learner, (up, down): a merged push's, and a
    broadcast's to one learner; None for a record written before the tape kept its bytes."""
    try:
        numel, pushes, receivers = int(record["numel"]), len(record["learners"]), int(record["receivers"])
        up, down = int(record["bytes_in"]), int(record["bytes_out"])
    except (KeyError, TypeError, ValueError):
        return None
    if numel <= 0:
        return None
    return (8 * up / numel / pushes if pushes else 0.0, 8 * down / numel / receivers if receivers else 0.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Final(TapeRecord):
    """The final cut: after how many rounds, at which versions, why, with the token ledger."""

    EVENT: ClassVar[str] = "final"
    rounds: int
    versions: list[int]
    reason: str
    ledger: dict[str, int]
