"""One round's merge on the syncer's CPU, and what screening its output costs.

    python -m benchmarks.merge                       # 16M-value fragment (64 MiB), 2 and 4 learners
    python -m benchmarks.merge --elements 4M --learners 2 8 --threads 2 --repeat 9

For each learner count it times, in one process and one after the other:

- **merge**: `syncer.merge.round_merge.merge_round` as the coordinator calls it (a reused workspace, RDA on
  every tensor, Nesterov 0.5/0.5), which includes the output screen;
- **screen**: the screen's own work on the same fragment (the L2 norms of params and momentum and
  the optimizer's bound; the gradient's norm is taken for the tape anyway), the part a merge
  without it would not do;
- **copy**: `Tensor.copy_` of the fragment into a preallocated tensor, the memory-speed baseline.

Medians over `--repeat` runs after one warm-up. Each row prints merge / copy and the screen's
share of the merge; the last line is `ratio merge/copy = X` for the largest learner count.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.wire import parse_count
from syncer.core.rounds import Answer
from syncer.merge.merge import Segment, accurate_norm
from syncer.merge.outer import Nesterov
from syncer.merge.round_merge import MergeWorkspace, merge_round

TENSOR = 1 << 20  # values per tensor; the last one takes what is left


def median_ms(run: Callable[[], object], repeat: int) -> float:
    run()  # warm-up: faults in the workspace and the copy target
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def segments_for(n: int) -> list[Segment]:
    return [Segment(off, min(TENSOR, n - off), rda=True) for off in range(0, n, TENSOR)]


def bench(n: int, learners: int, threads: int, repeat: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(learners)
    answers = [Answer(lid, 1, tokens=1000 + lid, steps=8, delta=torch.randn(n, generator=g) * 1e-3, base_version=0)
               for lid in range(learners)]
    params, momentum = torch.randn(n, generator=g), torch.zeros(n)
    outer, segments, workspace = Nesterov(lr=0.5, momentum=0.5), segments_for(n), MergeWorkspace()

    def merge() -> None:
        out = merge_round(answers, params=params, momentum=momentum, outer_state={}, segments=segments,
                          outer=outer, heloco=None, threads=threads, workspace=workspace)
        assert not out.overflowed

    def screen() -> None:
        outer.bound(param=accurate_norm(params), momentum=accurate_norm(momentum), grad=1.0)

    target = torch.empty(n)
    torch.set_num_threads(max(1, threads))
    return {"merge": median_ms(merge, repeat), "screen": median_ms(screen, repeat),
            "copy": median_ms(lambda: target.copy_(params), repeat)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=parse_count, default=16 << 20, help="values in the fragment (e.g. 16M)")
    ap.add_argument("--learners", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--threads", type=int, default=1, help="merge threads (--merge-threads) and torch threads")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    n = args.elements
    print(f"fragment of {n:,} float32 values ({n * 4 / 2**20:.0f} MiB), {args.threads} thread(s), "
          f"median of {args.repeat}")
    print(f"{'learners':>8} {'merge ms':>9} {'copy ms':>8} {'merge/copy':>10} {'screen ms':>9} {'screen share':>12}")
    ratio = 0.0
    for m in args.learners:
        t = bench(n, m, args.threads, args.repeat)
        ratio = t["merge"] / t["copy"]
        print(f"{m:>8} {t['merge']:>9.1f} {t['copy']:>8.1f} {ratio:>10.2f} {t['screen']:>9.1f} "
              f"{t['screen'] / t['merge']:>11.0%}")
    print(f"ratio merge/copy = {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
