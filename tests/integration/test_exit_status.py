"""`python -m syncer` exits 0 after finalization, however many connections it served (DESIGN §4.7)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ABORT_AT_EXIT, Island, Procs, RawPeer, join_raw, start_syncer

pytestmark = pytest.mark.integration

ATTEMPTS = 3  # the abort this guards against was a race that hit about half of the exits


@pytest.mark.timeout(200)
def test_syncer_exits_zero_after_finalizing_with_many_streams(procs: Procs, key_file: Path) -> None:
    key = key_file.read_bytes().strip()
    for attempt in range(ATTEMPTS):
        syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=24,
                              tape_name=f"tape-{attempt}.jsonl", checkpoint_name=None,
                              extra=["--final-timeout-s", "1"])
        island = Island(syncer, key_file, 0)
        peers: list[RawPeer] = []
        try:
            island.start()
            # Silent members with many data streams: every stream's sender thread ends up holding a
            # broadcast chunk, and none of them confirms the final cut (the syncer gives up after 1 s).
            peers = [join_raw(syncer.port, key, 10 + j, island.fingerprint, data_streams=16) for j in range(8)]
            island.train_until(lambda: False, 60, "the final cut")
        finally:
            island.close()
        try:
            code = syncer.proc.wait(timeout=60)
        finally:
            for peer in peers:
                peer.close()
        err = syncer.proc.stderr()
        assert "syncer exits with code 0" in err, syncer.proc.tail()
        assert code == 0 and ABORT_AT_EXIT not in err, (
            f"attempt {attempt + 1}: exit status {code} after the syncer logged exit code 0\n{syncer.proc.tail()}")
