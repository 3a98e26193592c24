"""Run a worker script as N gloo ranks on loopback, with a hard deadline.

The test side calls `run_ranks(script, world_size)`; each rank is a ``python script`` subprocess
with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``, pinned to one thread. The worker side calls `report(result)` once to hand a
JSON-able dict back; the launcher reads it from the directory named by ``YETO_TEST_RESULT_DIR``.

Each rank runs in its own session (process group); when the deadline passes or any rank fails,
every rank's group is killed by pid, and the AssertionError carries the tail of each failing
rank's output. Output goes to files, not pipes, so a chatty rank can never block on a full pipe.
The Megatron workers of this directory start warm (`tests/integration/warm.py`): forked from a
parent that imported megatron-core behind the CPU shim once, instead of 11 s of imports each.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from warm import WarmProcess, WarmStarter, end_process

RESULT_DIR_ENV = "YETO_TEST_RESULT_DIR"
TAIL_CHARS = 4000  # of each failing rank's output in an AssertionError
MEGATRON_WORKERS = frozenset(Path(__file__).with_name(name)
                             for name in ("fixture_worker.py", "sync_worker.py", "miles_worker.py"))
MEGATRON = WarmStarter("megatron")  # started by the first warm start of a Megatron worker
Rank = subprocess.Popen[bytes] | WarmProcess


@dataclass(frozen=True)
class RankResult:
    """What one rank left behind: its exit status, its output, and the dict it reported."""

    rank: int
    returncode: int | None  # None: killed at the deadline
    output: str  # stdout then stderr
    result: dict[str, Any] | None  # None: the rank never called `report`


def report(result: Mapping[str, Any]) -> None:
    """Worker side: hand `result` back to the launcher (call once per rank)."""
    path = Path(os.environ[RESULT_DIR_ENV]) / f"rank{os.environ['RANK']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(result)))
    tmp.replace(path)  # the launcher never sees half a file


def end_rank(code: int = 0) -> NoReturn:
    """Worker side: exit once done without the interpreter's teardown (`warm.end_process`)."""
    end_process(code)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kill_group(proc: Rank) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the rank is its group's leader (start_new_session)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _tail(text: str) -> str:
    return text if len(text) <= TAIL_CHARS else "…" + text[-TAIL_CHARS:]


def run_ranks(
    script: str | Path,
    world_size: int,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    started: Callable[[list[int]], None] | None = None,
) -> list[RankResult]:
    """Run ``python script *args`` as `world_size` ranks; return their results, rank order.

    `started`, if given, receives the ranks' pids (rank order) once all are running, e.g. for a
    test that stops and continues them.

    Raises AssertionError, with the tail of each failing rank's output, if the deadline passes,
    any rank exits non-zero, or any rank exits without calling `report`.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="yeto-ranks-") as tmp:
        workdir = Path(tmp)
        base = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
        base.update({
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "WORLD_SIZE": str(world_size),
            RESULT_DIR_ENV: str(workdir),
        })
        base.update(env or {})
        procs: list[Rank] = []
        warm = Path(script).resolve() in MEGATRON_WORKERS
        logs = [workdir / f"rank{r}.log" for r in range(world_size)]
        deadline = time.monotonic() + timeout_s
        timed_out = False
        try:
            for rank in range(world_size):
                argv = [sys.executable, str(script), *args]
                rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                if warm and MEGATRON.can_start(argv, rank_env):
                    logs[rank].touch()
                    procs.append(MEGATRON.start(argv, env=rank_env, cwd=Path.cwd(), stdout=logs[rank],
                                                stderr=logs[rank], session=True))
                    continue
                with logs[rank].open("wb") as log:
                    procs.append(subprocess.Popen(argv, env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, start_new_session=True))
            if started is not None:
                started([p.pid for p in procs])
            # Wait for all, but stop at the first failure: its peers would only hang in a collective.
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                _kill_group(proc)
        results = []
        for rank, proc in enumerate(procs):
            out_file = workdir / f"rank{rank}.json"
            results.append(RankResult(
                rank=rank,
                returncode=proc.returncode if proc.returncode is not None and proc.returncode >= 0 else None,
                output=logs[rank].read_text(errors="replace"),
                result=json.loads(out_file.read_text()) if out_file.exists() else None,
            ))
    failed = [r for r in results if r.returncode != 0 or r.result is None]
    failed.sort(key=lambda r: r.returncode is None)  # ranks that failed on their own first, killed peers last
    if timed_out or failed:
        why = f"deadline of {timeout_s:.0f} s passed" if timed_out else "a rank failed"
        parts = [f"{Path(script).name} x{world_size}: {why}"]
        for r in failed:
            status = "killed" if r.returncode is None else f"exit {r.returncode}"
            parts.append(f"--- rank {r.rank} ({status}, reported: {r.result is not None}) ---\n{_tail(r.output)}")
        raise AssertionError("\n".join(parts))
    return results
