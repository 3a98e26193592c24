"""The settings, grouped by the component that takes them: one pydantic model a section.

`LearnerSettings` and `SyncerSettings` (yeto_core/settings.py) are made of these sections (the
learner's `link`, `consensus` and `island`, the syncer's `streams` and `merging`) beside their
own top-level fields. Each setting is written once, here, with its default, its bounds and its
description; a component takes its section whole, so what it depends on is written once too, in
its signature. Users still set each one by a single flat name (`YETO_DILOCO_HEARTBEAT_S`,
`--outer-lr`): the field's name, or its `validation_alias` where the component calls it otherwise
(`stall_timeout_s` is set as `WAN_STALL_TIMEOUT_S`); yeto_core/setting_names.py maps the names.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

if TYPE_CHECKING:
    from yeto_core.codecs import Codec

log = logging.getLogger("yeto.settings")

# Upper bounds of every duration and count: far past any real run, yet small enough that no timer
# overflows (`threading` and `select` take at most ~2^31 ms; TCP_USER_TIMEOUT is an int of ms) and
# nothing is allocated in proportion to an absurd value.
HOUR_S = 3600.0
DAY_S = 86400.0
WEEK_S = 7 * DAY_S
MAX_STEPS = 1_000_000  # an interval in learner steps (H), or an every-N count of rounds

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
class Endpoint:
    """Who a learner is, where its syncer is and the key that proves it: what the settings resolve
    to (the address parsed, the key read once), not a section users set."""

    address: tuple[str, int]
    key: bytes
    learner_id: int


class Section(BaseModel):
    """A group of settings one component takes whole; built by field name, or by the flat names
    users set when it is part of the settings."""

    # allow_inf_nan: "inf" parses as a float, and an infinite timeout overflows the socket layer.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, validate_by_name=True,
                              validate_by_alias=True)
    heading: ClassVar[str] = ""  # what a command line's help lists the section's flags under


class StreamSettings(Section):
    """The rules of a live connection group, the same on both ends: heartbeats, silence, stalls and
    how chunks are striped over the data streams."""

    heading = "connection groups (the learners' link keeps the same rules)"

    heartbeat_s: float = Field(default=2.0, gt=0, le=HOUR_S, description="heartbeat period on the control stream")
    peer_timeout_s: float = Field(default=30.0, gt=0, le=DAY_S, description="silence after which a link is dead")
    stall_timeout_s: float = Field(default=0.0, ge=0, le=DAY_S, validation_alias="wan_stall_timeout_s",
                                   description="seconds without progress on a stream that fail its connection "
                                   "group; also the streams' TCP_USER_TIMEOUT once the initial cut is in (0: off)")
    stream_schedule: Literal["rr", "adaptive"] = Field(default="rr", validation_alias="wan_stream_schedule",
                                                       description="stripe chunks round-robin (rr) or to the data "
                                                       "stream with the earliest estimated finish (adaptive)")


DEFAULT_STREAMS = StreamSettings()


class LinkSettings(StreamSettings):
    """A learner's connection to the syncer: its streams, its deadlines, and what it tells the
    syncer in HELLO of how it takes merges."""

    data_streams: int = Field(default=2, ge=1, le=64, description="parallel TCP data streams")
    connect_timeout_s: float = Field(default=10.0, gt=0, le=HOUR_S, description="deadline of one dial + handshake")
    reconnect_max_s: float = Field(default=30.0, gt=0, le=HOUR_S, description="cap of the redial backoff")
    downlink_dtype: Literal["f32", "bf16", "int8", "int4", "e3m0", "int4-log", "int2"] = Field(
        default="f32", description="how broadcasts reach this learner: f32, each fragment exact; or a code of "
        "(Θ − a hash-checked anchor both ends keep), whose error goes out with the fragment's next broadcast: "
        "bf16 (16 bits a value), int8 (8.25), int4, e3m0 or int4-log (4.25), int2 (2.25); the final cut is always "
        "exact")
    bcast_delta: bool = Field(default=False, description="deprecated: downlink_dtype=bf16")
    overlap: bool = Field(default=True, description="Mix1: install by rebasing, θ ← Θ + (θ − θ at the push), "
                          "instead of blending with merge_alpha")
    rl_mode: Literal["stream", "sweep", "overlap"] = Field(
        default="stream",
        description="RL trainers (verl, Miles): stream: a fragment boundary every H/P optimizer steps; sweep: "
        "every fragment at the end of each RL iteration, the merges installed before the rollout gets "
        "weights; overlap: every fragment at the end of each iteration, training on at once and rebasing at the next")

    @field_validator("rl_mode")
    @classmethod
    def _rl_mode(cls, v: str, info: ValidationInfo) -> str:
        if v == "overlap" and info.data.get("overlap") is False:
            raise ValueError("overlap trains on while its pushes merge, so it installs by rebasing: it cannot be "
                             "combined with YETO_DILOCO_OVERLAP=false")
        return v

    @model_validator(mode="after")
    def _bcast_delta_is_bf16(self) -> LinkSettings:
        if not self.bcast_delta:
            return self
        if "downlink_dtype" in self.model_fields_set and self.downlink_dtype != "bf16":
            raise ValueError(f"YETO_DILOCO_BCAST_DELTA (deprecated) asks for a bf16 downlink and "
                             f"YETO_DILOCO_DOWNLINK_DTYPE for {self.downlink_dtype}: drop BCAST_DELTA")
        if self.downlink_dtype != "bf16":
            log.warning("YETO_DILOCO_BCAST_DELTA is deprecated; use YETO_DILOCO_DOWNLINK_DTYPE=bf16 (read as that)")
            self.__dict__["downlink_dtype"] = "bf16"  # frozen: the validated value, set before anyone reads it
        return self

    @property
    def sweeps(self) -> bool:
        """Whether boundaries come once per RL iteration, every fragment at once (`sweep()`)."""
        return self.rl_mode != "stream"

    @property
    def delta_codec(self) -> Codec | None:
        """The codec of this learner's downlink deltas; None for exact f32 broadcasts."""
        from yeto_core.downlink import downlink_codec

        return downlink_codec(self.downlink_dtype)


class ConsensusSettings(Section):
    """The learner's consensus probe: how often, and how much of it is reported."""

    every: int = Field(default=4, ge=0, le=MAX_STEPS, validation_alias="consensus_every",
                       description="evaluate the probe batch after every N installs of merged fragments and "
                       "report it to the syncer (0: no consensus signal)")
    top_k: int = Field(default=64, ge=1, le=1024, validation_alias="consensus_top_k",
                       description="probabilities per probe token reported: the top k (the rest as one tail)")
    tokens: int = Field(default=64, ge=1, le=512, validation_alias="consensus_tokens",
                        description="tokens in the fixed probe batch")


class IslandSettings(Section):
    """How the ranks of a multi-rank island work together."""

    collective_timeout_s: float = Field(default=300.0, gt=0, le=DAY_S,
                                        description="multi-rank islands: deadline of one wait on the other ranks")
    gather_chunk_mib: int = Field(default=64, ge=1, le=1 << 16,
                                  description="multi-rank islands: MiB of a fragment moved between ranks at a time")

    @property
    def heartbeat_s(self) -> float:
        """Rank 0 tells the others it is alive this often while it waits on the syncer."""
        return min(5.0, self.collective_timeout_s / 4)


DEFAULT_ISLAND = IslandSettings()


class MergeSettings(Section):
    """How the syncer merges a round: the merge of the deltas, the outer step, and where it runs."""

    heading = "merge and outer step"

    merge: Literal["rda", "iso", "average"] = Field(default="rda", description="merge of every tensor: "
                                                    "radial-directional averaging (rda), rda with each 2-D matrix's "
                                                    "merged update but the embedding's given a flat spectrum (iso: "
                                                    "its singular values replaced by their mean), or the plain "
                                                    "weighted average")
    delta_correction: Literal["heloco", "none"] = Field(default="none", description="correct stale deltas that "
                                                        "oppose the outer momentum (HeLoCo) or not; HeLoCo "
                                                        "measured no better in compare_diloco")
    outer_optimizer: Literal["nesterov", "delayed-nesterov"] = Field(default="nesterov", description="outer optimizer")
    # Measured by benchmarks/compare_diloco.py (README "Does it learn?"): DiLoCo's stock 0.7/0.9
    # over-drives the strongly correlated deltas of a few dozen inner steps; with the momentum warmed
    # up, 0.7/0.5 (a steady step of 1.4 merged deltas) beats 0.5/0.5 in 6 of the 8 M = 2 cells, and
    # from four islands on a shorter step does better (`default_outer_lr`).
    outer_lr: float = Field(default=0.0, ge=0, le=100, description="Nesterov outer learning rate (0 = "
                            "0.7·min(1, 2/M)^¼: 0.7 for up to 2 learners, 0.59 for 4, 0.49 for 8)")
    outer_momentum: float = Field(default=0.5, ge=0, lt=1, description="Nesterov outer momentum")
    outer_momentum_warmup: int = Field(default=4, ge=0, le=MAX_STEPS, description="outer steps over which each "
                                       "fragment's outer momentum rises linearly from 0 to --outer-momentum "
                                       "(0: the full momentum from the first step)")
    outer_delay: int = Field(default=4, ge=1, le=MAX_STEPS, description="N of delayed Nesterov: momentum moves "
                             "every N steps")
    merge_threads: int = Field(default=1, ge=1, le=256, description="CPU merge threads (bit-identical results)")
    iso_worker_devices: str = Field(default="", description="with --merge iso: one SVD worker process per listed "
                                    "device, e.g. cpu,cpu or cuda:0,cuda:1 (none: the SVDs run in the syncer); "
                                    "deadlines from YETO_ISO_WORKER_*")

    @field_validator("iso_worker_devices")
    @classmethod
    def _iso_devices(cls, v: str, info: ValidationInfo) -> str:
        devices = [d.strip() for d in v.split(",") if d.strip()]
        for d in devices:
            if not re.fullmatch(r"cpu|cuda(:\d+)?", d):
                raise ValueError(f"{d!r} is not a device (cpu, cuda or cuda:N)")
        if devices and info.data.get("merge") != "iso":
            raise ValueError(f"iso workers need --merge iso (merge is {info.data.get('merge')})")
        return ",".join(devices)

    @property
    def iso_devices(self) -> list[str]:
        return [d for d in self.iso_worker_devices.split(",") if d]

    def for_learners(self, learners: int) -> MergeSettings:
        """These settings with the outer lr a fleet of `learners` steps by: the one set, or when
        none is (0) `default_outer_lr(learners)`."""
        return self if self.outer_lr else self.model_copy(update={"outer_lr": default_outer_lr(learners)})


OUTER_LR_TWO_ISLANDS = 0.7


def default_outer_lr(learners: int) -> float:
    """The outer lr when none is set: 0.7 up to two learners, then 0.7·(2/M)^¼ (0.59 at M = 4, 0.49
    at M = 8). Measured by benchmarks/compare_diloco.py on both model families: at M = 2 lr 0.7
    beats 0.5 in 6 of 8 cells, at M = 8 lr 0.5 beats 0.7 in every cell tried, lockstep and unpaced
    (docs/LEARNING.md); 1/√M shortens it too fast (0.35 at M = 8 was worse than 0.5 and 0.7)."""
    return OUTER_LR_TWO_ISLANDS * min(1.0, 2 / learners) ** 0.25
