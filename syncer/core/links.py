"""The protocol's vocabulary: its phases, its view of a learner's link, a carried push, and how
settings become scheduler config and a merge-backend id."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from syncer.core.effects import Peer
from syncer.core.rounds import SchedulerConfig
from yeto_core.codecs import F32, Codec
from yeto_core.sections import MergeSettings
from yeto_core.settings import SyncerSettings
from yeto_core.wire.messages import HELLO_SWEEP_OVERLAP, HELLO_SWEEPS, Push


def backend_id(s: MergeSettings) -> str:
    """Names the merge math a checkpoint was made with; --resume refuses a different one."""
    outer = "nesterov" if s.outer_optimizer == "nesterov" else f"delayed-nesterov{s.outer_delay}"
    return f"{s.merge}-{s.delta_correction}-{outer}-v1"


class Phase(enum.Enum):
    WAIT_INIT = "wait-init"
    RUNNING = "running"
    FINALIZING = "finalizing"
    DONE = "done"


@dataclass
class Link:
    """A connected learner as the protocol knows it; the shell holds its connection group."""

    learner_id: int
    generation: int
    fingerprint: bytes
    codec: Codec = F32  # the push codec agreed on HELLO (dtype and block size)
    downlink: Codec | None = None  # the codec of the downlink deltas it takes; None: exact f32 broadcasts
    consensus: bool = False  # takes CONSENSUS messages (HELLO_CONSENSUS)
    overlap: bool = False  # rebases on its merged pushes (DESIGN §3.3, §4.6): its late pushes are refused, not carried
    instance: bytes = b""  # the learner process's HELLO.instance (all zeros: it named none)
    address: str = ""  # where its control stream connects from

    @property
    def peer(self) -> Peer:
        return Peer(self.learner_id, self.generation)


@dataclass(frozen=True)
class Carried:
    """A late push waiting, still encoded, for its fragment's next round."""

    msg: Push
    payload: memoryview
    generation: int
    codec: Codec
    screened: bool | None = None  # the transport's finiteness verdict (`payload.payload_screen`)


def scheduler_config(s: SyncerSettings) -> SchedulerConfig:
    return SchedulerConfig(
        quorum=s.effective_quorum, learners=s.learners, pipeline=s.pipeline, round_timeout_s=s.round_timeout_s,
        grace_cap_s=s.grace_s, grace_gamma=s.grace_gamma, grace_tau=s.grace_tau,
        sync_interval_steps=s.sync_interval_steps, min_round_interval_s=s.min_round_interval_s,
        max_base_lag=s.max_base_lag, carry_counts=s.carry_answers_round, total_rounds=s.total_rounds,
    )


def id_conflict(holder: Link | None, instance: bytes, *, holder_closed: bool, holder_silent_s: float) -> str | None:
    """Why process `instance` may not take the id `holder` holds, or None.

    An id held by a live connection group is never handed to a newcomer: the newcomer is the one
    refused. A group whose peer went silent past the peer timeout, or whose connection broke,
    closes itself and frees the id, so a restarted process takes it over. Only a redial of the
    holder itself, naming the same instance, is welcome while its group lives (it replaces its
    own stale group). A peer that names no instance (all zeros) cannot show that it is the
    holder, so it never takes a held id."""
    if holder is None or holder_closed or (any(instance) and holder.instance == instance):
        return None
    unnamed = "" if any(instance) else (" (this peer names no process instance, so it cannot be told from the "
                                        "holder)")
    return (f"learner id {holder.learner_id} is held by another live process, connected from {holder.address} "
            f"(generation {holder.generation}, heard from {holder_silent_s:.1f} s ago){unnamed}; give each "
            "island its own YETO_DILOCO_LEARNER_ID")


def layout_mismatch(learner_id: int, theirs: bytes, ours: bytes) -> str:
    return (f"layout fingerprint mismatch: learner {learner_id} has {theirs.hex()[:16]}…, the syncer's model has "
            f"{ours.hex()[:16]}… (different model, tensor names, shapes, dtypes or fragment assignment)")


def sweep_problem(flags: int, *, fragments: int, pipeline: int, sync_interval_steps: int) -> str | None:
    """Why a learner that sweeps (its HELLO `flags`: RL iterations, DESIGN §3.4) cannot work with
    this syncer's schedule, or None. A sweep answers every fragment's PULL at once, so rounds must
    not be paced by learner steps; one that trains on while they merge needs them all in flight."""
    problems = []
    if flags & HELLO_SWEEPS and sync_interval_steps:
        problems.append(f"--sync-interval-steps {sync_interval_steps} paces rounds by learner steps, and a learner "
                        "that sweeps (YETO_DILOCO_RL_MODE=sweep|overlap) needs them unpaced: --sync-interval-steps 0")
    if flags & HELLO_SWEEP_OVERLAP and pipeline < fragments:
        problems.append(f"--pipeline {pipeline} keeps fewer rounds in flight than the {fragments} fragments a sweep "
                        f"pushes, and YETO_DILOCO_RL_MODE=overlap needs them all: --pipeline {fragments}")
    return "; ".join(problems) or None
