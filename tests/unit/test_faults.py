"""Fault points: parsing the arming setting, counting occurrences per injector, and what each action does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from yeto_core import faults
from yeto_core.faults import NO_FAULTS, POINTS, FaultInjector
from yeto_core.settings import LearnerSettings, SettingsError, SyncerSettings, load_settings

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


def test_a_bad_spec_fails_the_injector_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"YETO_FAULT='mid-merge@x': the occurrence after '@'"):
        FaultInjector("mid-merge@x")


def test_no_faults_arms_nothing_and_never_fires() -> None:
    for injector in (NO_FAULTS, FaultInjector(), FaultInjector("  ")):
        for name in POINTS:
            assert not injector.armed(name)
            injector.point(name)  # returns: this process is still here


def test_an_injector_is_armed_for_its_point_only() -> None:
    injector = FaultInjector("mid-bcast@1000")  # far ahead: reaching it here fires nothing
    assert injector.armed("mid-bcast") and not injector.armed("mid-merge")
    for name in POINTS:
        injector.point(name)


ROOT = Path(__file__).resolve().parents[2]
ARM_FROM_SETTINGS = ("from yeto_core.settings import SyncerSettings, load_settings\n"
                     "injector = load_settings(SyncerSettings).fault_injector()\n")


def run_script(env_value: str, script: str) -> subprocess.CompletedProcess[str]:
    code = f"{script}\nprint('survived', flush=True)\n"
    return subprocess.run([sys.executable, "-c", code], env={"YETO_FAULT": env_value, "PATH": ""}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)


def run_points(env_value: str, script: str) -> subprocess.CompletedProcess[str]:
    """`script` reaches points of `injector`, built as the syncer builds its own: from the settings."""
    return run_script(env_value, ARM_FROM_SETTINGS + script)


def test_the_armed_occurrence_kills_the_process() -> None:
    done = run_points("mid-merge@3", "for i in range(5):\n    injector.point('mid-merge')\n    print(i, flush=True)")
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.split() == ["0", "1"]  # killed at the third time, before printing it
    assert "fault point mid-merge reached (occurrence 3): kill" in done.stderr


def test_other_points_and_unset_settings_do_nothing() -> None:
    done = run_points("mid-final", "injector.point('mid-merge')\ninjector.point('before-push')")
    assert done.returncode == 0 and "survived" in done.stdout
    done = run_points("", "injector.point('mid-merge')")
    assert done.returncode == 0 and "survived" in done.stdout


def test_each_injector_counts_its_own_occurrences() -> None:
    script = ("from yeto_core.faults import FaultInjector\n"
              "a, b = FaultInjector('mid-merge@2'), FaultInjector('mid-merge@2')\n"
              "a.point('mid-merge'); b.point('mid-merge'); print('both once', flush=True)\n"
              "a.point('mid-merge')")
    done = run_script("", script)
    assert done.returncode == -signal.SIGKILL and done.stdout.split() == ["both", "once"]


def test_occurrences_are_counted_exactly_across_threads() -> None:
    # Eight threads reach the point 2000 times each, armed at the very last: a lost count never fires.
    script = ("import threading\nfrom yeto_core.faults import FaultInjector\n"
              "injector = FaultInjector('mid-stripe@16000')\n"
              "def reach():\n    for _ in range(2000):\n        injector.point('mid-stripe')\n"
              "threads = [threading.Thread(target=reach) for _ in range(8)]\n"
              "for t in threads: t.start()\nfor t in threads: t.join()")
    done = run_script("", script)
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout
    assert "fault point mid-stripe reached (occurrence 16000): kill" in done.stderr


def test_exit_action() -> None:
    done = run_points("before-push:exit", "injector.point('before-push')")
    assert done.returncode == faults.FAULT_EXIT_CODE and "survived" not in done.stdout


def test_stop_action_freezes_the_process() -> None:
    code = ARM_FROM_SETTINGS + "injector.point('mid-stripe')\nprint('resumed', flush=True)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], env={"YETO_FAULT": "mid-stripe:stop", "PATH": ""},
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


# -- the setting -------------------------------------------------------------------------------

@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in list(os.environ):
        if var.upper().startswith("YETO_"):
            monkeypatch.delenv(var)
    return monkeypatch


def test_the_setting_reads_yeto_fault_and_its_prefixed_names(clean_env: pytest.MonkeyPatch) -> None:
    assert load_settings(SyncerSettings).fault_injector() is NO_FAULTS
    clean_env.setenv("YETO_FAULT", "mid-merge@3")
    assert load_settings(SyncerSettings).fault == "mid-merge@3"
    assert load_settings(LearnerSettings, syncer="127.0.0.1:7070").fault == "mid-merge@3"
    clean_env.delenv("YETO_FAULT")
    clean_env.setenv("YETO_SYNCER_FAULT", "mid-bcast:stop")
    assert load_settings(SyncerSettings).fault_injector().armed("mid-bcast")
    clean_env.setenv("YETO_DILOCO_FAULT", "before-push")
    assert load_settings(LearnerSettings, syncer="127.0.0.1:7070").fault_injector().armed("before-push")
    assert load_settings(SyncerSettings, fault="mid-final").fault == "mid-final"  # explicit wins


@pytest.mark.parametrize("cls", [SyncerSettings, LearnerSettings])
def test_a_bad_yeto_fault_fails_loading_the_settings_naming_it(clean_env: pytest.MonkeyPatch,
                                                               cls: type[SyncerSettings | LearnerSettings]) -> None:
    clean_env.setenv("YETO_FAULT", "mid-lunch")
    explicit: dict[str, Any] = {"syncer": "127.0.0.1:7070"} if cls is LearnerSettings else {}
    with pytest.raises(SettingsError) as err:
        load_settings(cls, **explicit)
    assert str(err.value).startswith("YETO_FAULT='mid-lunch': unknown fault point 'mid-lunch' (known: mid-init,")


def test_a_bad_yeto_fault_stops_the_syncer_at_start_up() -> None:
    done = subprocess.run([sys.executable, "-m", "syncer", "--port", "0"], env={"YETO_FAULT": "mid-merge:explode"},
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "YETO_FAULT='mid-merge:explode': unknown action 'explode'" in done.stderr


def test_a_learner_arms_its_link_from_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from yeto_core.learner import LearnerSession
    from yeto_core.settings import LearnerSettings

    monkeypatch.setenv("YETO_FAULT", "before-push:exit")
    session = LearnerSession(LearnerSettings(syncer="127.0.0.1:9", key="k" * 32), [("w", torch.zeros(2))])
    injector = session.link._faults  # type: ignore[attr-defined]
    assert injector.armed("before-push") and not injector.armed("mid-init")
