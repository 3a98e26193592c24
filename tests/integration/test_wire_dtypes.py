"""Push and downlink codecs (DESIGN §7.3, §7.4) against the real syncer: islands on different
push codecs, and on different downlink codecs, merge into one model, and every one ends with the
syncer's exact final bits."""

from __future__ import annotations

import dataclasses
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

from syncer.durability.checkpoint import load_checkpoint

pytestmark = pytest.mark.integration

ROUNDS = 16


def train_to_the_final_cut(islands: list[Island], timeout: float = 90.0, *, started: bool = False) -> None:
    """Start the islands unless `started` (learner 0 first: it seeds the syncer) and step them in
    turn until every one has installed the final cut."""
    for island in islands if not started else ():
        island.start()
    deadline = time.monotonic() + timeout
    while not all(i.finished for i in islands) and time.monotonic() < deadline:
        for island in islands:
            if not island.finished:
                island.train_step()
        time.sleep(0.002)
    assert all(i.finished for i in islands), "the final cut did not reach every island"


def assert_hold_the_checkpoint(islands: list[Island], checkpoint: Path) -> None:
    reference = checkpoint_params(checkpoint)
    for island in islands:
        for name, param in island.model.named_parameters():
            assert torch.equal(param.detach(), reference[name]), f"learner {island.session.settings.learner_id} {name}"


@pytest.mark.timeout(120)
def test_bf16_and_f32_islands_merge_into_one_model(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=ROUNDS)
    assert syncer.checkpoint is not None and syncer.tape is not None
    islands = [Island(syncer, key_file, 0, wire_dtype="f32"), Island(syncer, key_file, 1, wire_dtype="bf16")]
    try:
        train_to_the_final_cut(islands)
        assert [i.session.link.codec.name for i in islands] == ["f32", "bf16"]
        assert all(i.session.stats.pushes > 0 for i in islands)
    finally:
        for island in islands:
            island.close()
    assert syncer_exit_code(syncer) == 0
    done = commits(read_tape(syncer.tape))
    assert [c["round"] for c in done] == list(range(ROUNDS))
    assert all(c["learners"] == [0, 1] for c in done)
    state = load_checkpoint(syncer.checkpoint)
    assert state.finalized and state.versions == [ROUNDS // 4] * 4
    assert_hold_the_checkpoint(islands, syncer.checkpoint)


@pytest.mark.timeout(120)
def test_delta_broadcasts_track_the_syncer_and_the_final_cut_is_exact(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=ROUNDS,
                          extra=["--bcast-delta-full-every", "3"])
    assert syncer.checkpoint is not None and syncer.tape is not None
    islands = [Island(syncer, key_file, 0, bcast_delta=True), Island(syncer, key_file, 1, wire_dtype="bf16")]
    try:
        train_to_the_final_cut(islands)
        reader = islands[0].session.link.downlink.reader
        decoder = reader.downlink if reader is not None else None
        assert decoder is not None and all(v >= 1 for v in decoder.versions), "no delta broadcast was applied"
        assert islands[0].session.stats.connected_generations == [1], "an anchor mismatch forced a reconnect"
    finally:
        for island in islands:
            island.close()
    assert syncer_exit_code(syncer) == 0
    assert [c["learners"] for c in commits(read_tape(syncer.tape))] == [[0, 1]] * ROUNDS
    assert_hold_the_checkpoint(islands, syncer.checkpoint)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("first", "second"), [("int8", "int4"), ("e3m0", "int4-log")])
def test_block_quantized_pushes_merge_into_one_model(procs: Procs, key_file: Path, first: str, second: str) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=ROUNDS)
    assert syncer.checkpoint is not None and syncer.tape is not None
    islands = [Island(syncer, key_file, 0, wire_dtype=first, push_block=64),
               Island(syncer, key_file, 1, wire_dtype=second, push_block=32)]
    try:
        train_to_the_final_cut(islands)
        assert all(i.session.stats.push_failures == 0 for i in islands)
    finally:
        for island in islands:
            island.close()
    assert syncer_exit_code(syncer) == 0
    records = read_tape(syncer.tape)
    assert not [r for r in records if r["event"] == "refused"], "a quantized push was refused"
    assert [c["learners"] for c in commits(records)] == [[0, 1]] * ROUNDS
    assert_hold_the_checkpoint(islands, syncer.checkpoint)


@pytest.mark.timeout(120)
def test_islands_on_different_downlink_codecs_each_follow_their_own_anchor_and_end_exact(
        procs: Procs, key_file: Path) -> None:
    """int4 and int8 downlinks, each its own chain of anchors on the syncer; the int8 island's
    link is cut mid-run, and its reconnect's FULL puts it back on its chain."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=ROUNDS * 2)
    assert syncer.checkpoint is not None and syncer.tape is not None
    relay = LoopbackRelay(("127.0.0.1", syncer.port), "relay-learner1")
    islands = [Island(syncer, key_file, 0, downlink_dtype="int4", wire_dtype="int4"),
               Island(dataclasses.replace(syncer, port=relay.port), key_file, 1, downlink_dtype="int8")]
    try:
        for island in islands:
            island.start()
        readers = [i.session.link.downlink for i in islands]
        deadline = time.monotonic() + 60
        while not all(r.reader is not None and r.reader.downlink is not None
                      and min(r.reader.downlink.versions) >= 2 for r in readers):
            assert time.monotonic() < deadline, "two delta versions of every fragment did not arrive"
            for island in islands:
                island.train_step()
            time.sleep(0.002)
        shut_both(*relay.sockets[1:])  # learner 1's link drops mid-run
        train_to_the_final_cut(islands, started=True)
        assert islands[1].session.stats.connected_generations[-1] > 1, "learner 1 never reconnected"
        assert islands[0].session.stats.connected_generations == [1], "an anchor mismatch forced a reconnect"
        for island, codec in zip(islands, ("int4", "int8"), strict=True):
            reader = island.session.link.downlink.reader
            assert reader is not None and reader.downlink is not None and reader.downlink.codec.name == codec
            assert all(v >= ROUNDS * 2 // 4 - 1 for v in reader.downlink.versions), "deltas stopped reaching it"
    finally:
        for island in islands:
            island.close()
        relay.close()
    assert syncer_exit_code(syncer) == 0
    assert [c["learners"] for c in commits(read_tape(syncer.tape))][-1] == [0, 1]
    assert_hold_the_checkpoint(islands, syncer.checkpoint)
