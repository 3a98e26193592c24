"""Does it learn? yeto's merged model against synchronous data parallel and an island alone.

    python -m benchmarks.compare_diloco                     # 23 arms, 3 seeds (~26 min on 2 cores)
    python -m benchmarks.compare_diloco --quick             # dp, alone, yeto-default, one seed (~1.5 min)
    python -m benchmarks.compare_diloco --arms yeto-default,previous-defaults --model main
    python -m benchmarks.compare_diloco --matrix                 # every cell of diloco_matrix.py
    python -m benchmarks.compare_diloco --cells '*-h24-m2'       # the matrix's cells matching a glob
    python -m benchmarks.compare_diloco --collect A/compare_diloco.json B/compare_diloco.json  # pieces as one

Every arm trains the same model from the same seeded initial weights for the same number of
optimizer steps (`diloco_arm.py` says exactly how), so arms with M islands of batch b and the
data-parallel arm with batch M·b see equal tokens:

* `dp` — synchronous data parallel, global batch M·b: the baseline of its group (same M, same
  tuning) measured in the same run; every other arm's ratio is to it;
* `alone` — one island of batch b on its own 1/M of the data, for as many steps;
* `yeto-default` — M islands and the real syncer with nothing set beyond the run's shape;
* named variants — one setting changed against the defaults (the table says which).

Round boundaries are pinned to learner steps (`YETO_DILOCO_LOCKSTEP`), so a seed gives the
same numbers whatever the machine's load. A variant whose settings are the shipped defaults is
the default arm itself and is not trained twice.

Per arm it prints the held-out loss of the final global model (mean, min–max over seeds), the
ratio to its group's `dp`, and how much of the `alone`−`dp` gap it closes; then the goals with
their verdicts. It writes `compare_diloco.json` (every run, its loss curve, the summary) and
`compare_diloco.png` (held-out loss against tokens trained, and its ratio to `dp` at the same
step, mean over seeds) to `--out`.

`--matrix` (or `--cells`, a part of it) runs the cells of `diloco_matrix.py` instead: three model
families, two texts, two schedules, H = 24 and 96, M = 2, 4 and 8, a slow island; every yeto
cell both lockstep and unpaced. It prints one row per cell and yeto arm with its goal, and writes
`compare_diloco.json` and `compare_diloco_matrix.png`. `--collect` trains nothing: it reads the
results of pieces run apart and prints and draws them as one matrix.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from benchmarks import diloco_matrix
from benchmarks.diloco_arm import Arm, Shape
from benchmarks.diloco_data import CORPORA, SCHEDULES, check_family, family_lr

ROOT = Path(__file__).resolve().parents[1]

# Arms. Variants name settings absolutely, so each stays what it says when the defaults move.
ARMS: list[Arm] = [
    Arm("dp", "dp", note="synchronous data parallel, batch M·b"),
    Arm("alone", "alone", note="one island, batch b, its own shard"),
    Arm("yeto-default", "yeto", note="the shipped defaults"),
    Arm("nesterov-0.7-0.9", "yeto",
        syncer=["--outer-lr", "0.7", "--outer-momentum", "0.9", "--outer-momentum-warmup", "0"],
        note="DiLoCo's stock outer Nesterov, lr 0.7, momentum 0.9"),
    Arm("nesterov-0.5-0.5", "yeto",
        syncer=["--outer-lr", "0.5", "--outer-momentum", "0.5", "--outer-momentum-warmup", "0"],
        note="outer Nesterov, lr 0.5, momentum 0.5 from the first round (no warm-up)"),
    Arm("plain-averaging", "yeto", syncer=["--outer-lr", "1", "--outer-momentum", "0"],
        note="outer lr 1, no momentum: the merged delta as it is"),
    Arm("blend-0.5", "yeto", learner={"merge_alpha": 0.5, "overlap": False},
        note="install θ ← 0.5·θ_local + 0.5·Θ"),
    Arm("overwrite", "yeto", learner={"merge_alpha": 0.0, "overlap": False}, note="install θ ← Θ"),
    Arm("overlap", "yeto", learner={"overlap": True}, note="install by rebasing on Θ (Mix1)"),
    Arm("rda", "yeto", syncer=["--merge", "rda"], note="radial-directional averaging"),
    Arm("average", "yeto", syncer=["--merge", "average"], note="plain weighted average"),
    Arm("iso", "yeto", syncer=["--merge", "iso"], note="rda, each matrix's merged update with a flat spectrum"),
    # A flat spectrum shrinks the merged step's norm (s̄·√r < ‖s‖₂): iso wants a larger outer lr.
    Arm("iso-lr-1", "yeto", syncer=["--merge", "iso", "--outer-lr", "1.0"], note="iso, outer lr 1.0"),
    Arm("heloco", "yeto", syncer=["--delta-correction", "heloco"], note="HeLoCo delta correction on"),
    Arm("no-heloco", "yeto", syncer=["--delta-correction", "none"], note="HeLoCo delta correction off"),
    # Its momentum moves once per 4 rounds of a fragment and each round steps lr/4: lr 4 x 0.5 keeps the scale.
    Arm("delayed-nesterov", "yeto", syncer=["--outer-optimizer", "delayed-nesterov", "--outer-delay", "4",
                                            "--outer-lr", "2.0", "--outer-momentum", "0.5",
                                            "--outer-momentum-warmup", "0"],
        note="delayed Nesterov: momentum every 4 rounds, lr 2.0 = 4 x 0.5"),
    Arm("final-flush", "yeto", learner={"final_flush": True},
        note="the last steps of every fragment merged at the end", in_default_run=False),
    Arm("h4-unthrottled", "yeto", learner={"sync_interval": 4},
        note="H=4: a round every step, the fastest schedule (what an unthrottled LAN gives)"),
    Arm("int8", "yeto", learner={"wire_dtype": "int8"}, note="block int8 pushes"),
    Arm("int4", "yeto", learner={"wire_dtype": "int4"}, note="block 4-bit pushes"),
    Arm("previous-defaults", "yeto", learner={"merge_alpha": 0.5, "overlap": False},
        syncer=["--outer-lr", "0.7", "--outer-momentum", "0.9", "--outer-momentum-warmup", "0",
                "--delta-correction", "heloco"],
        note="yeto's defaults before this benchmark: Nesterov 0.7/0.9, α 0.5 blend, HeLoCo", in_default_run=False),
    Arm("dp-m4", "dp", learners=4, note="data parallel, batch 4·b"),
    Arm("alone-m4", "alone", learners=4, note="one island on 1/4 of the data"),
    Arm("yeto-m4", "yeto", learners=4, note="M=4, the shipped defaults"),
    Arm("dp-lora", "dp", lora=True, note="LoRA, data parallel, batch 2·b"),
    Arm("alone-lora", "alone", lora=True, note="LoRA, one island"),
    Arm("yeto-lora", "yeto", lora=True, note="LoRA adapters only, the shipped defaults"),
]
QUICK = ["dp", "alone", "yeto-default"]
MODELS = {
    "bench": Shape(),
    "main": Shape(hidden=128, layers=4, seq_len=128, batch=16, steps=288, lr=3e-3),  # examples/hf_tiny_llama.py
}


@dataclass(frozen=True)
class Goal:
    arm: str
    baseline: str
    max_ratio: float
    what: str


GOALS = [
    Goal("yeto-default", "dp", 1.02, "M=2, H=24: at most 1.02x dp"),
    Goal("yeto-m4", "dp-m4", 1.04, "M=4: at most 1.04x dp"),
    Goal("h4-unthrottled", "dp", 1.05, "unthrottled: at most 1.05x dp"),
    Goal("yeto-lora", "dp-lora", 1.03, "LoRA: at most 1.03x its dp"),
    Goal("int8", "yeto-default", 1.005, "int8 pushes: within 0.5% of f32"),
    Goal("int4", "yeto-default", 1.005, "4-bit pushes: within 0.5% of f32"),
]
GAP_GOAL = 0.8  # yeto-default closes at least this share of the alone−dp gap


def group_of(arm: Arm) -> tuple[str, int, bool]:
    return arm.cell, arm.learners, arm.lora


def baselines(arm: Arm, arms: dict[str, Arm]) -> tuple[str | None, str | None]:
    """The `dp` and `alone` arms of the same M and tuning."""
    dp = [a.name for a in arms.values() if a.kind == "dp" and group_of(a) == group_of(arm)]
    alone = [a.name for a in arms.values() if a.kind == "alone" and group_of(a) == group_of(arm)]
    return (dp[0] if dp else None), (alone[0] if alone else None)


def effective(arm: Arm) -> tuple[Any, ...]:
    """What an arm actually runs: its settings minus those equal to the shipped defaults."""
    from syncer.service.cli import build_parser
    from yeto_core.setting_names import flat_fields
    from yeto_core.settings import LearnerSettings, SyncerSettings

    flags = vars(build_parser().parse_args(arm.syncer))
    fields, learner_fields = flat_fields(SyncerSettings), flat_fields(LearnerSettings)
    syncer = sorted((k, v) for k, v in flags.items() if v is not None and k in fields and v != fields[k].info.default)
    learner = sorted((k, v) for k, v in arm.learner.items() if v != learner_fields[k].info.default)
    shape = (arm.cell, arm.unpaced, arm.slow, arm.lockstep_threads, arm.shards, arm.fleet_budget, arm.fleet_share)
    return arm.kind, arm.learners, arm.lora, shape, tuple(syncer), tuple(learner)


def same_as(arms: Sequence[Arm]) -> dict[str, str]:
    """Arm name -> the earlier arm it is identical to (a variant that names the defaults)."""
    seen: dict[tuple[Any, ...], str] = {}
    alias: dict[str, str] = {}
    for arm in arms:
        key = effective(arm)
        if key in seen:
            alias[arm.name] = seen[key]
        else:
            seen[key] = arm.name
    return alias


def cost(arm: Arm, shape: Shape) -> float:
    """Relative compute of one run, to start the longest first."""
    islands = arm.learners if arm.kind != "alone" else 1
    steps_per_round = max(1, int(arm.learner.get("sync_interval", shape.h)) // 4)
    per_step = islands * (1.0 + (0.3 if arm.kind == "yeto" else 0.0) + 0.2 / steps_per_round)
    return per_step * shape.steps * (0.7 if arm.lora else 1) * (arm.slow if arm.lockstep_threads else 1)


def run_job(arm: Arm, shape: Shape, seeds: list[int], workdir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Every seed of one arm, one after the other in one worker process (one import of torch and
    transformers); `timeout_s` is the deadline of each seed's run."""
    job = {"arm": asdict(arm), "shape": asdict(shape), "seeds": seeds, "workdir": str(workdir)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = workdir / f"{arm.name}.log"
    with open(log, "wb") as err:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.diloco_arm", json.dumps(job)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=err, timeout=timeout_s * len(seeds), check=False)
    lines = [line for line in proc.stdout.decode(errors="replace").splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(lines) != len(seeds):
        tail = log.read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{arm.name} (seeds {seeds}) failed (exit {proc.returncode}):\n{tail}")
    return [json.loads(line) for line in lines]


def summarize(arms: dict[str, Arm], runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    mean = {name: statistics.fmean(r["final_loss"] for r in rs) for name, rs in runs.items() if rs}
    out: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        if not rs:
            continue
        losses = [r["final_loss"] for r in rs]
        dp, alone = baselines(arms[name], arms)
        row: dict[str, Any] = {"mean": mean[name], "min": min(losses), "max": max(losses), "seeds": len(losses),
                               "dp": dp, "alone": alone}
        if dp in mean:
            row["ratio_dp"] = mean[name] / mean[dp]
        if dp in mean and alone in mean and mean[alone] != mean[dp]:
            row["gap_closed"] = (mean[alone] - mean[name]) / (mean[alone] - mean[dp])
        out[name] = row
    return out


def verdicts(summary: dict[str, dict[str, Any]]) -> list[tuple[str, str, bool | None]]:
    lines: list[tuple[str, str, bool | None]] = []
    for g in GOALS:
        if g.arm not in summary or g.baseline not in summary:
            lines.append((g.what, "not run", None))
            continue
        ratio = summary[g.arm]["mean"] / summary[g.baseline]["mean"]
        lines.append((g.what, f"{g.arm}/{g.baseline} = {ratio:.4f}", ratio <= g.max_ratio))
    if "yeto-default" in summary and "gap_closed" in summary["yeto-default"]:
        gap = summary["yeto-default"]["gap_closed"]
        lines.append((f"M=2: closes at least {GAP_GOAL:.0%} of the alone-dp gap", f"closes {gap:.0%}",
                      gap >= GAP_GOAL))
    return lines


def print_table(arms: dict[str, Arm], summary: dict[str, dict[str, Any]], alias: dict[str, str]) -> None:
    print(f"\n{'arm':<18} {'M':>2} {'mean':>7} {'min-max':>15} {'/dp':>7} {'gap':>5}  what")
    for name, arm in arms.items():
        row = summary.get(alias.get(name, name))
        if row is None:
            continue
        ratio = f"{row['ratio_dp']:.4f}" if "ratio_dp" in row else "-"
        gap = f"{row['gap_closed']:.0%}" if "gap_closed" in row else "-"
        note = arm.note + (f" (= {alias[name]}: the shipped default)" if name in alias else "")
        print(f"{name:<18} {arm.learners:>2} {row['mean']:7.4f} {row['min']:7.4f}-{row['max']:.4f} {ratio:>7} "
              f"{gap:>5}  {note}")


def mean_curve(rs: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """(tokens, held-out loss) along a run, the final loss last, each the mean over seeds."""
    tokens = [float(t) for t, _ in rs[0]["curve"]] + [float(rs[0]["tokens"])]
    losses = [statistics.fmean(r["curve"][i][1] for r in rs) for i in range(len(rs[0]["curve"]))]
    return tokens, [*losses, statistics.fmean(r["final_loss"] for r in rs)]


def plot(path: Path, arms: dict[str, Arm], runs: dict[str, list[dict[str, Any]]], shape: Shape) -> None:
    """Per group (M, tuning): held-out loss against tokens trained, and the same loss ÷ the group's
    dp at the same step (equal tokens for the yeto arms, half of them for `alone`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({group_of(a) for name, a in arms.items() if runs.get(name)})
    fig, axes = plt.subplots(2, len(groups), figsize=(6.5 * len(groups), 9), squeeze=False)
    for col, group in enumerate(groups):
        top, bottom = axes[0][col], axes[1][col]
        dp, _ = baselines(next(a for a in arms.values() if group_of(a) == group), arms)
        reference = mean_curve(runs[dp])[1] if dp and runs.get(dp) else None
        finals: list[float] = []
        for n, (name, arm) in enumerate(arms.items()):
            rs = runs.get(name)
            if group_of(arm) != group or not rs:
                continue
            tokens, losses = mean_curve(rs)
            finals.append(losses[-1])
            style: dict[str, Any] = {"linewidth": 1.0, "alpha": 0.85, "color": plt.cm.tab20(n % 20)}
            if arm.kind == "dp":
                style = {"color": "black", "linewidth": 2.0}
            elif arm.kind == "alone":
                style = {"color": "gray", "linewidth": 2.0, "linestyle": "--"}
            elif name.startswith("yeto-"):
                style = {"color": "tab:red", "linewidth": 2.5}
            top.plot([t / 1e6 for t in tokens], losses, label=name, **style)
            if reference is not None:
                per_step = tokens[-1] / shape.steps
                steps = [t / per_step for t in tokens[1:]]
                bottom.plot(steps, [x / r for x, r in zip(losses[1:], reference[1:], strict=True)], label=name,
                            **style)
        _, m, lora = group
        kind = f"M={m}{' LoRA' if lora else ''}"
        top.set_title(f"{kind}: held-out loss of the global model")
        top.set_xlabel("tokens trained, all islands (millions)")
        top.set_ylabel("eval loss (nats/token)")
        first = reference[1] if reference is not None else max(finals)
        top.set_ylim(min(finals) - 0.05, first + 0.3)
        bottom.set_title(f"{kind}: loss / {dp}'s at the same step")
        bottom.set_xlabel("optimizer steps of each island")
        bottom.set_ylabel(f"eval loss / {dp}")
        bottom.set_ylim(0.95, 1.4)
        bottom.axhline(1.0, color="black", linewidth=0.8)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"compare_diloco: {shape.steps} steps, batch {shape.batch} per island, seq {shape.seq_len}, "
                 f"{shape.hidden}x{shape.layers} Llama, lr {shape.lr:g}; mean of "
                 f"{max(len(r) for r in runs.values())} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _family(name: str) -> str:
    try:
        return check_family(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"one seed, arms {', '.join(QUICK)}")
    p.add_argument("--arms", help="comma-separated arms to run (default: all but final-flush and "
                   "previous-defaults); a yeto arm brings its dp and alone. With the matrix: the kinds of arm "
                   "each cell trains, e.g. yeto-unpaced (dp and alone always)")
    p.add_argument("--matrix", action="store_true", help="every cell of the matrix (diloco_matrix.py)")
    p.add_argument("--cells", help="comma-separated globs of matrix cells to run, e.g. 'gpt2-*-h24-m2'")
    p.add_argument("--seeds", type=int, help="seeds per arm (default 3; --quick 1)")
    p.add_argument("--model", choices=sorted(MODELS), default="bench",
                   help="bench: 128x2 Llama, seq 64 (default); main: the main job's 128x4 Llama, seq 128")
    p.add_argument("--family", type=_family, help="model family of the arms: llama (default), gpt2, neox, or a "
                   "Llama with some of GPT-2's and NeoX's parts, e.g. llama+bias+ln (diloco_data.LLAMA_PARTS); "
                   "not with the matrix")
    p.add_argument("--corpus", choices=CORPORA, help="text of the arms (default help; not with the matrix)")
    p.add_argument("--schedule", choices=SCHEDULES, help="learning-rate schedule (default constant; not with the "
                   "matrix)")
    p.add_argument("--steps", type=int, help="optimizer steps of every arm (default 288; the matrix doubles it "
                   "for its M = 4, M = 8 and H = 96 cells)")
    p.add_argument("--lr", type=float, help="inner learning rate of every arm (default: the model's; the bench "
                   "model at --family or in a matrix cell: the family's, diloco_data.FAMILY_LR)")
    p.add_argument("--syncer-flags", default="", help="syncer flags added to every yeto arm, e.g. "
                   "'--outer-lr 0.7' (to measure a candidate default across cells)")
    p.add_argument("--learner-settings", default="", help="learner settings added to every yeto arm, as "
                   "NAME=VALUE,... with JSON values, e.g. 'merge_alpha=0.5,overlap=false'")
    p.add_argument("--baselines", type=Path, help="a compare_diloco.json whose dp and alone runs of the same "
                   "arms, shapes and seeds are taken instead of trained again")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at once (default 2)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "compare-diloco", help="result directory")
    p.add_argument("--timeout", type=float, default=1800, help="deadline of one run in seconds")
    p.add_argument("--collect", type=Path, nargs="+", metavar="JSON", help="train nothing: the matrix table, "
                   "goals and figure of the cells in these results (pieces run with --cells), into --out; "
                   "a later file's runs of an arm replace an earlier one's")
    args = p.parse_args(argv)
    if args.collect:
        if missing := [str(path) for path in args.collect if not path.is_file()]:
            p.error(f"--collect: no such file: {', '.join(missing)}")
        return args
    matrix = args.matrix or args.cells
    if matrix and (args.quick or args.family or args.corpus or args.schedule):
        p.error("--matrix/--cells choose their own families, texts and schedules")
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be at least 1, not {args.steps}")
    try:
        args.learner_extra = {k.strip(): json.loads(v) for k, v in (
            pair.split("=", 1) for pair in args.learner_settings.split(",") if pair.strip())}
    except ValueError:
        p.error(f"--learner-settings {args.learner_settings!r}: want NAME=VALUE,... with JSON values")
    from yeto_core.setting_names import flat_fields
    from yeto_core.settings import LearnerSettings

    unknown_settings = sorted(set(args.learner_extra) - set(flat_fields(LearnerSettings)))
    if unknown_settings:
        p.error(f"--learner-settings: unknown learner settings {unknown_settings}")
    if args.baselines is not None and not args.baselines.is_file():
        p.error(f"--baselines {args.baselines}: no such file")
    if matrix:
        try:
            args.picked_cells = diloco_matrix.pick(args.cells)
        except ValueError as exc:
            p.error(str(exc))
        kinds = {a.name.split(":", 1)[1] for cell in args.picked_cells for a in cell.arms()}
        unknown = sorted(set(args.arms.split(",")) - kinds) if args.arms else []
        if unknown:
            p.error(f"--arms: the matrix's cells have no arms {unknown}; theirs: {', '.join(sorted(kinds))}")
    else:
        args.picked_cells = None
        known = {a.name for a in ARMS}
        wanted = QUICK if args.quick else (args.arms.split(",") if args.arms else [])
        unknown = [w for w in wanted if w not in known]
        if unknown:
            p.error(f"unknown arms {unknown}; known: {', '.join(known)}")
    return args


def select(args: argparse.Namespace, base: Shape) -> tuple[dict[str, Arm], dict[str, Shape]]:
    """The arms to train (each with its dp and alone, every yeto arm with the extra settings) and the
    shape each trains at."""
    arms, shapes = _select(args, base)
    extra = shlex.split(args.syncer_flags)
    for name, arm in arms.items():
        if arm.kind == "yeto" and (extra or args.learner_extra):
            arms[name] = replace(arm, syncer=[*arm.syncer, *extra], learner={**arm.learner, **args.learner_extra})
    return arms, shapes


Runs = dict[str, list[dict[str, Any]]]  # arm name -> its runs, one per seed


def _same(recorded: dict[str, Any] | None, now: Arm | Shape) -> bool:
    """Whether a recorded arm or shape is `now`; a field it lacks (added since) counts as its default."""
    if recorded is None:
        return False
    defaults = {f.name: f.default for f in fields(now) if f.default is not MISSING}
    return all(recorded.get(k, defaults.get(k, MISSING)) == v for k, v in asdict(now).items())


def reused(path: Path, arms: dict[str, Arm], shapes: dict[str, Shape], seeds: list[int]) -> Runs:
    """The dp and alone runs of an earlier result that trained the same arm at the same shape, for
    every seed asked (an arm missing a seed is trained again)."""
    earlier = json.loads(path.read_text())
    out: dict[str, list[dict[str, Any]]] = {}
    for name, arm in arms.items():
        if arm.kind == "yeto" or not _same(earlier.get("shapes", {}).get(name), shapes[name]):
            continue
        if not _same(earlier.get("arms", {}).get(name), arm):
            continue
        got = {r["seed"]: r for r in earlier.get("runs", {}).get(name, [])}
        if all(seed in got for seed in seeds):
            out[name] = [got[seed] for seed in seeds]
    return out


def _select(args: argparse.Namespace, base: Shape) -> tuple[dict[str, Arm], dict[str, Shape]]:
    if args.picked_cells is not None:  # --arms names kinds of arm here; dp and alone always come
        kinds = set(args.arms.split(",")) | {"dp", "alone"} if args.arms else None
        arms = {a.name: a for cell in args.picked_cells for a in cell.arms()
                if (a.in_default_run if kinds is None else a.name.split(":", 1)[1] in kinds)}
        shapes = {a.name: cell.shape(base, lr=args.lr)
                  for cell in args.picked_cells for a in cell.arms() if a.name in arms}
        return arms, shapes
    known = {a.name: a for a in ARMS}
    wanted = QUICK if args.quick else (args.arms.split(",") if args.arms else
                                       [a.name for a in ARMS if a.in_default_run])
    picked = set(wanted)
    for name in wanted:  # every arm is read against its dp and alone
        picked.update(b for b in baselines(known[name], known) if b is not None)
    arms = {name: a for name, a in known.items() if name in picked}
    return arms, {name: base for name in arms}


def train_all(jobs: list[Arm], shapes: dict[str, Shape], seeds: list[int], args: argparse.Namespace,
              t0: float) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """Every seed of every job on `--jobs` workers, the costliest first; progress as each ends."""
    runs: dict[str, list[dict[str, Any]]] = {a.name: [] for a in jobs}
    failures: list[str] = []
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_job, a, shapes[a.name], seeds, args.out, args.timeout): a for a in jobs}
        for done, future in enumerate(as_completed(futures), 1):
            arm = futures[future]
            try:
                results = future.result()
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failures.append(str(exc))
                print(f"[{done:2d}/{len(jobs)} {time.monotonic() - t0:6.0f}s] {arm.name}: FAILED", flush=True)
                continue
            with lock:
                runs[arm.name].extend(results)
            losses = ", ".join(f"{r['final_loss']:.4f}" for r in results)
            trips = [r["round_trip_steps"] for r in results if r.get("round_trip_steps") is not None]
            trip = f", round trip {', '.join(f'{t:.1f}' for t in trips)} steps" if trips else ""
            print(f"[{done:2d}/{len(jobs)} {time.monotonic() - t0:6.0f}s] {arm.name:<18} eval loss {losses} "
                  f"({sum(r['wall_s'] for r in results):.0f} s{trip})", flush=True)
    for rs in runs.values():
        rs.sort(key=lambda r: r["seed"])
    return runs, failures


def base_shape(args: argparse.Namespace) -> Shape:
    """The shape `--model` names, with what the flags change; the bench model at another `--family`
    takes that family's rate (diloco_data.FAMILY_LR) unless `--lr` is given."""
    lr = args.lr
    if lr is None and args.family is not None and args.model == "bench":
        lr = family_lr(args.family)
    given = {"steps": args.steps, "lr": lr, "family": args.family, "corpus": args.corpus,
             "schedule": args.schedule}
    return Shape(**{**asdict(MODELS[args.model]), **{k: v for k, v in given.items() if v is not None}})


def collect(paths: list[Path], out: Path) -> int:
    """The matrix of the cells these results hold, as if one run had trained them all."""
    runs: Runs = {}
    for path in paths:
        try:
            found = json.loads(path.read_text())["runs"]
        except (ValueError, KeyError, TypeError):
            print(f"compare_diloco: --collect {path}: not a compare_diloco.json (no runs)", file=sys.stderr)
            return 2
        runs.update(found)
    cells = [cell for cell in diloco_matrix.all_cells() if runs.get(f"{cell.name}:dp")]
    if not cells:
        print("compare_diloco: --collect: these results hold no matrix cell with its dp runs", file=sys.stderr)
        return 2
    print(f"compare_diloco: {len(cells)} cells from {len(paths)} results")
    out.mkdir(parents=True, exist_ok=True)
    figure = out / "compare_diloco_matrix.png"
    payload: dict[str, Any] = {"collected": [str(path) for path in paths], "runs": runs}
    last = report_matrix(cells, runs, payload, figure)
    (out / "compare_diloco.json").write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out / 'compare_diloco.json'} and {figure}\n{last}")
    return 0


def report_matrix(cells: list[diloco_matrix.Cell], runs: Runs, payload: dict[str, Any], figure: Path) -> str:
    """Print the cells' table and the slow island's verdicts, put both in `payload`, draw `figure`;
    the closing line, how many goals were met."""
    table = diloco_matrix.rows(cells, runs)
    diloco_matrix.print_rows(table)
    slow = diloco_matrix.slow_verdicts(cells, runs)
    for what_, value, met_ in slow:
        print(f"  {what_:<60} {value:<40} {'met' if met_ else 'MISSED'}")
    payload.update(matrix=table, goals=[{"goal": w, "value": v, "met": ok} for w, v, ok in slow])
    diloco_matrix.plot(figure, cells, runs)
    met = [bool(r["met"]) for r in table if "met" in r] + [m for _, _, m in slow]
    return f"matrix goals met: {sum(met)} of {len(met)}"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.collect:
        return collect(args.collect, args.out)
    shape = base_shape(args)
    arms, shapes = select(args, shape)
    alias = same_as(list(arms.values()))
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = reused(args.baselines, arms, shapes, seeds) if args.baselines else {}
    jobs = sorted((a for a in arms.values() if a.name not in alias and a.name not in earlier),
                  key=lambda a: -cost(a, shapes[a.name]))
    what = (f"{len(args.picked_cells)} cells" if args.picked_cells is not None else
            f"{shape.steps} steps x batch {shape.batch} x seq {shape.seq_len} per island")
    print(f"compare_diloco: {len(arms)} arms ({len(alias)} the same as another, {len(earlier)} from "
          f"{args.baselines}), {len(seeds)} seeds, {len(jobs) * len(seeds)} runs on {args.jobs} workers; {what}; "
          f"logs in {args.out}", flush=True)
    t0 = time.monotonic()
    runs, failures = train_all(jobs, shapes, seeds, args, t0)
    runs.update(earlier)
    summary = summarize(arms, runs)
    payload: dict[str, Any] = {"shape": asdict(shape), "seeds": seeds, "arms": {n: asdict(a) for n, a in arms.items()},
                               "shapes": {n: asdict(sh) for n, sh in shapes.items()}, "same_as": alias,
                               "runs": runs, "summary": summary}
    if args.picked_cells is not None:
        figure = args.out / "compare_diloco_matrix.png"
        last = report_matrix(args.picked_cells, runs, payload, figure)
    else:
        print_table(arms, summary, alias)
        results = verdicts(summary)
        print("\ngoals (mean over seeds):")
        for what_, value, ok in results:
            mark = "-" if ok is None else ("met" if ok else "MISSED")
            print(f"  {what_:<48} {value:<32} {mark}")
        payload["goals"] = [{"goal": w, "value": v, "met": ok} for w, v, ok in results]
        figure = args.out / "compare_diloco.png"
        plot(figure, arms, runs, shape)
        last = (f"ratio yeto-default/dp eval loss = {summary['yeto-default']['ratio_dp']:.4f}"
                if "ratio_dp" in summary.get("yeto-default", {}) else "")
    payload["wall_s"] = round(time.monotonic() - t0, 1)
    (args.out / "compare_diloco.json").write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {args.out / 'compare_diloco.json'} and {figure} ({time.monotonic() - t0:.0f} s)")
    if failures:
        print("\n".join(["failed runs:", *failures]), file=sys.stderr)
        return 1
    if last:
        print(last)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ARMS", "GOALS", "main"]
