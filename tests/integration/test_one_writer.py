"""One writer per run (DESIGN §6.2): a second syncer on a checkpoint or a tape that a live syncer
holds stops at once, before it touches either, with one line naming its holder; a killed holder
blocks nothing, so `--resume` takes its paths over."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import (
    Island,
    Procs,
    Syncer,
    commits,
    start_syncer,
    syncer_argv,
    syncer_exit_code,
    wait_until,
)

from syncer.durability.checkpoint import load_checkpoint
from syncer.durability.run_lock import lock_path_of
from syncer.durability.tape import read_tape

pytestmark = pytest.mark.integration

ROUNDS = 12


def second_syncer_line(procs: Procs, key_file: Path, *, checkpoint: Path, tape: Path) -> str:
    """Start another run (4 fragments, no --resume: it would write its own model) on `checkpoint`
    and `tape`; it must exit with code 2 and exactly one line on stderr, which is returned."""
    argv = syncer_argv(key_file=key_file, learners=1, quorum=1, fragments=4, checkpoint=checkpoint, tape=tape)
    second = procs.start("second-syncer", argv)
    assert second.wait(60) == 2, second.tail()
    assert second.stdout() == "", second.tail()  # it never listened
    lines = second.stderr().splitlines()
    assert len(lines) == 1, second.tail()
    return lines[0]


def assert_holder_named(line: str, flag: str, path: Path, syncer: Syncer) -> None:
    assert line.startswith(f"yeto syncer: {flag} {path} is in use by syncer pid {syncer.proc.pid} on host "
                           f"{socket.gethostname()} (since "), line
    assert line.endswith("; stop it or choose another path"), line


@pytest.mark.timeout(150)
def test_a_second_syncer_on_a_held_checkpoint_or_tape_is_refused_and_the_run_is_whole(procs: Procs,
                                                                                       key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=ROUNDS)
    assert syncer.checkpoint is not None and syncer.tape is not None
    island = Island(syncer, key_file)
    try:
        island.start()
        island.train_until(lambda: len(syncer.commits()) >= 2, 60, "2 committed rounds")
        line = second_syncer_line(procs, key_file, checkpoint=syncer.checkpoint, tape=syncer.tape)
        assert_holder_named(line, "--checkpoint", syncer.checkpoint, syncer)
        line = second_syncer_line(procs, key_file, checkpoint=procs.workdir / "other.safetensors", tape=syncer.tape)
        assert_holder_named(line, "--tape", syncer.tape, syncer)
        assert syncer.proc.poll() is None, syncer.proc.tail()
        island.train_until(lambda: False, 90, "the final cut")
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()

    state = load_checkpoint(syncer.checkpoint)
    assert state.finalized and state.next_round == ROUNDS and state.num_fragments == 2
    records = read_tape(syncer.tape)  # every line one JSON record, of this one run
    assert [r["round"] for r in commits(records)] == list(range(ROUNDS))
    assert [r["event"] for r in records].count("init") == 1
    assert [r["event"] for r in records].count("final") == 1
    for path in (syncer.checkpoint, syncer.tape):
        assert not lock_path_of(path).exists(), f"{lock_path_of(path)} left behind by a clean exit"
    assert not (procs.workdir / "other.safetensors").exists()


@pytest.mark.timeout(150)
def test_resume_takes_over_the_paths_of_a_killed_syncer(procs: Procs, key_file: Path) -> None:
    first = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=ROUNDS)
    assert first.checkpoint is not None and first.tape is not None
    island = Island(first, key_file)
    try:
        island.start()
        island.train_until(lambda: len(first.commits()) >= 2, 60, "2 committed rounds")
        first.proc.sigkill()
        assert lock_path_of(first.checkpoint).exists() and lock_path_of(first.tape).exists()  # left behind
        second = start_syncer(procs, key_file=key_file, port=first.port, learners=1, quorum=1, fragments=2,
                              total_rounds=ROUNDS, resume=True, bind_retry_s=20)
        assert "resumed from" in second.proc.stderr(), second.proc.tail()
        island.train_until(lambda: False, 90, "the final cut")
    finally:
        island.close()
    assert syncer_exit_code(second) == 0, second.proc.tail()
    checkpoint = first.checkpoint
    assert load_checkpoint(checkpoint).finalized
    wait_until(lambda: not lock_path_of(checkpoint).exists(), 5, "the resumed run's lock file to go")
