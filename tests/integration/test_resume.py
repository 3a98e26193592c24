"""A syncer killed mid-run resumes from its checkpoint; the islands redial and finish with it
(DESIGN §6.3, §9.2: a crashed syncer costs minutes, not the run)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    Island,
    Procs,
    assert_bit_identical,
    checkpoint_params,
    commits,
    eval_loss,
    model_dir,
    model_tensors,
    read_tape,
    start_learner,
    start_syncer,
    syncer_exit_code,
    wait_all,
    wait_until,
)

from syncer.durability.checkpoint import last_generations, ledger_key, load_checkpoint

pytestmark = pytest.mark.integration

FRAGMENTS = 4


@pytest.mark.timeout(300)
def test_killed_syncer_resumes_on_the_same_port(procs: Procs, key_file: Path) -> None:
    rounds = 80
    common: dict[str, Any] = {"learners": 2, "quorum": 2, "fragments": FRAGMENTS, "total_rounds": rounds}
    first = start_syncer(procs, key_file=key_file, tape_name="tape-1.jsonl", **common)
    max_steps = 6000  # far more than the run needs: the final cut, not max_steps, must end it
    learners = [start_learner(procs, first, key_file, i, max_steps=max_steps) for i in range(2)]

    wait_until(lambda: len(first.commits()) >= 4, 120, "4 committed rounds", interval=0.02, on_timeout=procs.tails)
    first.proc.sigkill()
    assert first.proc.poll() == -9
    assert all(lp.poll() is None for lp in learners), "a learner stopped when the syncer died\n" + procs.tails()

    assert first.checkpoint is not None
    saved = load_checkpoint(first.checkpoint)
    assert not saved.finalized
    assert 4 <= saved.next_round < rounds, f"killed too late to test a resume (round {saved.next_round})"
    assert sum(saved.versions) == saved.next_round
    before = first.commits()
    assert before and before[-1]["round"] <= saved.next_round - 1  # the checkpoint is written before the tape

    second = start_syncer(procs, key_file=key_file, port=first.port, tape_name="tape-2.jsonl", resume=True,
                          bind_retry_s=20, **common)
    assert second.port == first.port

    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(second) == 0, second.proc.tail()
    assert "resumed from" in second.proc.stderr()

    after = commits(second.tape_records())
    assert after, "the resumed syncer committed nothing"
    assert [r["round"] for r in after] == list(range(saved.next_round, rounds))
    versions = list(saved.versions)
    seen: set[int] = set()
    for rec in after:
        f = rec["fragment"]
        assert f == rec["round"] % FRAGMENTS
        if f not in seen:
            assert rec["version"] == saved.versions[f] + 1, f"fragment {f} restarted at v{rec['version']}"
            seen.add(f)
        versions[f] += 1
        assert rec["version"] == versions[f]
        assert sorted(rec["learners"]) == [0, 1], rec
    assert seen == set(range(FRAGMENTS))
    records = second.tape_records()
    assert sorted(r["learner"] for r in records if r["event"] == "join") == [0, 1]
    assert not any(r["event"] == "init" for r in records), "the resumed syncer took a new INIT"
    numbered_from = last_generations(saved.ledger)
    for join in (r for r in records if r["event"] == "join"):  # (learner, generation) names one connection
        assert join["generation"] > numbered_from.get(join["learner"], 0), join

    final = load_checkpoint(first.checkpoint)
    assert final.finalized and final.next_round == rounds
    assert final.versions == versions == [rounds // FRAGMENTS] * FRAGMENTS
    # Every committed round's tokens are in the ledger once: the resumed syncer starts from the
    # checkpoint's ledger, and rounds the first syncer committed after that checkpoint were redone,
    # and only the redone commit counts. (The tape cannot stand for the checkpoint: the checkpoint
    # is written first, so a kill between the two leaves a checkpointed commit off the tape.)
    expected: dict[str, int] = dict(saved.ledger)
    for c in after:
        for lid, gen, tokens in zip(c["learners"], c["generations"], c["tokens"], strict=True):
            expected[ledger_key(lid, gen)] = expected.get(ledger_key(lid, gen), 0) + tokens
    assert final.ledger == expected
    taped = [c for c in before if c["round"] < saved.next_round]
    assert taped and all(c["round"] == n for n, c in enumerate(taped))  # what the tape has, in order

    for lp in learners:
        last = eval_loss(lp, "final")
        assert last["final_cut"] is True, lp.tail()
        assert last["steps"] < max_steps, f"{lp.name} was not training any more when the run ended"
        assert last["loss"] < eval_loss(lp, "initial")["loss"]
    ckpt = checkpoint_params(first.checkpoint)
    m0, m1 = (model_tensors(model_dir(lp)) for lp in learners)
    assert_bit_identical(m0, ckpt, "learner 0 vs final checkpoint")
    assert_bit_identical(m1, ckpt, "learner 1 vs final checkpoint")


@pytest.mark.timeout(120)
def test_background_checkpoints_and_no_duplicate_final_write(procs: Procs, key_file: Path) -> None:
    rounds = 16
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=rounds,
                          extra=["--background-checkpoint", "--checkpoint-every", "2"])
    assert syncer.checkpoint is not None and syncer.tape is not None
    island = Island(syncer, key_file, 0)
    try:
        island.start()
        island.train_until(lambda: False, 90, "the final cut")
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 0
    done = commits(read_tape(syncer.tape))
    assert [c["round"] for c in done] == list(range(rounds))
    written = [c["round"] for c in done if "checkpoint_ms" in c]
    assert written == list(range(1, rounds - 1, 2)), written  # every 2nd round; the last cut only once, final
    state = load_checkpoint(syncer.checkpoint)
    assert state.finalized and state.next_round == rounds
    reference = checkpoint_params(syncer.checkpoint)
    for name, param in island.model.named_parameters():
        assert torch.equal(param.detach(), reference[name]), name


@pytest.mark.timeout(120)
def test_a_syncer_resumed_from_a_final_checkpoint_waits_for_its_learners(procs: Procs, key_file: Path) -> None:
    """Killed after the final cut was written but before every learner had it, a syncer resumed
    from that checkpoint hands the final cut to the learners that trained, even if none of them
    is connected when it starts (it used to exit at once, leaving them without the final cut)."""
    rounds = 8
    first = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=rounds,
                         tape_name="tape-1.jsonl")
    island = Island(first, key_file, 0)
    try:
        island.start()
        island.train_until(lambda: False, 60, "the final cut")
    finally:
        island.close()
    assert syncer_exit_code(first) == 0
    assert first.checkpoint is not None and load_checkpoint(first.checkpoint).finalized

    second = start_syncer(procs, key_file=key_file, port=first.port, tape_name="tape-2.jsonl", resume=True,
                          bind_retry_s=20, learners=1, quorum=1, fragments=4, total_rounds=rounds,
                          extra=["--final-timeout-s", "60"])
    wait_until(lambda: "already final" in second.proc.stderr(), 20, "the resumed syncer to start finalizing")
    # That it waits for a learner that is not back yet is the protocol's decision, checked on a
    # fake clock (tests/unit/test_protocol.py); here the real one must still be up to hand it over.
    assert second.proc.poll() is None, "the resumed syncer exited before its learner came back\n" + second.proc.tail()
    late = Island(second, key_file, 0)
    try:
        late.start()
        late.train_until(lambda: False, 30, "the final cut from the resumed syncer")
    finally:
        late.close()
    assert syncer_exit_code(second) == 0, second.proc.tail()
    reference = checkpoint_params(first.checkpoint)
    for name, param in late.model.named_parameters():
        assert torch.equal(param.detach(), reference[name]), name


@pytest.mark.timeout(180)
def test_a_syncer_restarted_without_resume_is_seeded_from_learner_0s_weights(
        procs: Procs, key_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Learner 0 seeds a syncer that lost its state with the weights it trains on, read on its
    training thread at the next step, and the run goes on to a final cut it installs."""
    common: dict[str, Any] = {"learners": 1, "quorum": 1, "fragments": FRAGMENTS}
    first = start_syncer(procs, key_file=key_file, tape_name="tape-1.jsonl", checkpoint_name=None, total_rounds=400,
                         **common)
    island = Island(first, key_file, reconnect_max_s=0.5)
    try:
        island.start()
        island.train_until(lambda: len(first.commits()) >= 3, 60, "3 committed rounds")
        first.proc.sigkill()
        second = start_syncer(procs, key_file=key_file, port=first.port, tape_name="tape-2.jsonl", total_rounds=8,
                              bind_retry_s=20, **common)
        island.train_until(lambda: any(r["event"] == "init" for r in second.tape_records()), 60,
                           "the new syncer's initial cut")
        island.train_until(lambda: False, 90, "the final cut")
        assert island.finished and island.session.stats.final_installed
    finally:
        island.close()
    assert syncer_exit_code(second) == 0, second.proc.tail()
    assert [r["round"] for r in second.commits()] == list(range(8))
    assert "the syncer has no model state; seeding it from this learner's current weights" in caplog.text
    assert second.checkpoint is not None
    ckpt = checkpoint_params(second.checkpoint)
    for name, param in island.model.named_parameters():
        assert torch.equal(param.detach(), ckpt[name]), f"{name} differs from the new syncer's final checkpoint"


@pytest.mark.timeout(180)
def test_learner_0_in_finish_seeds_a_syncer_restarted_without_resume(procs: Procs, key_file: Path) -> None:
    """The syncer dies and comes back without --resume while learner 0 waits in `finish()` for
    the final cut: finish serves the new syncer's INIT request from the weights it ended with,
    and then installs the final cut, instead of keeping its local weights at its deadline."""
    common: dict[str, Any] = {"learners": 1, "quorum": 1, "fragments": FRAGMENTS}
    first = start_syncer(procs, key_file=key_file, tape_name="tape-1.jsonl", checkpoint_name=None, total_rounds=400,
                         **common)
    island = Island(first, key_file, reconnect_max_s=0.5, final_timeout_s=90)
    outcome: dict[str, bool] = {}
    try:
        island.start()
        island.train_until(lambda: len(first.commits()) >= 3, 60, "3 committed rounds")
        first.proc.sigkill()
        # finish() answers rounds it owes only on a live link: let the link notice the loss first.
        wait_until(lambda: not island.session.link.connected, 10, "the island noticing its syncer died")
        ended = [p.detach().clone() for p in island.model.parameters()]
        waiting = threading.Thread(target=lambda: outcome.update(final=island.session.finish()), daemon=True)
        waiting.start()
        second = start_syncer(procs, key_file=key_file, port=first.port, tape_name="tape-2.jsonl",
                              bind_retry_s=20, **common)
        waiting.join(120)
        assert not waiting.is_alive(), "finish() did not return"
    finally:
        island.close()
    assert outcome.get("final") is True and island.session.stats.final_installed
    assert syncer_exit_code(second) == 0, second.proc.tail()
    assert any(r["event"] == "init" for r in second.tape_records()), second.proc.tail()
    assert second.checkpoint is not None
    ckpt = checkpoint_params(second.checkpoint)
    for (name, param), before in zip(island.model.named_parameters(), ended, strict=True):
        assert torch.equal(param.detach(), ckpt[name]), f"{name} differs from the new syncer's final checkpoint"
        assert torch.equal(before, ckpt[name]), f"{name}: the new syncer was not seeded with learner 0's weights"


@pytest.mark.timeout(240)
def test_a_resumed_syncer_serves_its_downlink_learners_the_anchors_they_hold(procs: Procs, key_file: Path) -> None:
    """int4 downlinks: the checkpoint keeps the chain of anchors, so the FULL a learner gets when it
    rejoins the resumed syncer holds the very bits it already had, where a chain started again
    would send it the exact values instead; the run then ends bit-identical with the checkpoint."""
    rounds = 48
    # Background checkpoints: an encode that finds its anchor still read by the writer moves a copy.
    common: dict[str, Any] = {"learners": 2, "quorum": 2, "fragments": FRAGMENTS, "total_rounds": rounds,
                              "extra": ["--background-checkpoint"]}
    first = start_syncer(procs, key_file=key_file, tape_name="tape-1.jsonl", **common)
    assert first.checkpoint is not None
    islands = [Island(first, key_file, i, downlink_dtype="int4") for i in range(2)]
    try:
        for island in islands:
            island.start()
        deadline = time.monotonic() + 90
        while len(first.commits()) < 3 * FRAGMENTS:
            assert time.monotonic() < deadline, "no 12 committed rounds\n" + procs.tails()
            for island in islands:
                island.train_step()
            time.sleep(0.002)
        first.proc.sigkill()
        decoders = [island.session.link.downlink.reader.downlink for island in islands]  # type: ignore[union-attr]
        assert all(d is not None for d in decoders)
        held = [[a.clone() for a in d.anchors] for d in decoders]  # type: ignore[union-attr]
        held_versions = [list(d.versions) for d in decoders]  # type: ignore[union-attr]
        objects = [[id(a) for a in d.anchors] for d in decoders]  # type: ignore[union-attr]
        saved = load_checkpoint(first.checkpoint)
        assert list(saved.downlink) == [4] and not saved.finalized

        second = start_syncer(procs, key_file=key_file, port=first.port, tape_name="tape-2.jsonl", resume=True,
                              bind_retry_s=20, **common)
        # Not stepping: the links redial on their own threads and take the full state.
        wait_until(lambda: all(id(a) != o for d, obs in zip(decoders, objects, strict=True)
                               for a, o in zip(d.anchors, obs, strict=True)), 60,  # type: ignore[union-attr]
                   "every fragment resent to both learners", on_timeout=procs.tails)
        compared = 0
        for d, anchors, versions in zip(decoders, held, held_versions, strict=True):
            for f in range(FRAGMENTS):
                if versions[f] == saved.versions[f]:
                    assert torch.equal(d.anchors[f], anchors[f]), f  # type: ignore[union-attr]
                    assert not torch.equal(anchors[f], saved.params[f]), f  # an int4 chain's bits, not Θ's
                    compared += 1
        assert compared >= FRAGMENTS, (held_versions, saved.versions)
        deadline = time.monotonic() + 120
        while not all(i.finished for i in islands):
            assert time.monotonic() < deadline, "the final cut did not reach every island\n" + procs.tails()
            for island in islands:
                if not island.finished:
                    island.train_step()
            time.sleep(0.002)
    finally:
        for island in islands:
            island.close()
    assert syncer_exit_code(second) == 0, second.proc.tail()
    reference = checkpoint_params(first.checkpoint)
    for island in islands:
        for name, param in island.model.named_parameters():
            assert torch.equal(param.detach(), reference[name]), name
