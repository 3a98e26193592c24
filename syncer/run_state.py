"""What the coordinator's parts share and none of them owns: the committed model state, the layout
it is split by, the learners connected, the rounds in flight and the phase of the run.

The coordinator writes it on its actor thread, the only thread that does; its parts (intake,
outbox, finale, checkpointing) read and write it through one `RunState` handed to each, so
every shared field is named in one place instead of being declared by every part that uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from syncer.checkpoint import SyncerState
from syncer.consensus import ConsensusBoard
from syncer.links import Link, Phase
from syncer.round_table import RoundTable
from syncer.tape import EventTape
from yeto_core.downlink import DownlinkEncoder
from yeto_core.faults import FaultInjector
from yeto_core.layout import Layout
from yeto_core.settings import SyncerSettings


@dataclass
class RunState:
    settings: SyncerSettings
    tape: EventTape
    clock: Callable[[], float]
    faults: FaultInjector
    links: dict[int, Link] = field(default_factory=dict)  # learner id -> its live connection
    rounds: RoundTable = field(default_factory=RoundTable)
    finished: set[int] = field(default_factory=set)  # learners that said DONE
    phase: Phase = Phase.WAIT_INIT
    state: SyncerState | None = None  # None until learner 0's manifest (or a checkpoint) pins the model
    layout: Layout | None = None
    downlink: DownlinkEncoder | None = None  # set with the layout
    consensus: ConsensusBoard | None = None  # the learners' probe summaries (DESIGN §8)
