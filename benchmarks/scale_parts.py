"""The in-process measures of `benchmarks.scale`, and the island it runs in a process of its own.

* `merge_times`: one round's `merge_round` (as the coordinator calls it) for `rda` and `average`,
  beside `Tensor.copy_` of the same fragment: the memory-speed baseline.
* `checkpoint_times`: `save_checkpoint` of a syncer state beside `write` + `fsync` of the same bytes
  from the same tensors into a new file that replaces the last (as the checkpoint's does), and
  `load_checkpoint` beside `readinto` of the same file into fresh memory (a resuming syncer's
  memory is new too). Each file is dropped from the page cache (`posix_fadvise DONTNEED`) before
  it is read, so both reads come from the disk. Each side's best of `repeat` runs, ABBA order.
* `first_touch_s`: writing one byte per page of fresh memory of a given size: what the machine
  charges for memory a process has not used before (INIT must fill the syncer's new state).
* `island_role`: a real `LearnerSession` over a `LocalStore` of synthetic weights, run for a few
  rounds against the benchmark's syncer; it reports its peak RSS beyond the weights it holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MIB = 1 << 20
TENSORS_PER_FRAGMENT = 4


def rss_bytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """A process's resident set (VmRSS) or its peak (VmHWM), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def synthetic_specs(model_bytes: int, fragments: int) -> list[Any]:
    """Equal float32 tensors, four per fragment, so binpack makes P equal fragments."""
    from yeto_core.layout import TensorSpec

    tensors = TENSORS_PER_FRAGMENT * fragments
    numel = model_bytes // 4 // tensors
    if numel < 1:
        raise SystemExit(f"{model_bytes} bytes is too small for {fragments} fragments")
    return [TensorSpec(f"blocks.{i}.weight", (numel,), "float32") for i in range(tensors)]


def best_of(run: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` runs after one untimed warm-up."""
    run()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# Merge
# ---------------------------------------------------------------------------------------------
def merge_times(numel: int, learners: int, repeat: int) -> dict[str, float]:
    """Seconds of one fragment's merge of `learners` answers, RDA and average, and of a copy."""
    from syncer.core.rounds import Answer
    from syncer.merge.merge import Segment
    from syncer.merge.outer import Nesterov
    from syncer.merge.round_merge import MergeWorkspace, merge_round

    g = torch.Generator().manual_seed(learners)
    answers = [Answer(lid, 1, tokens=1000 + lid, steps=8, delta=torch.randn(numel, generator=g).mul_(1e-3),
                      base_version=0) for lid in range(learners)]
    params, momentum = torch.randn(numel, generator=g), torch.zeros(numel)
    outer = Nesterov(lr=0.7, momentum=0.5)
    tensor = numel // TENSORS_PER_FRAGMENT  # the synthetic model's tensors: a segment each
    out: dict[str, float] = {}
    for method in ("rda", "average"):
        segments = [Segment(off, min(tensor, numel - off), rda=method == "rda") for off in range(0, numel, tensor)]
        workspace = MergeWorkspace()

        def merge(segments: list[Any] = segments, workspace: Any = workspace) -> None:
            merged = merge_round(answers, params=params, momentum=momentum, outer_state={}, segments=segments,
                                 outer=outer, heloco=None, threads=1, workspace=workspace)
            assert not merged.overflowed

        out[f"merge_{method}"] = best_of(merge, repeat)
        del workspace
    target = torch.empty(numel)
    out["copy"] = best_of(lambda: target.copy_(params), repeat)
    return out


def first_touch_s(nbytes: int) -> float:
    """Seconds to fault in `nbytes` of fresh anonymous memory, allocated as yeto's pooled buffers
    are (`fresh_array`, advised for huge pages), one write per page."""
    from yeto_core.buffers import fresh_array

    t0 = time.perf_counter()
    block = fresh_array(nbytes)
    block[:: os.sysconf("SC_PAGE_SIZE")] = 1
    took = time.perf_counter() - t0
    del block
    return took


# ---------------------------------------------------------------------------------------------
# Checkpoint
# ---------------------------------------------------------------------------------------------
def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_write(path: Path, tensors: list[torch.Tensor], chunk: int = 16 * MIB) -> None:
    """`write` + `fsync` of the tensors' bytes into a new file that then replaces `path`: what any
    save that survives a crash must do, and what the checkpoint does. (Truncating `path` and
    writing it again instead measured up to 4x faster or slower than a new file here, as the
    disk, which discards freed blocks, happened to reuse them or not: no baseline.)"""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for t in tensors:
            raw = t.view(torch.uint8).numpy().data
            for start in range(0, len(raw), chunk):
                f.write(raw[start : start + chunk])
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _raw_read(path: Path, sizes: list[int]) -> None:
    """Read the file back into fresh buffers of `sizes` values, as a resume must (its memory is new)."""
    with open(path, "rb", buffering=0) as f:
        for numel in sizes:
            view = torch.empty(numel).view(torch.uint8).numpy().data
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise RuntimeError(f"{path} ended early")
                got += n


def _synthetic_state(model_bytes: int, fragments: int) -> Any:
    from syncer.durability.checkpoint import SyncerState
    from yeto_core.layout import build_layout

    specs = synthetic_specs(model_bytes, fragments)
    layout = build_layout(specs, fragments, "binpack")
    g = torch.Generator().manual_seed(0)
    return SyncerState(specs=specs, num_fragments=fragments, pattern="binpack", fingerprint=layout.fingerprint,
                       backend="rda", params=[torch.rand(f.numel, generator=g) for f in layout.fragments],
                       momentum=[torch.rand(f.numel, generator=g) for f in layout.fragments], versions=[1] * fragments,
                       next_round=fragments, ledger={"0:1": 1000})


def _timed(times: dict[str, list[float]], name: str, run: Callable[[], object]) -> None:
    t0 = time.perf_counter()
    run()
    times.setdefault(name, []).append(time.perf_counter() - t0)


def _write_both(state: Any, ours: Path, plain: Path, repeat: int, times: dict[str, list[float]]) -> list[int]:
    """Alternated, so both see the same disk and the same page cache; the tensors' sizes back."""
    from syncer.durability.checkpoint import save_checkpoint

    tensors = [*state.params, *state.momentum]
    for i in range(repeat):  # ABBA order: neither is always the one that follows the other's writes
        for name in ("raw_write", "ckpt_write") if i % 2 == 0 else ("ckpt_write", "raw_write"):
            if name == "raw_write":
                _timed(times, name, lambda: _raw_write(plain, tensors))
            else:
                _timed(times, name, lambda: save_checkpoint(ours, state))
    return [t.numel() for t in tensors]


def checkpoint_times(model_bytes: int, fragments: int, directory: Path, repeat: int) -> dict[str, float]:
    """Seconds to save and load a syncer checkpoint of `model_bytes` of params (and as many of
    momentum), beside writing + fsyncing and reading the same bytes plainly. The state is freed
    before the reads, so at most one full copy of it is held at a time (a loaded one is dropped
    before the next read). The best of `repeat` runs of each."""
    from syncer.durability.checkpoint import load_checkpoint

    ours, plain = directory / "state.safetensors", directory / "plain.bin"
    times: dict[str, list[float]] = {}
    try:
        state = _synthetic_state(model_bytes, fragments)
        fingerprint = state.fingerprint
        sizes = _write_both(state, ours, plain, repeat, times)
        del state
        for i in range(repeat):  # ABBA again, each read from a cold page cache
            for name in ("raw_read", "ckpt_read") if i % 2 == 0 else ("ckpt_read", "raw_read"):
                if name == "raw_read":
                    _drop_cache(plain)
                    _timed(times, name, lambda: _raw_read(plain, sizes))
                else:
                    _drop_cache(ours)
                    _timed(times, name, lambda: load_checkpoint(ours, expect_fingerprint=fingerprint))
    finally:
        for p in (ours, plain):
            p.unlink(missing_ok=True)
    # The best of the runs, each side: this disk's noise only ever adds time (the same 2 GiB write
    # took 1.2 to 6 s in one minute, whichever way it was written), so a median of three would
    # compare the noise.
    return {k: min(v) for k, v in times.items()}


# ---------------------------------------------------------------------------------------------
# The island, in its own process
# ---------------------------------------------------------------------------------------------
ISLAND_ROLE = "__scale_island__"


def island_role(port: int, key_file: str, model_bytes: int, fragments: int, steps: int, out: str) -> int:
    """A `LearnerSession` (learner 0, f32 pushes, the shipped settings) over synthetic weights:
    `steps` steps, each nudging one tensor in place as an optimizer would, then the final cut.
    Lockstep, so that steps far faster than the wire still push every fragment once a round.
    Writes its peak RSS beyond the weights and the seconds each `step` call took."""
    from yeto_core.learner import LearnerSession
    from yeto_core.settings import LearnerSettings

    specs = synthetic_specs(model_bytes, fragments)
    g = torch.Generator().manual_seed(1)
    named = [(s.name, torch.rand(s.shape, generator=g)) for s in specs]
    weights_rss = rss_bytes()  # interpreter + torch + the weights, every page written
    settings = LearnerSettings(syncer=f"127.0.0.1:{port}", key_file=Path(key_file), learner_id=0,
                               sync_interval=fragments, lockstep=True)
    session = LearnerSession(settings, named, say=lambda message: None)
    in_step: list[float] = []
    try:
        session.start()
        for step in range(steps):
            named[step % len(named)][1].add_(1e-4)
            t0 = time.perf_counter()
            session.step(tokens=4096)
            in_step.append(time.perf_counter() - t0)
        final = session.finish()
    finally:
        session.close()
    Path(out).write_text(json.dumps({
        "weights_rss": weights_rss, "peak_rss": rss_bytes(field="VmHWM"), "step_s": in_step, "final": final,
        "pushes": session.stats.pushes, "installs": session.stats.installs,
    }))
    return 0


def scratch_dir(prefix: str) -> contextlib.AbstractContextManager[str]:
    """A temporary directory on the disk the benchmark runs from (not a RAM-backed /tmp)."""
    base = os.environ.get("YETO_SCALE_DIR") or None
    return tempfile.TemporaryDirectory(prefix=prefix, dir=base)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == ISLAND_ROLE:
    a = sys.argv[2:]
    sys.exit(island_role(int(a[0]), a[1], int(a[2]), int(a[3]), int(a[4]), a[5]))
