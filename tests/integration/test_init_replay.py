"""An INIT cut between fragments is replayed with the same result (DESIGN §4.2).

Learner 0 holds a model whose INIT spans several fragments and several chunks. A relay closes its
data stream in the middle of the INIT upload, on the first connection group only. The learner
redials, replays MANIFEST + INIT, the syncer reaches the initial cut, and the run completes. The
syncer's initial state (its checkpoint at the initial cut) is learner 0's initial weights bit for
bit, in the disturbed run as in an undisturbed one.

Both runs train under the lock-step driver (`lockstep.py`), so their final checkpoints are
compared too, bit for bit, as well as each learner against its own syncer's final checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    LoopbackRelay,
    Procs,
    Syncer,
    checkpoint_params,
    commits,
    read_tape,
    shut_both,
    start_syncer,
    syncer_exit_code,
    wait_until,
)
from lockstep import BOUNDARIES, lock_step

from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings
from yeto_core.wire.messages import CHUNK_BYTES

pytestmark = pytest.mark.integration

ROUNDS = 8
FRAGMENTS = 4
WIDTH, DEPTH = 1024, 6  # about 6.3 M parameters: 25 MB of INIT, about 6 MB (two chunks) per fragment
CUT_AFTER = 9 * 1024 * 1024  # inside fragment 1's INIT


class CuttingProxy(LoopbackRelay):
    """A loopback relay between one learner and the syncer. What the learner sends on its
    `cut_index`-th connection (0: the first control stream, 1: its first data stream) is forwarded
    up to `cut_after` bytes, then both sides of that connection are closed. Every other connection,
    and every later one, flows untouched."""

    def __init__(self, target: tuple[str, int], cut_index: int | None, cut_after: int) -> None:
        self.cut_index, self.cut_after = cut_index, cut_after
        self.cut = threading.Event()
        super().__init__(target, "cut-proxy")

    def relay(self, index: int, client: socket.socket, upstream: socket.socket) -> None:
        if index != self.cut_index:
            super().relay(index, client, upstream)
            return
        self.spawn(self._cut_uplink, client, upstream)
        self.spawn(self.downlink, upstream, client)

    def _cut_uplink(self, src: socket.socket, dst: socket.socket) -> None:
        sent = 0
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if sent + len(data) >= self.cut_after:
                    dst.sendall(data[: self.cut_after - sent])
                    self.cut.set()
                    break
                dst.sendall(data)
                sent += len(data)
        shut_both(src, dst)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()


class WideIsland:
    """An in-process learner 0 over a wide MLP with a deterministic data stream (its own generator)."""

    def __init__(self, syncer: Syncer, key_file: Path) -> None:
        torch.manual_seed(1234)
        layers: list[torch.nn.Module] = []
        for _ in range(DEPTH):
            layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
        self.model = torch.nn.Sequential(*layers[:-1])
        self.data = torch.Generator().manual_seed(99)
        self.target = torch.randn(WIDTH, WIDTH, generator=self.data) / WIDTH**0.5
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.initial = {k: v.detach().clone() for k, v in self.model.named_parameters()}
        config = load_settings(LearnerSettings, syncer=syncer.address, key_file=key_file, learner_id=0,
                               data_streams=1, sync_interval=8, init_timeout_s=60, final_timeout_s=60,
                               reconnect_max_s=1, connect_timeout_s=10, **BOUNDARIES)
        self.session = LearnerSession(config, list(self.model.named_parameters()))
        self.finished = False

    def start(self) -> None:
        """Already started by the test (the lock-step driver calls this again: nothing to do)."""

    def train_step(self) -> bool:
        x = torch.randn(8, WIDTH, generator=self.data)
        loss = torch.nn.functional.mse_loss(self.model(x), x @ self.target)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.finished = self.session.step(tokens=8)
        return self.finished


def one_run(procs: Procs, key_file: Path, *, cut: bool) -> dict[str, Any]:
    """Run ROUNDS rounds with one learner behind a relay (cutting or not); what the test compares."""
    tag = "cut" if cut else "clean"
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=FRAGMENTS,
                          total_rounds=ROUNDS, tape_name=f"tape-{tag}.jsonl",
                          checkpoint_name=f"syncer-{tag}.safetensors")
    assert syncer.checkpoint is not None and syncer.tape is not None
    tape, checkpoint = syncer.tape, syncer.checkpoint
    proxy = CuttingProxy(("127.0.0.1", syncer.port), 1 if cut else None, CUT_AFTER)
    island = WideIsland(dataclasses.replace(syncer, port=proxy.port), key_file)
    started = False
    try:
        island.session.start()  # returns once the initial cut is installed; no step has run yet
        started = True
        records = wait_until(lambda: [r for r in read_tape(tape) if r.get("event") == "init"], 30,
                             "the syncer's initial cut", on_timeout=syncer.proc.tail)
        assert island.session.initial_cut_installed, "the learner started training without the initial cut"
        # No push can have happened (no step ran), so the checkpoint still holds the initial cut.
        init_copy = procs.workdir / f"init-{tag}.safetensors"
        shutil.copyfile(checkpoint, init_copy)
        lock_step(syncer, [island], timeout=120, faults=cut)  # type: ignore[list-item]
        generations = list(island.session.stats.connected_generations)
        final_learner = {k: v.detach().clone() for k, v in island.model.named_parameters()}
    finally:
        if started:
            island.session.close()
        proxy.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    tape_records = read_tape(tape)
    assert [c["round"] for c in commits(tape_records)] == list(range(ROUNDS)), syncer.proc.tail()
    return {
        "init_records": records,
        "init": checkpoint_params(init_copy),
        "final": checkpoint_params(checkpoint),
        "final_learner": final_learner,
        "initial_weights": island.initial,
        "generations": generations,
        "proxy_cut": proxy.cut.is_set(),
        "connections": proxy.connections,
        "syncer_log": syncer.proc.stderr(),
    }


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert set(a) == set(b), f"{what}: {sorted(set(a) ^ set(b))}"
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, f"{what}: {name}"
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


@pytest.mark.timeout(300)
def test_an_init_cut_mid_upload_is_replayed_with_the_same_initial_cut(procs: Procs, key_file: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="yeto.client")
    nbytes = WIDTH * (WIDTH + 1) * DEPTH * 4
    assert nbytes // FRAGMENTS > CHUNK_BYTES, "each fragment's INIT must span more than one chunk"
    assert nbytes // 2 > CUT_AFTER, "the cut must fall in the middle of the upload"

    clean = one_run(procs, key_file, cut=False)
    assert "INIT upload interrupted" not in caplog.text, caplog.text
    caplog.clear()
    disturbed = one_run(procs, key_file, cut=True)
    # The learner saw its upload fail mid-way (not after it), then uploaded all of it again.
    assert "INIT upload interrupted" in caplog.text, caplog.text
    assert caplog.text.count("INIT of 4 fragments") == 1, caplog.text

    assert not clean["proxy_cut"] and clean["generations"] == clean["generations"][:1], clean["generations"]
    assert disturbed["proxy_cut"], "the relay never cut the INIT upload"
    assert len(disturbed["generations"]) >= 2, f"the learner never redialed: {disturbed['generations']}"
    assert disturbed["connections"] >= 4, "the learner did not open a second connection group"
    assert len(disturbed["init_records"]) == 1, disturbed["init_records"]
    assert "learner 0 left" in disturbed["syncer_log"], "the syncer never saw the first connection group go"

    for run in (clean, disturbed):
        assert_equal(run["init"], run["initial_weights"], "the syncer's initial cut vs learner 0's initial weights")
        assert_equal(run["final"], run["final_learner"], "the learner's final weights vs the syncer's final checkpoint")
    assert_equal(disturbed["init"], clean["init"], "the initial cut after a replayed INIT vs an undisturbed one")
    assert_equal(disturbed["final"], clean["final"], "the final model after a replayed INIT vs an undisturbed one")
