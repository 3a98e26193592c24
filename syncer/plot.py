"""`yeto-plot TAPE --out DIR`: pictures of a run from its event tape (matplotlib, the `plot` extra).

    yeto-plot run/tape.jsonl --out run/plots

Five PNGs, each from the tape's records alone (DESIGN §6.4), so a run can be looked at after the
fact, or while it runs:

* ``rounds.png``: the round timeline per fragment: launch → quorum (the wait) → grace → commit;
* ``learners.png``: tokens merged per learner over time, and the merge weight each got per commit;
* ``staleness.png``: per commit, how many versions behind each merged push was, and carried pushes;
* ``consensus.png``: the consensus JS distance and the fragments' delta L2 over the rounds;
* ``throughput.png``: committed rounds per minute and merged tokens per second.

A tape with no commit, a corrupt line (a torn last line is skipped, as everywhere) or a file that
is not a yeto tape is refused with one line; the exit status is 0, or 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from syncer.tape import TapeError, read_tape

PLOTS = ("rounds", "learners", "staleness", "consensus", "throughput")
SIZE_IN, DPI = (9.0, 4.5), 100  # every PNG is 900 x 450 pixels


class PlotError(ValueError):
    """The tape cannot be plotted (one line for the user)."""


def load(path: Path) -> list[dict[str, Any]]:
    try:
        records = read_tape(path)
    except (OSError, TapeError) as exc:
        raise PlotError(str(exc)) from None
    foreign = [r for r in records if not isinstance(r.get("event"), str) or "t" not in r]
    if foreign:
        raise PlotError(f"{path} is not a yeto event tape: a record without 'event' and 't' ({str(foreign[0])[:80]})")
    if not any(r["event"] == "commit" for r in records):
        raise PlotError(f"{path} holds no committed round yet: nothing to plot")
    return records


def plot_tape(path: Path, out: Path) -> list[Path]:
    """Write the PNGs of the tape at `path` into `out`; their paths."""
    records = load(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(r["t"] for r in records)
    commits = [r for r in records if r["event"] == "commit"]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in PLOTS:
        fig, axes = plt.subplots(1, 2, figsize=SIZE_IN, dpi=DPI, layout="constrained")
        DRAW[name](axes, records, commits, start)
        fig.suptitle(f"{path.name}: {name}")
        target = out / f"{name}.png"
        fig.savefig(target, dpi=DPI)
        plt.close(fig)
        written.append(target)
    return written


def _rounds(axes: Any, records: list[dict[str, Any]], commits: list[dict[str, Any]], start: float) -> None:
    timeline, fragments = axes
    launched = {(r["round"], r.get("attempt")): r["t"] for r in records if r["event"] == "launch"}
    for c in commits:
        end = c["t"] - start
        grace = (c.get("grace_ms") or 0.0) / 1000.0
        wait = (c.get("wait_ms") or 0.0) / 1000.0
        began = launched.get((c["round"], c.get("attempt")), c["t"] - wait - grace) - start
        row = c.get("fragment", 0)
        timeline.barh(row, max(end - grace - began, 0.0), left=began, color="tab:blue", height=0.6)
        timeline.barh(row, grace, left=end - grace, color="tab:orange", height=0.6)
        timeline.plot([end], [row], "k|")
    timeline.set(xlabel="seconds since the tape's first record", ylabel="fragment",
                 title="launch → quorum (blue), grace (orange), commit |")
    timeline.set_yticks(sorted({c.get("fragment", 0) for c in commits}))
    by_fragment: dict[int, list[float]] = defaultdict(list)
    for c in commits:
        by_fragment[c.get("fragment", 0)].append(c.get("merge_ms") or 0.0)
    for f, merges in sorted(by_fragment.items()):
        fragments.plot(range(len(merges)), merges, marker=".", label=f"fragment {f}")
    fragments.set(xlabel="commit of the fragment", ylabel="merge (ms)", title="merge time")
    fragments.legend(fontsize="small")


def _learners(axes: Any, records: list[dict[str, Any]], commits: list[dict[str, Any]], start: float) -> None:
    tokens, weights = axes
    total: dict[int, float] = defaultdict(float)
    series: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for c in commits:
        for lid, n, w in zip(c.get("learners", []), c.get("tokens", []), c.get("weights", []), strict=False):
            total[lid] += n
            series[lid][0].append(c["t"] - start)
            series[lid][1].append(total[lid])
            weights.plot([c["round"]], [w], ".", color=f"C{lid % 10}")
    for lid, (ts, ns) in sorted(series.items()):
        tokens.step(ts, ns, where="post", label=f"learner {lid}", color=f"C{lid % 10}")
    tokens.set(xlabel="seconds", ylabel="tokens merged", title="contributions")
    tokens.legend(fontsize="small")
    weights.set(xlabel="round", ylabel="merge weight", title="weight per commit (colour: learner)")


def _staleness(axes: Any, records: list[dict[str, Any]], commits: list[dict[str, Any]], start: float) -> None:
    lag, carried = axes
    for c in commits:
        behind = c.get("version", 1) - 1
        for lid, base in zip(c.get("learners", []), c.get("base_versions", []), strict=False):
            lag.plot([c["round"]], [behind - base], ".", color=f"C{lid % 10}")
    lag.set(xlabel="round", ylabel="versions behind", title="staleness of merged pushes (colour: learner)")
    carries = sorted(r["t"] - start for r in records if r["event"] == "carry")
    carried.step(carries, range(1, len(carries) + 1), where="post")
    carried.set(xlabel="seconds", ylabel="pushes carried", title=f"carried pushes ({len(carries)})")


def _consensus(axes: Any, records: list[dict[str, Any]], commits: list[dict[str, Any]], start: float) -> None:
    js, l2 = axes
    points = [(c["round"], c["consensus_js"]) for c in commits if c.get("consensus_js") is not None]
    js.plot([p[0] for p in points], [p[1] for p in points], marker=".")
    js.set(xlabel="round", ylabel="JS distance", title="consensus between learners" + ("" if points else " (none)"))
    norms = [(c["round"], sum(c["delta_norms"]) / len(c["delta_norms"])) for c in commits if c.get("delta_norms")]
    l2.plot([p[0] for p in norms], [p[1] for p in norms], marker=".")
    l2.set(xlabel="round", ylabel="mean |delta|", title="delta L2 per commit")


def _throughput(axes: Any, records: list[dict[str, Any]], commits: list[dict[str, Any]], start: float) -> None:
    rounds, tokens = axes
    times = [c["t"] - start for c in commits]
    span = max(times[-1] - times[0], 1e-9) if len(times) > 1 else 1.0
    window = max(span / 20, 1e-3)
    rate, token_rate, centres = [], [], []
    at = times[0]
    while at <= times[-1] + 1e-9:
        inside = [c for c, t in zip(commits, times, strict=True) if at <= t < at + window]
        centres.append(at + window / 2)
        rate.append(len(inside) * 60.0 / window)
        token_rate.append(sum(sum(c.get("tokens", [])) for c in inside) / window)
        at += window
    rounds.plot(centres, rate, marker=".")
    rounds.set(xlabel="seconds", ylabel="rounds / minute", title=f"committed rounds ({len(commits)})")
    tokens.plot(centres, token_rate, marker=".")
    tokens.set(xlabel="seconds", ylabel="tokens / s", title="merged tokens")


DRAW = {"rounds": _rounds, "learners": _learners, "staleness": _staleness, "consensus": _consensus,
        "throughput": _throughput}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="yeto-plot", description=__doc__.splitlines()[0])
    parser.add_argument("tape", type=Path, help="a syncer's JSONL event tape (--tape)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNGs")
    args = parser.parse_args(argv)
    try:
        written = plot_tape(args.tape, args.out)
    except PlotError as exc:
        print(f"yeto-plot: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        print(f"yeto-plot: {exc.name} is missing: pip install 'yeto[plot]'", file=sys.stderr)
        return 2
    print(f"yeto-plot: {len(written)} plots in {args.out}: {', '.join(p.name for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
