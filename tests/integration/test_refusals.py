"""Refused islands (wrong key, different model) train on alone; the run goes on without them
(SPEC §2.1, §4.2, §6)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from conftest import (
    TINY_MODEL,
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
    wait_until,
)

from syncer.checkpoint import load_checkpoint

pytestmark = pytest.mark.integration


def with_hidden(args: tuple[str, ...], hidden: int) -> list[str]:
    out = list(args)
    out[out.index("--hidden") + 1] = str(hidden)
    return out


@pytest.mark.timeout(240)
def test_wrong_key_and_wrong_model_are_refused_and_the_run_goes_on(procs: Procs, key_file: Path,
                                                                    tmp_path: Path) -> None:
    rounds = 16
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=1, fragments=4, total_rounds=rounds)
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text(secrets.token_hex(32))
    local_steps = 40

    # The refused islands dial first, so the syncer is certainly alive when they are judged: the
    # wrong key fails the handshake at once; the other model is accepted before any model is
    # pinned and must be refused when learner 0 pins the layout (then again on its redial).
    bad_key = start_learner(procs, syncer, wrong_key, 2, max_steps=local_steps, name="bad-key")
    bad_model = start_learner(procs, syncer, key_file, 1, max_steps=local_steps, name="bad-model",
                              model_args=with_hidden(TINY_MODEL, 48))
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

