"""Learner processes SIGKILLed or SIGSTOPped in the middle of a round, against the real syncer.

Three learner *processes* (tests/integration/fault_learner.py, a small MLP with real SGD steps)
train with a real `python -m syncer` on loopback, quorum 2 of 3, with a checkpoint and a tape.

* SIGKILL: right after the tape shows a commit, learner 2 is SIGKILLed. With `--pipeline 2` the
  syncer has just launched a round and the one before it is still open, so learner 2 dies while it
  is a member of open rounds (which then commit with its answer, or with it `dropped`). Proven:
  it answers no round launched after the kill, every such round commits on the two survivors'
  answers, the last rounds before its restart are launched without it as a member; a restart of
  learner 2 under the same id joins under a higher connection generation and answers rounds
  again, training ends, every process alive at the end holds the final checkpoint's weights bit
  for bit, and the syncer exits 0. ("Launched after the fault" is read off the tape: round r + 3
  launches only once round r + 1 has committed, so with r the last commit on the tape right after
  the signal, every round above r + 2 was launched after it.)
* SIGSTOP: right after a commit, learner 2 is frozen for longer than the syncer's peer timeout
  (heartbeats and peer timeout are shortened by environment for this test). Proven: rounds go on
  with the two others (learner 2 first `not_waited_for`, then no longer a member once the syncer
  dropped its silent connection); after SIGCONT it redials, joins under a higher generation,
  answers rounds again, and ends with the final weights; the syncer exits 0.
* No double count, in both runs: (a) the final checkpoint's ledger equals, per
  "learner:generation" key, the tokens of the tape's commit records with each round id counted
  once, and equals the ledger of the tape's `final` record; (b) no round id is committed twice;
  (c) every committed answer is a push its learner process reported before sending it (the
  learners print each push, flushed, before it goes to the sender thread, so a SIGKILLed
  incarnation's pushes are on record), no reported push is committed twice, and per incarnation
  and fragment the committed tokens never exceed the tokens that incarnation computed.

  The ledger counts, per push, the tokens trained since *that fragment's* anchor, so a learner's
  ledger total over its P fragments is up to P times the tokens it trained; the bound on
  `tokens_by_learner` is therefore P times the tokens computed, and the exact bound is the one
  per fragment.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    Proc,
    Procs,
    Syncer,
    base_env,
    checkpoint_params,
    start_syncer,
    syncer_exit_code,
    wait_all,
    wait_until,
)
from safetensors.torch import load_file

from syncer.durability.checkpoint import ledger_key, load_checkpoint, parse_ledger_key, tokens_by_learner

pytestmark = pytest.mark.integration

LEARNER = Path(__file__).resolve().parent / "fault_learner.py"
FRAGMENTS = 4
VICTIM = 2  # not learner 0, which sends INIT
STEP_S = 0.025  # each learner step takes this long: rounds are paced to H/P = 2 steps
PIPELINE = 2
SYNCER_FLAGS = ["--grace-s", "0.2", "--final-timeout-s", "30", "--pipeline", str(PIPELINE)]


def start_learner(procs: Procs, syncer: Syncer, key_file: Path, learner_id: int, *extra: str) -> Proc:
    name = f"learner{learner_id}"
    out = procs.workdir / f"{name}.{sum(p.name == name for p in procs.started)}.safetensors"
    argv = [sys.executable, str(LEARNER), "--syncer", syncer.address, "--key-file", str(key_file),
            "--learner-id", str(learner_id), "--out", str(out), "--step-s", str(STEP_S), *extra]
    return procs.start(name, argv, output_dir=out)


def joins(records: list[dict[str, Any]], learner_id: int) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "join" and r.get("learner") == learner_id]


def commits_in(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "commit"]


def wait_for_new_commit(syncer: Syncer, timeout: float) -> None:
    """Return as soon as one more commit is on the tape (polled every 5 ms)."""
    seen = len(syncer.commits())
    wait_until(lambda: len(syncer.commits()) > seen, timeout, "one more commit", interval=0.005,
               on_timeout=syncer.proc.tail)


def last_round(syncer: Syncer) -> int:
    """The last round on the tape. Read right after a fault: every round after it + PIPELINE was
    launched after the fault (round r + 3 launches only once round r + 1 has committed)."""
    done = syncer.commits()
    return done[-1]["round"] if done else -1


def member(c: dict[str, Any]) -> bool:
    """Whether the victim may have been a member of the committed attempt: it answered, was not
    waited for, was dropped, or a late push of it was carried in (then the record cannot tell)."""
    return VICTIM in c["answered"] + c["not_waited_for"] + c["dropped"] + c["carried"]


def non_members(records: list[dict[str, Any]], n: int) -> bool:
    """Whether the last `n` commits among `records` were launched without the victim as a member."""
    done = commits_in(records)
    return len(done) >= n and not any(member(c) for c in done[-n:])


def assert_left_behind(gap: list[dict[str, Any]], last: int) -> None:
    """Rounds commit without the victim: it answers no round launched after the fault, the
    survivors' two answers make every quorum, and the last rounds before it is back were launched
    without it as a member."""
    later = [c for c in gap if c["round"] > last + PIPELINE]
    assert len(later) >= 6, f"only {len(later)} commits of rounds launched after the fault: {gap}"
    for c in later:
        assert VICTIM not in c["answered"] + c["waited_for"], c
        assert c["answered"] == [0, 1], c
    assert non_members(gap, 3), f"the syncer still counted the faulty learner as a member: {gap[-3:]}"


def assert_final_weights(learners: list[Proc], checkpoint: Path) -> None:
    reference = checkpoint_params(checkpoint)
    for lp in learners:
        assert lp.output_dir is not None
        done = lp.events("learner_done")
        assert len(done) == 1 and done[0]["finished"], f"{lp.name} did not install the final cut\n{lp.tail()}"
        model = load_file(str(lp.output_dir))
        assert model.keys() == reference.keys(), lp.name
        for name, tensor in model.items():
            assert torch.equal(tensor, reference[name]), f"{lp.name}: {name} differs from the final checkpoint"


def assert_counted_once(syncer: Syncer, incarnations: dict[int, list[Proc]]) -> dict[str, Any]:
    """The ledger checks (a), (b), (c) of the module docstring; returns a few numbers for messages."""
    assert syncer.checkpoint is not None
    records = syncer.tape_records()
    done = commits_in(records)
    rounds = [c["round"] for c in done]
    assert len(rounds) == len(set(rounds)), f"a round was committed twice: {sorted(rounds)}"  # (b)

    # (a) the ledger is the sum of the commits' tokens per (learner, generation), each round once
    expected: dict[str, int] = defaultdict(int)
    for c in {c["round"]: c for c in done}.values():
        for lid, gen, tokens in zip(c["learners"], c["generations"], c["tokens"], strict=True):
            expected[ledger_key(lid, gen)] += tokens
    state = load_checkpoint(syncer.checkpoint)
    assert state.finalized
    assert state.ledger == dict(expected), (state.ledger, dict(expected))
    final = [r for r in records if r.get("event") == "final"]
    assert len(final) == 1 and final[0]["ledger"] == state.ledger

    # (c) every committed answer is one reported push of one incarnation, committed once
    owner: dict[tuple[int, int], int] = {}  # (learner, generation) -> incarnation index
    pushes: dict[tuple[int, int], set[tuple[int, int, int, int]]] = defaultdict(set)
    computed: dict[int, list[int]] = {}  # learner -> tokens computed per incarnation (a lower bound)
    for lid, procs in incarnations.items():
        computed[lid] = []
        for n, lp in enumerate(procs):
            lines = lp.json_lines()
            for e in lines:
                if e.get("event") == "connected" or (e.get("event") == "push" and e.get("generation") is not None):
                    assert owner.setdefault((lid, e["generation"]), n) == n, f"generation {e['generation']} twice"
                if e.get("event") == "push":
                    pushes[(lid, n)].add((e["fragment"], e["base_version"], e["tokens"], e["steps"]))
            computed[lid].append(max((e["cum_tokens"] if e.get("event") == "push" else e.get("tokens", 0)
                                      for e in lines), default=0))
    used: dict[tuple[int, int, int, int, int, int], int] = {}
    by_fragment: dict[tuple[int, int, int], int] = defaultdict(int)  # (learner, incarnation, fragment)
    for c in done:
        entries = zip(c["learners"], c["generations"], c["tokens"], c["steps"], c["base_versions"], strict=True)
        for lid, gen, tokens, steps, base in entries:
            assert (lid, gen) in owner, f"round {c['round']}: learner {lid} generation {gen} is no reported connection"
            n = owner[(lid, gen)]
            push = (c["fragment"], base, tokens, steps)
            assert push in pushes[(lid, n)], (f"round {c['round']}: learner {lid} (incarnation {n}) never reported "
                                              f"a push {push}")
            first = used.setdefault((lid, n, *push), c["round"])
            assert first == c["round"], f"learner {lid}'s push {push} committed in rounds {first} and {c['round']}"
            by_fragment[(lid, n, c["fragment"])] += tokens
    for (lid, n, fragment), tokens in by_fragment.items():
        assert tokens <= computed[lid][n], (f"learner {lid} incarnation {n}, fragment {fragment}: {tokens} tokens "
                                            f"committed, {computed[lid][n]} computed")
    for lid, tokens in tokens_by_learner(state.ledger).items():
        assert tokens <= FRAGMENTS * sum(computed[lid]), (lid, tokens, computed[lid])
    assert {parse_ledger_key(k) for k in state.ledger} <= set(owner)
    return {"computed": computed, "ledger": tokens_by_learner(state.ledger), "rounds": len(done)}


@pytest.mark.timeout(60)
def test_a_learner_sigkilled_mid_round_is_not_waited_for_and_rejoins(procs: Procs, key_file: Path) -> None:
    total = 200
    syncer = start_syncer(procs, key_file=key_file, learners=3, quorum=2, fragments=FRAGMENTS, total_rounds=total,
                          extra=SYNCER_FLAGS)
    assert syncer.checkpoint is not None
    learners = [start_learner(procs, syncer, key_file, lid) for lid in range(3)]
    victim = learners[VICTIM]

    wait_until(lambda: sum(c["answered"] == [0, 1, 2] for c in syncer.commits()) >= 3, 30,
               "three commits all three learners answered", on_timeout=procs.tails)
    wait_for_new_commit(syncer, 10)
    victim.sigkill()  # a round launched at that commit, and the one before it, are open
    mark = len(syncer.tape_records())
    last = last_round(syncer)
    first_generation = joins(syncer.tape_records(), VICTIM)[-1]["generation"]
    assert len(syncer.commits()) < total - 40, "the run went too far before the kill; nothing left to check"

    wait_until(lambda: syncer.commits()[-1]["round"] >= last + PIPELINE + 6, 20, "six rounds launched after the kill",
               on_timeout=procs.tails)
    restarted = start_learner(procs, syncer, key_file, VICTIM)

    def rejoined() -> bool:
        after = syncer.tape_records()[mark:]
        again = joins(after, VICTIM)
        return bool(again) and any(VICTIM in c["answered"] for c in commits_in(after[after.index(again[0]):]))

    wait_until(rejoined, 30, "the restarted learner to rejoin and answer a round", on_timeout=procs.tails)
    survivors = [learners[0], learners[1], restarted]
    assert wait_all(survivors, timeout=40) == [0, 0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert_final_weights(survivors, syncer.checkpoint)
    assert f"learner {VICTIM} left" in syncer.proc.stderr()

    records = syncer.tape_records()
    after = records[mark:]
    rejoin = joins(after, VICTIM)[0]
    assert rejoin["generation"] > first_generation, (rejoin, first_generation)
    assert [c["round"] for c in commits_in(records)] == list(range(total))
    # Rounds launched before the kill may hold the victim's last answers, or close without it
    # (`dropped`, or `not_waited_for` until the syncer has read the reset); later ones do not count on it.
    gap = commits_in(after[: after.index(rejoin)])
    assert_left_behind(gap, last)
    assert any(VICTIM in c["answered"] for c in commits_in(after[after.index(rejoin):]))
    counts = assert_counted_once(syncer, {0: [learners[0]], 1: [learners[1]], VICTIM: [victim, restarted]})
    assert len(counts["computed"][VICTIM]) == 2 and all(counts["computed"][VICTIM]), counts
    ledger = load_checkpoint(syncer.checkpoint).ledger  # each incarnation's tokens under its own connection
    assert {ledger_key(VICTIM, first_generation), ledger_key(VICTIM, rejoin["generation"])} <= ledger.keys(), ledger


@pytest.mark.timeout(60)
def test_a_learner_sigstopped_mid_round_is_left_behind_then_catches_up(procs: Procs, key_file: Path) -> None:
    total = 200
    peer_timeout_s = 2.0
    env = base_env({"YETO_SYNCER_HEARTBEAT_S": "0.25", "YETO_SYNCER_PEER_TIMEOUT_S": str(peer_timeout_s)})
    syncer = start_syncer(procs, key_file=key_file, learners=3, quorum=2, fragments=FRAGMENTS, total_rounds=total,
                          extra=SYNCER_FLAGS, env=env)
    assert syncer.checkpoint is not None
    hb = ("--heartbeat-s", "0.25", "--peer-timeout-s", "10")
    learners = [start_learner(procs, syncer, key_file, lid, *hb) for lid in range(3)]
    victim = learners[VICTIM]

    wait_until(lambda: sum(c["answered"] == [0, 1, 2] for c in syncer.commits()) >= 3, 30,
               "three commits all three learners answered", on_timeout=procs.tails)
    wait_for_new_commit(syncer, 10)
    os.kill(victim.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        mark = len(syncer.tape_records())
        last = last_round(syncer)
        first_generation = joins(syncer.tape_records(), VICTIM)[-1]["generation"]
        assert len(syncer.commits()) < total - 40, "the run went too far before the freeze; nothing left to check"
        wait_until(lambda: syncer.commits()[-1]["round"] >= last + PIPELINE + 6, 20,
                   "six rounds launched during the freeze", on_timeout=procs.tails)
        wait_until(lambda: f"learner {VICTIM} left" in syncer.proc.stderr(), peer_timeout_s + 10,
                   "the syncer to drop the frozen learner", on_timeout=syncer.proc.tail)
        wait_until(lambda: non_members(syncer.tape_records()[mark:], 3), 10,
                   "three rounds launched without the frozen learner as a member", on_timeout=syncer.proc.tail)
        frozen = syncer.tape_records()[mark:]
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    thawed = len(syncer.tape_records())
    assert time.monotonic() - stopped_at > peer_timeout_s
    assert all(r.get("event") != "join" or r.get("learner") != VICTIM for r in frozen), "a frozen learner joined"

    def caught_up() -> bool:
        after = syncer.tape_records()[thawed:]
        again = joins(after, VICTIM)
        return bool(again) and any(VICTIM in c["answered"] for c in commits_in(after[after.index(again[0]):]))

    wait_until(caught_up, 30, "the thawed learner to rejoin and answer a round", on_timeout=procs.tails)
    assert wait_all(learners, timeout=40) == [0, 0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert_final_weights(learners, syncer.checkpoint)

    records = syncer.tape_records()
    assert [c["round"] for c in commits_in(records)] == list(range(total))
    rejoin = joins(records[thawed:], VICTIM)[0]
    assert rejoin["generation"] > first_generation, (rejoin, first_generation)
    # Rounds go on without the frozen learner: first `not_waited_for` while its connection still
    # looks alive, then not a member at all once the syncer dropped the silent connection.
    during = commits_in(frozen)
    assert_left_behind(during, last)
    assert any(VICTIM in c["not_waited_for"] for c in during if c["round"] > last + PIPELINE), (
        "the frozen learner was never left behind while still connected")
    done = victim.events("learner_done")[0]
    assert len(done["generations"]) >= 2 and done["generations"][-1] == rejoin["generation"], done
    counts = assert_counted_once(syncer, {lid: [lp] for lid, lp in enumerate(learners)})
    assert all(counts["computed"][lid][0] > 0 for lid in range(3)), counts


@pytest.mark.timeout(60)
def test_a_learner_killed_as_the_others_finish_is_waited_for_and_trains_into_the_final_cut(
    procs: Procs, key_file: Path,
) -> None:
    """Without a round budget the run ends when the learners finish; one that crashed shortly
    before must not be dropped from it: the syncer waits `--rejoin-wait-s` for it to come back."""
    # Quorum 1: a crashed learner never lowers the quorum, so at K > 1 the survivors' last rounds
    # would wait for the victim before they could finish.
    syncer = start_syncer(procs, key_file=key_file, learners=3, quorum=1, fragments=FRAGMENTS,
                          extra=[*SYNCER_FLAGS, "--rejoin-wait-s", "30"])
    assert syncer.checkpoint is not None
    survivors = [start_learner(procs, syncer, key_file, lid, "--deadline-s", "8") for lid in (0, 1)]
    victim = start_learner(procs, syncer, key_file, VICTIM, "--deadline-s", "60")

    wait_until(lambda: any(VICTIM in c["answered"] for c in syncer.commits()), 20, "the victim to answer a round",
               on_timeout=procs.tails)
    victim.sigkill()
    done = lambda: {r["learner"] for r in syncer.tape_records() if r.get("event") == "done"}  # noqa: E731
    wait_until(lambda: done() >= {0, 1}, 30, "the other two learners to finish", on_timeout=procs.tails)
    wait_until(lambda: "waiting up to 30 s" in syncer.proc.stderr(), 5, "the syncer to say whom it waits for",
               on_timeout=syncer.proc.tail)
    assert not [r for r in syncer.tape_records() if r.get("event") == "final"], "finalized without the victim"
    assert f"for learner(s) {VICTIM}, which left while training" in syncer.proc.stderr()

    restarted = start_learner(procs, syncer, key_file, VICTIM, "--deadline-s", "3")
    assert wait_all([*survivors, restarted], timeout=40) == [0, 0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    records = syncer.tape_records()
    (final,) = [r for r in records if r.get("event") == "final"]
    assert final["reason"] == "3 learner(s) finished training and none is still training", final
    rejoin = joins(records, VICTIM)[-1]
    trained = [c for c in commits_in(records[records.index(rejoin):]) if VICTIM in c["answered"]]
    assert trained, "the restarted learner's steps never reached the global model"
    assert_final_weights([*survivors, restarted], syncer.checkpoint)
    assert_counted_once(syncer, {0: [survivors[0]], 1: [survivors[1]], VICTIM: [victim, restarted]})
