"""Who a finalizing syncer waits for (DESIGN §4.7): learners that trained and lost their link
without a goodbye are waited for (until --final-timeout-s); a learner says goodbye as soon as it
installed the final cut, so one that then leaves without closing politely is done."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import Island, Procs, start_syncer, syncer_exit_code, wait_until

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_a_learner_that_dropped_once_and_left_after_the_final_cut_does_not_hold_the_syncer(
        procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=12,
                          extra=["--final-timeout-s", "60"])
    island = Island(syncer, key_file, 0)
    island.start()
    try:
        island.train_until(lambda: len(syncer.commits()) >= 3, 60, "three commits")
        group = island.session.link._group
        assert group is not None
        group.close("test: the link drops without a goodbye")  # the learner redials by itself
        island.train_until(lambda: False, 60, "the final cut")
        assert island.session.stats.final_installed
        # The goodbye it says on installing the cut is what tells the syncer; then it vanishes.
        wait_until(lambda: "learner 0 says goodbye (final cut installed)" in syncer.proc.stderr(), 10,
                   "the goodbye said with the final cut", on_timeout=syncer.proc.tail)
    finally:
        island.session.link.close("test: gone without a goodbye", bye=False)
    started = time.monotonic()
    wait_until(lambda: syncer.proc.poll() is not None, 30, "the syncer to exit after the final cut")
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert time.monotonic() - started < 30  # not the 60 s final timeout
    said = syncer.proc.stderr()
    assert "learner 0 left" in said, syncer.proc.tail()  # the drop
    assert said.count("learner 0 says goodbye (final cut installed)") == 1, syncer.proc.tail()
