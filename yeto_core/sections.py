"""The settings, grouped by the component that uses them.

`LearnerSettings` and `SyncerSettings` stay flat, because each field is one environment variable
(`YETO_DILOCO_*`, `YETO_SYNCER_*`) or flag that users set. Components do not take the whole
settings object nor a dozen loose arguments copied out of it: each takes its section, built
by a property of the settings (`settings.link`, `.consensus`, `.island`, `.merging`), so what a
component depends on is written once, in its signature. Each default is written once too, here:
the settings' fields take theirs from these classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DEFAULT_SYNC_INTERVAL = 24  # H in learner steps: the syncer's, and a learner's under a syncer that does not pace


@dataclass(frozen=True)
class Schedule:
    """The run's schedule, the syncer's alone, which its CHALLENGE announces to every learner: P
    fragments laid out by `pattern`, and H (`sync_interval`), the learner steps per fragment round
    trip (0: the syncer does not pace rounds by steps, and each learner keeps its own H)."""

    num_fragments: int
    pattern: str
    sync_interval: int


@dataclass(frozen=True)
class LinkSettings:
    """A learner's connection to the syncer: where, who, and its deadlines."""

    address: tuple[str, int]
    key: bytes  # the shared HMAC key, read from KEY or KEY_FILE
    learner_id: int
    data_streams: int = 2
    connect_timeout_s: float = 10.0
    heartbeat_s: float = 2.0
    peer_timeout_s: float = 30.0
    reconnect_max_s: float = 30.0
    stall_timeout_s: float = 0.0  # 0: off
    bcast_delta: bool = False  # take broadcasts as bf16 deltas
    overlap: bool = True  # rebases on its merged pushes (told to the syncer in HELLO)
    stream_schedule: Literal["rr", "adaptive"] = "rr"  # chunk-to-stream striping
    rl_mode: Literal["stream", "sweep", "overlap"] = "stream"  # how it pushes (sweeps are told to the syncer in HELLO)


@dataclass(frozen=True)
class ConsensusSettings:
    """The learner's consensus probe: how often, and how much of it is reported."""

    every: int = 4  # installs between probes; 0: no probe
    top_k: int = 64
    tokens: int = 64


@dataclass(frozen=True)
class IslandSettings:
    """How the ranks of a multi-rank island work together."""

    collective_timeout_s: float = 300.0  # deadline of one wait on the other ranks
    gather_chunk_mib: int = 64  # MiB of a fragment moved between ranks at a time

    @property
    def heartbeat_s(self) -> float:
        """Rank 0 tells the others it is alive this often while it waits on the syncer."""
        return min(5.0, self.collective_timeout_s / 4)


DEFAULT_ISLAND = IslandSettings()


@dataclass(frozen=True)
class MergeSettings:
    """How the syncer merges a round: the merge of the deltas and the outer step."""

    merge: Literal["rda", "iso", "average"] = "rda"
    delta_correction: Literal["heloco", "none"] = "none"
    outer_optimizer: Literal["nesterov", "delayed-nesterov"] = "nesterov"
    # Measured by benchmarks/compare_diloco.py (README "Does it learn?"): DiLoCo's stock 0.7/0.9
    # over-drives the strongly correlated deltas of a few dozen inner steps; with the momentum warmed
    # up, 0.7/0.5 (a steady step of 1.4 merged deltas) beats 0.5/0.5 in 6 of the 8 M = 2 cells.
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    outer_momentum_warmup: int = 4  # outer steps over which a fragment's μ rises from 0
    outer_delay: int = 4
    merge_threads: int = 1
