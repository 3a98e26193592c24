"""The matrix of `compare_diloco --matrix`: cells of model family, text, schedule, H and M.

Each cell trains four arms from the same seeded weights at equal tokens: `dp` (synchronous data
parallel, batch M·b), `alone` (one island, batch b, its own shard), `yeto` (M islands, the shipped
defaults, lockstep: reproducible bit for bit) and `yeto-unpaced` (the same, paced as a user runs
it: islands on threads of their own, the syncer's own pacing, quorum and grace). The cells:

* M = 2, H = 24: every family × both texts × both schedules (12 cells, 288 steps);
* M = 2, H = 96: the Llama and GPT-2 × both schedules on `help` (4 cells, 576 steps: 6 round
  trips of each fragment);
* M = 4 and M = 8, H = 24: the Llama and GPT-2 × both schedules on `code` (8 cells, 576 steps;
  `help` is too short for eight islands: dp would see it ten times). The third family, `neox`,
  is a check at M = 2 of whether the defaults carry to a model they were not chosen on; the
  longer cells stay with the two families the defaults were measured against;
* `slow`: M = 4 on `code`, one island a quarter of the others' speed: the shipped rules
  (`yeto-slow`, unpaced), the slow island left out (`drop`: three islands, its shard untrained),
  and every round waiting for it (`wait`: lockstep, every island on its own thread). All three
  see equal tokens: in `yeto-slow` and `drop` the islands share M·steps optimizer steps, each
  training until they are taken, so the fast ones take the steps the slow one cannot. At equal
  tokens leaving the slow island out costs time instead: `drop-time` is `drop` stopped when
  `yeto-slow` would be done (three islands at full speed, `equal_time_share` of the budget), the
  question of a fleet with a deadline: does adding a slow island help? `yeto-slow-long` is
  `yeto-slow` trained on to LONG_SHARE of the budget, for the time its global model takes to reach
  `wait`'s final loss (`time_to`), which equal tokens alone cannot say when it stops short of it.
"""

from __future__ import annotations

import fnmatch
import itertools
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.diloco_arm import Arm, Shape
from benchmarks.diloco_data import CORPORA, FAMILIES, FAMILY_LR, SCHEDULES

GAP_GOAL = 0.8  # M = 2, H = 24: share of the alone−dp gap closed
DEEP_FAMILIES = FAMILIES[:2]  # the families of the H = 96, M = 4 and M = 8 cells
SLOW_FACTOR = 4
LONG_SHARE = 1.5  # yeto-slow-long's budget: the fleet's equal-token steps, and half again
# The uplink x downlink pairs the wire arms compare (`--arms wire-i4i4,wire-i4i4-unpaced,...`; not
# in `--matrix` unless named), each named absolutely so it stays what it says when defaults move:
# f32 both ways is the reference the others are read against.
WIRE_PAIRS = {"f32": ("f32", "f32"), "i8i8": ("int8", "int8"), "i4i4": ("int4", "int4"),
              "i4i2": ("int4", "int2"), "i2i2": ("int2", "int2")}


@dataclass(frozen=True)
class Cell:
    family: str
    corpus: str
    schedule: str
    h: int
    m: int
    slow: bool = False

    @property
    def name(self) -> str:
        return f"{self.family}-{self.corpus}-{self.schedule}-h{self.h}-m{self.m}" + ("-slow" if self.slow else "")

    @property
    def long(self) -> bool:
        """Twice today's budget: four or eight islands need more steps each to catch up, and H = 96
        would give each fragment only three round trips in 288."""
        return self.m >= 4 or self.h > 24

    def shape(self, base: Shape, *, lr: float | None = None) -> Shape:
        """The cell's shape: `base` at the cell's family, text, schedule and H, at `lr` if given, else
        at the family's (FAMILY_LR)."""
        return replace(base, family=self.family, corpus=self.corpus, schedule=self.schedule, h=self.h,
                       steps=base.steps * (2 if self.long else 1), lr=FAMILY_LR[self.family] if lr is None else lr)

    def arms(self) -> list[Arm]:
        c, m = self.name, self.m
        common: dict[str, Any] = {"learners": m, "cell": c}
        base = [Arm(f"{c}:dp", "dp", note=f"data parallel, batch {m}·b", **common),
                Arm(f"{c}:alone", "alone", note="one island, its own shard", **common)]
        if self.slow:
            return [*base,
                    Arm(f"{c}:yeto-slow", "yeto", unpaced=True, slow=SLOW_FACTOR, fleet_budget=True,
                        note=f"unpaced, island {m - 1} at 1/{SLOW_FACTOR} speed, shipped quorum and grace", **common),
                    Arm(f"{c}:yeto-slow-long", "yeto", unpaced=True, slow=SLOW_FACTOR, fleet_budget=True,
                        fleet_share=LONG_SHARE, note=f"as yeto-slow, on to {LONG_SHARE:g}x the tokens: when it "
                        "reaches wait's loss", **common),
                    Arm(f"{c}:drop", "yeto", unpaced=True, learners=m - 1, shards=m, cell=c, fleet_budget=True,
                        note=f"unpaced, the slow island left out ({m - 1} islands, its shard untrained)"),
                    Arm(f"{c}:drop-time", "yeto", unpaced=True, learners=m - 1, shards=m, cell=c, fleet_budget=True,
                        fleet_share=equal_time_share(m),
                        note=f"as drop, for the time yeto-slow trains: {m - 1} islands at full speed, the "
                             f"steps they take while {m - 1} and one at 1/{SLOW_FACTOR} take {m}·steps"),
                    Arm(f"{c}:wait", "yeto", slow=SLOW_FACTOR, lockstep_threads=True,
                        note="lockstep: every round waits for the slow island", **common)]
        wire = [Arm(f"{c}:wire-{key}{'-unpaced' if unpaced else ''}", "yeto", unpaced=unpaced, in_default_run=False,
                    learner={"wire_dtype": up, "downlink_dtype": down},
                    note=f"{up} pushes, {down} broadcasts, {'unpaced' if unpaced else 'lockstep'}", **common)
                for key, (up, down) in WIRE_PAIRS.items() for unpaced in (False, True)]
        return [*base,
                Arm(f"{c}:yeto", "yeto", note="the shipped defaults, lockstep", **common),
                Arm(f"{c}:yeto-unpaced", "yeto", unpaced=True, note="the shipped defaults, unpaced", **common),
                *wire]

    def max_ratio(self) -> float:
        """The goal for a yeto arm's loss ÷ dp's."""
        if self.m >= 8:
            return 1.05
        if self.m >= 4:
            return 1.03
        return 1.04 if self.h > 24 else 1.02

    def gap_goal(self) -> float | None:
        return GAP_GOAL if self.m == 2 and self.h == 24 else None


def equal_time_share(m: int) -> float:
    """The share of the slow cell's fleet budget (M·steps) that M − 1 islands at full speed take in
    the time M islands, one of them at 1/SLOW_FACTOR speed, take all of it: (M − 1)/(M − 1 + 1/SLOW).
    Nominal speeds: an island slower than its nominal 1/SLOW leaves the others a little more."""
    return (m - 1) / (m - 1 + 1 / SLOW_FACTOR)


def all_cells() -> list[Cell]:
    cells = [Cell(f, c, s, 24, 2) for f, c, s in itertools.product(FAMILIES, CORPORA, SCHEDULES)]
    cells += [Cell(f, "help", s, 96, 2) for f, s in itertools.product(DEEP_FAMILIES, SCHEDULES)]
    cells += [Cell(f, "code", s, 24, m) for m, f, s in itertools.product((4, 8), DEEP_FAMILIES, SCHEDULES)]
    cells.append(Cell("llama", "code", "constant", 24, 4, slow=True))
    return cells


def pick(patterns: str | None) -> list[Cell]:
    """The cells whose names match any of the comma-separated globs (all cells without patterns)."""
    cells = all_cells()
    if not patterns:
        return cells
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen = [c for c in cells if any(fnmatch.fnmatchcase(c.name, g) for g in globs)]
    if not chosen:
        raise ValueError(f"--cells {patterns!r} matches no cell; cells: {', '.join(c.name for c in cells)}")
    return chosen


def _mean(runs: dict[str, list[dict[str, Any]]], name: str, key: str = "final_loss") -> float | None:
    rs = runs.get(name) or []
    return statistics.fmean(r[key] for r in rs) if rs else None


def rows(cells: Iterable[Cell], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cell and yeto arm: mean, min–max, ÷ dp, share of the alone−dp gap closed, the goal."""
    out: list[dict[str, Any]] = []
    for cell in cells:
        dp, alone = _mean(runs, f"{cell.name}:dp"), _mean(runs, f"{cell.name}:alone")
        for arm in cell.arms():
            if arm.kind != "yeto" or not runs.get(arm.name) or arm.fleet_share > 1:
                continue  # an arm trained past equal tokens is judged by when it gets there (`time_to`)
            losses = [r["final_loss"] for r in runs[arm.name]]
            mean = statistics.fmean(losses)
            row: dict[str, Any] = {"cell": cell.name, "arm": arm.name.split(":", 1)[1], "mean": mean,
                                   "min": min(losses), "max": max(losses), "seeds": len(losses), "dp": dp,
                                   "alone": alone, "train_s": _mean(runs, arm.name, "train_s")}
            if dp is not None:
                row["ratio_dp"] = mean / dp
            if dp is not None and alone is not None and alone != dp:
                row["gap_closed"] = (alone - mean) / (alone - dp)
            if not cell.slow:
                row["goal"] = cell.max_ratio()
                row["met"] = "ratio_dp" in row and row["ratio_dp"] <= cell.max_ratio() and (
                    cell.gap_goal() is None or row.get("gap_closed", -1.0) >= (cell.gap_goal() or 0.0))
            out.append(row)
    return out


def slow_verdicts(cells: Iterable[Cell], runs: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, bool]]:
    """The slow island's goals: yeto with it beats yeto without it, and reaches the lock-step arm's
    loss in less wall-clock time."""
    lines: list[tuple[str, str, bool]] = []
    for cell in cells:
        if not cell.slow:
            continue
        c = cell.name
        slow, drop, drop_time, wait = (_mean(runs, f"{c}:{a}") for a in ("yeto-slow", "drop", "drop-time", "wait"))
        if slow is not None and drop is not None:
            lines.append((f"{c}: with the slow island beats without it, at equal tokens", f"{slow:.4f} vs {drop:.4f}",
                          slow < drop))
        if slow is not None and drop_time is not None:
            lines.append((f"{c}: with the slow island beats without it, in equal time",
                          f"{slow:.4f} vs {drop_time:.4f}", slow < drop_time))
        slow_s, wait_s = _mean(runs, f"{c}:yeto-slow", "train_s"), _mean(runs, f"{c}:wait", "train_s")
        if slow is not None and wait is not None and slow_s is not None and wait_s is not None:
            lines.append((f"{c}: reaches lockstep's loss in less time",
                          f"{slow:.4f} in {slow_s:.0f} s vs {wait:.4f} in {wait_s:.0f} s",
                          slow <= wait and slow_s < wait_s))
        long = runs.get(f"{c}:yeto-slow-long") or []
        if long and wait is not None and wait_s is not None:
            budget = _mean(runs, f"{c}:wait", "tokens") or 1.0
            # the final cut's model ends each curve: it is there when training ends
            reached = [time_to([*r.get("wall_curve", []), (r["train_s"], r["final_loss"], r["tokens"])], wait)
                       for r in long]
            if all(r is not None for r in reached):
                seconds = statistics.fmean(r[0] for r in reached if r is not None)
                tokens = statistics.fmean(r[1] for r in reached if r is not None) / budget
                lines.append((f"{c}: training on, reaches lockstep's loss sooner",
                              f"{wait:.4f} at {seconds:.0f} s ({tokens:.2f}x its tokens) vs {wait_s:.0f} s",
                              seconds < wait_s))
            else:
                lines.append((f"{c}: training on, reaches lockstep's loss sooner",
                              f"{sum(r is None for r in reached)} of {len(reached)} seeds never reach {wait:.4f}",
                              False))
    return lines


def time_to(wall_curve: list[Any], target: float) -> tuple[float, float] | None:
    """(seconds, tokens) at which a run's held-out loss first reaches `target`, interpolated
    between the last point above it and the first at or below; None if it never does. A point is
    (seconds, loss, tokens), as `diloco_arm`'s threaded arms record them."""
    before: Any = None
    for point in wall_curve:
        seconds, loss, tokens = point[:3]
        if loss <= target:
            if before is None:
                return float(seconds), float(tokens)
            share = (before[1] - target) / (before[1] - loss)
            return (before[0] + share * (seconds - before[0]), before[2] + share * (tokens - before[2]))
        before = (float(seconds), float(loss), float(tokens))
    return None


def print_rows(table: list[dict[str, Any]]) -> None:
    print(f"\n{'cell':<30} {'arm':<13} {'mean':>7} {'min-max':>15} {'/dp':>7} {'gap':>5} {'goal':>6}  met")
    for r in table:
        ratio = f"{r['ratio_dp']:.4f}" if "ratio_dp" in r else "-"
        gap = f"{r['gap_closed']:.0%}" if "gap_closed" in r else "-"
        goal = f"{r['goal']:.2f}" if "goal" in r else "-"
        met = "-" if "met" not in r else ("met" if r["met"] else "MISSED")
        print(f"{r['cell']:<30} {r['arm']:<13} {r['mean']:7.4f} {r['min']:7.4f}-{r['max']:.4f} {ratio:>7} {gap:>5} "
              f"{goal:>6}  {met}")


def plot(path: Path, cells: list[Cell], runs: dict[str, list[dict[str, Any]]]) -> None:
    """One panel per cell: each arm's held-out loss ÷ dp's at the same share of the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [c for c in cells if runs.get(f"{c.name}:dp")]
    if not shown:
        return
    cols = min(4, len(shown))
    nrows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.4 * nrows), squeeze=False)
    styles = {"alone": {"color": "gray", "linestyle": "--"}, "yeto": {"color": "tab:red"},
              "yeto-unpaced": {"color": "tab:blue"}, "yeto-slow": {"color": "tab:red"},
              "drop": {"color": "tab:orange"}, "drop-time": {"color": "tab:orange", "linestyle": ":"},
              "wait": {"color": "tab:green"}}
    for ax, cell in zip(axes.flat, shown, strict=False):
        dp = runs[f"{cell.name}:dp"]
        reference = [statistics.fmean(r["curve"][i][1] for r in dp) for i in range(len(dp[0]["curve"]))]
        reference.append(statistics.fmean(r["final_loss"] for r in dp))
        for arm in cell.arms():
            rs = runs.get(arm.name)
            kind = arm.name.split(":", 1)[1]
            if arm.kind == "dp" or not rs or kind not in styles:
                continue
            points = min(len(r["curve"]) for r in rs)
            losses = [statistics.fmean(r["curve"][i][1] for r in rs) for i in range(points)]
            losses.append(statistics.fmean(r["final_loss"] for r in rs))
            share = [i / (len(reference) - 1) for i in range(1, len(reference))]
            ratio = [x / ref for x, ref in zip(losses[1:], reference[1:], strict=False)]
            ax.plot(share[: len(ratio)], ratio, label=kind, linewidth=1.5, **styles[kind])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(cell.max_ratio(), color="black", linewidth=0.6, linestyle=":")
        ax.set_title(cell.name, fontsize=9)
        ax.set_ylim(0.97, 1.3)
        ax.set_xlabel("share of the run")
        ax.set_ylabel("eval loss / dp")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle("compare_diloco --matrix: held-out loss / data parallel's at the same step (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


__all__ = ["Cell", "all_cells", "pick", "plot", "print_rows", "rows", "slow_verdicts", "time_to"]
