"""How yeto's costs grow with the model: the syncer and an island from 16 MiB to 4 GiB of f32 weights.

    python -m benchmarks.scale [--sizes 16M,64M,256M,1G,4G] [--learners 2 4] [--fragments 8] [--out DIR]
    python -m benchmarks.scale --quick          # 4 and 16 MiB, M = 2: the suite's smoke test

Synthetic weights and deltas, no training. For every size, each yeto time is paired with a
baseline of the same bytes measured in the same run (only ratios mean anything on a shared machine):

* `init`: learner 0's INIT upload, first INIT sent → the syncer's initial cut (tape); against raw
  loopback of the model's bytes. `init_fresh` compares it with raw loopback into memory new to the
  receiver instead, taken after the syncer has exited (a diagnostic: an upload the receiver keeps
  must land in such memory, and on a virtual machine its page faults can cost more than the wire).
* `push`: one learner's PUSH of a fragment, submit → delta decoded, checked, stored in the syncer;
  against raw loopback of the push's bytes.
* `fanout`: a round's BCAST, commit (tape) → the last of M learners holding the f32 values;
  against raw loopback of M fragments' bytes.
* `merge_rda`, `merge_average`: `merge_round` of M answers for one fragment; against
  `Tensor.copy_` of the fragment.
* `ckpt_write`: `save_checkpoint` of params + momentum; against `write` + `fsync` of the same bytes
  (into a new file that replaces the last, as the checkpoint's does).
* `ckpt_read`: `load_checkpoint` (checksums and finiteness verified); against `readinto` of the
  same file into fresh memory, the page cache dropped before both.
* `syncer_rss`: the syncer's peak RSS (VmHWM) ÷ the model's bytes, after the timed rounds and P
  more in which every learner answers each pull at once (the pipeline full, every fragment merged).
* `island_rss`: a real `LearnerSession` island's peak RSS beyond its own weights ÷ the model's bytes.

The wire measures use the real syncer (`python -m syncer` with `benchmarks.ingest`'s timestamp probes)
and M `SyncerClient`s, the link a `LearnerSession` pushes through, driven in this process; pushes go
one at a time so nothing else is on the wire. `island_rss` runs a real `LearnerSession` over a
`LocalStore` in a process of its own against a syncer of its own, for two full rounds and the final
cut. Every figure is printed as it is taken; the table gives each speed as yeto ÷ baseline (1.0 is
the hardware's speed) and each time's growth per doubling of size from 256 MiB up. JSON and a
log-log plot go to `--out`. The last line names the lowest speed ratio at the largest size among
the measures whose baseline is the hardware's own speed (the wire and the disk; a merge makes
M + 3 passes over a fragment, so it is judged by its growth instead):
`worst ratio at SIZE: X (measure)`.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.ingest import Learner, ProbedSyncer, _synthetic_model
from benchmarks.loopback import RawLoopback
from benchmarks.scale_parts import (
    ISLAND_ROLE,
    MIB,
    checkpoint_times,
    first_touch_s,
    merge_times,
    rss_bytes,
    scratch_dir,
)

REPO = Path(__file__).resolve().parents[1]
SPEEDS = {  # measure: (yeto time key, baseline time key, what the baseline is)
    "init": ("init", "raw_init", "raw loopback"),
    "push": ("push", "raw_push", "raw loopback"),
    "fanout": ("fanout", "raw_fanout", "raw loopback"),
    "merge_rda": ("merge_rda", "copy", "memory copy"),
    "merge_average": ("merge_average", "copy", "memory copy"),
    "ckpt_write": ("ckpt_write", "raw_write", "write + fsync"),
    "ckpt_read": ("ckpt_read", "raw_read", "read"),
}
PIPELINE = 2  # the syncer's shipped pipeline depth: rounds in flight at once
SLOPE_FROM = 256 * MIB  # slopes per doubling are judged from this size up


def parse_size(text: str) -> int:
    """'16M', '1G', '512' (MiB) → bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"M": MIB, "G": 1024 * MIB}.get(t[-1:], MIB)
    number = t[:-1] if t[-1:] in ("M", "G") else t
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is not a size like 16M or 4G") from None
    if value < 4 * MIB:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is below 4 MiB")
    return value


def label(nbytes: int) -> str:
    return f"{nbytes // (1024 * MIB)} GiB" if nbytes >= 1024 * MIB else f"{nbytes // MIB} MiB"


# ---------------------------------------------------------------------------------------------
# The wire: INIT, pushes and fan-out through the real syncer
# ---------------------------------------------------------------------------------------------
def _pump_all(learners: list[Learner], done: list[Any], timeout: float, what: str) -> None:
    """Drain every learner's inbox on a thread of its own until its `done[i]()`."""
    errors: queue.SimpleQueue[BaseException] = queue.SimpleQueue()

    def run(i: int) -> None:
        try:
            learners[i].pump(done[i], timeout, f"{what} (learner {i})")
        except BaseException as exc:  # re-raised below, on the caller's thread
            errors.put(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(learners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not errors.empty():
        raise errors.get()


def wire_times(model_bytes: int, m: int, args: argparse.Namespace, raw: RawLoopback, workdir: Path,
               key: bytes, key_file: Path) -> dict[str, Any]:
    """One syncer, M learners: INIT, `--rounds` rounds of M pushes each, their fan-outs, the syncer's peak RSS."""
    from yeto_core.client import PushJob
    from yeto_core.codecs import codec_by_name

    layout, init, delta = _synthetic_model(model_bytes // MIB, args.fragments)
    codec = codec_by_name(args.codec)
    push_bytes = codec.encoded_nbytes(delta.numel())  # the raw baseline sends what a push does
    if args.codec != "f32":  # compile the codec's loops now: a push times its encode, not its compiler
        codec.encode(delta[:4096].contiguous(), memoryview(bytearray(codec.encoded_nbytes(4096))))
    times: dict[str, list[float]] = {k: [] for k in ("push", "raw_push", "fanout", "raw_fanout", "merge_tape",
                                                     "push_cold", "fanout_cold")}
    times["raw_init"] = [raw.transfer(model_bytes)]
    syncer = ProbedSyncer(workdir, key_file, args.fragments, "cpu", learners=m)
    learners: list[Learner] = []
    try:
        for i in range(m):
            learners.append(Learner(syncer.port, key, layout, init if i == 0 else [], args.streams, learner_id=i,
                                    codec=args.codec))
            learners[-1].start()
        p = layout.num_fragments
        _pump_all(learners, [lambda lr=lr: len(lr.bcast_versions) == p and bool(lr.pulls) for lr in learners],
                  600, "the initial cut and the first PULL")
        init_rec = syncer.tape_record(lambda r: r.get("event") == "init", 10)
        assert learners[0].init_started is not None
        times["init"] = [init_rec["t"] - learners[0].init_started]
        learners[0].init = []
        del init  # learner 0 sent it; the syncer's copy is the model from here on
        for round_no in range(args.rounds):
            # The first PIPELINE rounds meet receive buffers no earlier round has freed yet: their
            # pages are new to the process (`first_touch`). Later rounds reuse them, as a run does.
            warm = round_no >= PIPELINE or args.rounds <= PIPELINE
            pulls = [lr.pulls.pop(0) for lr in learners]
            if len({pl.round for pl in pulls}) != 1:
                raise RuntimeError(f"learners were pulled for different rounds: {[pl.round for pl in pulls]}")
            rid, frag, version = pulls[0].round, pulls[0].fragment, pulls[0].version + 1
            for lr, pull in zip(learners, pulls, strict=True):
                time.sleep(0.05)  # the previous transfer's frees and log writes settle
                times["raw_push"].append(raw.transfer(push_bytes))
                time.sleep(0.05)
                job = PushJob(pull, pull.version, tokens=4096, steps=1, step_s=None, delta=delta)
                t_submit = time.time()
                lr.client.submit(job)
                stored = syncer.probe("ingested", rid, 120)
                syncer.probe("delivered", rid, 5)
                if not job.done.wait(30) or job.error:
                    raise RuntimeError(f"push failed: {job.error}")
                if not stored["accepted"]:
                    raise RuntimeError(f"the syncer refused a push of round {rid}:\n{syncer.log_tail()}")
                times["push" if warm else "push_cold"].append(stored["t"] - t_submit)

            def fanned(lr: Learner, frag: int = frag, version: int = version) -> bool:
                return (frag, version) in lr.bcast_at and bool(lr.pulls)

            _pump_all(learners, [lambda lr=lr: fanned(lr) for lr in learners], 600, f"the BCAST of round {rid}")
            commit = syncer.tape_record(lambda r, rid=rid: r.get("event") == "commit" and r.get("round") == rid, 10)
            fanout = max(lr.bcast_at[(frag, version)] for lr in learners) - commit["t"]
            times["fanout" if warm else "fanout_cold"].append(fanout)
            times["merge_tape"].append(commit["merge_ms"] / 1e3)
            time.sleep(0.05)
            times["raw_fanout"].append(raw.transfer(m * delta.numel() * 4))  # broadcasts are f32
        steady_rounds(learners, syncer, delta, args.fragments)
        peak = rss_bytes(syncer.proc.pid, "VmHWM")
    finally:
        for lr in learners:
            lr.client.close("benchmark done")
        syncer.close()
    times["raw_init_fresh"] = [raw.transfer(model_bytes, fresh=True)]
    out: dict[str, Any] = {k: statistics.median(v) for k, v in times.items() if v}
    out["syncer_rss"] = peak / model_bytes
    return out


def steady_rounds(learners: list[Learner], syncer: ProbedSyncer, delta: Any, fragments: int) -> None:
    """Rounds as a run makes them, for the syncer's peak memory: every learner answers every pull it
    holds at once, so the pipeline's rounds are in flight together, until each fragment has
    committed once more (its momentum, which stays untouched zeros until then, is then all written)."""
    from yeto_core.client import PushJob

    def committed() -> int:
        count = 0
        for line in syncer.tape.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                count += json.loads(line).get("event") == "commit"
        return count

    target = committed() + fragments
    deadline = time.monotonic() + 600
    while committed() < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"steady rounds: {committed()} of {target} commits after 600 s:\n{syncer.log_tail()}")
        for lr in learners:
            while lr.pulls:
                pull = lr.pulls.pop(0)
                lr.client.submit(PushJob(pull, pull.version, tokens=4096, steps=1, step_s=None, delta=delta))
        until = time.monotonic() + 0.2
        _pump_all(learners, [lambda lr=lr, until=until: bool(lr.pulls) or time.monotonic() > until
                             for lr in learners], 10, "pulls of the steady rounds")


def island_rss(model_bytes: int, args: argparse.Namespace, workdir: Path, key_file: Path) -> dict[str, Any]:
    """A real `LearnerSession` in its own process for two rounds and the final cut: its extra peak RSS."""
    import subprocess

    # The island's H is P (a boundary every step): the syncer announces it, and the island takes it.
    syncer = ProbedSyncer(workdir, key_file, args.fragments, "cpu", learners=1,
                          extra_args=("--sync-interval-steps", str(args.fragments)))
    out_path = workdir / "island.json"
    log = open(workdir / "island.log", "wb")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale_parts", ISLAND_ROLE, str(syncer.port), str(key_file),
             str(model_bytes), str(args.fragments), str(2 * args.fragments), str(out_path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            rc = proc.wait(timeout=1200)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if rc != 0:
            raise RuntimeError(f"the island exited with {rc}:\n{(workdir / 'island.log').read_text()[-2000:]}")
    finally:
        log.close()
        syncer.close()
    got = json.loads(out_path.read_text())
    if not got["final"] or got["pushes"] < args.fragments:
        raise RuntimeError(f"the island did not finish its rounds: {got['pushes']} pushes, final cut {got['final']}")
    steps = sorted(got["step_s"])
    return {"island_rss": (got["peak_rss"] - got["weights_rss"]) / model_bytes, "island_pushes": got["pushes"],
            "island_step_median": statistics.median(steps)}


# ---------------------------------------------------------------------------------------------
# The run, the table, the plot
# ---------------------------------------------------------------------------------------------
def measure_size(model_bytes: int, args: argparse.Namespace, raw: RawLoopback, tmp: Path, key: bytes,
                 key_file: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"bytes": model_bytes, "first_touch": first_touch_s(model_bytes)}
    frag_numel = model_bytes // 4 // args.fragments
    for m in args.learners:
        need, free = wire_bytes_needed(model_bytes, m, args.fragments, args.codec), available_bytes()
        if need > free:
            say(f"{label(model_bytes)}, M={m}: skipped: the syncer and {m} learners in this process need about "
                f"{need / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB is available")
            continue
        workdir = tmp / f"{model_bytes // MIB}-m{m}"
        workdir.mkdir()
        wire = wire_times(model_bytes, m, args, raw, workdir, key, key_file)
        wire["syncer_rss_planned"] = planned_memory(model_bytes, m, args.fragments, args.codec)[0] / model_bytes
        merge = merge_times(frag_numel, m, args.repeat)
        row[f"m{m}"] = {**wire, **merge}
        say(f"{label(model_bytes)}, M={m}: " + ", ".join(
            f"{name} {ratio(row[f'm{m}'], name):.2f}" for name in ("init", "push", "fanout", "merge_rda"))
            + f", syncer RSS {wire['syncer_rss']:.2f}x the model")
    release_buffers()
    row.update(checkpoint_times(model_bytes, args.fragments, tmp, args.repeat))
    say(f"{label(model_bytes)}: checkpoint write {ratio(row, 'ckpt_write'):.2f}, read {ratio(row, 'ckpt_read'):.2f}")
    syncer_plan, island_plan = planned_memory(model_bytes, 1, args.fragments)
    row["island_rss_planned"] = island_plan / model_bytes
    need, free = syncer_plan + model_bytes + island_plan + (1 << 30), available_bytes()
    if need > free:
        say(f"{label(model_bytes)}: island skipped: it and its syncer need about {need / 2**30:.1f} GiB, and "
            f"{free / 2**30:.1f} GiB is available")
        return row
    island_dir = tmp / f"{model_bytes // MIB}-island"
    island_dir.mkdir()
    row.update(island_rss(model_bytes, args, island_dir, key_file))
    say(f"{label(model_bytes)}: island RSS beyond its weights {row['island_rss']:.2f}x the model "
        f"(yeto-plan: {row['island_rss_planned']:.2f}x)")
    return row


def release_buffers() -> None:
    """Give back what the M in-process learners' receive pool kept, before the next phase's memory."""
    import gc

    from yeto_core.buffers import RECEIVE_POOL

    gc.collect()
    RECEIVE_POOL.clear()


def wire_bytes_needed(model_bytes: int, m: int, fragments: int, codec: str = "f32") -> float:
    """What the wire phase holds at its peak, the larger of two moments, each with the M learners'
    receive buffers (two fragments each) and 1 GiB for the runtimes and the raw loopback's ring:
    the INIT, when the model learner 0 uploads from and the syncer's copy of it coexist, and the
    steady rounds, once that model is let go, with the syncer as yeto-plan sizes it and 10% more
    (the plan's error measured here; running out of memory would end the whole benchmark)."""
    frag = model_bytes / fragments
    beside = 2 * m * frag + (1 << 30)
    return max(2 * model_bytes, 1.1 * planned_memory(model_bytes, m, fragments, codec)[0]) + beside


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def planned_memory(model_bytes: int, m: int, fragments: int, codec: str = "f32") -> tuple[float, float]:
    """yeto-plan's syncer memory at M learners and an island's beyond its weights, for this run's
    synthetic model, pushes in `codec` and f32 broadcasts, the shipped pipeline (`syncer.tools.plan`)."""
    from benchmarks.scale_parts import synthetic_specs
    from syncer.tools.plan import (
        Choice,
        Island,
        Model,
        Setup,
        SyncerHost,
        Tensor,
        fragment_params,
        island_memory,
        syncer_memory,
    )

    tensors = tuple(Tensor(s.name, math.prod(s.shape)) for s in synthetic_specs(model_bytes, fragments))
    model = Model("synthetic", tensors, sum(t.numel for t in tensors))
    setup = Setup(model=model, islands=(Island(1e9, 1e9, 1.0),) * m, quorum=m, host=SyncerHost(memory_bytes=1e15))
    choice = Choice(sync_interval=fragments, codec=codec, downlink="f32", fragments=fragments, pipeline=PIPELINE)
    sizes = fragment_params(model, fragments, "binpack")
    return syncer_memory(setup, choice, sizes).total, island_memory(choice, sizes).total


def ratio(times: dict[str, Any], measure: str) -> float:
    """yeto's speed ÷ the baseline's (baseline time ÷ yeto time); 1.0 is the baseline's speed."""
    ours, base, _ = SPEEDS[measure]
    return float(times[base] / times[ours])


def speeds(row: dict[str, Any], learners: list[int]) -> dict[str, float]:
    """Every speed ratio of one size, named `measure` or `measure@M`."""
    out = {name: ratio(row, name) for name in ("ckpt_write", "ckpt_read")}
    for m in (m for m in learners if f"m{m}" in row):
        for name in ("init", "push", "fanout", "merge_rda", "merge_average"):
            out[f"{name}@M{m}"] = ratio(row[f"m{m}"], name)
    return out


def yeto_times(row: dict[str, Any], learners: list[int]) -> dict[str, float]:
    out = {name: float(row[name]) for name in ("ckpt_write", "ckpt_read")}
    for m in (m for m in learners if f"m{m}" in row):
        for name in ("init", "push", "fanout", "merge_rda", "merge_average"):
            out[f"{name}@M{m}"] = float(row[f"m{m}"][name])
    return out


def slopes(rows: list[dict[str, Any]], learners: list[int]) -> dict[str, float]:
    """Each time's largest growth per doubling of size between successive sizes from SLOPE_FROM up."""
    out: dict[str, float] = {}
    big = [r for r in rows if r["bytes"] >= SLOPE_FROM]
    for a, b in itertools.pairwise(big):
        doublings = math.log2(b["bytes"] / a["bytes"])
        ta, tb = yeto_times(a, learners), yeto_times(b, learners)
        for name in ta.keys() & tb.keys():
            out[name] = max(out.get(name, 0.0), (tb[name] / ta[name]) ** (1 / doublings))
    return out


def plot(rows: list[dict[str, Any]], learners: list[int], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(dict.fromkeys(name for r in rows for name in yeto_times(r, learners)))
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(names) / cols), cols, figsize=(4 * cols, 3.2 * math.ceil(len(names) / cols)),
                             squeeze=False)
    sizes = [r["bytes"] / MIB for r in rows]
    for ax, name in zip(axes.flat, names, strict=False):
        measure, _, m = name.partition("@M")
        _, base_key, base_name = SPEEDS[measure]
        have = [(size, r) for size, r in zip(sizes, rows, strict=True) if name in yeto_times(r, learners)]
        xs = [size for size, _ in have]
        ax.loglog(xs, [yeto_times(r, learners)[name] for _, r in have], "o-", label="yeto")
        ax.loglog(xs, [float(r[f"m{m}"][base_key] if m else r[base_key]) for _, r in have], "s--", label=base_name)
        ax.set_title(name.replace("@", ", "), fontsize=9)
        ax.set_xlabel("model MiB (f32)", fontsize=8)
        ax.set_ylabel("seconds", fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def say(text: str) -> None:
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                    default=[parse_size(x) for x in ["16M", "64M", "256M", "1G", "4G"]],
                    help="model sizes of f32 weights, comma-separated (default 16M,64M,256M,1G,4G)")
    ap.add_argument("--learners", type=int, nargs="+", default=[2, 4], help="M, one run each (default 2 4)")
    ap.add_argument("--fragments", type=int, default=8, help="P (default 8)")
    ap.add_argument("--streams", type=int, default=2, help="data streams, and raw streams (default 2)")
    ap.add_argument("--rounds", type=int, default=4, help="push rounds per syncer; the first 2 are reported "
                    "apart, as cold (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each in-process measure, the median kept "
                    "(default 3)")
    ap.add_argument("--out", type=Path, default=Path("scale-out"), help="where JSON and the plot go")
    ap.add_argument("--codec", default="f32", choices=["f32", "bf16", "int8", "int4", "e3m0", "int4-log", "int2"],
                    help="the M learners' push codec (default f32, the shipped one); the raw baseline sends "
                    "the same bytes, and the island and the in-process merges stay f32")
    ap.add_argument("--quick", action="store_true", help="4 and 16 MiB, M = 2, one round: a smoke test")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.learners, args.rounds, args.repeat = [4 * MIB, 16 * MIB], [2], 1, 1
    if min(args.learners) < 1 or args.fragments < 1 or args.streams < 1 or args.rounds < 1 or args.repeat < 1:
        ap.error("every count must be >= 1")
    args.sizes = sorted(set(args.sizes))
    args.out.mkdir(parents=True, exist_ok=True)
    import tqdm  # noqa: F401 - the client imports it lazily inside the timed INIT upload; pay that here

    t_begin = time.monotonic()
    say(f"yeto at scale: sizes {', '.join(label(s) for s in args.sizes)}, M = {args.learners}, P = {args.fragments}, "
        f"{args.codec} pushes, {args.streams} streams, {os.cpu_count()} cores")
    rows: list[dict[str, Any]] = []
    raw = RawLoopback(max(args.sizes) * max(args.learners), args.streams)
    try:
        with scratch_dir("yeto-scale-") as tmp_dir:
            tmp = Path(tmp_dir)
            key = os.urandom(16).hex().encode()
            key_file = tmp / "key"
            key_file.write_bytes(key)
            for size in args.sizes:
                rows.append(measure_size(size, args, raw, tmp, key, key_file))
    finally:
        raw.close()
    return report(rows, args, time.monotonic() - t_begin)


def _line(name: str, values: list[float | None], tail: str = "") -> None:
    say(f"{name:<22}" + "".join(f"{'-':>10}" if v is None else f"{v:>10.2f}" for v in values) + tail)


def report(rows: list[dict[str, Any]], args: argparse.Namespace, elapsed: float) -> int:
    table = [speeds(r, args.learners) for r in rows]
    names = list(dict.fromkeys(name for t in table for name in t))
    say(f"\nspeed ÷ baseline (1.0 = the baseline's speed), {elapsed:.0f} s in all")
    say(f"{'measure':<22}" + "".join(f"{label(r['bytes']):>10}" for r in rows) + f"{'per 2x':>9}")
    grow = slopes(rows, args.learners)
    for name in names:
        _line(name, [t.get(name) for t in table], f"{grow[name]:>9.2f}" if name in grow else "")
    wire = {m: [r.get(f"m{m}") for r in rows] for m in args.learners}
    ref = next((r for r in rows if r["bytes"] == SLOPE_FROM), None)
    for m, cells in wire.items():  # the goal: no superlinear merge, judged per byte against 256 MiB
        base = ref and ref.get(f"m{m}")
        if base:
            per_byte = base["merge_rda"] / ref["bytes"]
            per_size = [c["merge_rda"] / r["bytes"] / per_byte if c else None for r, c in zip(rows, cells, strict=True)]
            _line(f"merge_rda@M{m} s/B", per_size, "   (÷ its time per byte at 256 MiB)")
    for m, cells in wire.items():
        _line(f"push_cold@M{m}", [c["raw_push"] / c["push_cold"] if c and "push_cold" in c else None for c in cells])
    for m, cells in wire.items():
        _line(f"init_fresh@M{m}", [c["raw_init_fresh"] / c["init"] if c and "raw_init_fresh" in c else None
                                   for c in cells], "   (÷ raw loopback into memory new to the receiver)")
    for m, cells in wire.items():
        _line(f"syncer_rss@M{m} (x)", [c["syncer_rss"] if c else None for c in cells], "   (peak RSS ÷ model bytes)")
        _line("  yeto-plan says", [c["syncer_rss_planned"] if c else None for c in cells])
    _line("island_rss (x)", [r.get("island_rss") for r in rows], "   (peak RSS beyond the weights ÷ model bytes)")
    _line("  yeto-plan says", [r["island_rss_planned"] for r in rows])
    _line("first touch GB/s", [r["bytes"] / r["first_touch"] / 1e9 for r in rows], "   (fresh memory, a write a page)")
    m0 = args.learners[0]
    _line("raw loopback GB/s", [r["bytes"] / c["raw_init"] / 1e9 if c else None for r, c in zip(rows, wire[m0],
                                                                                                strict=True)])
    doc = {"sizes": [r["bytes"] for r in rows], "learners": args.learners, "fragments": args.fragments,
           "codec": args.codec, "rows": rows, "speeds": table, "slopes_per_doubling": grow, "seconds": elapsed}
    (args.out / "scale.json").write_text(json.dumps(doc, indent=1))
    if plot(rows, args.learners, args.out / "scale.png"):
        say(f"wrote {args.out / 'scale.json'} and {args.out / 'scale.png'}")
    else:
        say(f"wrote {args.out / 'scale.json'} (no plot: matplotlib is not installed)")
    last = {k: v for k, v in speeds(rows[-1], args.learners).items() if not k.startswith("merge")}
    worst = min(last, key=last.__getitem__)
    baseline = SPEEDS[worst.partition("@")[0]][2]
    say(f"worst ratio at {label(rows[-1]['bytes'])}: {last[worst]:.2f} ({worst} ÷ {baseline})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
