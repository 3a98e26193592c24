"""What the protocol's parts share and none of them owns: the committed model state, the layout it
is split by, the learners connected, the rounds in flight, the phase of the run, the time of the
event being handled, and the effects decided so far in this turn.

The protocol writes it on the coordinator's thread, the only thread that does; its parts
(intake, outbox, finale) read and write it through one `RunState` handed to each, so every
shared field is named in one place instead of being declared by every part that uses it. They
never act on the world themselves: they `emit` effects, which `SyncerProtocol.handle` returns.

Effects leave in the order they were decided, asks included (`effects.is_ask`). An ask ends
what a turn hands out: whatever is decided after it is held, and handed out by the turn that
takes its answer in, right behind what taking the answer in decided itself (`answered`). A part
that needs an ask's answer to say what comes next (the sends of a broadcast being encoded)
puts a step in the stream (`later`): it runs where it stands, once everything before it is out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from syncer.core import records
from syncer.core.consensus import ConsensusBoard
from syncer.core.effects import Close, Effect, Record, is_ask
from syncer.core.lifecycle import Lives
from syncer.core.links import Link, Phase
from syncer.core.round_table import RoundTable
from syncer.durability.checkpoint import SyncerState
from yeto_core.downlink import DownlinkChains
from yeto_core.layout import Layout
from yeto_core.settings import SyncerSettings
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import Error

Step = Callable[[], None]

log = logging.getLogger("yeto.syncer")


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
    # learner -> the raw merge weight (tokens² / steps) of its last merged answer: what it stands for
    # in the rounds after it finished training (`finished_weight`). Not durable, as above.
    merged_weights: dict[int, float] = field(default_factory=dict)
    # round -> learners whose answer to it is merged, for the recent rounds a late push may still
    # name: a push sent twice is refused instead of carried into a later round and counted again.
    # Kept in the checkpoint (`memory.py`), so a resumed syncer refuses it too.
    merged_rounds: dict[int, set[int]] = field(default_factory=dict)
    phase: Phase = Phase.WAIT_INIT
    state: SyncerState | None = None  # None until learner 0's manifest (or a checkpoint) pins the model
    layout: Layout | None = None
    downlinks: DownlinkChains | None = None  # the downlink anchors of each codec in use; set with the layout
    consensus: ConsensusBoard | None = None  # the learners' probe summaries (DESIGN §8)
    effects: list[Effect] = field(default_factory=list)  # handed out by this turn, in order
    held: list[Effect | Step] = field(default_factory=list)  # decided behind the ask out, in order
    asked: bool = False  # the last of `effects` is an ask whose answer is not taken in yet

    def emit(self, effect: Effect) -> None:
        if self.asked:
            self.held.append(effect)
            return
        self.effects.append(effect)
        self.asked = is_ask(effect)

    def record(self, record: records.TapeRecord) -> None:
        """An event tape record, in the order of everything else this turn does."""
        self.emit(Record(record))

    def refuse(self, link: Link, code: ErrorCode, reason: str) -> None:
        """Close `link`'s connection for good, recorded, its ERROR sent first."""
        log.warning("refusing learner %d: %s", link.learner_id, reason)
        self.record(records.Refused(link.learner_id, code=code.name, reason=reason))
        self.emit(Close(link.peer, reason, last=Error(code, reason)))

    def later(self, step: Step) -> None:
        """Run `step` where it stands in the stream: now, or once the asks before it are answered."""
        if self.asked:
            self.held.append(step)
        else:
            step()

    def answered(self, take_in: Step) -> None:
        """The ask out is answered: `take_in` takes the answer in, its effects where the ask stood;
        then what was held behind the ask is handed out, up to the next ask."""
        assert self.asked, "an answer to no ask"
        self.asked = False
        behind, self.held = self.held, []
        take_in()
        self.held += behind
        while not self.asked and self.held:
            item = self.held.pop(0)
            if isinstance(item, Effect):
                self.emit(item)
            else:  # a step: what it emits goes before the rest of what waits
                rest, self.held = self.held, []
                item()
                self.held += rest
