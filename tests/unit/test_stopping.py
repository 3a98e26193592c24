"""A stop request (a signal) ends every wait of the syncer within a moment: checkpoint retries and
writes, background writes, the coordinator's checkpoint effects; the last checkpoint stays as it
was (`syncer/durability/stopping.py`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from syncer_harness import RecordingTape, SyncerUnderTest

from syncer.core.leases import Leases
from syncer.core.links import Phase
from syncer.durability.checkpoint import SyncerState, load_checkpoint, save_checkpoint
from syncer.durability.checkpointing import Checkpointing
from syncer.durability.snapshots import CheckpointWriter
from syncer.durability.stopping import Stopped, StopRequest
from yeto_core.faults import NO_FAULTS
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.wire.messages import Bcast

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def state(value: float, round_id: int) -> SyncerState:
    specs = [TensorSpec("emb.weight", (8, 4), "float32", embedding=True), TensorSpec("layers.0.w", (4, 4), "float32")]
    layout = build_layout(specs, 2)
    return SyncerState(specs=specs, num_fragments=2, pattern="binpack", fingerprint=layout.fingerprint, backend="b",
                       params=[torch.full((f.numel,), value) for f in layout.fragments],
                       momentum=[torch.zeros(f.numel) for f in layout.fragments], versions=[round_id, round_id],
                       next_round=round_id, ledger={"0:1": round_id})


def set_later(stop: StopRequest | SyncerUnderTest, seconds: float) -> threading.Timer:
    """Set the stop request (or ask the coordinator to stop, as the signal handler does) in `seconds`."""
    action = stop.co.request_stop if isinstance(stop, SyncerUnderTest) else stop.set
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def test_wait_returns_as_soon_as_the_stop_is_requested() -> None:
    stop = StopRequest()
    assert stop.wait(0.05) is False
    set_later(stop, 0.1)
    t0 = time.monotonic()
    assert stop.wait(30) is True
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(Stopped, match="the checkpoint abandoned: the syncer is stopping"):
        stop.check("the checkpoint")


def test_a_stopped_write_leaves_the_previous_checkpoint_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state(1.0, 1))
    stop = StopRequest()
    stop.set()
    with pytest.raises(Stopped, match=f"writing checkpoint {path} abandoned"):
        save_checkpoint(path, state(2.0, 2), stop=stop)
    assert load_checkpoint(path).next_round == 1
    assert not path.with_name(path.name + ".tmp").exists()


def test_a_background_write_gives_up_and_its_wait_says_so(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    stop = StopRequest()
    writer = CheckpointWriter(path, background=True, leases=Leases(), stop=stop)
    writer.save(state(1.0, 1), wait=True)
    stop.set()
    writer.save(state(2.0, 2))
    with pytest.raises(Stopped):
        writer.wait()
    assert load_checkpoint(path).next_round == 1


def failing_checkpointing(path: Path, stop: StopRequest) -> tuple[Checkpointing, RecordingTape]:
    """Checkpoints at `path` that cannot be written (a directory in the way of the temporary file),
    retried for two minutes."""
    path.with_name(path.name + ".tmp").mkdir()
    tape = RecordingTape()
    return Checkpointing(path, background=False, retry_s=120.0, leases=Leases(), tape=tape,  # type: ignore[arg-type]
                         faults=NO_FAULTS, stop=stop), tape


def test_retries_of_a_failing_checkpoint_end_within_a_moment_of_the_stop(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state(1.0, 1))
    stop = StopRequest()
    checkpoints, tape = failing_checkpointing(path, stop)
    set_later(stop, 0.8)  # past the first retry's sleep (0.5 s), inside the second's (1 s)
    t0 = time.monotonic()
    with pytest.raises(Stopped, match="previous checkpoint is intact, nothing after it is durable"):
        checkpoints.save(state(2.0, 2))
    assert time.monotonic() - t0 < 1.5
    assert len(tape.of("checkpoint_failed")) == 2
    assert load_checkpoint(path).next_round == 1


def test_no_write_starts_once_the_stop_is_requested(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    stop = StopRequest()
    stop.set()
    checkpoints = Checkpointing(path, background=False, retry_s=120.0, leases=Leases(),
                                tape=RecordingTape(), faults=NO_FAULTS, stop=stop)  # type: ignore[arg-type]
    with pytest.raises(Stopped):
        checkpoints.save(state(1.0, 1))
    assert not path.exists()


def test_a_signal_during_checkpoint_retries_stops_the_coordinator_with_nothing_undurable_sent(tmp_path: Path) -> None:
    """The commit's checkpoint fails and is retried; the stop ends the retries, and the commit is
    neither taped nor broadcast: the syncer stops as a signal stops it (exit code 0 here, 130 from
    the command line), the last checkpoint as it was."""
    path = tmp_path / "ckpt.safetensors"
    s = SyncerUnderTest(pipeline=1, checkpoint=path, checkpoint_retry_s=120.0)
    s.start(0, 1)
    s.advance(0.0)
    before = path.read_bytes()  # the initial cut's
    path.with_name(path.name + ".tmp").mkdir()  # every write fails from now on
    pull = next(p for p in s.pulls(0) if p.round == 0)
    s.push(0, pull, 1.0)
    bcasts = [len(s.groups[lid].of(Bcast)) for lid in (0, 1)]
    set_later(s, 0.8)
    t0 = time.monotonic()
    s.push(1, pull, 3.0)  # the round closes, merges and its checkpoint fails
    assert time.monotonic() - t0 < 1.5
    assert s.co.protocol.phase is Phase.DONE and s.co.exit_code == 0
    assert s.tape.of("checkpoint_failed") and not s.tape.of("commit")
    assert [len(s.groups[lid].of(Bcast)) for lid in (0, 1)] == bcasts
    assert path.read_bytes() == before and load_checkpoint(path).next_round == 0
