"""One writer per run: the advisory locks beside a syncer's checkpoint and tape (`syncer/durability/run_lock.py`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from syncer.durability.run_lock import RunLock, RunLockError, lock_path_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# A process that takes the lock, says so (with the pid of a child it started, when asked to start
# one that could inherit its descriptors), then waits to be killed.
HOLDER = """
import subprocess, sys, time
from pathlib import Path
from syncer.durability.run_lock import RunLock
lock = RunLock()
lock.acquire("--checkpoint", Path(sys.argv[1]))
child = 0
if sys.argv[2] == "with-child":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False).pid
print(f"locked {child}", flush=True)
time.sleep(60)
"""


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Pids of the processes a test starts: each is SIGKILLed at the end, by pid."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_holder(path: Path, started: list[int], *, with_child: bool = False) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "with-child" if with_child else "alone"],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    started.append(proc.pid)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("locked "), line
    child = int(line.split()[1])
    if child:
        started.append(child)
    return proc, child


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    assert proc.stdout is not None
    proc.stdout.close()


def test_a_second_lock_is_refused_naming_the_holders_pid_and_host(tmp_path: Path) -> None:
    path = tmp_path / "run.safetensors"
    with RunLock() as first:
        first.acquire("--checkpoint", path)
        with pytest.raises(RunLockError) as refused:
            RunLock().acquire("--checkpoint", path)
    message = str(refused.value)
    assert message.startswith(f"--checkpoint {path} is in use by syncer pid {os.getpid()} on host "
                              f"{socket.gethostname()} (since ")
    assert message.endswith("); stop it or choose another path") and "\n" not in message


def test_the_lock_file_says_who_holds_it_and_is_gone_after_release(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    lock = RunLock()
    lock.acquire("--tape", path)
    info = json.loads(lock_path_of(path).read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname() and info["since"]
    assert not path.exists()  # the lock reads and writes nothing of the path itself
    lock.release()
    assert not lock_path_of(path).exists()
    with RunLock() as again:
        again.acquire("--tape", path)  # released: taken at once


def test_a_lock_file_left_by_a_killed_holder_does_not_block(tmp_path: Path, started: list[int]) -> None:
    path = tmp_path / "run.safetensors"
    holder, _ = start_holder(path, started)
    with pytest.raises(RunLockError, match=f"in use by syncer pid {holder.pid} "):
        RunLock().acquire("--checkpoint", path)
    kill(holder)
    assert json.loads(lock_path_of(path).read_text())["pid"] == holder.pid  # left behind
    with RunLock() as lock:
        lock.acquire("--checkpoint", path)
        assert json.loads(lock_path_of(path).read_text())["pid"] == os.getpid()


def test_a_child_process_does_not_keep_the_lock_alive(tmp_path: Path, started: list[int]) -> None:
    """The lock's descriptor is close-on-exec: a child started with every inheritable descriptor
    (as an iso worker could be) still runs when its parent is killed, and holds nothing."""
    path = tmp_path / "run.safetensors"
    holder, child = start_holder(path, started, with_child=True)
    kill(holder)
    os.kill(child, 0)  # still alive
    with RunLock() as lock:
        lock.acquire("--checkpoint", path)


def test_a_lock_file_removed_between_open_and_lock_is_opened_again(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The race a removed lock file opens: a taker opened the file, its holder removed it on exit,
    and the taker locks the unnamed file. It must notice, and lock the file at the path instead."""
    path = tmp_path / "run.safetensors"
    opens: list[int] = []
    real_open = RunLock._open

    def open_then_lose_it(flag: str, lock_path: Path) -> int:
        fd = real_open(flag, lock_path)
        if not opens:
            lock_path.unlink()  # the holder's clean exit, just after our open
        opens.append(fd)
        return fd

    monkeypatch.setattr(RunLock, "_open", staticmethod(open_then_lose_it))
    with RunLock() as lock:
        lock.acquire("--checkpoint", path)
        assert len(opens) == 2 and lock_path_of(path).exists()
        monkeypatch.setattr(RunLock, "_open", staticmethod(real_open))
        with pytest.raises(RunLockError, match="is in use by"):
            RunLock().acquire("--checkpoint", path)


def test_one_file_for_both_paths_is_refused(tmp_path: Path) -> None:
    with RunLock() as lock:
        lock.acquire("--checkpoint", tmp_path / "run")
        with pytest.raises(RunLockError, match="--checkpoint and --tape name the same file"):
            lock.acquire("--tape", tmp_path / "run")


def test_a_missing_directory_is_made(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "a" / "run.safetensors"
    with RunLock() as lock:
        lock.acquire("--checkpoint", path)
        assert lock_path_of(path).exists()
