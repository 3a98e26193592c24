"""The merge methods side by side, on the same deltas in the same run: plain weighted average, RDA,
HeLoCo + RDA, and iso (RDA, then each matrix's spectrum flattened: in the coordinator, and in a
pool of 1 and of 2 CPU worker processes, `--iso-worker-devices cpu` / `cpu,cpu`).

    python -m benchmarks.merge_methods                                  # 1, 16, 64 MiB; M = 2, 4, 8
    python -m benchmarks.merge_methods --sizes 1M 16M 64M 256M --learners 2 4 8 --repeat 5

For each fragment size and learner count M it builds one fragment of 512 x 512 matrices (a
remainder, if any, is averaged plainly by every method and left out of the norms compared) and M
learners' float32 deltas, then times each method's `merge_deltas` (HeLoCo also corrects each
learner's delta against a momentum first; iso's SVDs run after RDA). Columns:

- **s/GB**: seconds per GB of learner deltas read (M · 4 · n bytes), median of `--repeat`
  timings (for the average and RDA each timing spans 16 MiB of fragment or more);
- **÷ avg**: the method's time over the plain average's;
- **round ÷ avg** (average and RDA): the same, timing the merge as a round runs it
  (`round_merge.prepare_merge`: the deltas stacked, every learner's norm per tensor, which the
  tape and the overflow check need under any method and RDA reuses, and the merge writing the
  outer gradient), the two timed in turns. The goal for RDA is at most 1.5; the merge alone is
  shown beside it;
- **norm err**: the largest relative error, over the fragment's matrices, of the merged tensor's
  L2 norm against the same method computed in float64 (the goal is at most 1e-6);
- **mem**: the peak resident memory the method added, per byte of merged fragment, sampled every
  millisecond while it ran (glibc is asked to map every large allocation on its own, so freed
  memory goes back at once and the next method starts from the same baseline). For the pools
  it is the syncer's side only: each worker holds about two copies of the matrix it works on.

The pools' workers run one torch thread each; their results are checked bit for bit against
the in-process iso at one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import psutil
import torch

from benchmarks.wire import parse_count
from syncer.core.rounds import Answer
from syncer.merge.correction import HelocoConfig, heloco_correct
from syncer.merge.iso import direction_weights
from syncer.merge.iso_pool import IsoPool
from syncer.merge.merge import Segment, merge_deltas
from syncer.merge.round_merge import MergeWorkspace, prepare_merge
from yeto_core.settings import IsoWorkerSettings

MATRIX = (512, 512)  # 1 MiB of float32: the smallest fragment holds one
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc: allocations above this many bytes get their own mapping


def segments_for(n: int, method: str) -> list[Segment]:
    size = MATRIX[0] * MATRIX[1]
    rda = method != "average"
    iso = method.startswith("iso")
    segs = [Segment(i * size, size, rda=rda, iso_shape=MATRIX if iso else None) for i in range(n // size)]
    start = (n // size) * size
    return [*segs, Segment(start, n - start, rda=False)] if start < n else segs


class PeakRss:
    """The peak resident set size above the level at entry, sampled every millisecond."""

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self.peak = 0

    def __enter__(self) -> PeakRss:
        self._base = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss - self._base)
            self._stop.wait(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss - self._base)


def run_method(method: str, deltas: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor,
               segments: list[Segment], pools: dict[str, IsoPool]) -> torch.Tensor:
    if method == "heloco+rda":
        config = HelocoConfig(momentum_scale=0.5)
        corrected = torch.stack([heloco_correct(deltas[m], momentum, segments, config) for m in range(deltas.size(0))])
        return merge_deltas(corrected, weights, segments)
    return merge_deltas(deltas, weights, segments, iso=pools.get(method))


def reference_norms(method: str, deltas: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor,
                    segments: list[Segment]) -> list[float]:
    """The matrices' merged norms, the same method in float64 (HeLoCo's correction in float32 first, as it runs)."""
    if method == "heloco+rda":
        config = HelocoConfig(momentum_scale=0.5)
        deltas = torch.stack([heloco_correct(deltas[m], momentum, segments, config) for m in range(deltas.size(0))])
    d64, w64 = deltas.double(), weights.double()
    out = []
    for seg in segments:
        if seg.iso_shape is None and not seg.rda and method != "average":
            continue  # the plainly averaged remainder: no matrix
        cols = d64[:, seg.offset : seg.offset + seg.numel]
        if not seg.rda:
            merged = (w64[:, None] * cols).sum(0)
        else:
            norms = cols.norm(dim=1)
            u = (w64[:, None] * cols / norms[:, None]).sum(0)
            merged = (w64 * norms).sum() * u / u.norm()
        if seg.iso_shape is not None:  # the flattened matrix's norm: s̄·√(Σ w_i²), syncer/merge/iso.py's weights
            s = torch.linalg.svdvals(merged.view(seg.iso_shape))
            w = direction_weights(s, seg.iso_shape)
            out.append(float((w * s).sum() / w.sum() * (w * w).sum().sqrt()) if w.sum() > 0 else 0.0)
            continue
        out.append(float(merged.norm()))
    return out


def bench(n: int, learners: int, repeat: int, pools: dict[str, IsoPool]) -> dict[str, dict[str, float]]:
    g = torch.Generator().manual_seed(n + learners)
    scales = torch.linspace(0.5, 2.0, learners)[:, None] * 1e-3
    deltas = torch.randn(learners, n, generator=g) * scales
    momentum = torch.randn(n, generator=g) * 1e-3
    weights = torch.softmax(torch.randn(learners, generator=g, dtype=torch.float64), 0)
    rows: dict[str, dict[str, float]] = {}
    in_process: torch.Tensor | None = None
    for method in ("average", "rda", "heloco+rda", "iso", *pools):
        segments = segments_for(n, method)
        with PeakRss() as mem:
            merged = run_method(method, deltas, weights, momentum, segments, pools)
        if method == "iso":
            in_process = merged
        elif method in pools and in_process is not None and not torch.equal(merged, in_process):
            raise SystemExit(f"{method} differs from the in-process iso merge at {n * 4} bytes, M={learners}")
        times, runs = [], batch_of(method, n)
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(runs):
                run_method(method, deltas, weights, momentum, segments, pools)
            times.append((time.perf_counter() - t0) / runs)
        want = reference_norms(method, deltas, weights, momentum, segments)
        got = [float(merged[s.offset : s.offset + s.numel].double().norm()) for s in segments
               if s.rda or s.iso_shape is not None or method == "average"]
        err = max((abs(a - b) / b for a, b in zip(got, want, strict=True) if b > 0), default=0.0)
        rows[method] = {"s_per_gb": statistics.median(times) / (learners * 4 * n / 1e9), "norm_err": err,
                        "mem": mem.peak / (4 * n)}
    for method, s_per_gb in round_s_per_gb(deltas, weights, momentum, repeat).items():
        rows[method]["round_s_per_gb"] = s_per_gb
    return rows


def round_s_per_gb(deltas: torch.Tensor, weights: torch.Tensor, momentum: torch.Tensor,
                   repeat: int) -> dict[str, float]:
    """Seconds per GB of learner deltas of the merge half of a round under the average and RDA, as
    the coordinator runs it (a workspace kept from round to round). The two are timed in turns, at
    least 5 times each, so that a slow spell of the machine falls on both."""
    m, n = deltas.shape
    tokens = [max(1, round(1000 * float(w))) for w in weights]
    answers = [Answer(i, 1, tokens=tokens[i], steps=1, delta=deltas[i].clone(), base_version=0) for i in range(m)]
    workspace = MergeWorkspace()
    runs = batch_of("rda", n)
    times: dict[str, list[float]] = {"average": [], "rda": []}
    for turn in range(max(5, repeat) + 1):
        for method, samples in times.items():
            segments = segments_for(n, method)
            t0 = time.perf_counter()
            for _ in range(runs):
                prepare_merge(answers, momentum=momentum, segments=segments, heloco=None, workspace=workspace)
            if turn:  # the first turn faults the workspace in
                samples.append((time.perf_counter() - t0) / runs)
    return {method: statistics.median(samples) / (m * 4 * n / 1e9) for method, samples in times.items()}


def batch_of(method: str, n: int) -> int:
    """Runs per timing: the quick methods on small fragments take well under a millisecond, where
    one run's timing is mostly noise, so each timing spans at least 16 MiB of fragment."""
    return 1 if method not in ("average", "rda") else max(1, (4 << 20) // n)


def main(argv: list[str] | None = None) -> int:
    if MMAP_ENV not in os.environ:  # measure memory as it is used: re-run with every large allocation mapped alone
        os.environ[MMAP_ENV] = str(1 << 17)
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.merge_methods", *(argv or sys.argv[1:])])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=parse_count, nargs="+", default=[1 << 20, 16 << 20, 64 << 20],
                    help="fragment sizes in bytes (1M = 1 MiB)")
    ap.add_argument("--learners", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="iso pools of this many CPU workers")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pools = {f"iso/{k}w": IsoPool(["cpu"] * k, IsoWorkerSettings()) for k in args.workers}
    try:
        return report(args, pools)
    finally:
        for pool in pools.values():
            pool.close()


def report(args: argparse.Namespace, pools: dict[str, IsoPool]) -> int:
    bench(1 << 18, 2, 1, pools)  # warm-up: torch's own first-use allocations are no method's
    print(f"merge methods, {args.threads} torch thread(s), median of {args.repeat}; s/GB of learner deltas read")
    print(f"{'fragment':>9} {'M':>2} {'method':>11} {'s/GB':>8} {'÷ avg':>7} {'round ÷ avg':>12} {'norm err':>9} "
          f"{'mem':>6}")
    worst_ratio, worst_round, worst_err = 0.0, 0.0, 0.0
    for size in args.sizes:
        n = size // 4
        for m in args.learners:
            rows = bench(n, m, args.repeat, pools)
            avg, avg_round = rows["average"]["s_per_gb"], rows["average"]["round_s_per_gb"]
            for method, r in rows.items():
                ratio = r["s_per_gb"] / avg
                in_round = r["round_s_per_gb"] / avg_round if "round_s_per_gb" in r else None
                shown = "" if in_round is None else f"{in_round:.2f}"
                print(f"{size / 2**20:>7.0f} MiB {m:>2} {method:>11} {r['s_per_gb']:>8.3f} {ratio:>7.2f} "
                      f"{shown:>12} {r['norm_err']:>9.1e} {r['mem']:>5.2f}x", flush=True)
                if method == "rda":
                    assert in_round is not None
                    worst_ratio, worst_round = max(worst_ratio, ratio), max(worst_round, in_round)
                if method != "average":
                    worst_err = max(worst_err, r["norm_err"])
    if pools:
        print(f"iso pools ({', '.join(pools)}): bit-identical to the in-process iso in every cell")
    print(f"largest norm error = {worst_err:.1e} (goal <= 1e-6)")
    print(f"rda/average, merge alone = {worst_ratio:.2f} (the largest)")
    print(f"ratio rda/average in a round = {worst_round:.2f} (the largest; goal <= 1.5)")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
