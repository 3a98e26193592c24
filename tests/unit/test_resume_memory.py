"""What a resumed syncer remembers besides the model (`syncer/core/memory.py`, DESIGN §4.6): who
each recent round merged, so a push sent twice is refused after a restart as before it, kept in
the checkpoint's extra metadata and bounded to the rounds a late push may still name."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from syncer.core import records
from syncer.core.effects import Effect, Merge, Record, Send, is_ask
from syncer.core.events import Got, Joined, Merged
from syncer.core.memory import MEMBERS, MERGED_ROUNDS, keep_merged, merged_horizon, merged_rounds_of
from syncer.core.protocol import SyncerProtocol
from syncer.durability.checkpoint import SyncerState, load_checkpoint, save_checkpoint
from syncer.merge.round_merge import RoundMerger
from syncer.service.coordinator import answer
from yeto_core.codecs import F32, tensor_bytes
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.settings import SyncerSettings
from yeto_core.wire.messages import Error, Init, Manifest, Pull, Push

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SPECS = (TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32"))
LAYOUT = build_layout(SPECS, 2, "binpack")
CPU = torch.device("cpu")


class Syncer:
    """One syncer process as the protocol alone, its asks answered by the shell's `answer`."""

    def __init__(self, state: SyncerState | None = None, **settings: Any) -> None:
        config: dict[str, Any] = {"learners": 2, "fragments": 2, "grace_s": 0.0, "device": "cpu", "pipeline": 1}
        self.settings = SyncerSettings(**{**config, **settings})
        self.protocol = SyncerProtocol(self.settings, device=CPU, state=state, now=0.0)
        self.generations: dict[int, int] = {}

    def turn(self, event: Any = None) -> list[Effect]:
        out: list[Effect] = []
        batch = self.protocol.handle(0.0, event)
        while True:
            out += batch
            if not batch or not is_ask(batch[-1]):
                return out
            batch = self.protocol.handle(0.0, answer(batch[-1], LAYOUT, CPU))  # type: ignore[arg-type]

    def join(self, lid: int) -> list[Effect]:
        self.generations[lid] = self.generations.get(lid, 0) + 1
        manifest = Manifest(2, LAYOUT.pattern, SPECS) if lid == 0 else None
        return self.turn(Joined(lid, self.generations[lid], LAYOUT.fingerprint, F32.wire_id, manifest,
                                instance=bytes([lid + 1]) * 16))

    def got(self, lid: int, msg: Any, payload: bytes | None = None) -> list[Effect]:
        view = None if payload is None else memoryview(bytearray(payload))
        return self.turn(Got(lid, self.generations[lid], msg, view))


def push_of(pull: Pull, value: float) -> tuple[Push, bytes]:
    return (Push(pull.round, pull.attempt, pull.fragment, pull.version, 100, 4, 0, 0, 16, F32.wire_id),
            tensor_bytes(torch.full((4,), value)))


def pulls(effects: list[Effect]) -> list[Pull]:
    return [e.msg for e in effects if isinstance(e, Send) and isinstance(e.msg, Pull)]


def tape(effects: list[Effect], kind: type) -> list[Any]:
    return [e.record for e in effects if isinstance(e, Record) and isinstance(e.record, kind)]


def round_0_merged(path: Path) -> tuple[Push, bytes]:
    """Both learners answer round 0 and it commits; the checkpoint is written to `path`. Returns
    learner 1's push, to be sent again."""
    s = Syncer()
    s.join(0)
    s.join(1)
    cut: list[Effect] = []
    for f in LAYOUT.fragments:
        cut += s.got(0, Init(f.index, 0, 0, F32.wire_id), tensor_bytes(torch.zeros(f.numel)))
    pull = pulls(cut)[0]
    s.got(0, *push_of(pull, 1.0))
    again = push_of(pull, 3.0)
    merge = s.got(1, *again)[-1]
    assert isinstance(merge, Merge)
    outcome, back = RoundMerger(s.settings.merging).merge(merge.lent, list(merge.answers), list(merge.segments))
    s.turn(Merged(merge.round, outcome, back))
    state = s.protocol.state
    assert state is not None and state.next_round == 1
    assert state.extra[MERGED_ROUNDS] == [[0, [0, 1]]] and s.protocol.shared.merged_rounds == {0: {0, 1}}
    save_checkpoint(path, state)
    return again


def resumed(path: Path, *, forget: bool = False) -> Syncer:
    state = load_checkpoint(path)
    if forget:  # a checkpoint written before the memory was kept
        del state.extra[MERGED_ROUNDS]
    s = Syncer(state)
    s.join(0)
    s.join(1)
    return s


def test_a_resumed_syncer_still_refuses_a_push_of_a_round_it_merged(tmp_path: Path) -> None:
    path = tmp_path / "syncer.ckpt"
    duplicate = round_0_merged(path)
    s = resumed(path)
    assert s.protocol.shared.merged_rounds == {0: {0, 1}}
    effects = s.got(1, *duplicate)
    (refused,) = tape(effects, records.Refused)
    assert refused.learner == 1 and refused.round == 0 and "already merged" in refused.reason
    assert not tape(effects, records.Carry)
    (error,) = [e for e in effects if isinstance(e, Send) and isinstance(e.msg, Error)]
    assert "learner 1's answer to round 0 is already merged" in error.msg.reason  # type: ignore[union-attr]
    ledger = s.protocol.state.ledger  # type: ignore[union-attr]
    assert sum(ledger.values()) == 200  # counted once


def test_without_the_memory_the_same_push_would_be_carried_and_counted_again(tmp_path: Path) -> None:
    path = tmp_path / "syncer.ckpt"
    duplicate = round_0_merged(path)
    s = resumed(path, forget=True)
    assert s.protocol.shared.merged_rounds == {}
    effects = s.got(1, *duplicate)
    assert tape(effects, records.Carry) and not tape(effects, records.Refused)


def state_at(next_round: int, fragments: int = 4) -> SyncerState:
    return SyncerState(specs=[], num_fragments=fragments, pattern="binpack", fingerprint=b"", backend="",
                       params=[], momentum=[], versions=[0] * fragments, next_round=next_round, ledger={},
                       extra={MEMBERS: [0, 1]})


def test_the_memory_keeps_only_the_rounds_a_late_push_may_still_name() -> None:
    state = state_at(next_round=100, fragments=4)
    merged = {r: {r % 3} for r in range(100)}
    keep_merged(state, merged, max_base_lag=1)
    horizon = merged_horizon(state, 1)
    assert horizon == 100 - 4 * 3
    assert sorted(merged) == list(range(horizon, 100))
    assert state.extra[MERGED_ROUNDS] == [[r, [r % 3]] for r in range(horizon, 100)]
    assert state.extra[MEMBERS] == [0, 1]  # the rest of the metadata is left alone


def test_the_memory_is_written_afresh_each_commit_so_a_background_snapshot_keeps_what_it_copied() -> None:
    state = state_at(next_round=5)
    merged: dict[int, set[int]] = {4: {0}}
    keep_merged(state, merged, max_base_lag=1)
    snapshot = dict(state.extra)  # what `snapshots.py` copies: the dict, not its values
    merged[5] = {1}
    state.next_round = 6
    keep_merged(state, merged, max_base_lag=1)
    assert snapshot[MERGED_ROUNDS] == [[4, [0]]] and state.extra[MERGED_ROUNDS] == [[4, [0]], [5, [1]]]


def test_a_malformed_memory_is_said_and_ignored_and_an_older_checkpoint_has_none(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = state_at(next_round=3)
    state.extra[MERGED_ROUNDS] = [[1, [0, 2]], [2, [1]]]
    assert merged_rounds_of(state) == {1: {0, 2}, 2: {1}}
    for bad in ({"1": [0]}, [[1, 0]], [["1", [0]]], [[1, [0.5]]], [[True, [0]]]):
        state.extra[MERGED_ROUNDS] = bad
        with caplog.at_level(logging.WARNING, logger="yeto.syncer"):
            assert merged_rounds_of(state) == {}
        assert MERGED_ROUNDS in caplog.text
    del state.extra[MERGED_ROUNDS]
    assert merged_rounds_of(state) == {}  # a checkpoint from before it was kept
