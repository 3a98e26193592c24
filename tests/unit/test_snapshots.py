"""Background checkpoints: one writer at a time, the newest lands last, failures surface."""

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from syncer.core.leases import Leases
from syncer.durability import snapshots
from syncer.durability.checkpoint import CheckpointError, SyncerState, load_checkpoint
from syncer.durability.snapshots import CheckpointWriter
from yeto_core.layout import TensorSpec, build_layout

pytestmark = pytest.mark.unit


def state(value: float, round_id: int) -> SyncerState:
    specs = [TensorSpec("emb.weight", (8, 4), "float32", embedding=True), TensorSpec("layers.0.w", (4, 4), "float32")]
    layout = build_layout(specs, 2)
    return SyncerState(specs=specs, num_fragments=2, pattern="binpack", fingerprint=layout.fingerprint, backend="b",
                       params=[torch.full((f.numel,), value) for f in layout.fragments],
                       momentum=[torch.zeros(f.numel) for f in layout.fragments], versions=[round_id, round_id],
                       next_round=round_id, ledger={"0": round_id})


def writable(leases: Leases, live: SyncerState, f: int) -> None:
    """What the coordinator does before a commit writes fragment f in place."""
    leases.writable(f, {"param": live.params, "momentum": live.momentum, "accum": live.outer_accum})


def test_a_background_write_is_a_snapshot_that_later_commits_cannot_touch(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    leases = Leases()
    writer = CheckpointWriter(path, background=True, leases=leases)
    live = state(1.0, 3)
    writer.save(live)
    writable(leases, live, 0)
    live.params[0].fill_(99.0)  # a commit right after the snapshot
    live.versions[0] = 4
    writer.wait()
    back = load_checkpoint(path)
    assert back.versions == [3, 3] and torch.equal(back.params[0], torch.full_like(back.params[0], 1.0))


def test_the_newest_checkpoint_lands_last(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    writer = CheckpointWriter(path, background=True, leases=Leases())
    for r in range(1, 6):
        writer.save(state(float(r), r))
    writer.save(state(9.0, 9), wait=True)  # a synchronous save waits for the one in flight
    assert load_checkpoint(path).next_round == 9


def test_a_failed_write_surfaces_and_the_previous_file_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    writer = CheckpointWriter(path, background=True, leases=Leases())
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
    real_read = snapshots.SnapshotReads.read

    @contextlib.contextmanager
    def slow_read(self: snapshots.SnapshotReads, kind: str, fragment: int) -> Iterator[torch.Tensor]:
        with real_read(self, kind, fragment) as t:
            if kind == "param" and fragment == 1:
                reading.set()
                assert gate.wait(10)  # hold the writer in the middle of reading fragment 1's params
            yield t

    monkeypatch.setattr(snapshots.SnapshotReads, "read", slow_read)
    leases = Leases()
    writer = CheckpointWriter(path, background=True, leases=leases)
    live = big_state(1.0)
    writer.save(live)
    assert reading.wait(10)
    # The writer reads every fragment's params, then their momentum; it is in fragment 1's params.
    # Commits of 0-3 meanwhile write copies of what it has still to read (without waiting on it),
    # and fragment 0's params, already written, in place.
    before = list(live.params)
    for f in range(4):
        writable(leases, live, f)
        live.params[f].fill_(50.0 + f)
        live.momentum[f].fill_(60.0 + f)
    assert live.params[0] is before[0] and all(live.params[f] is not before[f] for f in (1, 2, 3))
    gate.set()
    writer.wait()
    assert sorted(leases.copied) == [(0, "momentum")] + [(f, kind) for f in (1, 2, 3) for kind in ("momentum", "param")]
    back = load_checkpoint(path)
    for f in range(4):
        assert torch.equal(back.params[f], torch.full_like(back.params[f], 1.0)), f
        assert torch.equal(back.momentum[f], torch.full_like(back.momentum[f], -1.0)), f


def test_a_fragment_already_written_is_not_copied(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    leases = Leases()
    writer = CheckpointWriter(path, background=True, leases=leases)
    live = big_state(2.0, fragments=2)
    writer.save(live)
    writer.wait()
    writable(leases, live, 0)  # nothing in flight: nothing to copy
    assert leases.copied == []
    assert torch.equal(load_checkpoint(path).params[0], torch.full_like(live.params[0], 2.0))


def test_a_background_writer_needs_the_leases(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the run's leases"):
        CheckpointWriter(tmp_path / "c.safetensors", background=True)
