"""Processes for the suites that run in a trainer's own venv (`tests/rl/verl`, `tests/ms_swift`).

Each process starts in a session of its own and is stopped by its process group's id, so a launcher
(torchrun, `swift sft`) takes its children with it; every wait has a deadline, and a failure carries
the log's tail. The real `python -m syncer` runs from the same venv on 127.0.0.1, on a port of its
choosing.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$", re.MULTILINE)
# One thread a process (2 cores), loopback for gloo, and no hub: what every run here starts with.
QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "MASTER_ADDR": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class Run:
    """A started process: its command's name, its log, and the process (leader of its own group)."""

    name: str
    log: Path
    process: subprocess.Popen[bytes]

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, characters: int = 6000) -> str:
        return f"--- {self.name} (pid {self.process.pid}) ---\n{self.text()[-characters:]}"

    def wait(self, deadline_s: float) -> int:
        try:
            return self.process.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            stop(self)
            pytest.fail(f"{self.name} still running after {deadline_s:.0f} s:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the process alone (a syncer killed mid-run), and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def crash(self) -> None:
        """SIGKILL the process and every process under it, by pid (an island's machine lost mid-run), and reap
        it. torchrun starts its ranks in sessions of their own, so its group alone would leave them running."""
        for pid in [self.process.pid, *descendants(self.process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=10)


def descendants(pid: int) -> list[int]:
    """Every living process under `pid`, from /proc (children before their own children)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parent = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name may hold spaces and parentheses
                parents.setdefault(parent, []).append(int(entry))
    found, todo = [], list(parents.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(parents.get(child, []))
    return found


def stop(run: Run) -> None:
    """End the process and everything under it: SIGTERM to its group (a launcher passes it on to its ranks), then
    SIGKILL to whatever is left of its tree, by pid."""
    tree = [run.process.pid, *descendants(run.process.pid)]  # before the launcher dies and its ranks are orphans
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.process.wait(timeout=10)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        run.process.wait(timeout=10)


def start(name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Run:
    """`argv` in the repository, its output (both streams) in `log`; `env` adds to the caller's and QUIET_ENV."""
    with log.open("wb") as sink:
        process = subprocess.Popen(list(argv), cwd=REPOSITORY, env={**os.environ, **QUIET_ENV, **(env or {})},
                                   stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    return Run(name, log, process)


def torchrun(script: Path, ranks: int, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
             name: str | None = None) -> Run:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script),
            *args]
    return start(name or f"{script.stem} x{ranks}", argv, log, env)


@dataclass
class Syncer:
    run: Run
    address: str
    checkpoint: Path
    tape: Path
    key_file: Path


def start_syncer(workdir: Path, *flags: str, learners: int = 2, fragments: int = 2) -> Syncer:
    """The real `python -m syncer` on 127.0.0.1, a port of its choosing, with a checkpoint and a tape."""
    key_file = workdir / "syncer.key"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o600)
    checkpoint, tape = workdir / "syncer.safetensors", workdir / "tape.jsonl"
    argv = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", "0", "--learners", str(learners),
            "--fragments", str(fragments), "--checkpoint", str(checkpoint), "--tape", str(tape),
            "--key-file", str(key_file), "--device", "cpu", *flags]
    run = start("syncer", argv, workdir / "syncer.log")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = LISTENING.search(run.text())
        if found:
            return Syncer(run, f"{found.group(1)}:{found.group(2)}", checkpoint, tape, key_file)
        if run.process.poll() is not None:
            break
        time.sleep(0.1)
    stop(run)
    pytest.fail(f"the syncer did not start listening:\n{run.tail()}")


def island_env(syncer: Syncer, learner_id: int, **settings: object) -> dict[str, str]:
    """The `YETO_DILOCO_*` variables that make a process an island of `syncer`'s run."""
    env = {"YETO_DILOCO_SYNCER": syncer.address, "YETO_DILOCO_KEY_FILE": str(syncer.key_file),
           "YETO_DILOCO_LEARNER_ID": str(learner_id), "YETO_DILOCO_RECONNECT_MAX_S": "1"}
    env.update({f"YETO_DILOCO_{key.upper()}": str(value) for key, value in settings.items()})
    return env


@contextlib.contextmanager
def stopped_at_exit(*runs: Run) -> Iterator[list[Run]]:
    """Stops whatever is still running when the block ends, pass or fail; more may be appended."""
    started = list(runs)
    try:
        yield started
    finally:
        for run in reversed(started):
            if run.process.poll() is None:
                stop(run)
