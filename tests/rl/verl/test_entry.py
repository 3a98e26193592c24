"""yeto's `verl.plugins` entry point, as verl itself loads it (verl 0.9.1 `verl/__init__.py:55-76`): found
in the installed metadata, inert without `YETO_DILOCO_*`, the actor's worker class with them, and loud,
not a DEBUG line, when the settings are wrong. Each case is a fresh process that imports verl, the three
started at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.timeout(150)

PROBE = """
import json, sys
import verl  # loads every verl.plugins entry point, as in each verl process
from verl.workers.engine_workers import ActorRolloutRefWorker
cls = ActorRolloutRefWorker.actor_worker_cls
try:
    cls(config=None)  # how ActorRolloutRefWorker.init_model builds its actor (engine_workers.py:644)
    built = "built"
except Exception as exc:
    built = f"{type(exc).__name__}: {exc}"
print(json.dumps({"worker": cls.__name__, "built": built,
                  "yeto_loaded": sorted(m for m in sys.modules if m.startswith("yeto_plugins.verl"))}))
"""

CASES = {
    "unset": {},
    "set": {"YETO_DILOCO_SYNCER": "127.0.0.1:7070", "YETO_DILOCO_KEY": "0123456789abcdef01"},
    "bad": {"YETO_DILOCO_SYNCER": "not-an-address"},
}


@pytest.fixture(scope="module")
def loaded() -> Iterator[dict[str, tuple[dict[str, object], str]]]:
    """Each case's report and stderr."""
    runs = {}
    try:
        for case, yeto in CASES.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
            env.pop("VERL_USE_EXTERNAL_PLUGINS", None)
            runs[case] = subprocess.Popen([sys.executable, "-c", PROBE], env={**env, **yeto}, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
        out = {}
        for case, proc in runs.items():
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stdout + stderr
            out[case] = (json.loads(stdout.strip().splitlines()[-1]), stderr)
        yield out
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_the_entry_point_is_in_the_installed_metadata() -> None:
    (ours,) = [ep for ep in entry_points(group="verl.plugins") if ep.name == "yeto"]
    assert ours.value == "yeto_plugins.verl.entry"


def test_without_settings_verl_keeps_its_own_worker_and_yeto_loads_nothing(loaded: dict) -> None:
    seen, _ = loaded["unset"]
    assert seen["worker"] == "TrainingWorker"
    assert seen["yeto_loaded"] == ["yeto_plugins.verl", "yeto_plugins.verl.entry"]  # not the worker


def test_with_settings_the_actor_trains_in_yetos_worker(loaded: dict) -> None:
    seen, _ = loaded["set"]
    assert seen["worker"] == "YetoTrainingWorker" and "yeto_plugins.verl.worker" in seen["yeto_loaded"]


def test_a_bad_setting_is_said_on_stderr_and_stops_the_actor_when_it_is_built(loaded: dict) -> None:
    seen, err = loaded["bad"]
    assert seen["worker"] == "YetoTrainingWorker"
    assert "yeto: YETO_DILOCO_SYNCER='not-an-address': expected HOST:PORT" in err  # printed, not a DEBUG line
    assert str(seen["built"]).startswith("SettingsError: YETO_DILOCO_SYNCER='not-an-address'")
