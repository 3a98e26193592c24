"""The run planner's arithmetic: what a DiLoCo run costs before it is paid for (`yeto-plan`).

Dataclasses in, dataclasses out, no I/O: `predict` says what one choice of sync interval H,
push codec, downlink, fragment count P and pipeline depth costs on given islands and a given
syncer host; `recommend` searches those choices. What a message weighs is `plan_wire.py`, what
each side holds `plan_memory.py`; `syncer/tools/plan_cli.py` reads models and links, and prints.
Every number follows the code it names; docs/planner.md states the formulas and the validation
against measured runs.

Time model of one round (DESIGN §3.2, §4.5). Round r merges fragment r mod P. Island i trains a
boundary's steps per round, max(1, H // P) (`LearnerSession.boundary_every`), answers a PULL at its
next step (`answer_on_arrival`; at its next boundary without), with one push in flight at a time,
and it receives every broadcast; so it can answer at most one round per c_i = max(boundary_i,
upload_i, download_i). The syncer launches one round per
(H/P)·median step time (`rounds.round_interval`, polled every 20 ms while throttled:
`SyncerProtocol.wakeup`), keeps at most `pipeline` rounds uncommitted, merges one round at a time
on its coordinator, and a round commits with K answers (plus grace for slower members). So the
round time is the largest of: the pacing, the K-th smallest c_i, the syncer link's bytes per
round, the syncer's serial merge and commit, and one upload plus the rest of the launch-to-commit
latency / pipeline depth (rounds in flight share the link their pushes queue on).
Islands never wait on the network: a round slower than the compute between boundaries makes
each fragment sync every H·(round time / compute) steps instead of idling anyone.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from syncer.tools.plan_memory import (
    RUNTIME_BYTES,
    IslandMemory,
    Memory,
    island_memory,
    syncer_memory,
)
from syncer.tools.plan_wire import (
    ALL_DOWNLINKS,
    ALL_PUSH_CODECS,
    DEFAULT_BLOCK,
    DOWNLINKS,
    ETHERNET_FRAME,
    MSS,
    PUSH_CODECS,
    PlanError,
    bcast_wire_bytes,
    moment_bytes,
    on_the_wire,
    push_wire_bytes,
)

GIB = 1 << 30

THROTTLE_POLL_S = 0.02  # syncer/core/protocol.py wakeup(): a throttled launch is looked at every 20 ms

# Bounds a machine can honour. Every count an input gives is checked against them before anything is
# sized by it, so an absurd one is a PlanError naming the input, not an allocation that never ends;
# the search's cost grows with the islands and the tensors (each prediction sorts the islands).
MAX_ISLANDS = 1024
MAX_FRAGMENTS = 4096  # and rounds in flight
MAX_INTERVAL = 1 << 20  # H, inner steps between a fragment's syncs
MAX_TENSORS = 1 << 18  # synced tensors of a model (a 1,000-layer decoder has ~13,000)
MAX_BLOCK = 1 << 20  # yeto_core/quant.py MAX_BLOCK

# yeto_core/layout.py _LAYER_RE, for the `strided` pattern.
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Tensor:
    name: str
    numel: int
    embedding: bool = False  # the input embedding (and a tied head): fragment 0 of its own


@dataclass(frozen=True)
class Model:
    name: str
    tensors: tuple[Tensor, ...]  # the synced tensors, in parameter order
    total_params: int  # every parameter of the model, frozen ones included (LoRA: the base too)
    tuning: str = "full"  # "full" or "lora" (only the adapters sync: torch_dist/modules.synced_parameters)

    @property
    def synced_params(self) -> int:
        return sum(t.numel for t in self.tensors)


@dataclass(frozen=True)
class Island:
    up_bps: float  # goodput, bytes/s, this island to the syncer
    down_bps: float
    step_s: float  # one optimizer step


@dataclass(frozen=True)
class SyncerHost:
    memory_bytes: float
    link_in_bps: float | None = None  # the syncer's own link (goodput) from all islands; None: not a bottleneck
    link_out_bps: float | None = None  # ... and to all islands
    merge_bps: float = 2.0e9  # f32 bytes of (answers + MERGE_PASSES) fragment passes a second (CPU, here)
    commit_s: float = 0.005  # per commit: bookkeeping and the tape's fsync
    checkpoint_every: int = 0  # synchronous checkpoint every N rounds (0: none counted)
    checkpoint_bps: float = 1.0e9  # disk write rate of a checkpoint
    background_checkpoint: bool = False
    delayed_nesterov: bool = False  # keeps an f32 accumulator per fragment (syncer/merge/outer.py)
    heloco: bool = False  # --delta-correction heloco: a round's deltas are corrected in a stacked copy


@dataclass(frozen=True)
class Setup:
    model: Model
    islands: tuple[Island, ...]
    quorum: int
    host: SyncerHost
    pattern: str = "binpack"
    block: int = DEFAULT_BLOCK
    rtt_s: float = 0.0
    queue_s: float = 0.0  # standing queue of a saturated link (its bottleneck's buffer), which a PULL waits out
    grace_cap_s: float = 5.0  # SyncerSettings grace_s, grace_gamma, grace_tau
    grace_gamma: float = 1.0
    grace_tau: float = 2.0
    tcp_efficiency: float = MSS / ETHERNET_FRAME  # TCP payload per line byte at MTU 1500
    share_momentum: bool = False  # YETO_DILOCO_SHARE_MOMENTUM: pushes and broadcasts carry their fragment's moment
    answer_on_arrival: bool = False  # YETO_DILOCO_ANSWER_ON_ARRIVAL: a PULL waits for the next step, not boundary


@dataclass(frozen=True)
class Choice:
    sync_interval: int  # H
    codec: str
    downlink: str
    fragments: int  # P
    pipeline: int


@dataclass(frozen=True)
class Prediction:
    choice: Choice
    fragment_params: tuple[int, ...]
    push_bytes: float  # one island's push of the mean fragment, with its frames
    bcast_bytes: float  # one broadcast of the mean fragment to one island, frames included
    compute_s: float  # steps between boundaries of the quorum's islands (the planned round time)
    pacing_s: float
    island_cycle_s: tuple[float, ...]  # per island: the fastest it can answer rounds
    upload_s: float  # the K-th island's push of the mean fragment
    download_s: float
    syncer_in_s: float
    syncer_out_s: float
    serial_s: float  # merge + commit (+ checkpoint share) on the syncer's coordinator
    latency_s: float  # launch → commit of the mean fragment
    round_s: float
    bound: str  # which term sets the round time
    pushes_per_round: tuple[float, ...]  # per island
    up_bytes_per_round: float  # all islands' pushes, frames included (yeto's bytes)
    down_bytes_per_round: float
    up_wire_bytes_per_round: float  # the same on the line: TCP/IP/Ethernet headers, the downlink's ACKs
    down_wire_bytes_per_round: float
    memory: Memory
    island_memory: IslandMemory  # each island's rank 0, beyond its weights

    @property
    def utilization(self) -> float:
        """Compute between boundaries / round time: 1 when the wire hides behind compute."""
        return min(1.0, self.compute_s / self.round_s)

    @property
    def effective_interval(self) -> float:
        """Steps each fragment actually trains between its syncs (H when utilization is 1)."""
        return self.choice.sync_interval / self.utilization


@dataclass(frozen=True)
class Recommendation:
    best: Prediction
    alternatives: tuple[Prediction, ...]  # the best plan of each other codec and downlink, for the table


# ---- fragments and bytes --------------------------------------------------------------------------


def fragment_params(model: Model, fragments: int, pattern: str = "binpack") -> tuple[int, ...]:
    """Elements per fragment, as `yeto_core.layout.build_layout` splits the synced tensors: with
    P ≥ 2 the embedding is fragment 0 alone; the rest binpacked (largest first into the lightest,
    ties to the lower index) or strided (layer i to bin i mod B, the rest binpacked onto that)."""
    if not 1 <= fragments <= MAX_FRAGMENTS:
        raise PlanError(f"--fragments {fragments}: must be between 1 and {MAX_FRAGMENTS}")
    tensors = model.tensors
    split = fragments >= 2 and any(t.embedding for t in tensors)
    first = 1 if split else 0
    others = [t for t in tensors if not (split and t.embedding)]
    bins = fragments - first
    if len(others) < bins:
        raise PlanError(f"--fragments {fragments}: {model.name} has {len(tensors)} synced tensors, too few to fill "
                        f"{fragments} fragments{' (fragment 0 is the embedding)' if split else ''}")
    loads = [0] * bins
    loose = others
    if pattern == "strided" and bins > 1:
        loose = []
        for t in others:
            m = _LAYER_RE.search(t.name)
            if m is None:
                loose.append(t)
            else:
                loads[int(m.group(1)) % bins] += t.numel
    heap = [(load, b) for b, load in enumerate(loads)]
    heapq.heapify(heap)
    for t in sorted(loose, key=lambda t: -t.numel):  # stable: canonical order among equal sizes
        load, b = heap[0]
        heapq.heapreplace(heap, (load + t.numel, b))
    sizes = [0] * bins
    for load, b in heap:
        sizes[b] = load
    out = ([sum(t.numel for t in tensors if t.embedding)] if split else []) + sizes
    if min(out) == 0:
        raise PlanError(f"--fragments {fragments}: a fragment of {model.name} would be empty; ask for fewer")
    return tuple(out)


# ---- one choice ---------------------------------------------------------------------------------------


# syncer/merge/round_merge.py merge_round costs about (answers + MERGE_PASSES) passes over the f32
# fragment: benchmarks.merge on a 16 MiB fragment here took 36, 46 and 63 ms for 1, 2 and 4
# learners, 8.8 ms a learner on top of 27 ms (3.1 passes) of norms, screen and outer step.
MERGE_PASSES = 3.0


def merge_seconds(numel: float, answers: float, merge_bps: float) -> float:
    return 4.0 * numel * (answers + MERGE_PASSES) / merge_bps


def _kth_smallest(values: Sequence[float], k: int) -> float:
    return sorted(values)[k - 1]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]  # syncer/core/protocol.py _fleet_step_s: the upper median


def predict(setup: Setup, choice: Choice) -> Prediction:
    """What one choice costs on these islands and this syncer (module docstring)."""
    check_setup(setup)
    return _predict(setup, choice)


def _predict(setup: Setup, choice: Choice, sizes: Sequence[int] | None = None) -> Prediction:
    """`predict` of a checked setup; `sizes`, when given, are `fragment_params(setup.model,
    choice.fragments, setup.pattern)` (the search computes them once per P)."""
    h, p = choice.sync_interval, choice.fragments
    if not (1 <= h <= MAX_INTERVAL and 1 <= choice.pipeline <= MAX_FRAGMENTS):
        raise PlanError(f"H={h}, pipeline {choice.pipeline}: H must be between 1 and {MAX_INTERVAL}, the pipeline "
                        f"between 1 and {MAX_FRAGMENTS}")
    sizes = tuple(sizes) if sizes is not None else fragment_params(setup.model, p, setup.pattern)
    n_mean = sum(sizes) / p
    push = sum(push_wire_bytes(choice.codec, n, setup.block) for n in sizes) / p
    bcast = sum(bcast_wire_bytes(choice.downlink, n) for n in sizes) / p
    moment = sum(moment_bytes(n) for n in sizes) / p if setup.share_momentum else 0.0
    push, bcast = push + moment, bcast + moment  # the same bulk message, a longer payload
    islands, k, m = setup.islands, setup.quorum, len(setup.islands)
    depth = min(choice.pipeline, p)  # syncer/core/rounds.py pipeline_depth
    every = max(1, h // p)  # LearnerSession.boundary_every
    boundary = [every * i.step_s for i in islands]
    up = [push / i.up_bps for i in islands]
    down = [bcast / i.down_bps for i in islands]
    cycle = [max(b, u, d) for b, u, d in zip(boundary, up, down, strict=True)]
    planned = h / p * _median([i.step_s for i in islands])  # rounds.round_interval's pacing
    compute = max(planned, _kth_smallest(boundary, k))
    kth = sorted(range(m), key=lambda j: cycle[j])[k - 1]  # the island whose answer completes the quorum
    island_term = "compute" if cycle[kth] == boundary[kth] else _island_bound(up[kth], down[kth])
    host = setup.host
    checkpoint = 0.0
    if host.checkpoint_every and not host.background_checkpoint:
        state = (12.0 if host.delayed_nesterov else 8.0) * sum(sizes)
        checkpoint = state / host.checkpoint_bps / host.checkpoint_every
    answering_step = _median(sorted(i.step_s for i in islands)[:k])
    round_s = max(compute, cycle[kth])
    for _ in range(4):  # pushes per round depend on the round time: a short fixed-point iteration
        # the K fastest islands answer every round; each slower one as often as its cycle lets it
        pushes = [min(1.0, round_s / c) for c in cycle]
        answers = sum(pushes)
        serial = merge_seconds(n_mean, answers, host.merge_bps) + host.commit_s + checkpoint
        if setup.share_momentum:  # the moments' average: each answer's decoded and the mean encoded
            serial += 4.0 * n_mean * (answers + 1) / host.merge_bps
        syncer_in = answers * push / host.link_in_bps if host.link_in_bps else 0.0
        syncer_out = m * bcast / host.link_out_bps if host.link_out_bps else 0.0
        # pushes of one round arrive together, so they share the syncer's link
        upload = max(up[kth], syncer_in)
        # a round's PULLs leave right after the broadcasts of the commit that made room for it, so
        # they queue behind them on the downlink's bottleneck, for at most its standing queue
        pull_wait = min(setup.queue_s, max(down[kth], syncer_out))
        # a PULL waits for the island's next step (on arrival) or its next boundary, half of one on average
        answer_wait = islands[kth].step_s if setup.answer_on_arrival else boundary[kth]
        quorum_at = setup.rtt_s + pull_wait + answer_wait / 2 + upload
        grace = 0.0
        # a member that misses rounds is waited for, unless it is more than τ× slower than the fleet
        # (rounds.grace_window)
        if k < m and any(c > round_s * 1.0001 and i.step_s <= setup.grace_tau * answering_step
                         for c, i in zip(cycle, islands, strict=True)):
            grace = min(max(setup.grace_gamma * ((depth * every + setup.grace_tau) * answering_step - quorum_at
                                                 - serial), 0.0), setup.grace_cap_s)
        latency = quorum_at + grace + serial
        # The rounds in flight share the fixed part of a round's latency, but not the link: their
        # pushes queue on it together (a push is out once the kernel holds it), so they commit
        # together, and a batch of `depth` rounds takes the fixed part plus `depth` uploads.
        terms = {"compute": max(planned + THROTTLE_POLL_S / 2, _kth_smallest(boundary, k)),
                 "syncer link in": syncer_in, "syncer link out": syncer_out, "syncer merge": serial,
                 "latency/pipeline": upload + (latency - upload) / depth}
        terms[island_term] = max(terms.get(island_term, 0.0), cycle[kth])
        bound = max(terms, key=lambda t: terms[t])
        round_s = terms[bound]
    memory = syncer_memory(setup, choice, sizes, answers)
    return Prediction(choice=choice, fragment_params=sizes, push_bytes=push, bcast_bytes=bcast, compute_s=compute,
                      pacing_s=planned, island_cycle_s=tuple(cycle), upload_s=up[kth], download_s=down[kth],
                      syncer_in_s=syncer_in, syncer_out_s=syncer_out, serial_s=serial, latency_s=latency,
                      round_s=round_s, bound=bound, pushes_per_round=tuple(pushes),
                      up_bytes_per_round=answers * push, down_bytes_per_round=m * bcast,
                      up_wire_bytes_per_round=on_the_wire(answers * push, m * bcast, setup.tcp_efficiency),
                      down_wire_bytes_per_round=on_the_wire(m * bcast, answers * push, setup.tcp_efficiency),
                      memory=memory,
                      island_memory=island_memory(choice, sizes, setup.block, share_momentum=setup.share_momentum))


def _island_bound(upload: float, download: float) -> str:
    return "island upload" if upload >= download else "island download"


def check_setup(setup: Setup) -> None:
    """One PlanError naming the first input that cannot describe a run."""
    if not 1 <= len(setup.islands) <= MAX_ISLANDS:
        raise PlanError(f"--islands {len(setup.islands)}: between 1 and {MAX_ISLANDS} islands")
    for j, i in enumerate(setup.islands):
        for name, value in (("--up-mbps", i.up_bps), ("--down-mbps", i.down_bps), ("--step-s", i.step_s)):
            if not (value > 0 and math.isfinite(value)):
                raise PlanError(f"{name}: island {j}'s value must be a finite number > 0")
    if not 1 <= setup.quorum <= len(setup.islands):
        raise PlanError(f"--quorum {setup.quorum}: must be between 1 and the {len(setup.islands)} islands")
    host = setup.host
    for rate in (host.link_in_bps, host.link_out_bps):
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            raise PlanError(f"--syncer-mbps: the syncer's link rate {rate:g} must be a finite number > 0")
    for flag, value in (("--merge-gbps", host.merge_bps), ("--checkpoint-gbps", host.checkpoint_bps),
                        ("--syncer-memory-gib", host.memory_bytes)):
        if not (value > 0 and math.isfinite(value)):
            raise PlanError(f"{flag}: {value:g} must be a finite number > 0")
    if host.checkpoint_every < 0:
        raise PlanError(f"--checkpoint-every {host.checkpoint_every}: cannot be negative")
    if not 1 <= setup.block <= MAX_BLOCK:
        raise PlanError(f"--push-block {setup.block}: must be between 1 and {MAX_BLOCK}")
    for flag, value in (("--rtt-ms", setup.rtt_s), ("--queue-ms", setup.queue_s)):
        if not (value >= 0 and math.isfinite(value)):
            raise PlanError(f"{flag}: the delay {value * 1000:g} ms must be a finite number >= 0")
    if not 0 < setup.tcp_efficiency <= 1:
        raise PlanError(f"--tcp-efficiency {setup.tcp_efficiency:g}: must be in (0, 1]")
    if not setup.model.tensors or setup.model.synced_params <= 0:
        raise PlanError(f"--model: {setup.model.name} has no parameters to sync")
    if len(setup.model.tensors) > MAX_TENSORS:
        raise PlanError(f"--model: {setup.model.name} has {len(setup.model.tensors)} synced tensors; at most "
                        f"{MAX_TENSORS} are planned for")


# ---- the search -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Search:
    """What `recommend` may choose from; a one-element tuple pins that knob."""

    target_utilization: float = 0.95
    min_interval: int = 24  # README: H=4 measured no better than the default 24 (compare_diloco)
    max_interval: int = 4096
    codecs: tuple[str, ...] = PUSH_CODECS
    downlinks: tuple[str, ...] = DOWNLINKS
    fragments: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    pipelines: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    interval_slack: float = 0.10  # an H this much above the smallest workable one still counts as smallest
    interval: int | None = None  # pinned H
    run_steps: int | None = None  # the islands' whole run: H above it never completes a round trip


def _meets(pred: Prediction, setup: Setup, search: Search) -> bool:
    return pred.utilization >= search.target_utilization and pred.memory.total <= setup.host.memory_bytes


def _smallest_interval(setup: Setup, search: Search, codec: str, downlink: str, sizes: Sequence[int],
                       depth: int) -> Prediction | None:
    """The smallest multiple of P in [min, max] meeting the target (utilization grows with H);
    `sizes` are the P fragments' parameter counts."""
    p = len(sizes)

    def at(h: int) -> Prediction:
        return _predict(setup, Choice(h, codec, downlink, p, depth), sizes)

    if search.interval is not None:
        pred = at(search.interval)
        return pred if _meets(pred, setup, search) else None
    lo, hi = max(1, math.ceil(search.min_interval / p)), search.max_interval // p
    if lo > hi:
        return None
    best = at(hi * p)
    if not _meets(best, setup, search):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        pred = at(mid * p)
        if _meets(pred, setup, search):
            best, hi = pred, mid
        else:
            lo = mid + 1
    return best if best.choice.sync_interval == lo * p else at(lo * p)


def _rank(pred: Prediction) -> tuple[int, int, int, int, int]:
    """Among plans whose H is about the smallest workable one: the more precise push codec and
    downlink first, then the smaller H (fewer local steps), then fewer rounds in flight (fresher
    merges), then fewer fragments (fewer rounds per H)."""
    c = pred.choice
    return (ALL_PUSH_CODECS.index(c.codec), ALL_DOWNLINKS.index(c.downlink), c.sync_interval, c.pipeline,
            c.fragments)


def recommend(setup: Setup, search: Search) -> Recommendation:
    """The best choice meeting the target utilization within the host's memory, or a PlanError
    that names what stands in the way."""
    check_setup(setup)
    check_search(search)
    _check_state_fits(setup)
    found: list[Prediction] = []
    feasible_p = []
    for p in search.fragments:
        try:
            sizes = fragment_params(setup.model, p, setup.pattern)  # once per P: a sort of every tensor
        except PlanError:
            continue
        feasible_p.append(p)
        for codec in search.codecs:
            for downlink in search.downlinks:
                for depth in sorted({min(d, p) for d in search.pipelines}):
                    pred = _smallest_interval(setup, search, codec, downlink, sizes, depth)
                    if pred is not None:
                        found.append(pred)
    if not feasible_p:
        raise PlanError(f"--fragments {','.join(map(str, search.fragments))}: none splits {setup.model.name}'s "
                        f"{len(setup.model.tensors)} synced tensors")
    if not found:
        raise PlanError(_why_nothing_fits(setup, search, feasible_p))
    # H comes in multiples of P, so the smallest H of each P differs by a step or two: an H within
    # `interval_slack` of the smallest counts as small, and precision decides among those.
    smallest = min(p.choice.sync_interval for p in found)
    small = sorted((p for p in found if p.choice.sync_interval <= smallest * (1 + search.interval_slack)), key=_rank)
    best = small[0]
    found.sort(key=lambda p: (p.choice.sync_interval, *_rank(p)))
    if search.run_steps is not None and best.effective_interval > search.run_steps:
        raise PlanError(f"--steps {search.run_steps}: the smallest workable H is {best.choice.sync_interval} "
                        f"({best.effective_interval:.0f} steps per fragment round trip at this round time): not one "
                        "round trip of every fragment fits in the run")
    seen = {(best.choice.codec, best.choice.downlink)}
    others = []
    for pred in found:
        key = (pred.choice.codec, pred.choice.downlink)
        if key not in seen:
            seen.add(key)
            others.append(pred)
    return Recommendation(best, tuple(others))


def check_search(search: Search) -> None:
    """One PlanError naming the first knob of the search that no run could have."""
    if not 0 < search.target_utilization <= 1:
        raise PlanError(f"--target-utilization {search.target_utilization:g}: must be in (0, 1]")
    if not 1 <= search.min_interval <= search.max_interval <= MAX_INTERVAL:
        raise PlanError(f"--min-h {search.min_interval}, --max-h {search.max_interval}: need 1 <= --min-h <= --max-h "
                        f"<= {MAX_INTERVAL}")
    if search.interval is not None and not 1 <= search.interval <= MAX_INTERVAL:
        raise PlanError(f"--h {search.interval}: must be between 1 and {MAX_INTERVAL}")
    for flag, values in (("--fragments", search.fragments), ("--pipeline", search.pipelines)):
        if not values or not all(1 <= v <= MAX_FRAGMENTS for v in values):
            raise PlanError(f"{flag} {','.join(map(str, values))}: each must be between 1 and {MAX_FRAGMENTS}")
    if search.run_steps is not None and search.run_steps < 1:
        raise PlanError(f"--steps {search.run_steps}: a run has at least one step")


def _check_state_fits(setup: Setup) -> None:
    n = setup.model.synced_params
    state = 8.0 * n + (4.0 * n if setup.host.delayed_nesterov else 0.0)
    if state + RUNTIME_BYTES > setup.host.memory_bytes:
        raise PlanError(f"--syncer-memory-gib {setup.host.memory_bytes / GIB:.1f}: the syncer's state alone is "
                        f"{state / GIB:.1f} GiB (f32 params + outer momentum of {n / 1e9:.2f}B synced parameters), "
                        "more than the host's memory; give a larger host, or sync fewer parameters (LoRA)")


def _why_nothing_fits(setup: Setup, search: Search, feasible_p: Sequence[int]) -> str:
    """The most lenient choice searched, and what holds it back."""
    h = search.interval or search.max_interval
    p = max(feasible_p)
    depth = min(max(search.pipelines), p)
    lenient = predict(setup, Choice(max(h, p), search.codecs[-1], search.downlinks[-1], p, depth))
    if lenient.memory.total > setup.host.memory_bytes:
        return (f"--syncer-memory-gib {setup.host.memory_bytes / GIB:.1f}: even with {p} fragments and pipeline "
                f"{depth} the syncer needs {lenient.memory.total / GIB:.1f} GiB")
    knob = f"H={search.interval} (--h)" if search.interval else f"--max-h {search.max_interval}"
    return (f"{knob}: no plan reaches utilization {search.target_utilization:g}; the best, {lenient.choice.codec} "
            f"pushes with {lenient.choice.downlink} broadcasts, {p} fragments, pipeline {depth}, reaches "
            f"{lenient.utilization:.2f}: a round takes {lenient.round_s:.3g} s ({lenient.bound}) against "
            f"{lenient.compute_s:.3g} s of compute. Allow a larger H, lower --target-utilization, or give faster links")

