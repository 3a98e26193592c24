"""The iso worker pool with real worker processes: the same bits as the merge's own SVDs whatever
the number of workers and the order jobs finish in, a bounded queue, and every failure (a worker
killed mid-job, hung past its deadline, failing to start, or failing a job) poisoning the pool
with a message naming the worker, its device and the matrix, and leaving no process behind."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from syncer.durability.stopping import Stopped, StopRequest
from syncer.merge.iso import isotropic_
from syncer.merge.iso_pool import IsoPool, IsoPoolError
from yeto_core.settings import IsoWorkerSettings

pytestmark = pytest.mark.timeout(120)


def matrices(count: int = 6, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(48 + 16 * (i % 3), 32 + 8 * i) for i in range(count)]
    return [(f"layers.{i}.weight", torch.randn(*s, generator=g)) for i, s in enumerate(shapes)]


def reference(mats: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The in-process merge's SVDs at the workers' thread count (1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [isotropic_(m.clone()) for _, m in mats]
    finally:
        torch.set_num_threads(threads)


def worker_children() -> set[int]:
    """Pids of this process's children that run an iso worker (read from /proc, not by signal)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"syncer.merge.iso_worker" in cmdline:
            found.add(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def no_orphans() -> object:
    before = worker_children()
    yield
    assert worker_children() == before, "an iso worker outlived its pool"


def settings(**kw: float) -> IsoWorkerSettings:
    return IsoWorkerSettings(**kw)


def test_results_are_the_same_bits_for_one_and_two_workers_in_any_order() -> None:
    mats = matrices(8)
    want = reference(mats)
    with IsoPool(["cpu"], settings()) as one:
        got1 = [(n, m.clone()) for n, m in mats]
        one.flatten(got1)
    order = list(range(len(mats)))
    random.Random(3).shuffle(order)  # jobs go out (and so finish) in another order
    with IsoPool(["cpu", "cpu"], settings()) as two:
        got2 = [(mats[i][0], mats[i][1].clone()) for i in order]
        two.flatten(got2)
        assert two.in_flight == 0 and two.poisoned is None
    for i, (_, m) in enumerate(got1):
        assert torch.equal(m, want[i]), f"1 worker: matrix {i}"
    for k, i in enumerate(order):
        assert torch.equal(got2[k][1], want[i]), f"2 workers: matrix {i}"


def test_the_queue_counts_queued_and_running_matrices() -> None:
    mats = matrices(10)
    peak = [0]
    stop = threading.Event()
    with IsoPool(["cpu", "cpu"], settings(queue=3)) as pool:
        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], pool.in_flight)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        pool.flatten(mats)
        stop.set()
        watcher.join(5)
        pool.drain()
        assert pool.capacity == 3 and 1 <= peak[0] <= 3 and pool.in_flight == 0


def test_zero_rank_deficient_and_empty_matrices_pass_through_the_workers() -> None:
    zero = torch.zeros(8, 5)
    rank1 = torch.outer(torch.arange(1.0, 9.0), torch.arange(1.0, 6.0))
    mats = [("zero", zero), ("rank1", rank1.clone()), ("empty", torch.zeros(0, 4))]
    want = reference(mats)
    with IsoPool(["cpu"], settings()) as pool:
        pool.flatten(mats)
    assert all(torch.equal(m, w) for (_, m), w in zip(mats, want, strict=True))
    assert torch.equal(mats[0][1], torch.zeros(8, 5))


def test_a_worker_killed_mid_job_poisons_the_pool_naming_worker_device_and_matrix() -> None:
    with IsoPool(["cpu", "cpu"], settings(), fault="iso-job@2:kill") as pool:
        pid = pool.workers[0].proc.pid
        with pytest.raises(IsoPoolError, match=rf"iso worker 0 \(cpu, pid {pid}\) failed on matrix layers\.\d\.weight "
                                               r"\[\d+x\d+\]: exited \(code -9\)"):
            for _ in range(4):  # the first worker's second job kills it
                pool.flatten(matrices(4))
        assert pool.poisoned is not None
        assert all(w.proc.poll() is not None for w in pool.workers)  # the healthy one is stopped too
        with pytest.raises(IsoPoolError, match="iso worker 0"):
            pool.flatten(matrices(1))  # poisoned for good
        with pytest.raises(IsoPoolError, match="iso worker 0"):
            pool.drain()


def test_a_worker_hung_past_the_request_deadline_is_killed() -> None:
    with IsoPool(["cpu"], settings(request_timeout_s=1.5), fault="iso-job:stop") as pool:
        pid = pool.workers[0].proc.pid
        with pytest.raises(IsoPoolError, match=rf"iso worker 0 \(cpu, pid {pid}\) failed on matrix layers\.0\.weight "
                                               r".*no answer in time \(YETO_ISO_WORKER_REQUEST_TIMEOUT_S=1\.5\)"):
            pool.flatten(matrices(2))
        assert pool.workers[0].proc.poll() is not None


@pytest.mark.parametrize(("fault", "why"), [
    ("iso-start:exit", r"exited \(code 86\)"),
    ("iso-start:stop", r"no start in time \(YETO_ISO_WORKER_STARTUP_TIMEOUT_S=3\)"),
])
def test_a_worker_that_fails_to_start_fails_the_pool_and_leaves_none_running(fault: str, why: str) -> None:
    with pytest.raises(IsoPoolError, match=rf"iso worker 0 \(cpu, pid \d+\) did not start: {why}"):
        IsoPool(["cpu", "cpu"], settings(startup_timeout_s=3), fault=fault)


def test_a_device_that_does_not_exist_fails_the_start_naming_it() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(IsoPoolError, match=r"iso worker 1 \(cuda:0, pid \d+\) did not start"):
        IsoPool(["cpu", "cuda:0"], settings(startup_timeout_s=60))


def test_a_job_the_worker_cannot_do_poisons_the_pool_with_its_error() -> None:
    bad = torch.ones(4, 3)
    bad[1, 1] = float("nan")
    with IsoPool(["cpu"], settings()) as pool, pytest.raises(
            IsoPoolError, match=r"iso worker 0 \(cpu, pid \d+\) failed on matrix bad \[4x3\]: \w+Error: .*non-finite"):
        pool.flatten([("bad", bad)])


def test_drain_waits_at_most_its_deadline_then_poisons_the_pool() -> None:
    errors: list[BaseException] = []
    with IsoPool(["cpu"], settings(request_timeout_s=60, drain_timeout_s=1), fault="iso-job:stop") as pool:
        def merge() -> None:
            try:
                pool.flatten(matrices(1))
            except IsoPoolError as exc:
                errors.append(exc)

        merging = threading.Thread(target=merge, daemon=True)
        merging.start()
        while pool.in_flight == 0:
            threading.Event().wait(0.01)
        with pytest.raises(IsoPoolError, match=r"did not drain 1 matrices within 1 s "
                                               r"\(YETO_ISO_WORKER_DRAIN_TIMEOUT_S\)"):
            pool.drain()
        merging.join(30)
        assert not merging.is_alive() and errors, "the merge waiting on the pool did not end"


def test_a_stop_request_ends_the_merges_waits_and_close_ends_a_busy_worker_at_once() -> None:
    """A signal while a worker hangs on a job: the merge waiting for it and the drain before a
    checkpoint both give up within a moment, and closing the pool kills the worker at once
    instead of waiting out the request deadline."""
    stop = StopRequest()
    outcome: list[BaseException] = []
    pool = IsoPool(["cpu"], settings(request_timeout_s=60, drain_timeout_s=60), fault="iso-job:stop")
    try:
        pool.abandon_on(stop)

        def merge() -> None:
            try:
                pool.flatten(matrices(1))
            except BaseException as exc:
                outcome.append(exc)

        merging = threading.Thread(target=merge, daemon=True)
        merging.start()
        while pool.in_flight == 0:
            threading.Event().wait(0.01)
        threading.Timer(0.3, stop.set).start()
        t0 = time.monotonic()
        with pytest.raises(Stopped, match="draining the iso workers abandoned"):
            pool.drain()
        assert time.monotonic() - t0 < 1.5
        merging.join(2)
        assert not merging.is_alive() and isinstance(outcome[0], Stopped), outcome
    finally:
        t0 = time.monotonic()
        pool.close()
        assert time.monotonic() - t0 < 3.0, "close waited for the hung worker"
    assert pool.workers[0].proc.poll() is not None


def test_a_merge_on_the_pool_is_the_merge_without_it() -> None:
    from syncer.merge.merge import Segment, merge_deltas

    g = torch.Generator().manual_seed(1)
    deltas = torch.randn(3, 24 * 16 + 7 + 12 * 10, generator=g)
    weights = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float32)
    segments = [Segment(0, 24 * 16, rda=True, iso_shape=(24, 16), name="a"), Segment(384, 7, rda=True),
                Segment(391, 120, rda=True, iso_shape=(12, 10), name="b")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = merge_deltas(deltas, weights, segments)
    finally:
        torch.set_num_threads(threads)
    with IsoPool(["cpu", "cpu"], settings()) as pool:
        pooled = merge_deltas(deltas, weights, segments, iso=pool)
    assert torch.equal(alone, pooled)
