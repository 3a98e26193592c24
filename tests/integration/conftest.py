"""Helpers for integration tests: a real syncer process and real learners on loopback.

Every process a test starts goes through the `procs` fixture, which terminates (then kills) it
by pid when the test ends, pass or fail. Every wait has a deadline; a missed deadline fails the
test with the tail of the process's output, so a hang never stays silent. Syncers and learners
start warm (`warm.py`): forked from a parent that imported torch and transformers once, instead
of each importing them again; `fresh=True` starts a new interpreter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from mlp import small_mlp
from safetensors.torch import load_file
from warm import WarmProcess, WarmStarter

from yeto_core.codecs import F32
from yeto_core.learner import LearnerSession
from yeto_core.net.stream import Stream
from yeto_core.settings import LearnerSettings, load_settings
from yeto_core.wire import auth
from yeto_core.wire.messages import CHUNK_BYTES, Attach, Challenge, Error, Hello, Welcome

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_tiny_llama.py"
IO_TIMEOUT_S = 10.0  # deadline of one raw socket read in hand-made protocol exchanges
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$")
# Lines of a dying process worth reading first: a C++ abort, a fatal Python error, an exception.
FATAL = re.compile(r"terminate called|what\(\)|Fatal Python error|Aborted|Segmentation|^\w*(Error|Exception)\b|"
                   r"^\s*raise |exitcode\s*:|Traceback")

# A model small enough that two learners and the syncer share 2 CPU cores comfortably.
TINY_MODEL = ("--hidden", "32", "--layers", "2", "--seq-len", "32", "--batch-size", "4", "--threads", "1")
# H = 8 with 4 fragments: one fragment boundary every 2 inner steps.
FAST_SYNC = {"YETO_DILOCO_SYNC_INTERVAL": "8", "YETO_DILOCO_RECONNECT_MAX_S": "1"}


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without any YETO_* setting, pinned to one thread, offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update({
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    })
    if extra:
        env.update(extra)
    return env


def parse_json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among mixed output lines (non-JSON lines are skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_tape(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSONL tape that may still be growing (a torn last line is skipped)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    records = []
    for raw in data.split(b"\n")[:-1]:  # the piece after the last newline may be half written
        if raw.strip():
            records.append(json.loads(raw))
    return records


def commits(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("event") == "commit"]


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05,
               on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = on_timeout() if on_timeout else ""
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{detail}")
        time.sleep(interval)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes] | WarmProcess
    stdout_path: Path
    stderr_path: Path
    output_dir: Path | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace") if self.stdout_path.exists() else ""

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def json_lines(self) -> list[dict[str, Any]]:
        return parse_json_lines(self.stdout())

    def events(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.json_lines() if e.get("event") == event and all(e.get(k) == v
                                                                               for k, v in match.items())]

    def fatal_lines(self) -> str:
        """The stderr lines that say why the process died, or ""."""
        why = "\n".join([line for line in self.stderr().splitlines() if FATAL.search(line)][-12:])
        return f"--- {self.name} (pid {self.pid}) fatal lines ---\n{why}\n" if why else ""

    def tail(self, lines: int = 40, *, lead: bool = True) -> str:
        """The last lines of both streams, led by the fatal ones (a long tail gets cut in the middle
        by whoever shows it; these come first, and short)."""
        out = "\n".join(self.stdout().splitlines()[-lines:])
        err = "\n".join(self.stderr().splitlines()[-lines:])
        return (f"{self.fatal_lines() if lead else ''}--- {self.name} (pid {self.pid}) stdout tail ---\n{out}\n"
                f"--- {self.name} stderr tail ---\n{err}")

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float) -> int:
        """Wait for the exit code; fail the test (with the output tails) after `timeout` seconds."""
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.name} (pid {self.pid}) still running after {timeout:.0f} s\n{self.tail()}")

    def stop(self, grace: float = 5.0) -> None:
        """Terminate, then kill, by pid; never raises."""
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(OSError):
            self.popen.terminate()
        try:
            self.popen.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(OSError):
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=grace)

    def sigkill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=10)


class Procs:
    """Starts processes with output to files under `workdir`; `close()` stops every one of them."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Proc] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              output_dir: Path | None = None, *, fresh: bool = False) -> Proc:
        """Start `argv` with output to files; warm where it can (`warm.py`), or, with `fresh`, in a
        new interpreter (for what interpreter start-up itself does, as the auto-attach hook)."""
        tag = f"{name}.{sum(p.name == name for p in self.started)}"
        out, err = self.workdir / f"{tag}.out", self.workdir / f"{tag}.err"
        env = env if env is not None else base_env()
        popen: subprocess.Popen[bytes] | WarmProcess
        if not fresh and WARM.can_start(argv, env):
            out.touch()
            err.touch()
            popen = WARM.start(argv, env=env, cwd=ROOT, stdout=out, stderr=err)
        else:
            with out.open("wb") as fo, err.open("wb") as fe:
                popen = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=fo,
                                         stderr=fe)
        proc = Proc(name, popen, out, err, output_dir)
        self.started.append(proc)
        return proc

    def tails(self) -> str:
        return tails(self.started)

    def close(self) -> None:
        for p in reversed(self.started):
            p.stop()


WARM = WarmStarter("hf")  # the session's warm parent for syncers and learners, started by the first warm start


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    manager = Procs(tmp_path)
    try:
        yield manager
    finally:
        manager.close()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "syncer.key"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)  # as a key file should be: others may not read it
    return path


@dataclass
class Syncer:
    proc: Proc
    host: str
    port: int
    checkpoint: Path | None
    tape: Path | None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def tape_records(self) -> list[dict[str, Any]]:
        assert self.tape is not None
        return read_tape(self.tape)

    def commits(self) -> list[dict[str, Any]]:
        return commits(self.tape_records())


def syncer_argv(*, key_file: Path | None, port: int = 0, learners: int = 2, quorum: int | None = 2,
                fragments: int = 4, total_rounds: int | None = None, checkpoint: Path | None = None,
                tape: Path | None = None, resume: bool = False, extra: Sequence[str] = ()) -> list[str]:
    # The syncer paces rounds to the learners' H (FAST_SYNC), so they match the learners' boundaries.
    argv = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", str(port), "--learners", str(learners),
            "--fragments", str(fragments), "--sync-interval-steps", FAST_SYNC["YETO_DILOCO_SYNC_INTERVAL"]]
    if quorum is not None:
        argv += ["--quorum", str(quorum)]
    if total_rounds is not None:
        argv += ["--total-rounds", str(total_rounds)]
    if checkpoint is not None:
        argv += ["--checkpoint", str(checkpoint)]
    if tape is not None:
        argv += ["--tape", str(tape)]
    if key_file is not None:
        argv += ["--key-file", str(key_file)]
    if resume:
        argv.append("--resume")
    return argv + list(extra)


def start_syncer(procs: Procs, *, key_file: Path, port: int = 0, tape_name: str = "tape.jsonl",
                 checkpoint_name: str | None = "syncer.safetensors", timeout: float = 60.0,
                 bind_retry_s: float = 0.0, env: dict[str, str] | None = None, max_descriptors: int = 0,
                 **kwargs: Any) -> Syncer:
    """Start `python -m syncer` and wait for its listening line; `bind_retry_s` > 0 retries a
    start that could not bind its port (e.g. a restart on the port of a killed syncer);
    `max_descriptors` > 0 runs it under `ulimit -n` of that many (the pid stays the syncer's)."""
    tape = procs.workdir / tape_name
    checkpoint = procs.workdir / checkpoint_name if checkpoint_name else None
    argv = syncer_argv(key_file=key_file, port=port, checkpoint=checkpoint, tape=tape, **kwargs)
    if max_descriptors:
        argv = ["sh", "-c", f'ulimit -n {max_descriptors} && exec "$@"', "sh", *argv]
    retry_until = time.monotonic() + bind_retry_s
    while True:
        proc = procs.start("syncer", argv, env=base_env(env))  # `env` adds to the usual one
        deadline = time.monotonic() + timeout
        while True:
            for line in proc.stdout().splitlines():
                m = LISTENING.match(line)
                if m:
                    return Syncer(proc, m.group(1), int(m.group(2)), checkpoint, tape)
            code = proc.poll()
            if code is not None:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"syncer did not print its listening line within {timeout:.0f} s\n{proc.tail()}")
            time.sleep(0.05)
        if code != 0 and "cannot listen" in proc.stderr() and time.monotonic() < retry_until:
            time.sleep(0.2)
            continue
        pytest.fail(f"syncer exited with {code} before listening\n{proc.tail()}")


# A known product bug (test_exit_status.py): the syncer's interpreter can abort at exit, after it
# logged its exit code, because connection-group threads still free torch-backed buffers.
ABORT_AT_EXIT = "terminate called without an active exception"


def syncer_exit_code(syncer: Syncer, timeout: float = 60.0) -> int:
    """The syncer's exit code; an abort at interpreter exit fails the test with the syncer's output."""
    code = syncer.proc.wait(timeout)
    assert ABORT_AT_EXIT not in syncer.proc.stderr(), syncer.proc.tail()
    return code


def learner_env(syncer: Syncer | str, key_file: Path, learner_id: int, **settings: Any) -> dict[str, str]:
    """Environment of one learner; `settings` are extra YETO_DILOCO_* values (lower-case names)."""
    address = syncer.address if isinstance(syncer, Syncer) else syncer
    env = {
        "YETO_DILOCO_SYNCER": address,
        "YETO_DILOCO_KEY_FILE": str(key_file),
        "YETO_DILOCO_LEARNER_ID": str(learner_id),
        "YETO_DILOCO_INIT_TIMEOUT_S": "60",
        "YETO_DILOCO_FINAL_TIMEOUT_S": "90",
        **FAST_SYNC,
    }
    env.update({f"YETO_DILOCO_{k.upper()}": str(v) for k, v in settings.items()})
    return base_env(env)


def start_learner(procs: Procs, syncer: Syncer | str, key_file: Path, learner_id: int, *, max_steps: int,
                  model_args: Sequence[str] = TINY_MODEL, name: str | None = None, **settings: Any) -> Proc:
    out_dir = procs.workdir / f"{name or f'learner{learner_id}'}-model"
    argv = [sys.executable, str(EXAMPLE), "--output-dir", str(out_dir), "--max-steps", str(max_steps), *model_args]
    env = learner_env(syncer, key_file, learner_id, **settings)
    return procs.start(name or f"learner{learner_id}", argv, env=env, output_dir=out_dir)


def model_dir(proc: Proc) -> Path:
    assert proc.output_dir is not None, f"{proc.name} has no output directory"
    return proc.output_dir


def tails(procs: Sequence[Proc]) -> str:
    """Every process's fatal lines first, then each one's tail."""
    return "".join(p.fatal_lines() for p in procs) + "\n".join(p.tail(lead=False) for p in procs)


def wait_all(procs: Sequence[Proc], timeout: float) -> list[int]:
    """Exit codes of all `procs`, waiting at most `timeout` seconds for all of them together."""
    deadline = time.monotonic() + timeout
    return [p.wait(max(0.1, deadline - time.monotonic())) for p in procs]


def checkpoint_params(path: Path) -> dict[str, torch.Tensor]:
    """`param/<name>` tensors of a syncer checkpoint, keyed by model tensor name."""
    tensors = load_file(str(path))
    return {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}


def model_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def assert_bit_identical(model: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    """Every tensor in `model` equals (torch.equal) the same-named reference tensor.

    Tied weights are stored once in the model file, so only the names present there count; every
    reference tensor must be among them.
    """
    assert model, f"{what}: no tensors"
    missing = sorted(set(reference) - set(model))
    assert not missing, f"{what}: synced tensors missing from the model file: {missing}"
    for name, tensor in model.items():
        assert name in reference, f"{what}: {name} is in the model file but not in the reference"
        ref = reference[name]
        assert tensor.shape == ref.shape and tensor.dtype == ref.dtype, f"{what}: {name} differs in shape/dtype"
        if not torch.equal(tensor, ref):
            diff = (tensor.double() - ref.double()).abs().max().item()
            pytest.fail(f"{what}: {name} differs (max abs diff {diff:.3g})")


def eval_loss(proc: Proc, phase: str) -> dict[str, Any]:
    found = proc.events("eval", phase=phase)
    assert len(found) == 1, f"{proc.name}: expected one {phase} eval line\n{proc.tail()}"
    return found[0]


# -- a raw client speaking the wire protocol by hand (hostile peers) -------------------------------
def dial(port: int, rcvbuf: int = 0) -> tuple[Stream, Challenge]:
    """Connect and read the CHALLENGE; `rcvbuf` > 0 sets a receive buffer that small before the
    connection exists, so the window the syncer sees is small from the start."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(IO_TIMEOUT_S)
    try:
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    stream = Stream(sock, "hostile")
    challenge = stream.read_message()
    assert isinstance(challenge, Challenge), challenge
    return stream, challenge


def read_until_error(stream: Stream, limit: int = 1000) -> Error:
    """Skip whatever the syncer sends (pulls, broadcast announcements, heartbeats) up to its ERROR."""
    for _ in range(limit):
        msg = stream.read_message()
        if isinstance(msg, Error):
            return msg
    pytest.fail(f"no ERROR frame among {limit} frames")


def assert_closed(stream: Stream) -> None:
    """The syncer closes the socket after its ERROR: EOF (or a reset), never more frames or a hang."""
    deadline = time.monotonic() + IO_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            data = stream.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            return
        except TimeoutError:
            pytest.fail("the syncer kept the socket open after its ERROR frame")
        if not data:
            return
    pytest.fail("the syncer kept sending after its ERROR frame")


def hello(learner_id: int, fingerprint: bytes, nonce: bytes, key: bytes, data_streams: int = 1) -> Hello:
    h = Hello(learner_id, data_streams, fingerprint, F32.wire_id, CHUNK_BYTES, 0, auth.new_nonce())
    return dataclasses.replace(h, mac=auth.sign(key, auth.HELLO_LABEL, nonce, h.signed_part()))


@dataclass
class RawPeer:
    """An authenticated connection group driven by hand: it reads nothing unless told to."""

    control: Stream
    data: list[Stream]

    def close(self) -> None:
        for stream in [self.control, *self.data]:
            stream.close()


def join_raw(port: int, key: bytes, learner_id: int, fingerprint: bytes, data_streams: int = 1,
             rcvbuf: int = 0) -> RawPeer:
    """Authenticate as `learner_id` and attach `data_streams` data streams; the caller speaks (or
    stays silent) by hand and must close the peer."""
    control, challenge = dial(port, rcvbuf)
    peer = RawPeer(control, [])
    try:
        control.send_frame(hello(learner_id, fingerprint, challenge.nonce, key, data_streams))
        welcome = control.read_message()
        assert isinstance(welcome, Welcome), welcome
        for i in range(data_streams):
            stream, data_challenge = dial(port, rcvbuf)
            peer.data.append(stream)
            stream.send_frame(Attach(welcome.token, i, auth.sign(key, auth.ATTACH_LABEL, data_challenge.nonce,
                                                                 welcome.token, bytes([i]))))
    except BaseException:
        peer.close()
        raise
    return peer


# -- an honest in-process learner -----------------------------------------------------------------
class Island:
    """A framework-free LearnerSession over a 3-layer MLP regressing a fixed linear map (real SGD
    steps), for tests that need an honest learner without importing HF."""

    def __init__(self, syncer: Syncer, key_file: Path, learner_id: int = 0, **settings: Any) -> None:
        self.model, self.target, self.opt = small_mlp(learner_id)
        given: dict[str, Any] = {"sync_interval": 8, "init_timeout_s": 30, "final_timeout_s": 30,
                                 "reconnect_max_s": 1, "connect_timeout_s": 10, **settings}
        config = load_settings(LearnerSettings, syncer=syncer.address, key_file=key_file, learner_id=learner_id,
                               **given)
        self.session = LearnerSession(config, list(self.model.named_parameters()))
        self.finished = False
        self._started = False

    def start(self) -> None:
        self._started = True
        self.session.start()

    def close(self) -> None:
        """Close the session if it was started (sends BYE, stops its threads)."""
        if self._started:
            self._started = False
            self.session.close()

    def batch(self) -> torch.Tensor:
        return torch.randn(16, 8)

    def train_step(self) -> bool:
        x = self.batch()
        loss = torch.nn.functional.mse_loss(self.model(x), x @ self.target)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.finished = self.session.step(tokens=16)
        return self.finished

    def train_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        for _ in range(100_000):
            if done() or self.train_step():
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)  # the session's network threads need the GIL too
        pytest.fail(f"the learner session did not reach {what} within {timeout:.0f} s")

    @property
    def fingerprint(self) -> bytes:
        assert self.session.layout is not None
        return self.session.layout.fingerprint


# -- a loopback TCP relay between learners and the syncer ---------------------------------------
class LoopbackRelay:
    """Listens on 127.0.0.1, and for every connection a learner opens, connects to `target` and
    calls `relay(index, client, upstream)` (index counts connections in accept order: a learner's
    control stream, then its data streams). The default relays both directions unchanged;
    subclasses shape what the learner sends (delay, stall, cut) and keep `downlink` for the rest."""

    def __init__(self, target: tuple[str, int], name: str) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        self.connections = 0
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name=name).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                return
            upstream.settimeout(None)
            index, self.connections = self.connections, self.connections + 1
            self.sockets += [client, upstream]
            self.relay(index, client, upstream)

    def relay(self, index: int, client: socket.socket, upstream: socket.socket) -> None:
        self.spawn(self.downlink, client, upstream)
        self.spawn(self.downlink, upstream, client)

    @staticmethod
    def spawn(target: Callable[..., None], *args: Any) -> None:
        threading.Thread(target=target, args=args, daemon=True).start()

    @staticmethod
    def downlink(src: socket.socket, dst: socket.socket) -> None:
        """Copy src to dst until src ends, then shut both down."""
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        shut_both(src, dst)

    def close(self) -> None:
        self.closed.set()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


def shut_both(*sockets: socket.socket) -> None:
    for s in sockets:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
