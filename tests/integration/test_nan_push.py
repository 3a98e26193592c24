"""A push holding NaN or Inf, from a peer that holds the key and the model, is refused as it lands:
one ERROR naming the reason, nothing of it merged, and the run goes on (DESIGN §7.5, §9.3)."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch
from conftest import Island, Procs, Syncer, checkpoint_params, join_raw, start_syncer, syncer_exit_code, wait_until

from syncer.durability.checkpoint import load_checkpoint
from yeto_core.codecs import F32, tensor_bytes
from yeto_core.net.group import ConnectionGroup
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import Bye, Error, Message, Pull, Push

pytestmark = pytest.mark.integration

ROUNDS = 40


def close_both(group: ConnectionGroup | None, island: Island) -> None:
    if group is not None:  # a goodbye, as a learner says it: else a syncer finalizing waits for it to return
        group.close("test: cleanup", last=Bye("test: cleanup"))
        group.join(10)
    island.close()


def assert_holds_the_final_checkpoint(island: Island, syncer: Syncer) -> None:
    """The syncer's final checkpoint is finite and the island holds it, bit for bit."""
    assert syncer.checkpoint is not None
    ckpt = checkpoint_params(syncer.checkpoint)
    for name, param in island.model.named_parameters():
        assert torch.isfinite(ckpt[name]).all(), name
        assert torch.equal(param.detach(), ckpt[name]), f"{name} differs from the final checkpoint"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_non_finite_push_is_refused_and_never_reaches_the_model(procs: Procs, key_file: Path, bad: float) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=1, fragments=2, total_rounds=ROUNDS)
    key = key_file.read_bytes().strip()
    island = Island(syncer, key_file)
    inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
    group = None
    try:
        island.start()
        island.train_until(lambda: len(syncer.commits()) >= 2, 60, "2 committed rounds")

        peer = join_raw(syncer.port, key, 1, island.fingerprint, data_streams=2)
        group = ConnectionGroup(peer.control, peer.data, name="nan-peer", on_message=lambda m, p: inbox.put(m),
                                on_close=lambda reason: None, max_payload=lambda: 1 << 30)
        group.start()
        seen: list[Message] = []

        def heard(kind: type[Message]) -> bool:
            while not inbox.empty():
                seen.append(inbox.get())
            return any(isinstance(m, kind) for m in seen)

        island.train_until(lambda: heard(Pull), 60, "a PULL for the hand-driven learner")
        pull = next(m for m in seen if isinstance(m, Pull))
        assert island.session.layout is not None
        delta = torch.zeros(island.session.layout.fragments[pull.fragment].numel)
        delta[-1] = bad  # in the last bytes: every part before it passes
        group.send(Push(pull.round, pull.attempt, pull.fragment, pull.version, tokens=16, steps=1, step_us=0,
                        transfer=0, nbytes=0, codec=F32.wire_id), tensor_bytes(delta))
        wait_until(lambda: heard(Error), 30, "the syncer's answer to the poisoned push")
        refusal = next(m for m in seen if isinstance(m, Error))
        assert refusal.code is ErrorCode.REFUSED, refusal
        assert refusal.reason == f"delta for fragment {pull.fragment} contains NaN or Inf", refusal
        group.close("test: done")
        group.join(10)
        group = None

        island.train_until(lambda: False, 120, "the final cut")
        assert island.finished and island.session.stats.final_installed
    finally:
        close_both(group, island)
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()

    records = syncer.tape_records()
    refused = [r for r in records if r["event"] == "refused" and r["learner"] == 1]
    assert [r["round"] for r in refused] == [pull.round]
    done = [r for r in records if r["event"] == "commit"]
    assert [r["round"] for r in done] == list(range(ROUNDS))
    assert all(r["learners"] == [0] for r in done), "the poisoned push was merged"
    assert_holds_the_final_checkpoint(island, syncer)


@pytest.mark.timeout(120)
def test_learner_0_refuses_to_start_a_run_from_nan_weights(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=4,
                          extra=["--init-timeout-s", "5"])
    island = Island(syncer, key_file)
    with torch.no_grad():
        last = list(island.model.named_parameters())[-1]
        last[1].view(-1)[-1] = float("nan")
    try:
        with pytest.raises(ValueError, match=rf"the initial weights hold NaN or Inf \(first in '{last[0]}'\)"):
            island.start()
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 3, syncer.proc.tail()  # no INIT ever came: it never trained
    assert not any(r["event"] in ("init", "commit") for r in syncer.tape_records())


@pytest.mark.timeout(120)
def test_the_syncer_refuses_an_init_holding_nan(procs: Procs, key_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The syncer's own defence, for a learner 0 that does not check its weights (an older or a
    broken client): every INIT fragment is screened as it lands, and a poisoned one is refused."""
    import yeto_core.learner

    monkeypatch.setattr(yeto_core.learner, "nonfinite_tensor", lambda fragment, values: None)
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=4,
                          extra=["--init-timeout-s", "20"])
    island = Island(syncer, key_file, init_timeout_s=2)
    with torch.no_grad():
        list(island.model.parameters())[-1].view(-1)[-1] = float("nan")
    try:
        island.start()  # gives up waiting for the initial cut after 2 s; its link keeps offering INIT
        wait_until(lambda: "contains NaN or Inf" in syncer.proc.stderr(), 30, "the syncer's refusal of the INIT")
        assert not island.session.link.initial_cut_received.is_set()
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 3, syncer.proc.tail()  # no complete INIT: it never trained
    refused = [line for line in syncer.proc.stderr().splitlines() if "contains NaN or Inf" in line]
    assert refused and "INIT of fragment" in refused[0], syncer.proc.tail()
    assert not any(r["event"] in ("init", "commit") for r in syncer.tape_records())


OVERFLOW_ROUNDS = 12


@pytest.mark.timeout(180)
def test_a_finite_delta_that_would_overflow_the_merge_is_left_out_and_named(procs: Procs, key_file: Path) -> None:
    """3e38 is finite, so it passes the push screen; averaged with a weight near 1 and stepped with
    momentum it would turn the fragment Inf. `--merge average` merges every fragment the way the
    embedding fragment is merged (this model has none). Both learners answer every round (quorum
    2), so the huge delta is in every merge; each round commits without it, and says so."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=2, total_rounds=OVERFLOW_ROUNDS,
                          extra=["--merge", "average"])
    key = key_file.read_bytes().strip()
    island = Island(syncer, key_file)
    inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
    group = None
    seen: list[Message] = []
    try:
        island.start()
        island.train_until(lambda: island.session.layout is not None and island.session.link.initial_cut_received
                           .is_set(), 60, "the initial cut")
        peer = join_raw(syncer.port, key, 1, island.fingerprint, data_streams=2)
        group = ConnectionGroup(peer.control, peer.data, name="huge-peer", on_message=lambda m, p: inbox.put(m),
                                on_close=lambda reason: None, max_payload=lambda: 1 << 30)
        group.start()
        layout = island.session.layout
        assert layout is not None

        def answer_pulls() -> bool:
            while not inbox.empty():
                msg = inbox.get()
                seen.append(msg)
                if isinstance(msg, Pull):  # every answer huge, and weighed like a million tokens
                    delta = torch.full((layout.fragments[msg.fragment].numel,), 3e38)
                    assert group is not None
                    group.send(Push(msg.round, msg.attempt, msg.fragment, msg.version, tokens=10**6, steps=1,
                                    step_us=0, transfer=0, nbytes=0, codec=F32.wire_id), tensor_bytes(delta))
            return False

        island.train_until(answer_pulls, 120, "the final cut")
        assert island.finished and island.session.stats.final_installed
    finally:
        close_both(group, island)
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()

    records = syncer.tape_records()
    done = [r for r in records if r["event"] == "commit"]
    assert [r["round"] for r in done] == list(range(OVERFLOW_ROUNDS))
    assert all(r["learners"] == [0] and r["overflowed"] == [1] for r in done), done
    refused = [r for r in records if r["event"] == "refused" and r["learner"] == 1]
    assert [r["round"] for r in refused] == list(range(OVERFLOW_ROUNDS)) and all(r["overflow"] for r in refused)
    errors = [m for m in seen if isinstance(m, Error)]
    assert len(errors) == OVERFLOW_ROUNDS and all(e.code is ErrorCode.REFUSED for e in errors)
    assert "(largest |value| 3e+38) would overflow the merged fragment" in errors[0].reason, errors[0]
    assert "would overflow the merged fragment" in syncer.proc.stderr()
    assert syncer.checkpoint is not None
    state = load_checkpoint(syncer.checkpoint)
    assert all(bool(torch.isfinite(m).all()) for m in state.momentum)
    assert_holds_the_final_checkpoint(island, syncer)
