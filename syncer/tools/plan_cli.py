"""`yeto-plan` (`python -m syncer.tools.plan_cli`): size a DiLoCo run before it is paid for.

    yeto-plan --preset 7b --islands 4 --up-mbps 1000 --down-mbps 1000 --step-s 2 --syncer-memory-gib 256
    yeto-plan --model CONFIG_DIR --lora-r 16 --islands 2 --probe HOST:7070 --key-file yeto.key --step-s 0.8

Reads the model (an HF config dir, a .safetensors file or a dir of them: the header only, or a
built-in shape preset), the islands' links (given rates, or the bandwidth probe of
`yeto_core/probe.py` against a running syncer) and step times, and prints the recommended H,
push codec, downlink, fragment count and pipeline depth with the bytes per round, round time,
compute utilization and syncer memory (`--json` for machines). An impossible plan is one line
naming the input and exit code 2. The arithmetic is `syncer/tools/plan.py`; docs/planner.md says how
it was checked against measured runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from syncer.tools.plan import (
    ALL_DOWNLINKS,
    ALL_PUSH_CODECS,
    DOWNLINKS,
    ETHERNET_FRAME,
    GIB,
    MAX_BLOCK,
    MAX_FRAGMENTS,
    MAX_INTERVAL,
    MAX_ISLANDS,
    MSS,
    PUSH_CODECS,
    Choice,
    Island,
    PlanError,
    Prediction,
    Recommendation,
    Search,
    Setup,
    SyncerHost,
    predict,
    recommend,
)
from syncer.tools.plan_model import DEFAULT_LORA_TARGETS, MAX_LORA_RANK, PRESETS, load_model
from syncer.tools.tool_args import ToolParser, one_line
from yeto_core.settings import default_quorum

MAX_PROBE_MIB = 1024  # yeto_core/wire/messages.py MAX_PROBE_BYTES each way, in MiB


def per_island(flag: str, text: str | None, islands: int, most: float = 1e9) -> list[float] | None:
    """`--flag 100` for every island, or `--flag 100,50,20,20` one per island; each in (0, most]."""
    if text is None:
        return None
    if text.count(",") >= islands:  # counted before anything is made of each
        raise PlanError(f"{flag}: {text.count(',') + 1} values for --islands {islands}")
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise PlanError(f"{flag} {text!r}: expected a number or a comma list of numbers") from None
    if len(values) == 1:
        values *= islands
    if len(values) != islands:
        raise PlanError(f"{flag} {text!r}: {len(values)} values for --islands {islands}")
    for j, v in enumerate(values):
        if not 0 < v <= most:
            raise PlanError(f"{flag} {text!r}: island {j}'s value {v:g} must be a finite number > 0 and <= {most:g}")
    return values


def host_memory_bytes() -> float:
    """This machine's RAM (the default host for the syncer)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float(16 * GIB)


def probe_link(address: str, key_file: Path, mib: int) -> tuple[float, float]:
    """(up, down) Mbit/s of this host's link to a running syncer, by yeto's bandwidth probe."""
    from yeto_core.probe import measure_link
    from yeto_core.settings import SettingsError, parse_address, read_key
    from yeto_core.wire.errors import WireError

    try:
        host_port = parse_address(address)
        key = read_key(None, key_file, prefix="YETO_DILOCO_", key_file_name="--key-file")
    except (ValueError, SettingsError) as exc:
        raise PlanError(f"--probe {address}: {exc}") from None
    try:
        result = measure_link(host_port, key, up_bytes=mib << 20, down_bytes=mib << 20, timeout_s=120)
    except (OSError, WireError) as exc:
        raise PlanError(f"--probe {address}: the bandwidth probe failed ({exc})") from None
    return result.up_mbps, result.down_mbps


# Every numeric flag's bounds (attribute, lowest, highest, lowest excluded), checked before anything is
# sized by it; an unset one (None) passes. Rates go up to a Pbit/s or a PB/s, delays to days.
NUMBER_FLAGS: tuple[tuple[str, float, float, bool], ...] = (
    ("islands", 1, MAX_ISLANDS, False), ("quorum", 0, MAX_ISLANDS, False), ("lora_r", 0, MAX_LORA_RANK, False),
    ("tokens_per_step", 0, 1e12, True), ("probe_mib", 1, MAX_PROBE_MIB, False), ("rtt_ms", 0, 1e8, False),
    ("queue_ms", 0, 1e8, False), ("tcp_efficiency", 0, 1, True), ("syncer_mbps", 0, 1e9, True),
    ("syncer_memory_gib", 0, 1 << 30, True), ("merge_gbps", 0, 1e6, True), ("checkpoint_every", 0, 1e12, False),
    ("checkpoint_gbps", 0, 1e6, True), ("h", 1, MAX_INTERVAL, False), ("fragments", 1, MAX_FRAGMENTS, False),
    ("pipeline", 1, MAX_FRAGMENTS, False), ("push_block", 1, MAX_BLOCK, False),
    ("target_utilization", 0, 1, True), ("min_h", 1, MAX_INTERVAL, False), ("max_h", 1, MAX_INTERVAL, False),
    ("steps", 1, 1e15, False),
)


def check_flags(args: argparse.Namespace) -> None:
    """One PlanError naming the first numeric flag out of its bounds (NUMBER_FLAGS)."""
    for attr, lo, hi, open_low in NUMBER_FLAGS:
        value = getattr(args, attr, None)
        if value is None:
            continue
        if not (lo < value <= hi if open_low else lo <= value <= hi):  # NaN fails both
            where = f"in ({_number(lo)}, {_number(hi)}]" if open_low else f"between {_number(lo)} and {_number(hi)}"
            raise PlanError(f"--{attr.replace('_', '-')} {_number(value)}: must be {where}")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else f"{value:g}"


def build_setup(args: argparse.Namespace) -> Setup:
    check_flags(args)
    m = args.islands
    model = load_model(args.model, args.preset, args.lora_r, args.lora_targets.split(","))
    steps = per_island("--step-s", args.step_s, m, most=1e6)
    if steps is None:
        raise PlanError("--step-s: each island's optimizer step time is needed (one value, or one per island)")
    up = per_island("--up-mbps", args.up_mbps, m)
    down = per_island("--down-mbps", args.down_mbps, m)
    eff = args.tcp_efficiency
    measured: tuple[float, float] | None = None
    if up is None or down is None:
        if args.probe is None:
            raise PlanError("--up-mbps/--down-mbps: give the islands' rates, or --probe HOST:PORT with --key-file "
                            "to measure this host's link")
        if args.key_file is None:
            raise PlanError("--probe: --key-file (the run's shared key) is needed to probe the syncer")
        measured = probe_link(args.probe, Path(args.key_file), args.probe_mib)
    # Given rates are line rates (TCP/IP headers ride on them); probed ones are already goodput.
    ups = [v * 1e6 / 8 * eff for v in up] if up else [measured[0] * 1e6 / 8 for _ in range(m)]  # type: ignore[index]
    downs = [v * 1e6 / 8 * eff for v in down] if down else [measured[1] * 1e6 / 8 for _ in range(m)]  # type: ignore[index]
    memory = args.syncer_memory_gib * GIB if args.syncer_memory_gib is not None else host_memory_bytes()
    link = args.syncer_mbps * 1e6 / 8 * eff if args.syncer_mbps else None
    host = SyncerHost(memory_bytes=memory, link_in_bps=link, link_out_bps=link,
                      merge_bps=args.merge_gbps * 1e9, checkpoint_every=args.checkpoint_every,
                      checkpoint_bps=args.checkpoint_gbps * 1e9, background_checkpoint=args.background_checkpoint,
                      delayed_nesterov=args.delayed_nesterov,
                      heloco=args.heloco)
    quorum = args.quorum or default_quorum(m)
    islands = tuple(Island(u, d, s) for u, d, s in zip(ups, downs, steps, strict=True))
    setup = Setup(model, islands, quorum, host, pattern=args.pattern, block=args.push_block, rtt_s=args.rtt_ms / 1000,
                  queue_s=args.queue_ms / 1000, tcp_efficiency=eff, share_momentum=args.share_momentum,
                  answer_on_arrival=args.on_arrival)
    args.measured = measured  # printed with the plan
    return setup


def build_search(args: argparse.Namespace) -> Search:
    def pinned(value: Any, default: tuple[Any, ...]) -> tuple[Any, ...]:
        return default if value is None else (value,)

    return Search(target_utilization=args.target_utilization, min_interval=args.min_h, max_interval=args.max_h,
                  codecs=pinned(args.codec, PUSH_CODECS), downlinks=pinned(args.downlink, DOWNLINKS),
                  fragments=pinned(args.fragments, Search.fragments), pipelines=pinned(args.pipeline, Search.pipelines),
                  interval=args.h, run_steps=args.steps)


# ---- printing -----------------------------------------------------------------------------------------


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1000:.3g} ms" if s < 1 else f"{s:.3g} s"


def _gib(n: float) -> str:
    return f"{n / GIB:.0f} GiB" if n >= 100 * GIB else f"{n / GIB:.3g} GiB"


def describe(setup: Setup, rec: Recommendation, args: argparse.Namespace) -> list[str]:
    best, c = rec.best, rec.best.choice
    model, m = setup.model, len(setup.islands)
    lines = [f"yeto-plan: {model.name}, {model.tuning} tuning: {model.synced_params / 1e9:.4g}B parameters synced "
             f"of {model.total_params / 1e9:.4g}B, {len(model.tensors)} tensors"]
    measured = getattr(args, "measured", None)
    if measured:
        lines.append(f"link measured by the bandwidth probe to {args.probe}: {measured[0]:.1f} Mbit/s up, "
                     f"{measured[1]:.1f} Mbit/s down (goodput)")
    rate = setup.host.link_in_bps
    link = f"{rate * 8 / 1e6 / setup.tcp_efficiency:.0f} Mbit/s" if rate else "unlimited"
    for j, i in enumerate(setup.islands):
        if j < 4 or j == m - 1:
            lines.append(f"  island {j}: up {i.up_bps * 8 / 1e6:.1f}, down {i.down_bps * 8 / 1e6:.1f} Mbit/s goodput, "
                         f"step {_seconds(i.step_s)}")
        elif j == 4:
            lines.append("  ...")
    lines.append(f"  quorum {setup.quorum} of {m}; syncer link {link}; syncer host memory "
                 f"{_gib(setup.host.memory_bytes)}")
    lines += ["", f"recommended: H={c.sync_interval}, push codec {c.codec}, downlink {c.downlink}, "
              f"{c.fragments} fragment{'s' if c.fragments > 1 else ''}, pipeline {c.pipeline}"]
    lines += [f"  syncer:   python -m syncer --learners {m} --quorum {setup.quorum} --fragments {c.fragments} "
              f"--pipeline {c.pipeline} --sync-interval-steps {c.sync_interval}"]
    env = f"YETO_DILOCO_WIRE_DTYPE={c.codec}"  # H they take from the syncer at the handshake
    lines += [f"  learners: {env}{f' YETO_DILOCO_DOWNLINK_DTYPE={c.downlink}' if c.downlink != 'f32' else ''}"]
    lines += ["", *prediction_lines(setup, best)]
    if rec.alternatives:
        lines += ["", "alternatives considered (the best plan of each other codec and downlink):",
                  f"  {'H':>6} {'codec':>6} {'downlink':>10} {'P':>3} {'pipe':>4} {'round':>9} {'util':>5} "
                  f"{'up/round':>9} {'down/round':>10} {'syncer mem':>10}"]
        for alt in rec.alternatives[:6]:
            a = alt.choice
            lines.append(f"  {a.sync_interval:>6} {a.codec:>6} {a.downlink:>10} {a.fragments:>3} {a.pipeline:>4} "
                         f"{_seconds(alt.round_s):>9} {alt.utilization:>5.2f} {_bytes(alt.up_bytes_per_round):>9} "
                         f"{_bytes(alt.down_bytes_per_round):>10} {_gib(alt.memory.total):>10}")
    return lines


def prediction_lines(setup: Setup, pred: Prediction) -> list[str]:
    c, mem = pred.choice, pred.memory
    sizes = pred.fragment_params
    lines = [f"per round (one fragment; mean of {c.fragments}, the largest {sizes and max(sizes) / 1e6:.4g}M "
             f"parameters, the smallest {min(sizes) / 1e6:.4g}M):",
             f"  compute between boundaries     {_seconds(pred.compute_s)}  ({max(1, c.sync_interval // c.fragments)} "
             "steps of the quorum's islands)",
             f"  push, one island               {_bytes(pred.push_bytes)}, upload {_seconds(pred.upload_s)}",
             f"  broadcast, one island          {_bytes(pred.bcast_bytes)}, download {_seconds(pred.download_s)}",
             f"  syncer merge + commit          {_seconds(pred.serial_s)}",
             f"  launch -> commit latency       {_seconds(pred.latency_s)}  (pipeline {c.pipeline})",
             f"  round time                     {_seconds(pred.round_s)}  (set by: {pred.bound})",
             f"  compute utilization            {pred.utilization:.3f}  (each fragment syncs every "
             f"{pred.effective_interval:.4g} steps)",
             f"bytes per round: up {_bytes(pred.up_bytes_per_round)} (all islands), down "
             f"{_bytes(pred.down_bytes_per_round)}; on the line with TCP/IP headers and ACKs up "
             f"{_bytes(pred.up_wire_bytes_per_round)}, down {_bytes(pred.down_wire_bytes_per_round)}",
             f"  the syncer's link carries {pred.up_wire_bytes_per_round * 8 / pred.round_s / 1e6:.4g} Mbit/s in, "
             f"{pred.down_wire_bytes_per_round * 8 / pred.round_s / 1e6:.4g} Mbit/s out at this round time",
             f"syncer memory: {_gib(mem.total)} = params {_gib(mem.params)} + momentum {_gib(mem.momentum)}"
             + (f" + accumulator {_gib(mem.accumulator)}" if mem.accumulator else "")
             + (f" + downlink anchors {_gib(mem.downlink_anchors)}" if mem.downlink_anchors else "")
             + f" + answers in flight {_gib(mem.answers_in_flight)} + merge workspace {_gib(mem.merge_workspace)}"
             f" + broadcast copy {_gib(mem.broadcast_copy)}"
             + (f" + checkpoint copies {_gib(mem.checkpoint_copies)}" if mem.checkpoint_copies else "")
             + (f" + shared moments {_gib(mem.shared_moments)}" if mem.shared_moments else "")
             + f" + runtime {_gib(mem.runtime)}",
             f"island memory beyond its weights (rank 0): {_gib(pred.island_memory.total)} = anchors "
             f"{_gib(pred.island_memory.anchors)} + work buffers {_gib(pred.island_memory.work_buffers)} + push "
             f"payload {_gib(pred.island_memory.push_payload)} + broadcast receive "
             f"{_gib(pred.island_memory.broadcast_receive)}"
             + (f" + shared moments {_gib(pred.island_memory.shared_moments)}"
                if pred.island_memory.shared_moments else "")]
    state = 8.0 * sum(sizes)
    if not setup.host.checkpoint_every:
        lines.append(f"  not counted: checkpoints; one is {_gib(state)} (a synchronous one every N rounds holds "
                     f"rounds {_seconds(state / setup.host.checkpoint_bps)} / N at --checkpoint-gbps "
                     f"{setup.host.checkpoint_bps / 1e9:g}; --background-checkpoint does not)")
    return lines


def as_json(setup: Setup, rec: Recommendation | None, pred: Prediction | None) -> dict[str, Any]:
    def flat(p: Prediction) -> dict[str, Any]:
        d = dataclasses.asdict(p)
        d["memory"]["total"] = p.memory.total
        d["island_memory"]["total"] = p.island_memory.total
        d["utilization"], d["effective_interval"] = p.utilization, p.effective_interval
        return d

    out: dict[str, Any] = {"model": {"name": setup.model.name, "tuning": setup.model.tuning,
                                     "synced_params": setup.model.synced_params,
                                     "total_params": setup.model.total_params, "tensors": len(setup.model.tensors)},
                           "islands": [dataclasses.asdict(i) for i in setup.islands], "quorum": setup.quorum,
                           "syncer_host": dataclasses.asdict(setup.host)}
    if rec is not None:
        out["recommended"] = flat(rec.best)
        out["alternatives"] = [flat(a) for a in rec.alternatives]
    if pred is not None:
        out["prediction"] = flat(pred)
    return out


# ---- the command ----------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = ToolParser(prog="yeto-plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    what = p.add_argument_group("the model")
    what.add_argument("--model", help="an HF config dir (config.json), a .safetensors file, or a dir of them")
    what.add_argument("--preset", choices=sorted(PRESETS), help="Llama-2-7B or Llama-2-70B shapes")
    what.add_argument("--lora-r", type=int, default=0, help="LoRA rank: only the adapters sync (0: full tuning)")
    what.add_argument("--lora-targets", default=",".join(DEFAULT_LORA_TARGETS), help="projections LoRA adapts")
    links = p.add_argument_group("the islands and their links")
    links.add_argument("--islands", type=int, default=2, help="M, the number of islands (learners)")
    links.add_argument("--quorum", type=int, default=0,
                       help="K, answers that close a round (0: M − ⌊M/4⌋, the syncer's default)")
    links.add_argument("--step-s", help="optimizer step time in seconds, one value or one per island")
    links.add_argument("--tokens-per-step", type=float, help="tokens per step, to show tokens between syncs")
    links.add_argument("--up-mbps", help="island -> syncer line rate, Mbit/s, one value or one per island")
    links.add_argument("--down-mbps", help="syncer -> island line rate, Mbit/s, one value or one per island")
    links.add_argument("--probe", metavar="HOST:PORT", help="measure this host's link to a running syncer instead")
    links.add_argument("--key-file", help="the run's shared key, for --probe")
    links.add_argument("--probe-mib", type=int, default=16, help="MiB the probe moves each way")
    links.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time between islands and syncer")
    links.add_argument("--queue-ms", type=float, default=0.0,
                       help="standing queue of a saturated link (its bottleneck buffer), e.g. a tbf's latency")
    links.add_argument("--tcp-efficiency", type=float, default=MSS / ETHERNET_FRAME,
                       help="TCP payload per byte of a given line rate (MTU 1500)")
    host = p.add_argument_group("the syncer host")
    host.add_argument("--syncer-mbps", type=float, help="the syncer's own link, each direction (default: unlimited)")
    host.add_argument("--syncer-memory-gib", type=float, help="the syncer host's memory (default: this machine's RAM)")
    host.add_argument("--merge-gbps", type=float, default=2.0,
                      help="syncer merge rate, f32 GB/s of fragment passes (CPU; measure with benchmarks.merge)")
    host.add_argument("--checkpoint-every", type=int, default=0, help="count a synchronous checkpoint every N rounds")
    host.add_argument("--checkpoint-gbps", type=float, default=1.0, help="checkpoint write rate")
    host.add_argument("--background-checkpoint", action="store_true", help="the syncer writes checkpoints aside")
    host.add_argument("--delayed-nesterov", action="store_true", help="--outer-optimizer delayed-nesterov")
    host.add_argument("--heloco", action="store_true", help="--delta-correction heloco")
    choice = p.add_argument_group("the plan (each pins one knob; the rest are searched)")
    choice.add_argument("--h", type=int, help="H, inner steps per fragment round trip")
    choice.add_argument("--codec", choices=ALL_PUSH_CODECS, help="push codec")
    choice.add_argument("--downlink", choices=ALL_DOWNLINKS, help="broadcasts: exact f32, or deltas in a codec "
                        "(YETO_DILOCO_DOWNLINK_DTYPE)")
    choice.add_argument("--fragments", type=int, help="P, fragments the model is split into")
    choice.add_argument("--pipeline", type=int, help="rounds in flight")
    choice.add_argument("--pattern", choices=("binpack", "strided"), default="binpack", help="fragment layout")
    choice.add_argument("--push-block", type=int, default=128, help="values per scale of the quantized codecs")
    choice.add_argument("--share-momentum", action="store_true",
                        help="YETO_DILOCO_SHARE_MOMENTUM: pushes and broadcasts carry their fragment's moment")
    choice.add_argument("--on-arrival", action="store_true",
                        help="YETO_DILOCO_ANSWER_ON_ARRIVAL=true: learners answer a PULL at the step after it arrives")
    choice.add_argument("--target-utilization", type=float, default=0.95, help="compute / round time to reach")
    choice.add_argument("--min-h", type=int, default=24, help="smallest H considered (24: yeto's default)")
    choice.add_argument("--max-h", type=int, default=4096, help="largest H considered")
    choice.add_argument("--steps", type=int, help="the run's steps per island: refuse a plan that cannot sync in it")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        setup = build_setup(args)
        search = build_search(args)
        pinned = None not in (args.h, args.codec, args.downlink, args.fragments, args.pipeline)
        if pinned:  # every knob given: what that plan costs, met target or not
            pred = predict(setup, Choice(args.h, args.codec, args.downlink, args.fragments, args.pipeline))
            if pred.memory.total > setup.host.memory_bytes:
                raise PlanError(f"--syncer-memory-gib {setup.host.memory_bytes / GIB:.1f}: this plan needs "
                                f"{pred.memory.total / GIB:.1f} GiB on the syncer host")
            if args.json:
                print(json.dumps(as_json(setup, None, pred), indent=1))
            else:
                c = pred.choice
                print(f"yeto-plan: {setup.model.name}: {setup.model.synced_params / 1e9:.4g}B parameters synced; "
                      f"H={c.sync_interval}, {c.codec} pushes, {c.downlink} downlink, {c.fragments} fragments, "
                      f"pipeline {c.pipeline}, {len(setup.islands)} islands, quorum {setup.quorum}")
                print("\n".join(prediction_lines(setup, pred)))
            return 0
        rec = recommend(setup, search)
    except PlanError as exc:
        print(one_line(f"yeto-plan: {exc}"), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_json(setup, rec, None), indent=1))
    else:
        print("\n".join(describe(setup, rec, args)))
        if args.tokens_per_step:
            h = rec.best.choice.sync_interval
            print(f"tokens per island between a fragment's syncs: {h * args.tokens_per_step / 1e6:.4g}M")
    return 0


if __name__ == "__main__":
    sys.exit(main())
