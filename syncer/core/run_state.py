"""What the protocol's parts share and none of them owns: the committed model state, the layout it
is split by, the learners connected, the rounds in flight, the phase of the run, the time of the
event being handled, and the effects decided so far in this turn.

The protocol writes it on the coordinator's thread, the only thread that does; its parts
(intake, outbox, finale) read and write it through one `RunState` handed to each, so every
shared field is named in one place instead of being declared by every part that uses it. They
never act on the world themselves: they `emit` effects, which `SyncerProtocol.handle` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from syncer.core.consensus import ConsensusBoard
from syncer.core.effects import Effect, Record
from syncer.core.lifecycle import Lives
from syncer.core.links import Link, Phase
from syncer.core.records import TapeRecord
from syncer.core.round_table import RoundTable
from syncer.durability.checkpoint import SyncerState
from yeto_core.downlink import DownlinkEncoder
from yeto_core.layout import Layout
from yeto_core.settings import SyncerSettings


@dataclass
class RunState:
    settings: SyncerSettings
    now: float = 0.0  # the time of the event being handled (the shell's clock)
    links: dict[int, Link] = field(default_factory=dict)  # learner id -> its live connection
    rounds: RoundTable = field(default_factory=RoundTable)
    lives: Lives = field(default_factory=Lives)  # every learner's state in the run (`lifecycle.py`)
    # fragment -> learner -> the version its last merged answer made (or it started from, on a
    # learner process's first join): how stale its next answer is (`answer_ages`). Not durable: a
    # restarted syncer counts every learner's next answer as fresh.
    merged_versions: dict[int, dict[int, int]] = field(default_factory=dict)
    # round -> learners whose answer to it is merged, for the recent rounds a late push may still
    # name: a push sent twice is refused instead of carried into a later round and counted again.
    merged_rounds: dict[int, set[int]] = field(default_factory=dict)
    phase: Phase = Phase.WAIT_INIT
    state: SyncerState | None = None  # None until learner 0's manifest (or a checkpoint) pins the model
    layout: Layout | None = None
    downlink: DownlinkEncoder | None = None  # set with the layout
    consensus: ConsensusBoard | None = None  # the learners' probe summaries (DESIGN §8)
    effects: list[Effect] = field(default_factory=list)  # decided in this turn, in order

    def emit(self, effect: Effect) -> None:
        self.effects.append(effect)

    def record(self, record: TapeRecord) -> None:
        """An event tape record, in the order of everything else this turn does."""
        self.effects.append(Record(record))
