"""`--merge iso` with its SVDs in worker processes (`--iso-worker-devices cpu,cpu`), end to end: the
main job's model trains to identical models; a worker killed mid-job, hung past its deadline or
failing to start stops the syncer with one message naming the worker, its device and the matrix,
its last durable checkpoint intact, and no worker left running (DESIGN §5.2)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import (
    Procs,
    Syncer,
    assert_bit_identical,
    base_env,
    checkpoint_params,
    commits,
    eval_loss,
    model_dir,
    model_tensors,
    start_learner,
    start_syncer,
    syncer_argv,
    syncer_exit_code,
    wait_all,
    wait_until,
)

from syncer.durability.checkpoint import load_checkpoint
from syncer.merge.iso_pool import ISO_EXIT_CODE

pytestmark = pytest.mark.integration

FRAGMENTS = 4
WORKERS = ["--merge", "iso", "--iso-worker-devices", "cpu,cpu"]
READY = re.compile(r"iso workers ready in [\d.]+ s: (.*)")


def worker_pids(syncer: Syncer) -> list[int]:
    m = READY.search(syncer.proc.stderr())
    assert m, f"the syncer did not report its iso workers\n{syncer.proc.tail()}"
    return [int(pid) for pid in re.findall(r"pid (\d+)", m.group(1))]


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie left for its parent to reap counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_no_workers_left(pids: list[int]) -> None:
    assert len(pids) == 2
    wait_until(lambda: not any(running(p) for p in pids), 10, "the iso workers to end")


@pytest.mark.timeout(240)
def test_iso_workers_train_two_islands_to_identical_models(procs: Procs, key_file: Path) -> None:
    rounds = 12
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=FRAGMENTS, total_rounds=rounds,
                          extra=WORKERS)
    pids = worker_pids(syncer)
    learners = [start_learner(procs, syncer, key_file, i, max_steps=3000) for i in range(2)]
    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert_no_workers_left(pids)
    for lp in learners:
        first, last = eval_loss(lp, "initial"), eval_loss(lp, "final")
        assert last["loss"] < first["loss"] and last["final_cut"] is True, lp.tail()
    assert syncer.checkpoint is not None
    state = load_checkpoint(syncer.checkpoint)
    assert state.finalized and state.backend.startswith("iso-"), state.backend
    ckpt = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        assert_bit_identical(model_tensors(model_dir(lp)), ckpt, f"{lp.name} vs checkpoint")
    assert len(commits(syncer.tape_records())) == rounds


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("fault", "why"), [("iso-job@12:kill", r"exited \(code -9\)"),
                                            ("iso-job@12:stop", r"no answer in time "
                                                                r"\(YETO_ISO_WORKER_REQUEST_TIMEOUT_S=3\)")])
def test_a_failed_worker_stops_the_syncer_with_its_last_checkpoint_intact(procs: Procs, key_file: Path, fault: str,
                                                                         why: str) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=FRAGMENTS, extra=WORKERS,
                          env={"YETO_SYNCER_FAULT": fault, "YETO_ISO_WORKER_REQUEST_TIMEOUT_S": "3"})
    pids = worker_pids(syncer)
    for i in range(2):
        start_learner(procs, syncer, key_file, i, max_steps=3000)
    code = syncer.proc.wait(150)
    assert code == ISO_EXIT_CODE, syncer.proc.tail()
    err = syncer.proc.stderr()
    assert re.search(rf"yeto syncer: iso worker 0 \(cpu, pid {pids[0]}\) failed on matrix model\.\S+ \[\d+x\d+\]: "
                     rf"{why}", err), syncer.proc.tail()
    assert_no_workers_left(pids)
    done = commits(syncer.tape_records())
    assert done, "no round committed before the worker failed"
    assert syncer.checkpoint is not None
    state = load_checkpoint(syncer.checkpoint)  # loads: the failed merge never reached the disk
    assert not state.finalized and state.next_round == done[-1]["round"] + 1
    assert all(math.isfinite(float(p.abs().max())) for p in state.params)


@pytest.mark.timeout(60)
def test_a_worker_that_cannot_start_stops_the_syncer_before_it_listens(procs: Procs, key_file: Path) -> None:
    argv = syncer_argv(key_file=key_file, fragments=FRAGMENTS, extra=WORKERS)
    proc = procs.start("syncer", argv, env=base_env({"YETO_SYNCER_FAULT": "iso-start:exit"}))
    assert proc.wait(50) == ISO_EXIT_CODE, proc.tail()
    assert re.search(r"yeto syncer: iso worker 0 \(cpu, pid \d+\) did not start: exited \(code 86\)", proc.stderr())
    assert "listening" not in proc.stdout() and "iso workers ready" not in proc.stderr()
