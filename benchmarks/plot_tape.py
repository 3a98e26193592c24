"""`yeto-plot` on a long tape: its peak RSS and wall time, which must not grow with the tape's length.

    python -m benchmarks.plot_tape                  # a ~1 GB tape (1.1M rounds, 4 learners, 4 fragments)
    python -m benchmarks.plot_tape --mb 100 --learners 8 --keep DIR

Writes a synthetic tape of the records a syncer writes per round (`launch`, then `commit` with
every field `syncer/core/commit.py` and the consensus add, a `carry` now and then, a `join` per
learner first), runs `python -m syncer.tools.plot` on it in a subprocess, and prints the tape's size
and rounds, the tool's wall time and its peak RSS (`getrusage(RUSAGE_CHILDREN).ru_maxrss`: the
child is the only one this process waits for).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = 1.7e9  # unix seconds the synthetic run starts at


def round_records(r: int, learners: int, fragments: int, rng: random.Random) -> list[dict[str, object]]:
    """The launch and commit records of round `r` (and a carry every 50th round), as a syncer writes them."""
    t = T0 + 0.5 * r
    f = r % fragments
    version = r // fragments + 1
    ids = list(range(learners))
    tokens = [4096 * rng.randint(20, 24) for _ in ids]
    total = sum(tokens)
    launch = {"event": "launch", "round": r, "attempt": r + 1, "fragment": f, "version": version - 1, "members": ids,
              "quorum": learners, "reason": "paced", "t": t}
    commit = {"event": "commit", "round": r, "attempt": r + 1, "fragment": f, "version": version, "learners": ids,
              "generations": [1] * learners, "answered": ids, "carried": [], "waited_for": [], "not_waited_for": [],
              "dropped": [], "base_versions": [max(version - 1 - rng.randint(0, 1), 0) for _ in ids],
              "grace_ms": round(rng.uniform(0, 50), 1), "weights": [round(n / total, 6) for n in tokens],
              "tokens": tokens, "steps": [24] * learners,
              "delta_norms": [round(rng.uniform(0.5, 2.0), 6) for _ in ids],
              "outer_grad_norm": rng.uniform(0.5, 2.0), "merge_ms": round(rng.uniform(20, 40), 3),
              "wait_ms": round(rng.uniform(100, 400), 1), "reason": "quorum",
              "consensus_js": round(rng.uniform(0.01, 0.1), 6), "consensus_learners": ids,
              "fragment_l2": [round(rng.uniform(0.5, 2.0), 6) for _ in range(fragments)], "t": t + 0.45}
    records: list[dict[str, object]] = [launch, commit]
    if r % 50 == 7:
        records.insert(1, {"event": "carry", "learner": r % learners, "round": r, "fragment": f,
                           "base_version": version - 2, "reason": "late", "t": t + 0.3})
    return records


def write_tape(path: Path, *, rounds: int | None = None, size: int | None = None, learners: int = 4,
               fragments: int = 4, seed: int = 0) -> int:
    """Write a tape of `rounds` rounds, or of about `size` bytes; returns the rounds written."""
    rng = random.Random(seed)
    written = r = 0
    with path.open("w") as f:
        for lid in range(learners):
            f.write(json.dumps({"event": "join", "learner": lid, "generation": 1, "t": T0 - 1}, sort_keys=True) + "\n")
        while (rounds is not None and r < rounds) or (size is not None and written < size):
            records = round_records(r, learners, fragments, rng)
            chunk = "".join(json.dumps(rec, sort_keys=True) + "\n" for rec in records)
            f.write(chunk)
            written += len(chunk)
            r += 1
    return r


def plot(tape: Path, out: Path) -> tuple[subprocess.CompletedProcess[str], float, int]:
    """Run yeto-plot on `tape` in a subprocess: the result, its wall seconds and peak RSS in bytes."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "syncer.tools.plot", str(tape), "--out", str(out)],
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    return done, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=1000.0, help="tape size in MB (10^6 bytes)")
    p.add_argument("--learners", type=int, default=4)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--keep", type=Path, help="write the tape and plots here instead of a temporary directory")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        tape = where / "tape.jsonl"
        started = time.perf_counter()
        rounds = write_tape(tape, size=int(args.mb * 1e6), learners=args.learners, fragments=args.fragments)
        print(f"tape: {tape.stat().st_size / 1e6:.0f} MB, {rounds} committed rounds, {args.learners} learners, "
              f"{args.fragments} fragments (written in {time.perf_counter() - started:.0f} s)")
        done, wall, rss = plot(tape, where / "plots")
        if done.returncode != 0:
            print(f"yeto-plot failed ({done.returncode}): {done.stderr.strip()}")
            return 1
        print(done.stdout.strip())
        print(f"yeto-plot: {wall:.1f} s wall ({wall / rounds * 1e6:.1f} µs per round), peak RSS {rss / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
