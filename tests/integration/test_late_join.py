"""A learner that (re)joins while the syncer is sending the final cut (DESIGN §3.7, §4.7)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from conftest import Island, Procs, checkpoint_params, join_raw, start_syncer, syncer_exit_code, wait_until

pytestmark = pytest.mark.integration

INIT_TIMEOUT_S = 8.0


@pytest.mark.timeout(120)
def test_learner_joining_during_finalization_takes_the_final_cut_at_once(procs: Procs, key_file: Path) -> None:
    # The silent peer never says goodbye, so once it closes the syncer waits out its final timeout
    # for it to come back (only a goodbye says the cut arrived): short here, so the syncer then exits.
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=1, fragments=4, total_rounds=8,
                          extra=["--final-timeout-s", "15"])
    assert syncer.checkpoint is not None
    key = key_file.read_bytes().strip()
    first = Island(syncer, key_file, 0)
    late: Island | None = None
    silent = None
    try:
        first.start()
        # An authenticated peer that never confirms the final cut keeps the syncer finalizing.
        silent = join_raw(syncer.port, key, 5, first.fingerprint)
        wait_until(lambda: "learner 5 joined" in syncer.proc.stderr(), 20, "the silent peer to join",
                   on_timeout=syncer.proc.tail)
        first.train_until(lambda: False, 60, "the final cut")
        wait_until(lambda: "finalizing" in syncer.proc.stderr(), 20, "the syncer to finalize",
                   on_timeout=syncer.proc.tail)

        late = Island(syncer, key_file, 1, init_timeout_s=INIT_TIMEOUT_S)
        t0 = time.monotonic()
        late.start()
        waited = time.monotonic() - t0
        assert late.session.link.refused is None
        assert waited < INIT_TIMEOUT_S / 2, f"start() blocked {waited:.1f} s although the final cut had arrived"
        assert late.train_step(), "the first step after joining must install the final cut and stop"
        ckpt = checkpoint_params(syncer.checkpoint)
        for name, param in late.model.named_parameters():
            assert torch.equal(param.detach(), ckpt[name]), name
    finally:
        for island in (first, late):
            if island is not None:
                island.close()
        if silent is not None:
            silent.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
