"""Rounds past the first allocate no new buffers, on the learner and on the syncer (DESIGN §10.1).

A fresh fragment-sized buffer costs a page fault per page as it is first written, more than
loopback moves the same bytes, so both ends recycle theirs. This run counts allocations with the
pools' own counters (the syncer's through its `/metrics`), never with timings: one learner, in
lockstep so each round is the same, 1 MiB+ fragments so every buffer is a pooled one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import Procs, commits, read_tape, start_syncer, wait_until
from tests.integration.test_metrics_endpoint import scrape
from yeto_core.buffers import MIN_POOLED_BYTES, RECEIVE_POOL, fault_in, fresh_array
from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings
from yeto_core.store import FRAGMENT_POOL

pytestmark = pytest.mark.integration
METRICS_LINE = re.compile(r"^yeto syncer metrics on (http://\S+/metrics)$", re.MULTILINE)
H, FRAGMENTS, NUMEL = 2, 2, 1 << 19  # two fragments of 2 MiB


@pytest.mark.timeout(120)
def test_rounds_after_the_first_allocate_nothing_new(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=FRAGMENTS,
                          extra=["--metrics-port", "0", "--sync-interval-steps", str(H)])
    found = METRICS_LINE.search(syncer.proc.stdout())
    assert found, syncer.proc.stdout()
    weights = [torch.rand(NUMEL), torch.rand(NUMEL)]
    settings = load_settings(LearnerSettings, syncer=syncer.address, key_file=key_file, learner_id=0, sync_interval=H,
                             lockstep=True, consensus_every=0)
    session = LearnerSession(settings, [("a", weights[0]), ("b", weights[1])])
    assert syncer.tape is not None
    tape = syncer.tape

    def train_until(rounds: int) -> None:
        def step() -> bool:
            weights[session.stats.steps % 2].add_(1e-3)
            session.step(tokens=64)
            return len(commits(read_tape(tape))) >= rounds

        wait_until(step, 60, f"{rounds} committed rounds", interval=0.0)

    def allocations() -> tuple[int, int, float]:
        syncer_side = scrape(found.group(1))[("yeto_syncer_receive_buffers_allocated", ())]
        return RECEIVE_POOL.allocated, FRAGMENT_POOL.allocated, syncer_side

    try:
        session.start()
        train_until(4)  # two rounds of each fragment: every buffer a steady round needs exists now
        warm = allocations()
        assert min(warm) > 0, warm
        if fault_in(fresh_array(MIN_POOLED_BYTES)):  # this kernel faults ranges in on request: so did the syncer
            ahead = scrape(found.group(1))[("yeto_syncer_receive_buffers_faulted_ahead", ())]
            assert ahead == FRAGMENTS, "the INIT's receive memory was not readied ahead of it"
        reused = RECEIVE_POOL.reused + FRAGMENT_POOL.reused
        train_until(14)
        assert allocations() == warm
        assert RECEIVE_POOL.reused + FRAGMENT_POOL.reused > reused  # the later rounds did draw on the pools
    finally:
        session.close()
