"""The fault matrix (DESIGN §9.2): the syncer is SIGKILLed at each named fault point, restarted
with `--resume` on the same port, and the run ends with final weights bit-identical to an
undisturbed run of the same deterministic schedule (`lockstep.py` says what makes a schedule
deterministic). The token ledger of the disturbed run equals the undisturbed one's: no round's
tokens are lost or counted twice across the crash.

The model is large enough that each fragment's push spans two 4 MiB chunks, so `mid-stripe`
really finds a transfer half received.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Procs, Syncer, checkpoint_params, commits, read_tape, start_syncer, syncer_exit_code
from lockstep import BOUNDARIES, SeededIsland, lock_step

from syncer.durability.checkpoint import load_checkpoint, tokens_by_learner

pytestmark = pytest.mark.integration

LEARNERS, FRAGMENTS, ROUNDS = 2, 2, 8
WIDTH = 1100  # two hidden 1100x1100 layers: each fragment is about 4.9 MB, two chunks

# (point, occurrence): INIT is two transfers (one mid-stripe each), every push one more; the
# first checkpoint is the initial cut's, then one per round.
MATRIX = [
    ("mid-init", 1),
    ("before-push", 5),
    ("mid-stripe", 5),
    ("mid-merge", 3),
    ("mid-checkpoint", 4),
    ("mid-bcast", 4),
    ("mid-final", 1),
]


def wide_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, 4))


class Restarter:
    """Watches the first syncer; once it dies, starts a second one with `--resume` on its port."""

    def __init__(self, procs: Procs, key_file: Path, first: Syncer, common: dict[str, Any], tape_name: str) -> None:
        self.procs, self.key_file, self.first, self.common = procs, key_file, first, common
        self.tape_name = tape_name
        self.second: Syncer | None = None
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="restarter")
        self.thread.start()

    def _watch(self) -> None:
        try:
            while not self.stop.is_set():
                code = self.first.proc.poll()
                if code is not None:
                    self.second = start_syncer(self.procs, key_file=self.key_file, port=self.first.port,
                                               tape_name=self.tape_name, resume=True, bind_retry_s=20,
                                               **self.common)
                    return
                time.sleep(0.02)
        except BaseException as exc:  # pytest.fail inside start_syncer: surfaced by the test
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(90)


def run(procs: Procs, key_file: Path, fault: str | None) -> dict[str, Any]:
    tag = (fault or "undisturbed").replace("@", "-")  # one workdir may hold both runs: keep their files apart
    common: dict[str, Any] = {"learners": LEARNERS, "quorum": LEARNERS, "fragments": FRAGMENTS,
                              "total_rounds": ROUNDS, "checkpoint_name": f"{tag}.safetensors",
                              "extra": ["--pipeline", "1", "--merge-threads", "1", "--device", "cpu",
                                        "--checkpoint-every", "1", "--final-timeout-s", "20"]}
    first = start_syncer(procs, key_file=key_file, tape_name=f"{tag}-1.jsonl",
                         env={"YETO_FAULT": fault} if fault else None, **common)
    restarter = Restarter(procs, key_file, first, common, f"{tag}-2.jsonl") if fault else None
    islands = [SeededIsland(first, key_file, lid, model=wide_model, in_features=32, **BOUNDARIES)
               for lid in range(LEARNERS)]
    try:
        try:
            lock_step(first, islands, timeout=60, faults=fault is not None)
        except BaseException:
            if restarter is not None and restarter.second is not None:
                print(f"the restarted syncer:\n{restarter.second.proc.tail()}")
            elif restarter is not None:
                print(f"no restarted syncer (first exit {first.proc.poll()}): {restarter.error!r}")
            raise
        if restarter is not None:
            restarter.close()
            if restarter.error is not None:
                raise restarter.error
    finally:
        for island in islands:
            island.close()
        if restarter is not None:
            restarter.close()
    assert first.checkpoint is not None and first.tape is not None
    last = first
    if restarter is not None:
        assert first.proc.poll() == -9, f"the syncer was not killed at {fault}\n{first.proc.tail()}"
        assert f"fault point {fault.split('@')[0]} reached" in first.proc.stderr()
        assert restarter.second is not None, "the syncer was never restarted"
        last = restarter.second
    assert syncer_exit_code(last) == 0, last.proc.tail()
    params = checkpoint_params(first.checkpoint)
    for n, island in enumerate(islands):
        assert island.finished, f"island {n} did not install the final cut"
        for name, p in island.model.named_parameters():
            assert torch.equal(p.detach(), params[name]), f"island {n}: {name} differs from the checkpoint"
    state = load_checkpoint(first.checkpoint)
    assert state.finalized and state.next_round == ROUNDS
    tapes = [read_tape(first.tape)] + ([read_tape(last.tape)] if last is not first and last.tape else [])
    by_round = {c["round"]: c for tape in tapes for c in commits(tape)}  # a redone round: the last commit counts
    assert sorted(by_round) == list(range(ROUNDS))
    # Every step is counted once per fragment, crash or not: fragment f's pushes add up to the
    # step of its last boundary (rounds f, f + P, ... are answered at steps (r + 1)·H/P).
    every = islands[0].session.boundary_every
    for lid in range(LEARNERS):
        for f in range(FRAGMENTS):
            rounds = [r for r in by_round if r % FRAGMENTS == f]
            steps = sum(by_round[r]["steps"][by_round[r]["learners"].index(lid)] for r in rounds)
            assert steps == (max(rounds) + 1) * every, (lid, f, [by_round[r]["steps"] for r in rounds])
    return {"params": params, "tokens": tokens_by_learner(state.ledger), "tapes": tapes}


_undisturbed: dict[str, Any] = {}


def undisturbed(procs: Procs, key_file: Path) -> dict[str, Any]:
    if not _undisturbed:
        _undisturbed.update(run(procs, key_file, None))
    return _undisturbed


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("point", "nth"), MATRIX, ids=[p for p, _ in MATRIX])
def test_a_syncer_killed_at_a_fault_point_resumes_to_the_same_bits(procs: Procs, key_file: Path, point: str,
                                                                   nth: int) -> None:
    reference = undisturbed(procs, key_file)
    got = run(procs, key_file, f"{point}@{nth}")
    assert got["params"].keys() == reference["params"].keys()
    for name, value in reference["params"].items():
        assert torch.equal(got["params"][name], value), f"{name} differs from the undisturbed run"
    assert got["tokens"] == reference["tokens"], "the token ledger differs from the undisturbed run"
