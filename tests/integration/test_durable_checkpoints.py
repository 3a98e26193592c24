"""Durable or stop: a syncer whose checkpoint cannot be written holds its rounds and retries, and
stops with a clear error rather than broadcasting what is not durable (issue 14, DESIGN §6.2).

The checkpoint lives on a small disk that the test fills: a 4 MiB tmpfs when the test may mount
one (root), otherwise a directory in the way of the checkpoint's temporary file. Both make every
write fail, as a full disk does, and both can be undone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    Island,
    Procs,
    Syncer,
    assert_bit_identical,
    checkpoint_params,
    model_dir,
    model_tensors,
    start_learner,
    start_syncer,
    syncer_exit_code,
    wait_all,
    wait_until,
)

from syncer.durability.checkpoint import load_checkpoint
from syncer.durability.run_lock import lock_path_of

pytestmark = pytest.mark.integration

CHECKPOINT = "disk/syncer.safetensors"


class Disk:
    def __init__(self, root: Path, mounted: bool) -> None:
        self.root = root
        self.mounted = mounted
        self._filler = root / "filler"
        self._in_the_way = root / "syncer.safetensors.tmp"

    @property
    def full_error(self) -> str:
        return "No space left on device" if self.mounted else "Is a directory"

    def fill(self) -> None:
        if not self.mounted:
            self._in_the_way.mkdir()
            return
        block = b"\0" * (64 << 10)
        # Unbuffered: a buffered file would try the bytes that did not fit again when it closes.
        with open(self._filler, "ab", buffering=0) as f, contextlib.suppress(OSError):
            for _ in range(1024):  # at most 64 MiB: the disk is 4 MiB
                f.write(block)

    def free(self) -> None:
        if self.mounted:
            self._filler.unlink(missing_ok=True)
        else:
            self._in_the_way.rmdir()


@pytest.fixture
def disk(procs: Procs) -> Iterator[Disk]:
    root = procs.workdir / "disk"
    root.mkdir()
    mounted = False
    if os.geteuid() == 0 and shutil.which("mount") and shutil.which("umount"):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(root)], capture_output=True,
                              timeout=30, check=False)
        mounted = done.returncode == 0
    try:
        yield Disk(root, mounted)
    finally:
        if mounted:
            procs.close()  # nothing may hold a file there when it goes
            subprocess.run(["umount", "-l", str(root)], capture_output=True, timeout=30, check=False)


def commits(syncer: Syncer) -> int:
    return len(syncer.commits())


@pytest.mark.timeout(240)
def test_a_failing_checkpoint_holds_every_round_until_it_is_written_again(procs: Procs, key_file: Path,
                                                                           disk: Disk) -> None:
    rounds = 40
    # The tape shares the full disk (the last page of its file may still hold a few records): it
    # loses none, and its file stays whole lines.
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=rounds,
                          checkpoint_name=CHECKPOINT, tape_name="disk/tape.jsonl",
                          extra=["--checkpoint-retry-s", "120"])
    learners = [start_learner(procs, syncer, key_file, i, max_steps=5000) for i in range(2)]
    wait_until(lambda: commits(syncer) >= 4, 90, "four commits", on_timeout=procs.tails)

    disk.fill()
    wait_until(lambda: "holding every round and retrying" in syncer.proc.stderr(), 30,
               "the syncer to hold its rounds", on_timeout=syncer.proc.tail)
    held = commits(syncer)
    time.sleep(3.0)
    assert commits(syncer) == held, "rounds were committed with nothing durable"
    assert disk.full_error in syncer.proc.stderr(), syncer.proc.tail()
    disk.free()

    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    records = syncer.tape_records()
    assert [r["round"] for r in records if r["event"] == "commit"] == list(range(rounds))
    assert any(r["event"] == "checkpoint_failed" for r in records)
    assert any(r["event"] == "checkpoint_recovered" for r in records)
    assert "rounds go on" in syncer.proc.stderr()
    assert syncer.checkpoint is not None
    final = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        assert_bit_identical(model_tensors(model_dir(lp)), final, lp.name)


@pytest.mark.timeout(180)
def test_no_final_cut_goes_out_before_it_is_durable_and_the_syncer_stops(procs: Procs, key_file: Path,
                                                                        disk: Disk) -> None:
    # Only the final cut is checkpointed (checkpoint every 1000 rounds): the disk fills mid-run,
    # rounds go on, and the final checkpoint cannot be written.
    rounds = 16
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=rounds,
                          checkpoint_name=CHECKPOINT,
                          extra=["--checkpoint-retry-s", "4", "--checkpoint-every", "1000"])
    learners = [start_learner(procs, syncer, key_file, i, max_steps=5000) for i in range(2)]
    wait_until(lambda: commits(syncer) >= 2, 90, "two commits", on_timeout=procs.tails)
    disk.fill()
    started = time.monotonic()
    code = syncer.proc.wait(60)
    assert code == 4, syncer.proc.tail()
    assert time.monotonic() - started < 45
    err = syncer.proc.stderr()
    assert "yeto syncer: writing checkpoint" in err and "syncer.safetensors" in err, syncer.proc.tail()
    assert disk.full_error in err and "no checkpoint could be written in 4 s" in err, syncer.proc.tail()
    assert "sending the final cut" not in err
    records = syncer.tape_records()
    assert not any(r["event"] == "final" for r in records), "a final cut went out that is not durable"
    assert len([r for r in records if r["event"] == "commit"]) == rounds
    assert all(lp.poll() is None for lp in learners), "a learner ended on a final cut that never went out"
    disk.free()
    assert syncer.checkpoint is not None
    state = load_checkpoint(syncer.checkpoint)  # the previous checkpoint, intact
    assert not state.finalized


@pytest.mark.timeout(120)
def test_a_signal_ends_the_checkpoint_retries_within_a_second_and_the_last_checkpoint_stays(
        procs: Procs, key_file: Path, disk: Disk) -> None:
    """SIGTERM while every checkpoint write fails (and two minutes of retries are allowed): the
    syncer stops at once with the signal's exit code, 130, and the checkpoint on disk is the last
    one written whole."""
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, checkpoint_name=CHECKPOINT,
                          extra=["--checkpoint-retry-s", "120"])
    assert syncer.checkpoint is not None
    island = Island(syncer, key_file)
    try:
        island.start()
        island.train_until(lambda: commits(syncer) >= 2, 60, "two commits")
        disk.fill()
        island.train_until(lambda: "holding every round and retrying in 1.0 s" in syncer.proc.stderr(), 60,
                           "the syncer to retry its checkpoint")
        last = syncer.checkpoint.read_bytes()
        started = time.monotonic()
        os.kill(syncer.proc.pid, signal.SIGTERM)
        code = syncer.proc.wait(30)
        took = time.monotonic() - started
    finally:
        island.close()
    assert code == 130, syncer.proc.tail()
    assert took < 2.0, f"the syncer took {took:.1f} s to obey SIGTERM\n{syncer.proc.tail()}"
    err = syncer.proc.stderr()
    assert "retrying checkpoint" in err and "abandoned: the syncer is stopping" in err, syncer.proc.tail()
    disk.free()
    assert syncer.checkpoint.read_bytes() == last
    assert load_checkpoint(syncer.checkpoint).next_round == commits(syncer)
    assert not lock_path_of(syncer.checkpoint).exists(), "the run's lock file outlived a stop by signal"
