"""A pool of isotropic-merge workers, one persistent process per device (`--iso-worker-devices`).

`--merge iso` takes one exact SVD per merged 2-D matrix: seconds each for a large model, on the
CPU. The pool moves those SVDs out of the syncer, onto the listed devices (`cpu,cpu`, or
`cuda:0,...,cuda:7`), each job one whole matrix on exactly one device. Every worker runs the
same code at the same thread count (`YETO_ISO_WORKER_THREADS`) and a job's result is written to
its own place, so the merged bits are the same whatever the number of workers and whatever order
the jobs finish in.

Bounded and deadlined throughout (`IsoWorkerSettings`): at most `queue` matrices are queued or
running at once (a submit waits for a slot), a worker must be ready within the start-up deadline
and answer each job within the request deadline, and `drain` (before a checkpoint or the final
cut) waits at most the drain deadline. A worker that fails, dies or misses a deadline is killed
and poisons the pool: every later call raises `IsoPoolError` naming the worker, its device and the
matrix, and the syncer stops with its last durable checkpoint as it was (the failed merge never
touched the fragment's state). `close` ends every worker; none outlives the syncer (each ends at
end of input, `syncer.merge.iso_worker`).
"""

from __future__ import annotations

import logging
import os
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from syncer.durability.stopping import POLL_S, StopRequest
from syncer.merge.iso_worker import ANSWER, JOB, OK, READY
from yeto_core.codecs import tensor_bytes
from yeto_core.faults import WORKER_POINTS, parse
from yeto_core.settings import IsoWorkerSettings

log = logging.getLogger("yeto.syncer.iso")

KILL_WAIT_S = 5.0
CLOSE_GRACE_S = 0.5  # how long `close` lets workers end by themselves before it kills the busy ones
ISO_EXIT_CODE = 5  # the syncer's exit code when its pool is poisoned or cannot start


class IsoPoolError(RuntimeError):
    """The pool is poisoned: a worker failed, died or missed a deadline (the message says which)."""


@dataclass
class IsoJob:
    """One matrix to flatten in place; `name` names it in errors."""

    matrix: torch.Tensor
    name: str
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class _Worker:
    """One worker process and the thread that feeds it jobs and reads its answers."""

    def __init__(self, index: int, device: str, settings: IsoWorkerSettings, fault: str) -> None:
        self.index, self.device = index, device
        cmd = [sys.executable, "-m", "syncer.merge.iso_worker", "--device", device, "--threads", str(settings.threads)]
        if fault:
            cmd += ["--fault", fault]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        self.thread: threading.Thread | None = None

    def __str__(self) -> str:
        return f"iso worker {self.index} ({self.device}, pid {self.proc.pid})"

    def wait_ready(self, deadline: float) -> None:
        (length,) = struct.unpack("<I", self._read(len(READY) + 4, deadline, "start")[len(READY):])
        self._read(length, deadline, "start")

    def run(self, job: IsoJob, number: int, timeout_s: float) -> None:
        """Send `job`, read its answer, write the matrix back; OSError/TimeoutError/IsoPoolError on failure."""
        deadline = time.monotonic() + timeout_s
        rows, cols = job.matrix.shape
        self._write(JOB.pack(number, rows, cols), deadline)
        self._write(tensor_bytes(job.matrix), deadline)
        answered, status, n = ANSWER.unpack(self._read(ANSWER.size, deadline, "answer"))
        body = self._read(n, deadline, "answer")
        if answered != number:
            raise IsoPoolError(f"answered job {answered} instead of {number}")
        if status != OK:
            raise IsoPoolError(body.decode(errors="replace"))
        if n != job.matrix.numel() * 4:
            raise IsoPoolError(f"answered {n} bytes for {rows}x{cols} float32")
        if n:
            job.matrix.copy_(torch.frombuffer(body, dtype=torch.float32).view(rows, cols))

    def _write(self, data: bytes | memoryview, deadline: float) -> None:
        view = memoryview(data).cast("B")
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("did not take the job in time")
            _, ready, _ = select.select([], [self._in], [], left)
            if ready:
                view = view[os.write(self._in, view[: 1 << 20]) :]

    def _read(self, n: int, deadline: float, what: str) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} in time")
            ready, _, _ = select.select([self._out], [], [], left)
            if not ready:
                continue
            k = os.readv(self._out, [view[got:]])
            if k == 0:  # end of its output: it is ending, give it a moment to say how
                try:
                    raise OSError(f"exited (code {self.proc.wait(KILL_WAIT_S)})")
                except subprocess.TimeoutExpired:
                    raise OSError("closed its output") from None
            got += k
        return buf

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log.error("%s did not end after SIGKILL", self)
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


class IsoPool:
    """Persistent iso workers over `devices`; `flatten` is the merge's one call."""

    def __init__(self, devices: Sequence[str], settings: IsoWorkerSettings, *, fault: str = "") -> None:
        if not devices:
            raise ValueError("IsoPool needs at least one device")
        self.settings = settings
        self.capacity = settings.queue or 2 * len(devices)
        self._slots = threading.BoundedSemaphore(self.capacity)
        self._jobs: queue.SimpleQueue[tuple[IsoJob, int] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0  # queued + running
        self._idle = threading.Condition(self._lock)
        self._numbers = 0
        self._poison: str | None = None
        self._workers_killed = threading.Event()  # set once a poisoned pool has killed its workers
        self._closed = False
        self._stop: StopRequest | None = None
        # The worker faults (iso-start, iso-job) are armed in the first worker only.
        worker_fault = fault if fault.strip() and parse(fault)[0] in WORKER_POINTS else ""
        self.workers: list[_Worker] = []
        t0 = time.monotonic()
        try:
            for i, device in enumerate(devices):
                self.workers.append(_Worker(i, device, settings, worker_fault if i == 0 else ""))
            deadline = t0 + settings.startup_timeout_s
            for w in self.workers:
                try:
                    w.wait_ready(deadline)
                except (OSError, TimeoutError) as exc:
                    raise IsoPoolError(f"{w} did not start: {exc} (YETO_ISO_WORKER_STARTUP_TIMEOUT_S="
                                       f"{settings.startup_timeout_s:g})") from exc
        except BaseException:
            for w in self.workers:
                w.kill()
            raise
        for w in self.workers:
            w.thread = threading.Thread(target=self._serve, args=(w,), name=f"iso-worker-{w.index}", daemon=True)
            w.thread.start()
        log.info("iso workers ready in %.1f s: %s", time.monotonic() - t0, ", ".join(map(str, self.workers)))

    # -- the merge's side ------------------------------------------------------------------------
    def abandon_on(self, stop: StopRequest) -> None:
        """Once `stop` is set, `flatten` and `drain` stop waiting and raise `stopping.Stopped`."""
        self._stop = stop

    def _stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def _check_stop(self, what: str) -> None:
        if self._stop is not None:
            self._stop.check(what)

    def flatten(self, matrices: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Give each float32 matrix a flat spectrum, in place (`syncer.merge.iso.isotropic_`); returns when
        all are done. IsoPoolError if the pool is or becomes poisoned (nothing is half written
        that the caller will use: the matrices are the merge's scratch)."""
        # Workers read and write host memory: a merge on an accelerator hands them host copies.
        self._check_stop("an iso merge")
        jobs = [IsoJob(m if m.device.type == "cpu" else m.detach().cpu(), name) for name, m in matrices]
        request_s = self.settings.request_timeout_s
        for job in jobs:
            # A slot frees within a request deadline, or its worker is killed and the pool poisoned.
            while not self._slots.acquire(timeout=0.2):
                self._check()
                self._check_stop("an iso merge")
            if self._poison is not None or self._closed:
                self._slots.release()
                self._check()
            with self._lock:
                self._in_flight += 1
                self._numbers += 1
                number = self._numbers
            self._jobs.put((job, number))
        for job in jobs:
            while not job.done.wait(min(request_s, POLL_S)):
                self._check()
                self._check_stop("an iso merge")
            if job.error is not None:
                self._check()
                raise IsoPoolError(job.error)
        for (_, matrix), job in zip(matrices, jobs, strict=True):
            if job.matrix is not matrix:
                matrix.copy_(job.matrix)

    def drain(self) -> None:
        """Wait until nothing is queued or running (before a checkpoint or the final cut)."""
        deadline = time.monotonic() + self.settings.drain_timeout_s
        late = 0
        with self._idle:
            while self._in_flight and self._poison is None and not self._stopping():
                left = deadline - time.monotonic()
                if left <= 0:
                    late = self._in_flight
                    break
                self._idle.wait(min(left, POLL_S))
        self._check_stop("draining the iso workers")
        if late:
            self._poison_with(f"iso workers did not drain {late} matrices within "
                              f"{self.settings.drain_timeout_s:g} s (YETO_ISO_WORKER_DRAIN_TIMEOUT_S)")
        self._check()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def poisoned(self) -> str | None:
        return self._poison

    def close(self) -> None:
        """End every worker (end of input; killed when it does not end by itself). A worker still
        busy with a job is killed after `CLOSE_GRACE_S`: nobody waits for its answer now."""
        with self._lock:
            self._closed = True
        for _ in self.workers:
            self._jobs.put(None)
        grace_until = time.monotonic() + CLOSE_GRACE_S
        for w in self.workers:
            if w.thread is not None:
                w.thread.join(max(0.0, grace_until - time.monotonic()))
                if w.thread.is_alive() and w.proc.poll() is None:
                    w.proc.kill()  # its thread then reads the end of the worker's output and ends
                w.thread.join(KILL_WAIT_S)
            try:
                if w.proc.stdin is not None:
                    w.proc.stdin.close()
                w.proc.wait(KILL_WAIT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
            w.kill()

    def __enter__(self) -> IsoPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the workers' threads --------------------------------------------------------------------
    def _serve(self, w: _Worker) -> None:
        while (item := self._jobs.get()) is not None:
            job, number = item
            if self._poison is not None:
                self._finish(job, self._poison)
                continue
            try:
                w.run(job, number, self.settings.request_timeout_s)
            except (OSError, TimeoutError, IsoPoolError, ValueError) as exc:
                shape = "x".join(map(str, job.matrix.shape))
                deadline = (f" (YETO_ISO_WORKER_REQUEST_TIMEOUT_S={self.settings.request_timeout_s:g})"
                            if isinstance(exc, TimeoutError) else "")
                why = f"{w} failed on matrix {job.name} [{shape}]: {exc}{deadline}"
                w.kill()
                self._poison_with(why)
                self._finish(job, why)
                continue
            self._finish(job, None)

    def _finish(self, job: IsoJob, error: str | None) -> None:
        job.error = error
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()
        self._slots.release()
        job.done.set()

    def _poison_with(self, why: str) -> None:
        with self._lock:
            if self._poison is not None or self._closed:
                return
            self._poison = why
        log.error("iso pool poisoned: %s", why)
        for w in self.workers:  # a poisoned pool takes no more work: no worker is left running
            w.kill()
        self._workers_killed.set()

    def _check(self) -> None:
        if self._poison is not None:
            self._workers_killed.wait()  # raised once no worker is left running (each kill is bounded)
            raise IsoPoolError(self._poison)
        if self._closed:
            raise IsoPoolError("the iso worker pool is closed")
