"""Smoke test of the Megatron island fixture: real megatron-core islands on 4 gloo CPU ranks.

Each layout trains 3 steps with bf16 params and fp32 masters in the DistributedOptimizer; the
loss must fall, every last-stage rank must report the same island loss, and DP replicas must
hold bit-identical parameters. A TP2×DP2 island must also match one rank training the same
global batch (fp32, so the comparison is tight).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")

from launch import run_ranks

WORKER = Path(__file__).with_name("fixture_worker.py")
DEADLINE_S = 120.0  # per launch; a 4-rank run takes ~11 s on 2 cores


def train(spec: dict[str, Any], world_size: int = 4, steps: int = 3) -> list[dict[str, Any]]:
    results = run_ranks(WORKER, world_size, args=[json.dumps(spec), str(steps)], timeout_s=DEADLINE_S)
    return [r.result for r in results if r.result is not None]


def island_losses(reports: list[dict[str, Any]]) -> list[float]:
    """The losses every last-stage rank reported; asserts they are all the same."""
    last = [r["losses"] for r in reports if r["losses"][0] is not None]
    assert last, "no rank reported a loss"
    assert all(losses == last[0] for losses in last), last
    return last[0]


LAYOUTS = {
    "tp2-dp2": ({"tp": 2}, {"dp_size": 2}, ["DistributedOptimizer"]),
    "tp2-pp2": ({"tp": 2, "pp": 2}, {"dp_size": 1}, ["DistributedOptimizer"]),
    # Dense params over DP 4, experts over expert-DP 2: one DistributedOptimizer for each.
    "ep2-moe": ({"ep": 2, "experts": 4}, {"dp_size": 4, "expert_dp_size": 2}, ["DistributedOptimizer"] * 2),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_island_trains(layout: str) -> None:
    spec, sizes, optimizers = LAYOUTS[layout]
    reports = train(spec)
    for report in reports:
        assert {k: report[k] for k in sizes} == sizes, report
        assert report["optimizers"] == optimizers
        assert report["param_dtypes"] == ["torch.bfloat16"]
        assert report["master_dtypes"] == ["torch.float32"]
        assert report["update_successful"]
    losses = island_losses(reports)
    assert losses[-1] < losses[0], losses
    replicas: dict[tuple[int, int, int], set[str]] = {}
    for report in reports:
        replicas.setdefault((report["tp"], report["pp"], report["ep"]), set()).add(report["param_digest"])
    assert all(len(digests) == 1 for digests in replicas.values()), replicas


@pytest.mark.timeout(180)
def test_tp2_dp2_matches_one_rank() -> None:
    spec = {"bf16": False, "micro_batches": 2}
    island = island_losses(train({**spec, "tp": 2}))
    # One rank with twice the microbatches trains on the same global batch.
    single = island_losses(train({**spec, "micro_batches": 4}, world_size=1))
    assert island == pytest.approx(single, abs=1e-5)
