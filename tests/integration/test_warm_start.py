"""Warm starts (`warm.py`): the syncers and learners the tests start are real processes of their own,
forked from a parent that imported torch and transformers once. Each gets its own argv,
environment, output files and random state, and its pid, signals and exit status behave as a
subprocess's; what depends on interpreter start-up starts fresh."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLE, WARM, Procs, base_env, start_syncer, syncer_argv, wait_until
from warm import WarmProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]



def test_a_syncer_starts_warm_and_its_signals_and_exit_status_are_its_own(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1)
    assert isinstance(syncer.proc.popen, WarmProcess)
    assert syncer.proc.poll() is None and "yeto syncer listening" in syncer.proc.stdout()
    syncer.proc.popen.send_signal(signal.SIGSTOP)  # stopped, not ended
    assert syncer.proc.poll() is None
    syncer.proc.popen.send_signal(signal.SIGCONT)
    syncer.proc.sigkill()
    assert syncer.proc.poll() == -signal.SIGKILL


def test_bad_settings_exit_with_the_syncers_own_code_and_message(procs: Procs, tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_text("00")
    short.chmod(0o600)
    proc = procs.start("syncer-short-key", syncer_argv(key_file=short))
    assert isinstance(proc.popen, WarmProcess)
    assert proc.wait(60) == 2
    assert "yeto syncer:" in proc.stderr() and "key" in proc.stderr()


def test_siblings_draw_different_random_numbers_and_see_their_own_environment(procs: Procs, tmp_path: Path) -> None:
    script = Path(__file__).with_name("warm_probe.py")
    assert WARM.can_start([sys.executable, str(script)], base_env())
    first = procs.start("probe", [sys.executable, str(script), "3"], env=base_env({"YETO_PROBE": "one"}))
    second = procs.start("probe", [sys.executable, str(script), "0"], env=base_env({"YETO_PROBE": "two"}))
    assert isinstance(first.popen, WarmProcess) and isinstance(second.popen, WarmProcess)
    assert first.wait(60) == 3 and second.wait(60) == 0
    a, b = first.json_lines()[0], second.json_lines()[0]
    assert a["random"] != b["random"]
    assert (a["env"], b["env"], a["argv"]) == ("one", "two", [str(script), "3"])
    assert a["main"] == "__main__" and a["cwd"] == str(Path(__file__).resolve().parents[2])


def test_what_interpreter_start_up_decides_starts_fresh(procs: Procs, tmp_path: Path) -> None:
    attach = base_env({"YETO_DILOCO_AUTO_ATTACH": "1"})
    assert not WARM.can_start([sys.executable, str(EXAMPLE)], attach)  # the .pth hook reads it at start-up
    assert not WARM.can_start([sys.executable, "-X", "importtime", str(EXAMPLE)], base_env())
    assert not WARM.can_start([sys.executable, str(tmp_path / "elsewhere.py")], base_env())
    proc = procs.start("fresh", [sys.executable, "-c", "print('fresh')"], fresh=True)
    assert isinstance(proc.popen, subprocess.Popen)
    wait_until(lambda: proc.poll() is not None, 60, "a fresh interpreter to finish")
    assert proc.poll() == 0 and proc.stdout().strip() == "fresh"
