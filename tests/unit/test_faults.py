"""Fault points: parsing the arming variable, counting occurrences, and what each action does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from yeto_core import faults

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("value", "expected"), [
    ("mid-merge", ("mid-merge", 1, "kill")),
    ("mid-bcast@3", ("mid-bcast", 3, "kill")),
    ("mid-stripe@2:stop", ("mid-stripe", 2, "stop")),
    ("before-push:exit", ("before-push", 1, "exit")),
])
def test_an_arming_value_names_a_point_an_occurrence_and_an_action(value: str, expected: tuple[str, int, str]) -> None:
    assert faults.parse(value) == expected


@pytest.mark.parametrize(("value", "complaint"), [
    ("mid-lunch", "unknown fault point 'mid-lunch'"),
    ("mid-merge@0", "whole number >= 1"),
    ("mid-merge@x", "whole number >= 1"),
    ("mid-merge:explode", "unknown action 'explode'"),
])
def test_a_bad_arming_value_is_named(value: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        faults.parse(value)


def run_points(env_value: str, script: str) -> subprocess.CompletedProcess[str]:
    code = f"from yeto_core.faults import fault_point\n{script}\nprint('survived', flush=True)\n"
    return subprocess.run([sys.executable, "-c", code], env={"YETO_FAULT": env_value, "PATH": ""},
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_armed_occurrence_kills_the_process() -> None:
    done = run_points("mid-merge@3", "for i in range(5):\n    fault_point('mid-merge')\n    print(i, flush=True)")
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.split() == ["0", "1"]  # killed at the third time, before printing it
    assert "fault point mid-merge reached (occurrence 3): kill" in done.stderr


def test_other_points_and_unset_variables_do_nothing() -> None:
    done = run_points("mid-final", "fault_point('mid-merge')\nfault_point('before-push')")
    assert done.returncode == 0 and "survived" in done.stdout
    done = run_points("", "fault_point('mid-merge')")
    assert done.returncode == 0 and "survived" in done.stdout


def test_exit_action_and_a_bad_value_that_arms_nothing() -> None:
    done = run_points("before-push:exit", "fault_point('before-push')")
    assert done.returncode == faults.FAULT_EXIT_CODE and "survived" not in done.stdout
    done = run_points("mid-lunch", "fault_point('mid-merge')")
    assert done.returncode == 0 and "survived" in done.stdout
    assert "unknown fault point 'mid-lunch'" in done.stderr and "no fault armed" in done.stderr


def test_stop_action_freezes_the_process() -> None:
    code = "from yeto_core.faults import fault_point\nfault_point('mid-stripe')\nprint('resumed', flush=True)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], env={"YETO_FAULT": "mid-stripe:stop", "PATH": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        status = 0
        for _ in range(600):  # bounded: up to 60 s for the interpreter to start and stop itself
            _, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
            if status:
                break
            time.sleep(0.1)
        assert os.WIFSTOPPED(status), "the process did not stop itself"
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
        assert "resumed" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
