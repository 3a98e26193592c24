"""The planner's memory: what the syncer and an island's rank 0 hold for a plan, counted from the
code each term names (DESIGN §10.2), for `syncer/tools/plan.py`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from syncer.tools.plan_wire import DEFAULT_BLOCK, downlink_payload_bytes, moment_bytes, payload_bytes

if TYPE_CHECKING:
    from syncer.tools.plan import Choice, Setup

RUNTIME_BYTES = 300 << 20  # the syncer's interpreter, torch and sockets (260 MiB RSS in README's soak run)


class _Summed:
    """Byte terms whose total is their sum."""

    __dataclass_fields__: dict[str, object]

    @property
    def total(self) -> float:
        return float(sum(getattr(self, f) for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class Memory(_Summed):
    """Host bytes the syncer holds (`syncer_memory`)."""

    params: float
    momentum: float
    accumulator: float
    downlink_anchors: float
    answers_in_flight: float
    merge_workspace: float
    broadcast_copy: float
    checkpoint_copies: float
    runtime: float
    shared_moments: float = 0.0


STEP_TEMP_ELEMENTS = 1 << 20  # syncer/merge/outer.py STEP_CHUNK: the outer step's temporary, a chunk at a time
PLAN_ELEMENTS = 1 << 20  # syncer/merge/fused.py PLAN_CHUNK: a fused merge's planning scratch


def merge_workspace_bytes(n_max: int, pushing: int, depth: int, heloco: bool, delayed: bool) -> float:
    """The merge's scratch (syncer/merge/round_merge.py, fused.py). The fused merge (plain Nesterov,
    no HeLoCo) forms the outer gradient a chunk at a time: two step chunks at the commit and a
    planning chunk for each merge prepared ahead and the commit's own. Otherwise the merged delta
    is held whole, with a chunk of the step's temporary, and HeLoCo corrects the pushes in a
    stacked copy; either way the merge reads the pushes where they were received."""
    step = 4.0 * min(n_max, STEP_TEMP_ELEMENTS)
    if not heloco and not delayed:
        return 2 * step + 4.0 * min(n_max, PLAN_ELEMENTS) * (depth + 1)
    return 4.0 * n_max + step + (4.0 * pushing * n_max if heloco else 0.0)


def syncer_memory(setup: Setup, choice: Choice, sizes: Sequence[int], answers: float | None = None) -> Memory:
    """Host bytes the syncer holds on a CPU merge device (`--device cpu`; cuda moves params,
    momentum and the workspace to the GPU). Counted from syncer/durability/checkpoint.py SyncerState,
    round_merge.py MergeWorkspace, intake.py and merge/held.py (an answer is its push's receive
    buffer: an f32 push viewed as the delta, a quantized or bf16 one held in its wire encoding until
    merged), leases.py (a commit copies a fragment a send still reads), snapshots.py and
    yeto_core/downlink.py. The receive pool's idle buffers are not counted again: each is an
    answer's payload between two uses, never both at once; benchmarks/scale.py measures the sum."""
    n_total, n_max = sum(sizes), max(sizes)
    host = setup.host
    m = len(setup.islands)
    pushing = m if answers is None else min(m, math.ceil(answers))
    depth = min(choice.pipeline, choice.fragments)
    answer = payload_bytes(choice.codec, n_max, setup.block)  # 4·n for f32
    return Memory(
        params=4.0 * n_total,
        momentum=4.0 * n_total,
        accumulator=4.0 * n_total if host.delayed_nesterov else 0.0,
        downlink_anchors=4.0 * n_total if choice.downlink != "f32" else 0.0,  # one chain: one codec in use
        answers_in_flight=float(depth * pushing * answer),
        merge_workspace=merge_workspace_bytes(n_max, pushing, depth, host.heloco, host.delayed_nesterov),
        broadcast_copy=4.0 * n_max,
        checkpoint_copies=8.0 * n_total if host.background_checkpoint else 0.0,
        runtime=float(RUNTIME_BYTES),
        # Each answer's moment in its receive buffer, the averages of the last two merges kept for
        # the broadcasts (syncer/service/moments.py), and a merge's two fragment scratches.
        shared_moments=(moment_bytes(n_max) * (depth * pushing + 2) + 8.0 * n_max) if setup.share_momentum else 0.0,
    )


# ---- an island's memory ----------------------------------------------------------------------------


STEADY_WORK_BUFFERS = 2  # yeto_core/store.py STEADY_FRAGMENT_BUFFERS: idle fragment buffers a learner keeps


@dataclass(frozen=True)
class IslandMemory(_Summed):
    """Host bytes an island's rank 0 holds for yeto beyond its own weights (DESIGN §10.2)."""

    anchors: float
    work_buffers: float
    push_payload: float
    broadcast_receive: float
    shared_moments: float = 0.0


def island_memory(choice: Choice, sizes: Sequence[int], block: int = DEFAULT_BLOCK, *,
                  share_momentum: bool = False) -> IslandMemory:
    """Counted from yeto_core/fragment_sync.py (an f32 anchor per fragment, θ at its last install),
    yeto_core/store.py (fragment work buffers: the ones the pool keeps idle and a push's delta) and
    yeto_core/client.py (a push's encoded payload; a broadcast's receive buffer); with shared
    moments yeto_core/moments.py (the moment of each push in flight, a broadcast's, two fragment
    scratches)."""
    n_total, n_max = sum(sizes), max(sizes)
    down = downlink_payload_bytes(choice.downlink, n_max)
    depth = min(choice.pipeline, choice.fragments)
    moments = moment_bytes(n_max) * (depth + 1) + 8.0 * n_max if share_momentum else 0.0
    return IslandMemory(anchors=4.0 * n_total, work_buffers=4.0 * (STEADY_WORK_BUFFERS + 1) * n_max,
                        push_payload=float(payload_bytes(choice.codec, n_max, block)), broadcast_receive=float(down),
                        shared_moments=moments)
