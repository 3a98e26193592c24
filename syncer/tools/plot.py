"""`yeto-plot TAPE --out DIR`: pictures of a run from its event tape (matplotlib, the `plot` extra).

    yeto-plot run/tape.jsonl --out run/plots

Six PNGs, each from the tape's records alone (DESIGN §6.4), so a run can be looked at after the
fact, or while it runs:

* ``rounds.png``: the round timeline per fragment: launch → quorum (the wait) → grace → commit;
* ``learners.png``: tokens merged per learner over time, and the merge weight each got per commit;
* ``staleness.png``: per commit, how many versions behind each merged push was, and carried pushes;
* ``consensus.png``: the consensus JS distance and the fragments' delta L2 over the rounds;
* ``throughput.png``: committed rounds per minute and merged tokens per second;
* ``wire.png``: bits per parameter of each commit's pushes (up) and broadcast (down), per
  learner, and the payload bytes moved each way over the run.

What is kept (`syncer/tools/plot_account.py`): the tape is read once, a line at a time, and memory
does not grow with its length. Each series holds at most ``POINTS`` points: when one fills up,
neighbouring points merge pairwise (their mean drawn as the point, their lowest and highest value
as a band) and each later point stands for twice as many records; the round timeline keeps at
most ``POINTS`` bars per fragment (a merged bar spans its rounds, as opaque as they fill it),
throughput is counted in at most ``POINTS`` time bins, and the first ``MAX_SERIES`` learners and
fragments get a series each (the rest share one). A 1 GB tape of 1.1M rounds is drawn in 88 MiB
of peak RSS (README, `python -m benchmarks.plot_tape`).

Bad input is one line and exit status 2: one naming the tape and its line (longer than
``MAX_LINE_BYTES``, not a JSON object, nested too deeply, NaN or Infinity, no "event" and "t", a
launch or commit record with fields of the wrong type or out of bounds), a tape that is missing,
not a regular file, unreadable or without a commit, an ``--out`` that cannot be made a directory
or written, a bad flag. A torn last line is skipped, as everywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from syncer.tools.plot_account import OTHERS, Account, PlotError, Series, read_account
from syncer.tools.tool_args import ToolParser, one_line, unwritable_dir

PLOTS = ("rounds", "learners", "staleness", "consensus", "throughput", "wire")
SIZE_IN, DPI = (9.0, 4.5), 100  # every PNG is 900 x 450 pixels


def check_out(out: Path) -> None:
    """`out` is, or can be made, a directory this process writes into (before the tape is read)."""
    if (problem := unwritable_dir(out)) is not None:
        raise PlotError(f"--out {out}: {problem}")


def plot_tape(path: Path, out: Path) -> list[Path]:
    """Write the PNGs of the tape at `path` into `out`; their paths."""
    check_out(out)
    account = read_account(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlotError(f"--out {out}: cannot make the directory ({exc.strerror})") from None
    written = []
    for name in PLOTS:
        fig, axes = plt.subplots(1, 2, figsize=SIZE_IN, dpi=DPI, layout="constrained")
        try:
            DRAW[name](axes, account)
            fig.suptitle(f"{path.name}: {name}")
            target = out / f"{name}.png"
            fig.savefig(target, dpi=DPI)
        except OSError as exc:
            raise PlotError(f"--out {out}: cannot write {name}.png ({exc.strerror})") from None
        finally:
            plt.close(fig)
        written.append(target)
    return written


def colour(key: int) -> str:
    return "0.5" if key == OTHERS else f"C{key % 10}"


def label(kind: str, key: int) -> str:
    return f"other {kind}s" if key == OTHERS else f"{kind} {key}"


def merged_note(*series: Series) -> str:
    stride = max((s.stride for s in series), default=1)
    return f"\n(points: means of ≤ {stride}; band: min to max)" if stride > 1 else ""


def draw(ax: Any, s: Series, *, offset: float = 0.0, style: str = ".-", step: bool = False, **kw: Any) -> None:
    """A series as points (or steps), with the band of its merged points' extremes."""
    x, y, lo, hi = s.points()
    x = [v - offset for v in x]
    if s.stride > 1:
        ax.fill_between(x, lo, hi, color=kw.get("color"), alpha=0.15, linewidth=0, step="post" if step else None)
    if step:
        ax.step(x, y, where="post", **kw)
    else:
        ax.plot(x, y, style, **kw)


def _rounds(axes: Any, a: Account) -> None:
    from matplotlib.colors import to_rgba

    timeline, fragments = axes
    rows = sorted(a.bars, key=lambda k: (k == OTHERS, k))
    for row, key in enumerate(rows):
        waits, graces, blues, oranges, ends = [], [], [], [], []
        for start, end, grace, busy in a.bars[key].bars():
            span = max(end - start, 0.0)
            grace = min(grace, span)
            opacity = min(1.0, busy / span) if span > 0 else 1.0  # a merged bar's rounds filled this much of it
            waits.append((start - a.start, span - grace))
            graces.append((end - grace - a.start, grace))
            blues.append(to_rgba("tab:blue", opacity))
            oranges.append(to_rgba("tab:orange", opacity))
            ends.append(end - a.start)
        # one collection per colour and row: thousands of bars draw as fast as one
        timeline.broken_barh(waits, (row - 0.3, 0.6), facecolors=blues, linewidth=0)
        timeline.broken_barh(graces, (row - 0.3, 0.6), facecolors=oranges, linewidth=0)
        timeline.plot(ends, [row] * len(ends), "k|")
    strides = max(b.stride for b in a.bars.values())
    timeline.set(xlabel="seconds since the tape's first record", ylabel="fragment",
                 title="launch → quorum (blue), grace (orange), commit |"
                 + (f"\n(a bar spans up to {strides} rounds, as opaque as they fill it)" if strides > 1 else ""))
    timeline.set_yticks(range(len(rows)), ["others" if k == OTHERS else str(k) for k in rows])
    for key, s in sorted(a.merge_ms.items()):
        draw(fragments, s, color=colour(key), label=label("fragment", key))
    fragments.set(xlabel="commit of the fragment", ylabel="merge (ms)",
                  title="merge time" + merged_note(*a.merge_ms.values()))
    fragments.legend(fontsize="small")


def _learners(axes: Any, a: Account) -> None:
    tokens, weights = axes
    for key, s in sorted(a.merged_tokens.items()):
        draw(tokens, s, offset=a.start, step=True, color=colour(key), label=label("learner", key))
    tokens.set(xlabel="seconds", ylabel="tokens merged", title="contributions" + merged_note(*a.merged_tokens.values()))
    if a.merged_tokens:
        tokens.legend(fontsize="small")
    for key, s in sorted(a.weights.items()):
        draw(weights, s, style=".", color=colour(key))
    weights.set(xlabel="round", ylabel="merge weight",
                title="weight per commit (colour: learner)" + merged_note(*a.weights.values()))


def _staleness(axes: Any, a: Account) -> None:
    lag, carried = axes
    for key, s in sorted(a.lag.items()):
        draw(lag, s, style=".", color=colour(key))
    lag.set(xlabel="round", ylabel="versions behind",
            title="staleness of merged pushes (colour: learner)" + merged_note(*a.lag.values()))
    draw(carried, a.carried, offset=a.start, step=True, color="C0")
    carried.set(xlabel="seconds", ylabel="pushes carried",
                title=f"carried pushes ({a.carried.count})" + merged_note(a.carried))


def _consensus(axes: Any, a: Account) -> None:
    js, l2 = axes
    draw(js, a.js, color="C0")
    js.set(xlabel="round", ylabel="JS distance",
           title="consensus between learners" + ("" if a.js.count else " (none)") + merged_note(a.js))
    draw(l2, a.l2, color="C0")
    l2.set(xlabel="round", ylabel="mean |delta|", title="delta L2 per commit" + merged_note(a.l2))


def _throughput(axes: Any, a: Account) -> None:
    rounds, tokens = axes
    centres, rate, token_rate = a.rates.windows()
    assert a.rates.origin is not None
    centres = [c + a.rates.origin - a.start for c in centres]
    rounds.plot(centres, rate, marker=".")
    rounds.set(xlabel="seconds", ylabel="rounds / minute", title=f"committed rounds ({a.commits})")
    tokens.plot(centres, token_rate, marker=".")
    tokens.set(xlabel="seconds", ylabel="tokens / s", title="merged tokens")


def _wire(axes: Any, a: Account) -> None:
    bits, total = axes
    for s, name, c in ((a.bits_up, "up (a push)", "C0"), (a.bits_down, "down (a broadcast)", "C1")):
        draw(bits, s, color=c, label=name)
    bits.set_ylim(bottom=0)
    kept = a.bits_up.count > 0
    bits.set(xlabel="round", ylabel="bits / parameter", title="wire per learner" + ("" if kept else
             " (not on this tape)") + merged_note(a.bits_up, a.bits_down))
    if kept:
        bits.legend(loc="best")
    for s, name, c in ((a.bytes_up, "up", "C0"), (a.bytes_down, "down", "C1")):
        draw(total, s, color=c, label=name, style="-")
    total.set(xlabel="seconds", ylabel="GB", title="payload bytes moved")
    if kept:
        total.legend(loc="best")


DRAW: dict[str, Callable[[Any, Account], None]] = {
    "rounds": _rounds, "learners": _learners, "staleness": _staleness, "consensus": _consensus,
    "throughput": _throughput, "wire": _wire,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = ToolParser(prog="yeto-plot", description=__doc__.splitlines()[0])
    parser.add_argument("tape", type=Path, help="a syncer's JSONL event tape (--tape)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNGs")
    args = parser.parse_args(argv)
    try:
        written = plot_tape(args.tape, args.out)
    except PlotError as exc:
        print(one_line(f"yeto-plot: {exc}"), file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        print(f"yeto-plot: {exc.name} is missing: pip install 'yeto[plot]'", file=sys.stderr)
        return 2
    print(f"yeto-plot: {len(written)} plots in {args.out}: {', '.join(p.name for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
