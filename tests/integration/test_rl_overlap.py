"""Overlapping RL islands (`rl_mode=overlap`, DESIGN §3.4) count every step exactly once, across syncer
crashes too.

Two islands against the real syncer, each a learner session over two integer-valued tensors (one
fragment each). An RL iteration adds known integers, then sweeps: the push goes out and the island
trains the next iteration at once, rebasing the merge in at the next sweep. The syncer averages the
two pushes with equal weights and steps by lr 1 without momentum, so the global model moves by the
mean of the islands' progress, exactly: whatever the schedule, the final model is the initial one
plus the mean of everything each island trained, iff every step's progress reached one merge,
once. The syncer is also SIGKILLed before a commit, mid-broadcast after one, and between the two
rounds of one sweep, and resumed from its checkpoint on the same port; the islands redial, replay
what was lost, and end at the same exact values, with each fragment's steps and tokens counted once.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Procs, Syncer, checkpoint_params, commits, read_tape, start_syncer, syncer_exit_code

from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings

pytestmark = pytest.mark.integration

N, FRAGMENTS, ITERATIONS, TOKENS = 6, 2, 4, 10
ROUNDS = ITERATIONS * FRAGMENTS
SYNCER = {"learners": 2, "quorum": 2, "fragments": FRAGMENTS, "total_rounds": ROUNDS,
          "extra": ["--pipeline", str(FRAGMENTS), "--sync-interval-steps", "0", "--merge", "average",
                    "--delta-correction", "none", "--outer-lr", "1", "--outer-momentum", "0",
                    "--checkpoint-every", "1", "--final-timeout-s", "30"]}


def progress(learner: int, iteration: int) -> torch.Tensor:
    """What iteration `iteration` of island `learner` adds to each tensor: distinct small integers."""
    return (learner + 1) * (torch.arange(N, dtype=torch.float32) + iteration + 1)


def expected() -> torch.Tensor:
    """Zero plus, per iteration, the mean of the two islands' progress (exact: halves of integers)."""
    return sum((progress(0, k) + progress(1, k)) / 2 for k in range(ITERATIONS))  # type: ignore[return-value]


class IntegerIsland:
    def __init__(self, syncer: Syncer, key_file: Path, learner_id: int) -> None:
        self.learner_id = learner_id
        self.a, self.b = torch.zeros(N), torch.zeros(N)
        settings = load_settings(LearnerSettings, syncer=syncer.address, key_file=key_file, learner_id=learner_id,
                                 rl_mode="overlap", final_flush=True, reconnect_max_s=1, consensus_every=0,
                                 init_timeout_s=60, final_timeout_s=90)
        self.session = LearnerSession(settings, [("a", self.a), ("b", self.b)])

    def iterate(self, iteration: int) -> None:
        """One RL iteration: an update that adds known integers, then the sweep (returns at once)."""
        self.a.add_(progress(self.learner_id, iteration))
        self.b.add_(progress(self.learner_id, iteration))
        self.session.step(TOKENS)
        self.session.sweep()

    def holds_pulls_for(self, iteration: int) -> bool:
        """The syncer asked for every fragment of `iteration`'s sweep (its rounds are launched)."""
        wanted = set(range(iteration * FRAGMENTS, (iteration + 1) * FRAGMENTS))
        return wanted <= {pull.round for pull in self.session.pending_pulls()}


class Restarter(threading.Thread):
    """Once the first syncer dies, starts a second with `--resume` on its port."""

    def __init__(self, procs: Procs, key_file: Path, first: Syncer) -> None:
        super().__init__(daemon=True, name="restarter")
        self.procs, self.key_file, self.first = procs, key_file, first
        self.second: Syncer | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                if self.first.proc.poll() is not None:
                    self.second = start_syncer(self.procs, key_file=self.key_file, port=self.first.port,
                                               tape_name="tape-2.jsonl", resume=True, bind_retry_s=20, **SYNCER)
                    return
                time.sleep(0.02)
        except BaseException as exc:  # pytest.fail inside start_syncer: raised by the test
            self.error = exc


def run(procs: Procs, key_file: Path, fault: str | None) -> tuple[list[IntegerIsland], Syncer, Syncer]:
    first = start_syncer(procs, key_file=key_file, tape_name="tape-1.jsonl",
                         env={"YETO_FAULT": fault} if fault else None, **SYNCER)
    restarter = Restarter(procs, key_file, first) if fault else None
    islands = [IntegerIsland(first, key_file, lid) for lid in (0, 1)]
    try:
        starting = [threading.Thread(target=island.session.start) for island in islands]
        for thread in starting:  # learner 1 waits for learner 0's initial cut
            thread.start()
        for thread in starting:
            thread.join(90)
        for k in range(ITERATIONS):
            for island in islands:
                island.iterate(k)
            deadline = time.monotonic() + 60
            # Keep the islands' sweeps aligned (one iteration per push, so equal weights): the next
            # update starts once the syncer asks for its rounds. Meanwhile the islands only take in
            # what arrives (re-pulls after a restart are answered as they come); the merges of this
            # iteration are rebased in by the next sweep, after the next update trained on top.
            while k + 1 < ITERATIONS and not all(island.holds_pulls_for(k + 1) for island in islands):
                assert time.monotonic() < deadline, f"the rounds of iteration {k + 1} were never launched"
                for island in islands:
                    island.session.pump(0.01)
        finishing = [threading.Thread(target=island.session.finish) for island in islands]
        for thread in finishing:
            thread.start()
        for thread in finishing:
            thread.join(120)
    finally:
        for island in islands:
            island.session.close()
        if restarter is not None:
            restarter.done.set()
            restarter.join(60)
    last = first
    if restarter is not None:
        if restarter.error is not None:
            raise restarter.error
        assert first.proc.poll() == -9, f"the syncer was not killed at {fault}\n{first.proc.tail()}"
        assert restarter.second is not None, "the syncer was never restarted"
        last = restarter.second
    assert syncer_exit_code(last) == 0, last.proc.tail()
    return islands, first, last


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", [None, "mid-merge@3", "mid-bcast@3", "mid-merge@4"],
                         ids=["undisturbed", "killed-before-a-commit", "killed-mid-broadcast",
                              "killed-between-the-rounds-of-a-sweep"])
def test_overlapping_islands_merge_every_step_exactly_once(procs: Procs, key_file: Path, fault: str | None) -> None:
    islands, first, last = run(procs, key_file, fault)
    want = expected()
    assert first.checkpoint is not None
    final = checkpoint_params(first.checkpoint)
    for island in islands:
        assert island.session.stats.final_installed, f"island {island.learner_id} has no final cut"
        assert island.session.stats.rebases >= ITERATIONS - 1  # merges came in under later progress
        for name, tensor in (("a", island.a), ("b", island.b)):
            assert torch.equal(tensor, want), (island.learner_id, name, tensor, want)
            assert torch.equal(final[name], want), name
    tapes: list[list[dict[str, Any]]] = [read_tape(first.tape)]  # type: ignore[arg-type]
    if last is not first:
        tapes.append(read_tape(last.tape))  # type: ignore[arg-type]
    by_round = {c["round"]: c for tape in tapes for c in commits(tape)}  # a redone round: the last commit counts
    assert sorted(by_round) == list(range(ROUNDS))
    for lid in (0, 1):
        for f in range(FRAGMENTS):
            mine = [(c["steps"][c["learners"].index(lid)], c["tokens"][c["learners"].index(lid)])
                    for r, c in by_round.items() if r % FRAGMENTS == f]
            assert sum(s for s, _ in mine) == ITERATIONS and sum(t for _, t in mine) == ITERATIONS * TOKENS, mine
