"""Values no one should give, given to a real `python -m syncer`: each is refused before anything
starts, with exit code 2 and one line that names the setting, no traceback, and the memory of a
process that read its settings and stopped (DESIGN §1.6)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import base_env, syncer_argv

pytestmark = pytest.mark.integration

# A syncer that imported torch and stopped; one that read /dev/zero or sized 10^8 fragments is far past it.
RSS_CAP_MB = 900
WAIT_S = 90.0


def drop_flag(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag` and its value, so that the environment's value is the one read."""
    at = argv.index(flag)
    return argv[:at] + argv[at + 2:]


def cases(key_file: Path, tmp_path: Path, taken_port: int) -> list[tuple[str, list[str], dict[str, str], str, str]]:
    """(case, argv, environment, the name the line must carry, a word of what it says)."""
    plain = syncer_argv(key_file=key_file)
    keyless = syncer_argv(key_file=None)
    regular = tmp_path / "regular"
    regular.write_text("")
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    return [
        ("key file /dev/zero", keyless, {"YETO_SYNCER_KEY_FILE": "/dev/zero"}, "YETO_SYNCER_KEY_FILE",
         "regular file"),
        ("key file flag /dev/zero", syncer_argv(key_file=Path("/dev/zero")), {}, "--key-file", "regular file"),
        ("key file a fifo", keyless, {"YETO_SYNCER_KEY_FILE": str(fifo)}, "YETO_SYNCER_KEY_FILE", "regular file"),
        ("10^8 fragments", [*drop_flag(plain, "--fragments"), "--fragments", "100000000"], {}, "--fragments",
         "less than or equal"),
        ("10^8 fragments in the environment", drop_flag(plain, "--fragments"),
         {"YETO_SYNCER_FRAGMENTS": "100000000"}, "YETO_SYNCER_FRAGMENTS", "less than or equal"),
        ("heartbeat 1e12", plain, {"YETO_SYNCER_HEARTBEAT_S": "1e12"}, "YETO_SYNCER_HEARTBEAT_S",
         "less than or equal"),
        ("stall timeout 3e6", plain, {"YETO_SYNCER_WAN_STALL_TIMEOUT_S": "3000000"},
         "YETO_SYNCER_WAN_STALL_TIMEOUT_S", "less than or equal"),
        ("port 99999", drop_flag(plain, "--port"), {"YETO_SYNCER_PORT": "99999"},
         "YETO_SYNCER_PORT", "less than"),
        ("device tpu", plain, {"YETO_SYNCER_DEVICE": "tpu"}, "YETO_SYNCER_DEVICE", "cuda:N"),
        ("device cuda:7", [*plain, "--device", "cuda:7"], {}, "--device", "CUDA"),
        ("iso workers on cuda", [*plain, "--merge", "iso", "--iso-worker-devices", "cuda:0"], {},
         "--iso-worker-devices", "CUDA"),
        ("tape under a regular file", [*plain, "--tape", str(regular / "tape.jsonl")], {}, "--tape",
         "not a directory"),
        ("tape a directory", [*plain, "--tape", str(tmp_path)], {}, "--tape", "is a directory"),
        ("checkpoint under a regular file", plain, {"YETO_SYNCER_CHECKPOINT": str(regular / "c.safetensors")},
         "YETO_SYNCER_CHECKPOINT", "not a directory"),
        ("checkpoint a directory", plain, {"YETO_SYNCER_CHECKPOINT": str(tmp_path)}, "YETO_SYNCER_CHECKPOINT",
         "is a directory"),
        ("port taken", [*drop_flag(plain, "--port"), "--port", str(taken_port)], {}, "--port", "in use"),
        ("web port taken", [*plain, "--metrics-port", str(taken_port)], {}, "--metrics-port", "in use"),
        ("host not of this machine", [*drop_flag(plain, "--host"), "--host", "192.0.2.1"], {}, "--host",
         "cannot listen"),
        ("misspelt prefix", plain, {"YETO_SYNCR_QUORUM": "1"}, "YETO_SYNCR_QUORUM", "YETO_SYNCER_QUORUM"),
    ]


@pytest.mark.timeout(240)
def test_absurd_values_stop_the_syncer_with_one_line_and_little_memory(key_file: Path, tmp_path: Path) -> None:
    if "cuda" in sys.modules or os.path.exists("/dev/nvidia0"):
        pytest.skip("the CUDA cases assume a machine without CUDA")
    taken = socket.create_server(("127.0.0.1", 0))  # a port another program listens on
    started = []
    for case, argv, env, name, word in cases(key_file, tmp_path, taken.getsockname()[1]):
        proc = subprocess.Popen(argv, env=base_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=tmp_path, text=True)
        started.append((case, proc, name, word))
    deadline = time.monotonic() + WAIT_S
    try:
        for case, proc, name, word in started:
            # wait4 gives the child's own peak RSS (the parent's getrusage sums every child).
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                assert time.monotonic() < deadline, f"{case}: still running after {WAIT_S:.0f} s"
                time.sleep(0.05)
            proc.returncode = os.waitstatus_to_exitcode(status)
            out, err = proc.communicate(timeout=10)
            rss_mb = usage.ru_maxrss * 1024 / 1e6 if sys.platform != "darwin" else usage.ru_maxrss / 1e6
            assert proc.returncode == 2, f"{case}: exit {proc.returncode}\n{err[-2000:]}"
            assert "Traceback" not in err, f"{case}:\n{err[-2000:]}"
            lines = [line for line in err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("yeto syncer: "), f"{case}: {lines}"
            assert name in lines[0] and word in lines[0], f"{case}: {lines[0]}"
            assert "listening" not in out, f"{case}: it started\n{out}"
            assert rss_mb < RSS_CAP_MB, f"{case}: peak RSS {rss_mb:.0f} MB"
    finally:
        taken.close()
        for _, proc, _, _ in started:
            if proc.poll() is None and proc.returncode is None:
                proc.kill()
        for _, proc, _, _ in started:
            if proc.returncode is None:
                proc.wait(timeout=10)
