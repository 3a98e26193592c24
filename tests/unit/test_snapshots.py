"""Background checkpoints: one writer at a time, the newest lands last, failures surface."""

import contextlib
import threading
import time
from collections.abc import Iterator
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
    writer.preserve(0)  # what the coordinator does before a commit changes fragment 0
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


def big_state(value: float, fragments: int = 4) -> SyncerState:
    specs = [TensorSpec(f"layers.{i}.w", (512, 512), "float32") for i in range(fragments)]
    layout = build_layout(specs, fragments)
    return SyncerState(specs=specs, num_fragments=fragments, pattern="binpack", fingerprint=layout.fingerprint,
                       backend="b", params=[torch.full((f.numel,), value) for f in layout.fragments],
                       momentum=[torch.full((f.numel,), -value) for f in layout.fragments],
                       versions=[1] * fragments, next_round=4, ledger={"0:1": 4})


def test_only_fragments_changed_before_the_writer_read_them_are_copied(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    gate, reading = threading.Event(), threading.Event()
    real_read = snapshots.CopyOnWrite.read

    @contextlib.contextmanager
    def slow_read(self: snapshots.CopyOnWrite, kind: str, fragment: int) -> Iterator[torch.Tensor]:
        with real_read(self, kind, fragment) as t:
            if kind == "param" and fragment == 1:
                reading.set()
                assert gate.wait(10)  # hold the writer in the middle of reading fragment 1's params
            yield t

    monkeypatch.setattr(snapshots.CopyOnWrite, "read", slow_read)
    writer = CheckpointWriter(path, background=True)
    live = big_state(1.0)
    writer.save(live)
    assert reading.wait(10)
    # The writer is at fragment 1: fragment 0's params are written, 2 and 3 not yet read at all.
    for f in (2, 3):
        writer.preserve(f)
        live.params[f].fill_(50.0 + f)
        live.momentum[f].fill_(60.0 + f)
    blocked = threading.Thread(target=writer.preserve, args=(1,))
    blocked.start()  # waits until the writer has finished reading fragment 1's piece
    time.sleep(0.1)
    assert blocked.is_alive(), "preserve did not wait for the piece being read"
    gate.set()
    blocked.join(10)
    live.params[1].fill_(51.0)
    writer.wait()
    assert sorted(writer.last_copied) == [1, 2, 3]
    back = load_checkpoint(path)
    for f in range(4):
        assert torch.equal(back.params[f], torch.full_like(back.params[f], 1.0)), f
        assert torch.equal(back.momentum[f], torch.full_like(back.momentum[f], -1.0)), f


def test_a_fragment_already_written_is_not_copied(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    writer = CheckpointWriter(path, background=True)
    live = big_state(2.0, fragments=2)
    writer.save(live)
    writer.wait()
    writer.preserve(0)  # nothing in flight: nothing to copy
    assert writer.last_copied == []
    assert torch.equal(load_checkpoint(path).params[0], torch.full_like(live.params[0], 2.0))
