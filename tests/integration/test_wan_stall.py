"""WAN robustness (DESIGN §7.6): a data stream that stops moving mid-push is detected by the stall
watchdog, the learner redials, and the run still ends with every learner holding the syncer's bits;
under a deterministic lock-step schedule the stalled run ends with exactly the bits of an
undisturbed one (the syncer re-pulls the round and both islands replay their pushes)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    Island,
    LoopbackRelay,
    Procs,
    checkpoint_params,
    commits,
    read_tape,
    shut_both,
    start_syncer,
    syncer_exit_code,
)
from lockstep import BOUNDARIES, SeededIsland, lock_step

pytestmark = pytest.mark.integration

ROUNDS = 24
STALL_S = 1.0


class StallingProxy(LoopbackRelay):
    """A loopback TCP relay between one learner and the syncer. `freeze(i)` stops forwarding what
    the learner sends on the i-th connection it opened (connection 0 is a control stream, the
    ones after it its data streams); everything else, and every later connection, flows."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.frozen: list[threading.Event] = []
        super().__init__(target, "stall-proxy")

    def relay(self, index: int, client: socket.socket, upstream: socket.socket) -> None:
        frozen = threading.Event()
        self.frozen.append(frozen)
        self.spawn(self._stallable_uplink, client, upstream, frozen)
        self.spawn(self.downlink, upstream, client)

    @staticmethod
    def _stallable_uplink(src: socket.socket, dst: socket.socket, frozen: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                while frozen.is_set():
                    time.sleep(0.05)  # hold the bytes: the stream stalls with the socket still open
                    if src.fileno() < 0:
                        return
                dst.sendall(data)
        shut_both(src, dst)

    def freeze(self, index: int) -> None:
        self.frozen[index].set()


@pytest.mark.timeout(120)
def test_a_stalled_data_stream_is_detected_and_the_learner_redials(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=ROUNDS,
                          extra=["--wan-stall-timeout-s", str(STALL_S)])
    assert syncer.checkpoint is not None and syncer.tape is not None
    proxy = StallingProxy(("127.0.0.1", syncer.port))
    via_proxy = dataclasses.replace(syncer, port=proxy.port)
    island = Island(via_proxy, key_file, 0, data_streams=1, wan_stall_timeout_s=STALL_S)
    try:
        island.start()
        tape = syncer.tape
        island.train_until(lambda: len(commits(read_tape(tape))) >= 6, 60, "6 commits before the stall")
        proxy.freeze(1)  # the learner's only data stream: its next push stalls mid-flight
        island.train_until(lambda: False, 90, "the final cut")
        assert island.finished
        assert len(island.session.stats.connected_generations) >= 2, "the learner never redialed"
    finally:
        island.close()
        proxy.close()
    assert syncer_exit_code(syncer) == 0
    log = syncer.proc.stderr()
    assert f"an inbound message stopped growing for {STALL_S:g} s" in log, syncer.proc.tail()
    done = commits(read_tape(syncer.tape))
    assert [c["round"] for c in done] == list(range(ROUNDS))
    reference = checkpoint_params(syncer.checkpoint)
    for name, param in island.model.named_parameters():
        assert torch.equal(param.detach(), reference[name]), name


DETERMINISTIC_ROUNDS = 12
STALLED_ROUND = 5


def two_island_run(procs: Procs, key_file: Path, tag: str, *, stall: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Two islands in lock step (`lockstep.py`), island 1 through a stalling proxy; with `stall`,
    island 1's data stream freezes right before the boundary step that answers STALLED_ROUND."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4,
                          total_rounds=DETERMINISTIC_ROUNDS, tape_name=f"{tag}.jsonl",
                          checkpoint_name=f"{tag}.safetensors",
                          extra=["--wan-stall-timeout-s", str(STALL_S), "--pipeline", "1", "--merge-threads", "1",
                                 "--device", "cpu", "--final-timeout-s", "20"])
    assert syncer.checkpoint is not None
    proxy = StallingProxy(("127.0.0.1", syncer.port))
    routes = [syncer, dataclasses.replace(syncer, port=proxy.port)]
    islands = [SeededIsland(routes[lid], key_file, lid, data_streams=1, wan_stall_timeout_s=STALL_S, **BOUNDARIES)
               for lid in range(2)]
    stall_step = (STALLED_ROUND + 1) * islands[1].session.sync_interval // 4

    def before_step(n: int, step: int) -> None:
        if stall and n == 1 and step == stall_step:
            proxy.freeze(1)  # island 1's only data stream: the push it makes at this step stalls mid-flight

    try:
        lock_step(syncer, islands, timeout=60, faults=stall, before_step=before_step)
        generations = len(islands[1].session.stats.connected_generations)
    finally:
        for island in islands:
            island.close()
        proxy.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    params = checkpoint_params(syncer.checkpoint)
    for n, island in enumerate(islands):
        for name, p in island.model.named_parameters():
            assert torch.equal(p.detach(), params[name]), f"island {n}: {name} differs from the checkpoint"
    if stall:
        assert f"an inbound message stopped growing for {STALL_S:g} s" in syncer.proc.stderr(), syncer.proc.tail()
    return params, generations


@pytest.mark.timeout(150)
def test_a_stalled_push_is_recovered_to_the_bits_of_an_undisturbed_run(procs: Procs, key_file: Path) -> None:
    calm, calm_links = two_island_run(procs, key_file, "undisturbed", stall=False)
    stalled, stalled_links = two_island_run(procs, key_file, "stalled", stall=True)
    assert calm_links == 1 and stalled_links >= 2, "the stalled island never redialed"
    assert calm.keys() == stalled.keys()
    for name, value in calm.items():
        assert torch.equal(stalled[name], value), f"{name}: the stalled run differs from the undisturbed one"
