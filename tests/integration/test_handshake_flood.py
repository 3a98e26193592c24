"""Nobody can lock learners out of the syncer without the key (issue 14, DESIGN §9.4).

* A slowloris crowd (100 connections from another address, each trickling a byte a second and
  reconnecting when cut) against a syncer under `ulimit -n 64`, while two real HF learners train:
  the whole-handshake deadline and the caps on unauthenticated connections (in all, and per
  address) keep descriptors for the learners. One learner is frozen past the peer timeout
  mid-flood, so the syncer drops it; thawed, it redials and rejoins within seconds while the
  crowd is still at it. Both finish on the final cut bit for bit, and the syncer's log speaks of
  the crowd in a few lines, not one per connection.
* Descriptor exhaustion: with the cap lifted, silent connections use up every descriptor and
  `accept()` fails with EMFILE. The accept loop backs off and retries (one log line for the
  burst) instead of ending, so once the deadline has cut the crowd an honest learner is greeted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import (
    Procs,
    Syncer,
    assert_bit_identical,
    base_env,
    checkpoint_params,
    join_raw,
    model_dir,
    model_tensors,
    start_learner,
    start_syncer,
    syncer_exit_code,
    wait_all,
    wait_until,
)
from crowd import Crowd

pytestmark = pytest.mark.integration

DESCRIPTORS = 64
DEADLINE_S = 3.0


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def crowd_lines(syncer: Syncer) -> list[str]:
    return [line for line in syncer.proc.stderr().splitlines()
            if "too many unauthenticated connections" in line or "handshakes cut at" in line
            or "handshake with" in line or "handshakes failed" in line]


@pytest.mark.timeout(300)
def test_slowloris_crowd_under_a_low_descriptor_limit_locks_no_learner_out(procs: Procs, key_file: Path) -> None:
    env = base_env({"YETO_SYNCER_HANDSHAKE_TIMEOUT_S": str(DEADLINE_S), "YETO_SYNCER_PEER_TIMEOUT_S": "3",
                    "YETO_SYNCER_HEARTBEAT_S": "0.5"})
    # No round budget: the run ends when both learners have trained their steps, well after the flood.
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=1, fragments=4, env=env,
                          max_descriptors=DESCRIPTORS)
    learners = [start_learner(procs, syncer, key_file, i, max_steps=1500, peer_timeout_s=3, heartbeat_s=0.5)
                for i in range(2)]
    # Quorum 1: learner 0 alone can commit, so wait for both to have joined before the flood.
    wait_until(lambda: len(syncer.commits()) >= 4 and all(f"learner {i} joined" in syncer.proc.stderr()
                                                          for i in range(2)),
               90, "both learners joined and four commits before the flood", on_timeout=procs.tails)
    assert all(lp.poll() is None for lp in learners), procs.tails()
    before = open_descriptors(syncer.proc.pid)

    # The crowd comes from another address (all of 127/8 is loopback), as an attacker's would.
    with Crowd(syncer.port, 100, source="127.0.0.2") as crowd:
        wait_until(lambda: crowd.opened >= 200 and crowd.cut >= 100, 60, "the crowd to be cut and come back",
                   on_timeout=procs.tails)
        victim = learners[1]
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: "learner 1 left" in syncer.proc.stderr(), 30,
                       "the syncer to drop the frozen learner", on_timeout=syncer.proc.tail)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        thawed = time.monotonic()

        def rejoined() -> bool:
            return len([r for r in syncer.tape_records() if r["event"] == "join" and r["learner"] == 1]) >= 2

        wait_until(rejoined, 60, "the thawed learner to rejoin during the flood", on_timeout=procs.tails)
        rejoin_s = time.monotonic() - thawed
        peak = open_descriptors(syncer.proc.pid)
        opened, cut = crowd.opened, crowd.cut
        assert crowd.open_now() > 0, "the crowd was not there when the learner rejoined"

    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    final = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        assert_bit_identical(model_tensors(model_dir(lp)), final, lp.name)
    rounds = [c["round"] for c in syncer.commits()]
    assert rounds == list(range(len(rounds))), "a round was lost or committed twice"

    # The cap and deadline held the crowd to a few descriptors; the log spoke of it per burst.
    assert peak < DESCRIPTORS, (before, peak)
    assert rejoin_s < 15, f"the thawed learner took {rejoin_s:.0f} s to rejoin through the flood"
    lines = crowd_lines(syncer)
    assert opened >= 200 and cut >= 100
    assert len(lines) <= 20, f"{len(lines)} log lines for {opened} crowd connections:\n" + "\n".join(lines[:30])
    assert any("too many unauthenticated connections" in line for line in lines), syncer.proc.tail()


@pytest.mark.timeout(120)
def test_accept_survives_descriptor_exhaustion(procs: Procs, key_file: Path, tmp_path: Path) -> None:
    env = base_env({"YETO_SYNCER_HANDSHAKE_TIMEOUT_S": "2"})
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, env=env,
                          max_descriptors=DESCRIPTORS, extra=["--max-handshakes", "4096"])
    key = key_file.read_bytes().strip()
    silent: list[socket.socket] = []
    try:
        for _ in range(DESCRIPTORS + 16):  # more than the syncer can hold: the rest wait in its backlog
            silent.append(socket.create_connection(("127.0.0.1", syncer.port), timeout=5))
        wait_until(lambda: "accept() failing" in syncer.proc.stderr(), 20, "accept() to fail with EMFILE",
                   on_timeout=syncer.proc.tail)
        assert "Too many open files" in syncer.proc.stderr(), syncer.proc.tail()
    finally:
        for sock in silent:  # whatever the syncer did not cut yet goes now
            sock.close()

    def greeted() -> bool:
        with contextlib.suppress(OSError, AssertionError):
            join_raw(syncer.port, key, 0, bytes(32)).close()
            return True
        return False

    wait_until(greeted, 30, "an honest learner to be greeted after the exhaustion", interval=0.5,
               on_timeout=syncer.proc.tail)
    assert syncer.proc.poll() is None, syncer.proc.tail()
    failing = [line for line in syncer.proc.stderr().splitlines() if "accept() failing" in line]
    assert 1 <= len(failing) <= 2, failing  # the burst's first line, and its end when it went quiet
