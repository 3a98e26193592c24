"""Megatron islands on real megatron-core (CPU gloo ranks) against the real syncer process.

The ranks are built by `tests/mcore/islands.py` (real parallel_state, GPTModel, Megatron DDP and
DistributedOptimizer; a test-only shim answers megatron's CUDA calls) and driven by
`tests/mcore/sync_worker.py`, which calls `MegatronDiLoCoSync` exactly as a trainer plugin does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, LoopbackRelay, Procs, checkpoint_params, start_syncer, syncer_exit_code, wait_until

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
sys.path.insert(0, str(ROOT / "tests" / "mcore"))
from launch import RankResult, run_ranks

pytestmark = pytest.mark.integration
WORKER = ROOT / "tests" / "mcore" / "sync_worker.py"

TP2_DP2 = {"tp": 2}
TP2_PP2 = {"tp": 2, "pp": 2, "tied_embeddings": True, "swiglu": True}
EP2_MOE = {"ep": 2, "experts": 4}
TP2_PLAIN_OPTIMIZER = {"tp": 2, "distributed_optimizer": False}
CONFIGS = {"tp2xdp2": TP2_DP2, "tp2xpp2-tied-swiglu": TP2_PP2, "ep2-moe": EP2_MOE,
           "tp2-float16-optimizer": TP2_PLAIN_OPTIMIZER}


def results(runs: list[RankResult]) -> list[dict[str, Any]]:
    out = []
    for r in runs:
        assert r.result is not None, f"rank {r.rank} reported nothing\n{r.output[-3000:]}"
        out.append(r.result)
    return out


@pytest.fixture(scope="module")
def single_rank() -> dict[str, dict[str, Any]]:
    """Each config built on one rank (TP = PP = EP = 1), in one process: its global names, and its
    consensus probe's logits on the weights `sync_worker.reference_values` sets."""
    singles = [{k: v for k, v in cfg.items() if k not in ("tp", "pp", "ep")} for cfg in CONFIGS.values()]
    (only,) = results(run_ranks(WORKER, 1, args=["names", *map(json.dumps, singles)], timeout_s=150))
    return {config: {"names": names, "logits": logits}
            for config, names, logits in zip(CONFIGS, only["names"], only["logits"], strict=True)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_global_names_and_masters_read_and_written_bit_for_bit(config: str,
                                                               single_rank: dict[str, dict[str, Any]]) -> None:
    ranks = results(run_ranks(WORKER, 4, args=["exact", json.dumps(CONFIGS[config])], timeout_s=180))
    for r in ranks:
        assert r["names"] == single_rank[config]["names"], f"rank {r['rank']}: global names differ from one rank's"
        assert r["problems"] == [], f"rank {r['rank']}: {r['problems']}"
        assert r["moments"] > 0  # Adam moments existed and were compared bit for bit
    losses = {r["loss"] for r in ranks if r["loss"] is not None}
    assert len(losses) == 1 and all(x == x and x < 1e4 for x in losses), losses  # one finite loss: trains on
    # The consensus probe (a forward pass through megatron's pipeline schedule, the logits split
    # over the vocabulary gathered, sent to rank 0) sees what one rank holding the model sees, up
    # to the bf16 roundings of a differently split forward pass.
    lead = next(r for r in ranks if r["rank"] == 0)
    got, want = torch.tensor(lead["logits"]), torch.tensor(single_rank[config]["logits"])
    assert got.shape == want.shape == (12, 256) and bool(torch.isfinite(want).all()) and want.std() > 0.1
    assert (got - want).abs().max() <= 0.05 * want.abs().max(), (got - want).abs().max()
    assert all(r["logits"] is None for r in ranks if r["rank"] != 0)


@pytest.mark.timeout(120)
def test_a_rank0_error_is_raised_on_every_rank() -> None:
    ranks = results(run_ranks(WORKER, 4, args=["error", json.dumps(TP2_DP2)], timeout_s=100))
    expected = "fragment 0: got torch.float32 values of shape (3,)"
    assert ranks[0]["error"].startswith("ValueError: ") and expected in ranks[0]["error"]
    for r in ranks[1:]:
        assert r["error"].startswith("IslandError: rank 0 of the island failed: ValueError: "), r["error"]
        assert expected in r["error"]
    assert all(r["still_reads"] for r in ranks)


@pytest.mark.timeout(120)
def test_a_refusal_by_the_syncer_is_raised_on_every_rank(procs: Procs, key_file: Path, tmp_path: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=3, total_rounds=6)
    wrong = tmp_path / "wrong.key"
    wrong.write_text("a key that is not the syncer's, long enough")
    env = {**island_env(syncer.address, wrong, 0), "YETO_DILOCO_INIT_TIMEOUT_S": "20"}
    ranks = results(run_ranks(WORKER, 4, args=["train", json.dumps(TP2_DP2), "5"], env=env, timeout_s=100))
    assert ranks[0]["error"].startswith("IslandRefused: "), ranks[0]["error"]
    assert "HMAC check failed" in ranks[0]["error"] and "this island stops" in ranks[0]["error"], ranks[0]["error"]
    for r in ranks[1:]:
        assert r["error"].startswith("IslandError: rank 0 of the island failed: IslandRefused: "), r["error"]
        assert "HMAC check failed" in r["error"]


# -- two islands and the real syncer ---------------------------------------------------------------
SYNC_ENV = {"YETO_DILOCO_RECONNECT_MAX_S": "1", "YETO_DILOCO_INIT_TIMEOUT_S": "90",
            "YETO_DILOCO_FINAL_TIMEOUT_S": "120", "YETO_DILOCO_MERGE_ALPHA": "0.5",
            "YETO_DILOCO_OVERLAP": "false"}  # installs blend into the fp32 masters and the bf16 params


class Island(threading.Thread):
    """One island's ranks, run in the background; `pids` once they started."""

    def __init__(self, spec: dict[str, Any], world: int, env: dict[str, str], steps: int, mode: str = "train") -> None:
        super().__init__(daemon=True)
        self.spec, self.world, self.env, self.steps, self.mode = spec, world, env, steps, mode
        self.pids: list[int] = []
        self.ranks: list[dict[str, Any]] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.ranks = results(run_ranks(WORKER, self.world, args=[self.mode, json.dumps(self.spec), str(self.steps)],
                                           env=self.env, timeout_s=200, started=self.pids.extend))
        except BaseException as exc:  # reported by `outcome`
            self.error = exc

    def outcome(self, timeout: float) -> list[dict[str, Any]]:
        self.join(timeout)
        assert not self.is_alive(), "island did not finish"
        if self.error is not None:
            raise self.error
        assert self.ranks is not None
        return self.ranks


def island_env(address: str, key_file: Path, learner_id: int) -> dict[str, str]:
    return {**SYNC_ENV, "YETO_DILOCO_SYNCER": address, "YETO_DILOCO_KEY_FILE": str(key_file),
            "YETO_DILOCO_LEARNER_ID": str(learner_id)}


def digests(path: Path) -> dict[str, str]:
    return {k: hashlib.sha256(v.float().numpy().tobytes()).hexdigest() for k, v in checkpoint_params(path).items()}


def check_final(islands: list[list[dict[str, Any]]], checkpoint: Path) -> None:
    final = digests(checkpoint)
    for n, ranks in enumerate(islands):
        for r in ranks:
            assert r["final"], f"island {n} rank {r['rank']} did not install the final cut"
            assert r["problems"] == [], f"island {n} rank {r['rank']}: {r['problems']}"
            assert r["digest"] == final, f"island {n} rank {r['rank']} does not hold the syncer's final weights"


@pytest.mark.timeout(300)
def test_two_islands_of_different_layouts_end_with_the_syncers_final_weights(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=3, total_rounds=6,
                          extra=["--sync-interval-steps", "4"])
    # The same model as TP2×DP2 (4 ranks) and as PP2 (2 ranks): one global description. Island B
    # runs through the ms-swift callback, driven by a loop with swift's trainer attributes.
    probing = {"YETO_DILOCO_CONSENSUS_EVERY": "1"}  # every island probes after each install
    a = Island(TP2_DP2, 4, {**island_env(syncer.address, key_file, 0), **probing}, steps=400)
    b = Island({"pp": 2}, 2, {**island_env(syncer.address, key_file, 1), **probing}, steps=400, mode="swift")
    a.start()
    b.start()
    ranks_a, ranks_b = a.outcome(240), b.outcome(60)
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    check_final([ranks_a, ranks_b], syncer.checkpoint)
    commits = syncer.commits()
    assert len(commits) >= 6
    assert ranks_a[0]["pushes"] >= 2 and ranks_b[0]["pushes"] >= 2
    # Both islands' consensus probes (sharded forward passes) reached the syncer and were compared.
    compared = [c for c in commits if c.get("consensus_learners") == [0, 1]]
    assert compared and all(0.0 <= c["consensus_js"] <= 1.0 for c in compared), [
        (c["round"], c.get("consensus_learners"), c.get("consensus_js")) for c in commits]
    for ranks in (ranks_a, ranks_b):
        stopped = {r["stopped_at"] for r in ranks}
        assert len(stopped) == 1 and None not in stopped, stopped  # every rank stopped at the same step


class CuttingRelay(LoopbackRelay):
    """Relays an island's connections to the syncer; `cut()` drops every open one at once."""

    def __init__(self, target: tuple[str, int]) -> None:
        super().__init__(target, "cutting-relay")

    def cut(self) -> None:
        for sock in self.sockets[1:]:
            with contextlib.suppress(OSError):
                sock.close()
        del self.sockets[1:]


@pytest.mark.timeout(300)
def test_a_dropped_connection_and_a_stalled_island_are_survived(procs: Procs, key_file: Path) -> None:
    # Quorum 1: rounds go on with whichever island is there. Paced, so that the run outlasts the
    # freeze below by several seconds whichever way the scheduling goes.
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=1, fragments=3, total_rounds=40,
                          extra=["--sync-interval-steps", "4", "--min-round-interval-s", "0.3"],
                          env={"YETO_SYNCER_PEER_TIMEOUT_S": "4", "YETO_SYNCER_HEARTBEAT_S": "1"})
    relay = CuttingRelay((syncer.host, syncer.port))
    try:
        a = Island(TP2_DP2, 4, {**island_env(f"127.0.0.1:{relay.port}", key_file, 0),
                                "YETO_DILOCO_PEER_TIMEOUT_S": "4", "YETO_DILOCO_HEARTBEAT_S": "1"}, steps=2000)
        b = Island({"pp": 2}, 2, {**island_env(syncer.address, key_file, 1), "YETO_DILOCO_PEER_TIMEOUT_S": "4",
                                  "YETO_DILOCO_HEARTBEAT_S": "1"}, steps=2000)
        a.start()
        b.start()
        wait_until(lambda: len(syncer.commits()) >= 3, 120, "three commits")
        relay.cut()  # island A's rank 0 loses every stream; it must redial and carry on
        wait_until(lambda: len(syncer.commits()) >= 6, 120, "three more commits after the cut")
        for pid in b.pids:  # island B freezes whole (every rank) past the syncer's peer timeout
            os.kill(pid, signal.SIGSTOP)
        frozen_at = len(syncer.commits())
        try:
            wait_until(lambda: len(syncer.commits()) >= frozen_at + 2, 120, "commits while island B is frozen")
            time.sleep(5)
        finally:
            for pid in b.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        ranks_a, ranks_b = a.outcome(240), b.outcome(120)
    finally:
        relay.closed.set()
        relay.cut()
        with contextlib.suppress(OSError):
            relay.listener.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    check_final([ranks_a, ranks_b], syncer.checkpoint)
    records = syncer.tape_records()
    joins = [r for r in records if r.get("event") == "join"]
    assert sum(1 for r in joins if r.get("learner") == 0) >= 2, "island A never rejoined after the cut"
    assert sum(1 for r in joins if r.get("learner") == 1) >= 2, "island B never rejoined after its stall"
