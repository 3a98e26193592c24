"""Warm starts for the tests' processes: forked from a parent that has imported torch, transformers
(or megatron-core) and yeto once, instead of each paying for those imports again.

A fresh interpreter spends 3 s (the syncer), 9 s (an HF learner) or 11 s (a Megatron rank) of
CPU on imports on these 2-core machines, and the tests start hundreds of them. So
`python -m syncer ...` and `python <script>.py ...` are started here by a *warm parent*
(`python warm.py PRELOAD`, once per test session and preload): it imports what they import,
starts no thread and runs no torch kernel, then forks one child per request. The child is a
real process of its own (its own pid, sockets, signals and exit status; with `session`, its own
process group) that sets its argv, environment, working directory and output files, reseeds
its random state, and runs the module or script as `__main__`, exactly as the interpreter
would have after start-up. Tests kill, stop and wait for it by pid, as for any subprocess.

Two preloads: `hf` (the syncer, HF Trainer learners) and `megatron` (megatron-core behind the
tests' CPU shim, `tests/mcore/cpu_shim.py`, for the Megatron rank workers only: the shim
changes torch process-wide).

What only a fresh interpreter does is left to one: `WarmStarter.can_start` refuses argv with
interpreter options, other executables, `-m` modules other than the syncer, and environments
that differ from the parent's in what is read at interpreter or library start-up (PYTHON*,
thread counts, offline flags, the auto-attach hook); those go through `subprocess.Popen`.

Protocol on the parent's stdin/stdout, one JSON object per line: a request
`{"argv", "env", "cwd", "stdout", "stderr", "session"}` is answered `{"pid": n}` (or
`{"error": why}`);
`{"exited": pid, "code": c}` is sent whenever a child ends (`c` as `Popen.returncode`: −signal
for a signal).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[2]
WARM_MODULES = ("syncer",)  # `python -m X` that may start warm
# What an interpreter or the preloaded libraries read while they start (thread pools, offline
# flags, the auto-attach hook); a child whose environment differs here starts fresh.
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "CUDA_",
                    "YETO_DILOCO_AUTO_ATTACH")
READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 30.0


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an environment that an interpreter or an imported library reads at start-up."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


# ---------------------------------------------------------------------------------------------
# The test side
# ---------------------------------------------------------------------------------------------
class WarmProcess:
    """A warm-started child, with the part of `subprocess.Popen` the tests use."""

    def __init__(self, starter: WarmStarter, pid: int, args: Sequence[str]) -> None:
        self._starter = starter
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._starter.exit_code(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._starter.exit_code(self.pid, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmStarter:
    """A warm parent with `preload`, started on first use with that start's environment (less any
    YETO_* setting); `start` forks a child from it. It ends when the test session does."""

    def __init__(self, preload: str = "hf") -> None:
        assert preload in PRELOADS, preload
        self.preload = preload
        self.env: dict[str, str] | None = None
        self._parent: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one request at a time: its answer is the next "pid" line
        self._cond = threading.Condition()
        self._answers: list[dict[str, Any]] = []
        self._exited: dict[int, int] = {}
        self._broken: str | None = None

    def can_start(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        if self._broken is not None or len(argv) < 2 or argv[0] != sys.executable:
            return False
        if argv[1] == "-m":
            module_ok = len(argv) > 2 and argv[2] in WARM_MODULES
        else:
            module_ok = argv[1].endswith(".py") and Path(argv[1]).resolve().is_relative_to(ROOT)
        parent_env = self.env if self.env is not None else _parent_env(env)
        return module_ok and startup_env(env) == startup_env(parent_env)

    def start(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, stdout: Path,
              stderr: Path, session: bool = False) -> WarmProcess:
        """Fork `argv` (which `can_start`) with output appended to `stdout` and `stderr` (one file
        for both when they are the same path); `session`: in a process group of its own."""
        request = {"argv": list(argv), "env": dict(env), "cwd": str(cwd), "stdout": str(stdout),
                   "stderr": str(stderr), "session": session}
        with self._lock:
            parent = self._running(env)
            assert parent.stdin is not None
            parent.stdin.write(json.dumps(request).encode() + b"\n")
            parent.stdin.flush()
            answer = self._answer(REQUEST_TIMEOUT_S)
        if "pid" not in answer:
            raise RuntimeError(f"the warm parent could not start {argv}: {answer.get('error')}")
        return WarmProcess(self, int(answer["pid"]), argv)

    def exit_code(self, pid: int, *, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pid not in self._exited:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                if self._broken is not None and not _alive(pid):
                    return -signal.SIGKILL  # the parent that would have reaped it is gone
                self._cond.wait(left if left is None else min(left, 1.0))
            return self._exited[pid]

    def close(self) -> None:
        if self._parent is None:
            return
        with contextlib.suppress(OSError):
            assert self._parent.stdin is not None
            self._parent.stdin.close()  # it exits at end of input
        try:
            self._parent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._parent.kill()
            self._parent.wait(timeout=10)

    def _running(self, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        if self._parent is None:
            self.env = _parent_env(env)
            self._parent = subprocess.Popen([sys.executable, __file__, self.preload], cwd=ROOT, env=self.env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            atexit.register(self.close)
            threading.Thread(target=self._read, name="warm-parent-reader", daemon=True).start()
            ready = self._answer(READY_TIMEOUT_S)
            if not ready.get("ready"):
                raise RuntimeError(f"the warm parent did not start: {ready}")
        return self._parent

    def _answer(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or self._broken is not None:
                    raise RuntimeError(f"no answer from the warm parent ({self._broken or 'timed out'})")
                self._cond.wait(left)
            return self._answers.pop(0)

    def _read(self) -> None:
        assert self._parent is not None and self._parent.stdout is not None
        for line in self._parent.stdout:
            message = json.loads(line)
            with self._cond:
                if "exited" in message:
                    self._exited[int(message["exited"])] = int(message["code"])
                else:
                    self._answers.append(message)
                self._cond.notify_all()
        with self._cond:
            self._broken = "the warm parent exited"
            self._cond.notify_all()


def _parent_env(env: Mapping[str, str]) -> dict[str, str]:
    """The parent's environment: no YETO_* setting, and one BLAS/OpenMP thread, whatever the first
    caller asked for: numpy's OpenBLAS otherwise starts a pool thread at import, and a parent with
    a second thread must not fork."""
    parent = {k: v for k, v in env.items() if not k.startswith("YETO_")}
    parent.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    return parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------
# The warm parent
# ---------------------------------------------------------------------------------------------
def _preload_hf() -> None:
    """What the syncer and the HF learners import, so that their children need not."""
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: F401

    import syncer.service.cli  # noqa: F401
    import yeto_plugins.hf  # noqa: F401


def _preload_megatron() -> None:
    """What the Megatron rank workers (`tests/mcore/*_worker.py`) import, the CPU shim first."""
    sys.path.insert(0, str(ROOT / "tests" / "mcore"))
    import cpu_shim

    cpu_shim.install()  # before megatron is imported, as the workers do: some modules bind torch names
    import islands  # noqa: F401
    import megatron.core  # noqa: F401
    import torch.distributed  # noqa: F401
    from megatron.core import parallel_state, tensor_parallel  # noqa: F401
    from megatron.core.distributed import DistributedDataParallel  # noqa: F401
    from megatron.core.models.gpt import GPTModel  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401
    from megatron.core.optimizer import get_megatron_optimizer  # noqa: F401
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: F401
    from megatron.core.transformer.module import Float16Module  # noqa: F401
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: F401

    import yeto_plugins.megatron.sync  # noqa: F401


PRELOADS = {"hf": _preload_hf, "megatron": _preload_megatron}


def _run_child(request: dict[str, Any], keep: list[int]) -> None:
    """In the forked child: become the requested process, run it, exit as the interpreter would."""
    code = 1
    try:
        for fd in keep:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if request.get("session"):
            os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        same = request["stderr"] == request["stdout"]
        err = out if same else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import random

        import numpy as np

        random.seed()  # a fresh interpreter seeds from the OS; siblings must not share a stream
        np.random.seed()
        argv = request["argv"]
        import runpy

        if argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            sys.path[0] = str(Path(argv[1]).resolve().parent)
            runpy.run_path(argv[1], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        end_process(code)


def end_process(code: int) -> NoReturn:
    """Exit as at a normal exit (non-daemon threads joined, atexit run, output flushed) but without
    the interpreter's teardown, where a gloo or DeepSpeed thread that must take the GIL is ended by
    pthread_exit and aborts the process ("terminate called without an active exception")."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as at exit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _exit_status(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def main(preload: str) -> None:
    PRELOADS[preload]()
    reply_fd = os.dup(1)
    request_fd = os.dup(0)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # stray prints must not corrupt the replies
    os.close(null)

    def reply(message: dict[str, Any]) -> None:
        os.write(reply_fd, json.dumps(message).encode() + b"\n")

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(request_fd, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    reply({"ready": True, "threads": threading.active_count()})
    pending = b""
    children: set[int] = set()
    open_input = True
    while open_input or children:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            elif open_input:
                data = os.read(request_fd, 1 << 16)
                if not data:
                    open_input = False
                    selector.unregister(request_fd)
                    continue
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    threads = len(os.listdir("/proc/self/task"))
                    if threads != 1:  # a fork would copy whatever lock another thread holds
                        reply({"error": f"the warm parent runs {threads} threads; it must run one to fork"})
                        continue
                    try:
                        pid = os.fork()
                    except OSError as exc:
                        reply({"error": str(exc)})
                        continue
                    if pid == 0:
                        _run_child(request, [reply_fd, request_fd, wake_r, wake_w, selector.fileno()])
                    children.add(pid)
                    reply({"pid": pid})
        while children:  # reap whatever ended, whether or not a signal woke us
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main(sys.argv[1])
