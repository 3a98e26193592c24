"""HF islands of several processes: DDP under torchrun (gloo, CPU) against the real syncer, and
FSDP2 islands (`fully_shard`) whose reads and writes must be exact (DESIGN §1.3, §1.4)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    EXAMPLE,
    ROOT,
    TINY_MODEL,
    Procs,
    assert_bit_identical,
    checkpoint_params,
    learner_env,
    model_dir,
    model_tensors,
    start_syncer,
    syncer_exit_code,
    tails,
    wait_all,
)

pytestmark = pytest.mark.integration


def start_ddp_island(procs: Procs, syncer_address: str, key_file: Path, learner_id: int, *, ranks: int,
                     max_steps: int, **settings: object) -> object:
    out_dir = procs.workdir / f"island{learner_id}-model"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            str(EXAMPLE), "--output-dir", str(out_dir), "--max-steps", str(max_steps), *TINY_MODEL]
    env = learner_env(syncer_address, key_file, learner_id, collective_timeout_s=60, **settings)
    env["OMP_NUM_THREADS"] = "1"
    return procs.start(f"island{learner_id}", argv, env=env, output_dir=out_dir)


def two_ddp_islands(procs: Procs, key_file: Path, **settings: object) -> tuple[list[Any], dict[str, Any],
                                                                               list[dict[str, Any]]]:
    """Two islands of two DDP ranks against a syncer of 16 rounds, run to the end: the islands, the
    final checkpoint's tensors and the tape's commits."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, total_rounds=16)
    islands = [start_ddp_island(procs, syncer.address, key_file, n, ranks=2, max_steps=2000, **settings)
               for n in range(2)]
    codes = wait_all(islands, 240)  # type: ignore[arg-type]
    assert codes == [0, 0], tails(islands)  # type: ignore[arg-type]
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    return islands, checkpoint_params(syncer.checkpoint), syncer.commits()


@pytest.mark.timeout(300)
def test_two_ddp_islands_of_two_ranks_end_with_the_syncers_final_weights(procs: Procs, key_file: Path) -> None:
    islands, final, commits = two_ddp_islands(procs, key_file, consensus_every=1)
    assert len(commits) == 16 and {tuple(c["learners"]) for c in commits} <= {(0, 1), (1, 0), (0,), (1,)}
    for n, island in enumerate(islands):
        said = [line for line in island.stderr().splitlines() if "final cut installed at step" in line]  # type: ignore[attr-defined]
        assert len(said) == 1, f"island {n}: the final-cut line once per island, not per rank: {said}"
        weights = island.events("weights")  # type: ignore[attr-defined]
        assert sorted(w["rank"] for w in weights) == [0, 1], f"island {n}: {weights}"
        assert all(w["final_cut"] for w in weights), f"island {n}: a rank did not install the final cut"
        assert len({w["sha256"] for w in weights}) == 1, f"island {n}: its ranks hold different weights"
        assert len({w["steps"] for w in weights}) == 1, f"island {n}: its ranks stopped at different steps"
        # Rank 0 saved the model; the ranks hold the same bits, so every rank holds the syncer's.
        assert_bit_identical(model_tensors(model_dir(island)), final, f"island {n}")  # type: ignore[arg-type]
    # Both islands probed (every rank ran the forward pass), so the syncer compared them.
    compared = [c for c in commits if c.get("consensus_js") is not None]
    assert compared and all(sorted(c["consensus_learners"]) == [0, 1] for c in compared), commits


FSDP_WORKER = ROOT / "tests" / "integration" / "fsdp_worker.py"


@pytest.mark.timeout(200)
def test_an_fsdp2_island_reads_and_writes_exactly_and_matches_one_process(procs: Procs, key_file: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "mcore"))
    from launch import run_ranks

    exact = run_ranks(FSDP_WORKER, 2, args=["exact"], timeout_s=120)
    for r in exact:
        assert r.result is not None and r.result["problems"] == [], r.result
    # The same deterministic schedule (a lone learner, the syncer's rounds paced to its steps) run
    # by a 2-rank FSDP2 island and by one process must end at the same weights.
    finals = {}
    for world in (2, 1):
        syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=3, total_rounds=9,
                              tape_name=f"tape{world}.jsonl", checkpoint_name=f"final{world}.safetensors",
                              extra=["--sync-interval-steps", "6"])  # the worker's H
        env = learner_env(syncer, key_file, 0, collective_timeout_s=60)
        ranks = run_ranks(FSDP_WORKER, world, args=["train"], env=env, timeout_s=150)
        assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
        assert all(r.result is not None and r.result["final"] and r.result["problems"] == [] for r in ranks), [
            r.result for r in ranks]
        assert syncer.checkpoint is not None
        finals[world] = checkpoint_params(syncer.checkpoint)
    for name, value in finals[1].items():
        assert (finals[2][name] - value).abs().max() < 1e-5, f"{name}: FSDP2 island and one process differ"


@pytest.mark.timeout(120)
def test_an_islands_ranks_share_the_optimizers_moment_together() -> None:
    """DESIGN §3.9 on an island of two ranks: rank 0 reads the whole first moment (FSDP2's shards
    all-gathered, DDP's replica its own), and the fleet's moment it folds in reaches every rank's
    shard or replica, so the replicas stay equal."""
    sys.path.insert(0, str(ROOT / "tests" / "mcore"))
    from launch import run_ranks

    for r in run_ranks(FSDP_WORKER, 2, args=["moments"], timeout_s=90):
        assert r.result is not None and r.result["problems"] == [], r.result


@pytest.mark.timeout(300)
def test_two_ddp_islands_share_their_moments_and_end_with_the_syncers_final_weights(procs: Procs,
                                                                                  key_file: Path) -> None:
    islands, final, commits = two_ddp_islands(procs, key_file, share_momentum=True)
    assert any(c.get("moments") for c in commits), "no round merged a moment"
    for n, island in enumerate(islands):
        shared = [e["moments_shared"] for e in island.events("train")  # type: ignore[attr-defined]
                  if e.get("moments_shared") is not None]
        assert shared and max(shared) > 0, f"island {n} folded in no fleet moment: {shared}"
        weights = island.events("weights")  # type: ignore[attr-defined]
        assert len({w["sha256"] for w in weights}) == 1, f"island {n}: its ranks hold different weights"
        assert_bit_identical(model_tensors(model_dir(island)), final, f"island {n}")  # type: ignore[arg-type]


DEEPSPEED_WORKER = ROOT / "tests" / "integration" / "deepspeed_worker.py"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_deepspeed_zero_island_reads_and_writes_masters_exactly(stage: int) -> None:
    """DeepSpeed's own engine on 2 CPU ranks (gloo): reads are the fp32 masters, writes reach both
    the masters and the parameters the forward pass uses, and the Adam moments are kept."""
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(ROOT / "tests" / "mcore"))
    from launch import run_ranks

    ranks = run_ranks(DEEPSPEED_WORKER, 2, args=[str(stage)], timeout_s=240)
    for r in ranks:
        assert r.result is not None and r.result["problems"] == [], r.result
        assert r.result["specs"] == [[16, 8], [16], [4, 16], [4]]  # whole shapes, also under ZeRO-3
