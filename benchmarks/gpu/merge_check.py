"""GPU check of the merges: the same deltas merged on cuda and on the CPU, and iso in a worker pool
of one worker per visible GPU (`benchmarks/gpu/check.sh` runs it).

    python benchmarks/gpu/merge_check.py [--mib 64] [--learners 4] [--repeat 3]

First each push codec encodes a cuda tensor and decodes into one: the same bytes and values as
from and into the CPU, with the time ratio. Then for each method (average, RDA, iso) it merges
one fragment of 512 x 512 matrices on the CPU and
on cuda:0 from the same float32 deltas, and prints the largest relative difference of the merged
matrices (and of their norms) with the time ratio CPU / cuda (a ratio above 1: cuda is faster).
Average and RDA must agree within 1e-5 relative per matrix and 1e-6 in norm (different reduction
orders, the same math); iso within 1e-3 per matrix (two LAPACK-class SVDs of the same matrix agree
to their own rounding, not bit for bit) and 1e-5 in norm. Then an iso pool with one worker per GPU
flattens the same matrices: bit-identical to one cuda worker alone, and within the iso bound of
the CPU. Exit 1 if a bound is broken; the last line says `gpu merge check: ok`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.wire import CODEC_NAMES
from syncer.merge.iso_pool import IsoPool
from syncer.merge.merge import Segment, merge_deltas
from yeto_core.codecs import codec_by_name
from yeto_core.settings import IsoWorkerSettings

MATRIX = (512, 512)
BOUNDS = {"average": (1e-5, 1e-6), "rda": (1e-5, 1e-6), "iso": (1e-3, 1e-5)}


def segments(n: int, method: str) -> list[Segment]:
    size = MATRIX[0] * MATRIX[1]
    return [Segment(i * size, size, rda=method != "average", iso_shape=MATRIX if method == "iso" else None,
                    name=f"m{i}") for i in range(n // size)]


def timed(fn: object, repeat: int, device: torch.device) -> tuple[torch.Tensor, float]:
    out = fn()  # type: ignore[operator]
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def differences(a: torch.Tensor, b: torch.Tensor, segs: list[Segment]) -> tuple[float, float]:
    worst, worst_norm = 0.0, 0.0
    for s in segs:
        x, y = a[s.offset : s.offset + s.numel].double(), b[s.offset : s.offset + s.numel].double()
        scale = float(y.abs().max()) or 1.0
        worst = max(worst, float((x - y).abs().max()) / scale)
        ny = float(y.norm())
        if ny > 0:
            worst_norm = max(worst_norm, abs(float(x.norm()) - ny) / ny)
    return worst, worst_norm


def check_codecs(values: torch.Tensor, cuda: torch.device, repeat: int) -> bool:
    """Each codec from and into cuda tensors: the same bytes and values as on the CPU."""
    ok = True
    on_gpu = values.to(cuda)
    print(f"{'codec':>9} {'same bytes':>10} {'same values':>11} {'encode cpu/cuda':>16} {'decode cpu/cuda':>16}")
    for name in CODEC_NAMES:
        codec = codec_by_name(name, block=128)
        cpu_buf = memoryview(bytearray(codec.encoded_nbytes(values.numel())))
        gpu_buf = memoryview(bytearray(codec.encoded_nbytes(values.numel())))
        _, enc_cpu = timed(lambda c=codec, b=cpu_buf: c.encode(values, b), repeat, torch.device("cpu"))
        _, enc_gpu = timed(lambda c=codec, b=gpu_buf: c.encode(on_gpu, b), repeat, cuda)
        out_cpu, out_gpu = torch.empty_like(values), torch.empty_like(on_gpu)
        _, dec_cpu = timed(lambda c=codec, b=cpu_buf, o=out_cpu: c.decode(b, o), repeat, torch.device("cpu"))
        _, dec_gpu = timed(lambda c=codec, b=cpu_buf, o=out_gpu: c.decode(b, o), repeat, cuda)
        same_bytes = bytes(cpu_buf) == bytes(gpu_buf)
        same_values = torch.equal(out_gpu.cpu(), out_cpu)
        ok &= same_bytes and same_values
        print(f"{name:>9} {same_bytes!s:>10} {same_values!s:>11} {enc_cpu / enc_gpu:>16.2f} {dec_cpu / dec_gpu:>16.2f}",
              flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda:0", help="the device checked against the CPU (cpu: a dry run of "
                    "this script, with two CPU workers for the pool)")
    args = ap.parse_args(argv)
    cuda = torch.device(args.device)
    if cuda.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs one", file=sys.stderr)
        return 2
    n = args.mib * (1 << 20) // 4
    g = torch.Generator().manual_seed(7)
    deltas = torch.randn(args.learners, n, generator=g) * torch.linspace(0.5, 2.0, args.learners)[:, None] * 1e-3
    weights = torch.softmax(torch.randn(args.learners, generator=g, dtype=torch.float64), 0).float()
    deltas_gpu, weights_gpu = deltas.to(cuda), weights.to(cuda)
    ok = check_codecs(deltas[0].contiguous(), cuda, args.repeat)
    print(f"{args.mib} MiB fragment of {MATRIX[0]}x{MATRIX[1]} matrices, M={args.learners}, median of {args.repeat}")
    print(f"{'method':>8} {'cpu s':>8} {'cuda s':>8} {'cpu/cuda':>9} {'max rel diff':>13} {'norm diff':>10}")
    cpu_iso = None
    for method in ("average", "rda", "iso"):
        segs = segments(n, method)
        cpu, t_cpu = timed(lambda segs=segs: merge_deltas(deltas, weights, segs), args.repeat, torch.device("cpu"))
        gpu, t_gpu = timed(lambda segs=segs: merge_deltas(deltas_gpu, weights_gpu, segs), args.repeat, cuda)
        diff, norm_diff = differences(gpu.cpu(), cpu, segs)
        bound, norm_bound = BOUNDS[method]
        good = diff <= bound and norm_diff <= norm_bound
        ok &= good
        print(f"{method:>8} {t_cpu:>8.3f} {t_gpu:>8.3f} {t_cpu / t_gpu:>9.2f} {diff:>13.2e} {norm_diff:>10.2e}"
              f"{'' if good else '   OUT OF BOUND'}", flush=True)
        if method == "iso":
            cpu_iso = cpu
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda.type == "cuda" else ["cpu", "cpu"]
    segs = segments(n, "iso")
    rda = merge_deltas(deltas, weights, segments(n, "rda"))
    results = {}
    for devices in ([gpus[0]], gpus):
        with IsoPool(devices, IsoWorkerSettings()) as pool:
            mats = [(s.name, rda[s.offset : s.offset + s.numel].clone().view(MATRIX)) for s in segs]
            t0 = time.perf_counter()
            pool.flatten(mats)
            took = time.perf_counter() - t0
        results[len(devices)] = torch.cat([m.reshape(-1) for _, m in mats])
        print(f"iso pool on {','.join(devices)}: {took:.3f} s for {len(mats)} matrices", flush=True)
    same = torch.equal(results[1], results[len(gpus)])
    assert cpu_iso is not None
    diff, norm_diff = differences(results[len(gpus)], cpu_iso, segs)
    good = same and diff <= BOUNDS["iso"][0] and norm_diff <= BOUNDS["iso"][1]
    ok &= good
    print(f"iso pool, 1 vs {len(gpus)} GPU workers bit-identical: {same}; against the CPU: max rel diff {diff:.2e}, "
          f"norm diff {norm_diff:.2e}{'' if good else '   OUT OF BOUND'}")
    print("gpu merge check: ok" if ok else "gpu merge check: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
