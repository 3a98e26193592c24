"""A learner that stops reading its sockets (its receive window full) while the others go on: the
syncer's coordinator never waits on it. Control frames go out on each connection's own sender
thread, so rounds keep committing at the honest learners' pace until the stuck connection's
send deadline closes it. (With the frames written on the coordinator's thread, as before, one
commit here waited 10.7 s: the whole send deadline.)"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from conftest import Island, Procs, base_env, join_raw, start_syncer, wait_until

from yeto_core.wire.messages import Push

pytestmark = pytest.mark.integration

HEARTBEAT_S = 20.0  # a control send to a peer that reads nothing gives up after half of it: 10 s
FLOOD = 4000  # pushes the syncer refuses, each with an ERROR the stuck peer never reads


@pytest.mark.timeout(180)
def test_a_learner_that_stops_reading_stalls_no_round(procs: Procs, key_file: Path) -> None:
    env = base_env({"YETO_SYNCER_HEARTBEAT_S": str(HEARTBEAT_S), "YETO_SYNCER_PEER_TIMEOUT_S": "60"})
    syncer = start_syncer(procs, key_file=key_file, learners=3, quorum=2, fragments=2, env=env,
                          extra=["--grace-s", "0"])
    key = key_file.read_bytes().strip()
    islands = [Island(syncer, key_file, i) for i in range(2)]
    peer = None

    def train(until: float) -> None:  # both honest islands, step by step, in this thread
        while time.monotonic() < until:
            for island in islands:
                assert not island.train_step(), "the run ended early"
            time.sleep(0.002)

    try:
        islands[0].start()
        islands[1].start()
        train(time.monotonic() + 3.0)
        assert len(syncer.commits()) >= 3, syncer.proc.tail()
        peer = join_raw(syncer.port, key, 2, islands[0].fingerprint, rcvbuf=4096)
        train(time.monotonic() + 1.0)
        flood_at = time.time()
        bad = Push(0, 0, 0, 0, tokens=1, steps=1, step_us=0, transfer=0, nbytes=0, codec=99)  # wrong codec
        for i in range(FLOOD):
            peer.control.send_frame(Push(0, 0, 0, 0, 1, 1, 0, i + 1, 0, 99) if i else bad)
        wait_until(lambda: (train(time.monotonic() + 0.5), "learner 2 left" in syncer.proc.stderr())[1], 60,
                   "the syncer to give up on the peer that reads nothing", on_timeout=syncer.proc.tail)
        left_at = time.time()
        train(time.monotonic() + 2.0)
    finally:
        if peer is not None:
            peer.close()
        for island in islands:
            island.close()

    refused = [r for r in syncer.tape_records() if r["event"] == "refused" and r["learner"] == 2]
    assert refused, "the flood was never answered"
    commits = [r for r in syncer.commits() if flood_at <= r["t"] <= left_at + 2.0]
    assert len(commits) >= 5, (len(commits), syncer.proc.tail())
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(commits)]
    assert max(gaps) < HEARTBEAT_S / 4, f"a commit waited {max(gaps):.1f} s on the stuck peer"
    assert all(2 not in r["learners"] for r in commits)
    # It went at its control stream's send deadline, not for silence (it kept talking).
    assert "learner 2 left (send failed on control stream: timed out)" in syncer.proc.stderr(), syncer.proc.tail()
    assert left_at - flood_at < 40, "the peer that reads nothing was dropped only for its silence"
