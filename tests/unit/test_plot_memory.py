"""`yeto-plot` streams the tape: its memory does not grow with the tape's length. Ten times the
rounds, the same peak RSS within matplotlib's noise (the pictures differ, and so does what drawing
them takes: ±15 MiB here), and the same Python allocations while reading within a few KiB
(`benchmarks/plot_tape.py` measures a 1 GB tape)."""

from __future__ import annotations

import json
import random
import sys
import tracemalloc
from pathlib import Path

import pytest
from peak_rss import run_measured

from syncer.tools import plot_account
from syncer.tools.plot_account import read_account

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]
LEARNERS, FRAGMENTS = 4, 4


def write_tape(path: Path, rounds: int) -> int:
    """A tape of `rounds` launch and commit records shaped as `syncer/core/commit.py` writes them; its size."""
    rng = random.Random(0)
    ids = list(range(LEARNERS))
    with path.open("w") as f:
        for r in range(rounds):
            t, version = 1.7e9 + 0.5 * r, r // FRAGMENTS + 1
            tokens = [4096 * rng.randint(20, 24) for _ in ids]
            f.write(json.dumps({"event": "launch", "round": r, "attempt": r + 1, "fragment": r % FRAGMENTS,
                                "version": version - 1, "members": ids, "quorum": LEARNERS, "t": t}) + "\n")
            f.write(json.dumps({
                "event": "commit", "round": r, "attempt": r + 1, "fragment": r % FRAGMENTS, "version": version,
                "learners": ids, "generations": [1] * LEARNERS, "answered": ids, "carried": [], "waited_for": [],
                "not_waited_for": [], "dropped": [],
                "base_versions": [max(version - 1 - rng.randint(0, 1), 0) for _ in ids],
                "grace_ms": round(rng.uniform(0, 50), 1), "weights": [n / sum(tokens) for n in tokens],
                "tokens": tokens, "steps": [24] * LEARNERS, "delta_norms": [rng.uniform(0.5, 2) for _ in ids],
                "outer_grad_norm": rng.uniform(0.5, 2), "merge_ms": rng.uniform(20, 40),
                "wait_ms": rng.uniform(100, 400), "reason": "quorum", "consensus_js": rng.uniform(0.01, 0.1),
                "consensus_learners": ids, "fragment_l2": [1.0] * FRAGMENTS, "t": t + 0.45}) + "\n")
    return path.stat().st_size


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux")
def test_peak_rss_does_not_grow_with_the_tapes_length(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rss = {}
    for rounds in (1_000, 10_000):
        tape = tmp_path / f"tape-{rounds}.jsonl"
        size = write_tape(tape, rounds)
        code, err, _, rss[rounds] = run_measured([sys.executable, "-m", "syncer.tools.plot", str(tape), "--out",
                                                  str(tmp_path / f"plots-{rounds}")], ROOT)
        assert code == 0, err
        assert rounds < 10_000 or size > 8_000_000
    # Before streaming, the tool held every record and an artist per commit: ~48 KiB a round, 420 MiB here.
    assert rss[10_000] - rss[1_000] < 24 << 20, {k: v >> 20 for k, v in rss.items()}
    assert rss[10_000] < 400 << 20, rss


def test_reading_allocates_the_same_whatever_the_tapes_length(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plot_account, "POINTS", 64)  # every series full at the shorter tape too
    peak = {}
    for rounds in (500, 5_000):
        tape = tmp_path / f"tape-{rounds}.jsonl"
        write_tape(tape, rounds)
        tracemalloc.start()
        try:
            account = read_account(tape)
            peak[rounds] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert account.commits == rounds
    assert abs(peak[5_000] - peak[500]) < 16 << 10 and peak[5_000] < 1 << 20, peak
