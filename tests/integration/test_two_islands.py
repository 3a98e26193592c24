"""Two HF islands and a real syncer on loopback: both ways a run can end (DESIGN §3.7, §4.7, §6.2)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from conftest import (
    Procs,
    assert_bit_identical,
    checkpoint_params,
    commits,
    eval_loss,
    model_dir,
    model_tensors,
    start_learner,
    start_syncer,
    syncer_exit_code,
    wait_all,
)

from syncer.durability.checkpoint import load_checkpoint

pytestmark = pytest.mark.integration

FRAGMENTS = 4


def check_versions_follow_rounds(records: list[dict], first_round: int = 0,
                                 start_versions: list[int] | None = None) -> None:
    """Commits have consecutive rounds from `first_round`; round r merges fragment r mod P and
    bumps that fragment's version by exactly one."""
    versions = list(start_versions or [0] * FRAGMENTS)
    for expected_round, rec in enumerate(records, start=first_round):
        assert rec["round"] == expected_round, f"commit rounds are not consecutive: {[r['round'] for r in records]}"
        f = rec["fragment"]
        assert f == expected_round % FRAGMENTS
        versions[f] += 1
        assert rec["version"] == versions[f], f"round {expected_round}: fragment {f} version {rec['version']}"


@pytest.mark.timeout(240)
def test_syncer_budget_ends_the_run_with_identical_models(procs: Procs, key_file: Path) -> None:
    rounds = 24
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=FRAGMENTS, total_rounds=rounds)
    max_steps = 3000  # far beyond what 24 rounds need: the final cut must end training
    learners = [start_learner(procs, syncer, key_file, i, max_steps=max_steps) for i in range(2)]

    codes = wait_all(learners, timeout=180)
    assert codes == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()

    for lp in learners:
        first, last = eval_loss(lp, "initial"), eval_loss(lp, "final")
        assert last["loss"] < first["loss"], f"{lp.name}: loss did not fall ({first['loss']} -> {last['loss']})"
        assert last["final_cut"] is True, lp.tail()
        assert last["steps"] < max_steps, f"{lp.name} ran to max_steps; the final cut should have stopped it"
        assert lp.events("saved"), lp.tail()

    assert syncer.checkpoint is not None
    state = load_checkpoint(syncer.checkpoint)
    assert state.finalized
    assert state.next_round == rounds
    assert state.versions == [rounds // FRAGMENTS] * FRAGMENTS

    ckpt = checkpoint_params(syncer.checkpoint)
    m0, m1 = (model_tensors(model_dir(lp)) for lp in learners)
    assert_bit_identical(m0, ckpt, "learner 0 vs checkpoint")
    assert_bit_identical(m1, ckpt, "learner 1 vs checkpoint")
    assert_bit_identical(m0, m1, "learner 0 vs learner 1")

    records = syncer.tape_records()
    done = commits(records)
    assert len(done) == rounds, [r["round"] for r in done]
    check_versions_follow_rounds(done)
    for rec in done:
        assert sorted(rec["learners"]) == [0, 1], rec
        assert len(rec["weights"]) == len(rec["tokens"]) == len(rec["steps"]) == 2
        assert all(t > 0 for t in rec["tokens"]) and all(s > 0 for s in rec["steps"])
        assert abs(sum(rec["weights"]) - 1.0) < 1e-4
    kinds = [r["event"] for r in records]
    assert kinds.count("init") == 1 and kinds.count("final") == 1
    assert kinds.index("init") < kinds.index("commit")
    assert kinds.index("final") > len(kinds) - 1 - kinds[::-1].index("commit"), "final before the last commit"
    assert "committed" in syncer.proc.stderr()


@pytest.mark.timeout(240)
def test_learners_finish_first_and_still_end_identical(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=FRAGMENTS, total_rounds=100_000)
    max_steps = 400
    learners = [start_learner(procs, syncer, key_file, i, max_steps=max_steps) for i in range(2)]

    codes = wait_all(learners, timeout=180)
    assert codes == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()

    for lp in learners:
        first, last = eval_loss(lp, "initial"), eval_loss(lp, "final")
        assert last["final_cut"] is True, lp.tail()
        assert last["steps"] == max_steps, lp.tail()
        assert last["loss"] < first["loss"]

    records = syncer.tape_records()
    kinds = [r["event"] for r in records]
    joins = [i for i, r in enumerate(records) if r["event"] == "join"]
    assert len(joins) == 2 and max(joins) < kinds.index("done"), "the islands did not train side by side"
    assert sorted(r["learner"] for r in records if r["event"] == "done") == [0, 1]
    finals = [r for r in records if r["event"] == "final"]
    assert len(finals) == 1 and "finished" in finals[0]["reason"], finals
    done = commits(records)
    assert done, "no round was committed"
    check_versions_follow_rounds(done)

    assert syncer.checkpoint is not None
    state = load_checkpoint(syncer.checkpoint)
    assert state.finalized
    assert state.next_round == len(done)
    per_fragment: dict[int, int] = defaultdict(int)
    for rec in done:
        per_fragment[rec["fragment"]] += 1
    assert state.versions == [per_fragment[f] for f in range(FRAGMENTS)]

    ckpt = checkpoint_params(syncer.checkpoint)
    m0, m1 = (model_tensors(model_dir(lp)) for lp in learners)
    assert_bit_identical(m0, ckpt, "learner 0 vs checkpoint")
    assert_bit_identical(m1, ckpt, "learner 1 vs checkpoint")


@pytest.mark.timeout(240)
def test_overlapping_learners_with_a_blocking_embedding_end_identical(procs: Procs, key_file: Path) -> None:
    """Mix1 + Mix2 with real HF learners: learners rebase on merged fragments and wait at the
    embedding's boundary; training converges and ends on the syncer's final cut."""
    rounds = 16
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=FRAGMENTS, total_rounds=rounds)
    learners = [start_learner(procs, syncer, key_file, i, max_steps=3000, overlap="true", blocking="embedding")
                for i in range(2)]
    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    for lp in learners:
        first, last = eval_loss(lp, "initial"), eval_loss(lp, "final")
        assert last["loss"] < first["loss"] and last["final_cut"], lp.tail()
    assert syncer.checkpoint is not None
    ckpt = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        assert_bit_identical(model_tensors(model_dir(lp)), ckpt, f"{lp.name} vs checkpoint")
    done = commits(syncer.tape_records())
    assert len(done) == rounds and all(sorted(r["learners"]) == [0, 1] for r in done), done


@pytest.mark.timeout(240)
def test_int4_both_ways_learns_and_ends_identical_at_about_4_bits_a_parameter(procs: Procs, key_file: Path) -> None:
    """HF islands on int4 pushes and int4 broadcasts: the loss falls, the final cut is the
    checkpoint bit for bit, and the tape says each round moved about 4.25 bits a parameter each way."""
    rounds = 16
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=FRAGMENTS, total_rounds=rounds)
    learners = [start_learner(procs, syncer, key_file, i, max_steps=3000, wire_dtype="int4", downlink_dtype="int4")
                for i in range(2)]
    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    for lp in learners:
        assert eval_loss(lp, "final")["loss"] < eval_loss(lp, "initial")["loss"], lp.tail()
    assert syncer.checkpoint is not None
    ckpt = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        assert_bit_identical(model_tensors(model_dir(lp)), ckpt, f"{lp.name} vs checkpoint")
    done = commits(syncer.tape_records())
    assert len(done) == rounds
    for c in done:
        up, down = 8 * c["bytes_in"] / c["numel"] / 2, 8 * c["bytes_out"] / c["numel"] / c["receivers"]
        assert 4.25 <= up < 4.3, c  # 4 bits a value, a 32-bit scale per 128, a 4-byte header
        last = c["version"] == rounds // FRAGMENTS  # the last version goes out exact, for the final cut
        assert (down == 32.0) if last else (4.25 <= down < 4.3), c
