"""Refused islands (wrong key, different model, an id another live process holds) stop with the
refusal as their error, or train on alone when told to; the run goes on without them (DESIGN §3.8,
§7.2, §9.4; issue 14)."""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import pytest
from conftest import (
    TINY_MODEL,
    Procs,
    assert_bit_identical,
    base_env,
    checkpoint_params,
    commits,
    eval_loss,
    model_dir,
    model_tensors,
    start_learner,
    start_syncer,
    syncer_exit_code,
    wait_all,
    wait_until,
)

from syncer.durability.checkpoint import load_checkpoint

pytestmark = pytest.mark.integration


def with_hidden(args: tuple[str, ...], hidden: int) -> list[str]:
    out = list(args)
    out[out.index("--hidden") + 1] = str(hidden)
    return out


@pytest.mark.timeout(240)
def test_refused_islands_told_to_train_alone_do_and_the_run_goes_on(procs: Procs, key_file: Path,
                                                                    tmp_path: Path) -> None:
    rounds = 16
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=1, fragments=4, total_rounds=rounds)
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text(secrets.token_hex(32))
    local_steps = 40

    # The refused islands dial first, so the syncer is certainly alive when they are judged: the
    # wrong key fails the handshake at once; the other model is accepted before any model is
    # pinned and must be refused when learner 0 pins the layout (then again on its redial).
    bad_key = start_learner(procs, syncer, wrong_key, 2, max_steps=local_steps, name="bad-key", alone_if_refused=1)
    bad_model = start_learner(procs, syncer, key_file, 1, max_steps=local_steps, name="bad-model",
                              model_args=with_hidden(TINY_MODEL, 48), alone_if_refused=1)
    wait_until(lambda: "refused by syncer" in bad_key.stderr() or bad_key.poll() is not None, 90,
               "the wrong-key learner to be refused", on_timeout=procs.tails)
    wait_until(lambda: any(r["event"] == "join" and r["learner"] == 1 for r in syncer.tape_records())
               or bad_model.poll() is not None, 90, "the other-model learner to join", on_timeout=procs.tails)
    good = start_learner(procs, syncer, key_file, 0, max_steps=3000)

    assert wait_all([bad_key, bad_model, good], timeout=180) == [0, 0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()

    key_err = bad_key.stderr()
    assert "yeto learner 2: refused by syncer:" in key_err, bad_key.tail()
    refusal = next(line for line in key_err.splitlines() if "refused by syncer" in line)
    assert "HMAC" in refusal and "key" in refusal, refusal

    model_err = bad_model.stderr()
    assert "yeto learner 1: refused by syncer:" in model_err, bad_model.tail()
    refusal = next(line for line in model_err.splitlines() if "refused by syncer" in line)
    assert "layout fingerprint mismatch" in refusal, refusal

    for lp in (bad_key, bad_model):
        last = eval_loss(lp, "final")
        assert last["final_cut"] is False, lp.tail()
        assert last["steps"] == local_steps, lp.tail()  # it trained locally to its own limit
        assert last["loss"] < eval_loss(lp, "initial")["loss"]
        assert lp.events("saved")

    last = eval_loss(good, "final")
    assert last["final_cut"] is True and last["loss"] < eval_loss(good, "initial")["loss"], good.tail()

    records = syncer.tape_records()
    done = commits(records)
    assert [r["round"] for r in done] == list(range(rounds))
    assert all(r["learners"] == [0] for r in done), [r["learners"] for r in done]
    assert not any(r["event"] == "join" and r["learner"] == 2 for r in records), "a wrong key joined"
    assert any(r["event"] == "final" for r in records)
    err = syncer.proc.stderr()
    assert "HMAC check failed" in err and "layout fingerprint mismatch" in err

    assert syncer.checkpoint is not None
    assert load_checkpoint(syncer.checkpoint).finalized
    assert_bit_identical(model_tensors(model_dir(good)), checkpoint_params(syncer.checkpoint), "learner 0")



@pytest.mark.timeout(120)
def test_a_wrong_key_island_stops_within_seconds_with_the_refusal(procs: Procs, key_file: Path,
                                                                  tmp_path: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=1, fragments=4)
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text(secrets.token_hex(32))
    started = time.monotonic()
    bad = start_learner(procs, syncer, wrong_key, 1, max_steps=100_000, name="bad-key")
    code = bad.wait(60)
    took = time.monotonic() - started
    assert code != 0, bad.tail()
    err = bad.stderr()
    assert "IslandRefused" in err and "HMAC check failed" in err and "this island stops" in err, bad.tail()
    assert "YETO_DILOCO_ALONE_IF_REFUSED=1" in err
    assert not bad.events("eval", phase="final"), "a refused island trained to its end"
    assert took < 45, f"the refused island took {took:.0f} s to stop"
    assert syncer.proc.poll() is None, syncer.proc.tail()


@pytest.mark.timeout(240)
def test_a_second_live_process_with_a_taken_id_is_refused_and_exits(procs: Procs, key_file: Path) -> None:
    # No round budget: the run lasts until both learners trained their steps, long after the twin.
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4)
    learners = [start_learner(procs, syncer, key_file, i, max_steps=900) for i in range(2)]
    wait_until(lambda: len(syncer.commits()) >= 3, 90, "three commits", on_timeout=procs.tails)

    twin = start_learner(procs, syncer, key_file, 1, max_steps=5000, name="twin")  # left at an id in use
    assert twin.wait(60) != 0, twin.tail()
    err = twin.stderr()
    assert "learner id 1 is held by another live process, connected from 127.0.0.1:" in err, twin.tail()
    assert "IslandRefused" in err and "(duplicate)" in err, twin.tail()

    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    records = syncer.tape_records()
    rounds = [r["round"] for r in commits(records)]
    assert rounds == list(range(len(rounds)))
    assert [r["generation"] for r in records if r["event"] == "join" and r["learner"] == 1] == [1], \
        "the holder of id 1 was evicted"
    assert not any(r["event"] == "replaced" for r in records)
    assert syncer.checkpoint is not None
    final = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        assert_bit_identical(model_tensors(model_dir(lp)), final, lp.name)


@pytest.mark.timeout(240)
def test_a_process_restarted_after_the_holder_went_silent_takes_the_id_over(procs: Procs, key_file: Path) -> None:
    fast = {"peer_timeout_s": 3, "heartbeat_s": 0.5}
    env = base_env({"YETO_SYNCER_PEER_TIMEOUT_S": "3", "YETO_SYNCER_HEARTBEAT_S": "0.5"})
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=1, fragments=4, env=env)
    first = start_learner(procs, syncer, key_file, 1, max_steps=5000, name="first", **fast)
    holder = start_learner(procs, syncer, key_file, 0, max_steps=1200, **fast)
    wait_until(lambda: any(1 in c["answered"] for c in syncer.commits()), 90, "learner 1 to answer a round",
               on_timeout=procs.tails)
    os.kill(first.pid, signal.SIGSTOP)  # a hung host: its sockets stay open, it says nothing
    try:
        wait_until(lambda: "learner 1 left" in syncer.proc.stderr(), 30, "the syncer to drop the silent holder",
                   on_timeout=syncer.proc.tail)
        restarted = start_learner(procs, syncer, key_file, 1, max_steps=400, name="restarted", **fast)
        wait_until(lambda: "learner 1 replaced" in syncer.proc.stderr() or restarted.poll() is not None, 90,
                   "the restarted process to take id 1 over", on_timeout=procs.tails)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    # The old process wakes to a dead link and redials: the id is the new process's now.
    assert first.wait(60) != 0, first.tail()
    assert "learner id 1 is held by another live process" in first.stderr(), first.tail()

    assert wait_all([holder, restarted], timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    replaced = [line for line in syncer.proc.stderr().splitlines() if "learner 1 replaced" in line]
    assert len(replaced) == 1 and "a new process" in replaced[0], replaced
    assert "IslandRefused" not in restarted.stderr()
    assert syncer.checkpoint is not None
    final = checkpoint_params(syncer.checkpoint)
    for lp in (holder, restarted):
        assert_bit_identical(model_tensors(model_dir(lp)), final, lp.name)


@pytest.mark.timeout(120)
def test_a_sweeping_island_is_refused_by_a_syncer_whose_rounds_cannot_serve_it(procs: Procs, key_file: Path) -> None:
    """RL sweeps need rounds unpaced by learner steps, and overlap needs every fragment's round in
    flight: a syncer started otherwise refuses the island at its handshake, naming the flags."""
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4,
                          extra=["--pipeline", "2"])  # and --sync-interval-steps 8, as every test syncer
    island = start_learner(procs, syncer, key_file, 0, max_steps=100_000, name="overlap", rl_mode="overlap")
    assert island.wait(60) != 0, island.tail()
    err = island.stderr()
    assert "IslandRefused" in err and "--sync-interval-steps 8" in err and "--pipeline 2" in err, island.tail()
    assert "--pipeline 4" in err and "YETO_DILOCO_RL_MODE=overlap" in err
    assert syncer.proc.poll() is None, syncer.proc.tail()
