"""Background checkpoints: one writer at a time, the newest lands last, failures surface."""

from pathlib import Path

import pytest
import torch

from syncer import snapshots
from syncer.checkpoint import CheckpointError, SyncerState, load_checkpoint
from syncer.snapshots import CheckpointWriter
from yeto_core.layout import TensorSpec, build_layout

pytestmark = pytest.mark.unit


def state(value: float, round_id: int) -> SyncerState:
    specs = [TensorSpec("emb.weight", (8, 4), "float32", embedding=True), TensorSpec("layers.0.w", (4, 4), "float32")]
    layout = build_layout(specs, 2)
    return SyncerState(specs=specs, num_fragments=2, pattern="binpack", fingerprint=layout.fingerprint, backend="b",
                       params=[torch.full((f.numel,), value) for f in layout.fragments],
                       momentum=[torch.zeros(f.numel) for f in layout.fragments], versions=[round_id, round_id],
                       next_round=round_id, ledger={"0": round_id})


def test_a_background_write_is_a_snapshot_that_later_commits_cannot_touch(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    writer = CheckpointWriter(path, background=True)
    live = state(1.0, 3)
    writer.save(live)
    live.params[0].fill_(99.0)  # a commit right after the snapshot
    live.versions[0] = 4
    writer.wait()
    back = load_checkpoint(path)
    assert back.versions == [3, 3] and torch.equal(back.params[0], torch.full_like(back.params[0], 1.0))


def test_the_newest_checkpoint_lands_last(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    writer = CheckpointWriter(path, background=True)
    for r in range(1, 6):
        writer.save(state(float(r), r))
    writer.save(state(9.0, 9), wait=True)  # a synchronous save waits for the one in flight
    assert load_checkpoint(path).next_round == 9


def test_a_failed_write_surfaces_and_the_previous_file_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    writer = CheckpointWriter(path, background=True)
    writer.save(state(1.0, 1), wait=True)

    def broken(*args: object, **kwargs: object) -> int:
        raise OSError("disk full")

    monkeypatch.setattr(snapshots, "save_checkpoint", broken)
    writer.save(state(2.0, 2))
    with pytest.raises(CheckpointError, match=r"disk full.*previous checkpoint is intact"):
        writer.wait()
    assert load_checkpoint(path).next_round == 1
    writer.wait()  # reported once


def test_foreground_writes_are_durable_on_return(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    CheckpointWriter(path, background=False).save(state(5.0, 7))
    assert load_checkpoint(path).next_round == 7
