"""`pip install yeto` plus a trainer is always enough: every module of `yeto_core`, `syncer` and
`yeto_plugins` imports in `.venv-core` (`scripts/setup.sh`: torch and yeto's core dependencies, no
extra), but the few that exist to wrap an optional package, and those fail only for want of it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE_PYTHON = ROOT / ".venv-core" / "bin" / "python"

# module -> the one package it may miss: each wraps that package (an extra, or a trainer's own code)
NEEDS = {
    "yeto_core.quant_loops": "numba",  # the fast extra's kernels; quant_kernels imports them only when numba is there
    "yeto_plugins.hf": "transformers",
    "yeto_plugins.miles.actor": "miles",
    "yeto_plugins.swift_megatron.plugin.swift_plugin": "swift",
    "yeto_plugins.verl.worker": "verl",
}

WALK = """
import importlib, json, pkgutil, sys
out = {}
for pkg in ("yeto_core", "syncer", "yeto_plugins"):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue  # a command line, not a library module
        try:
            importlib.import_module(info.name)
            out[info.name] = None
        except ModuleNotFoundError as exc:
            out[info.name] = ["missing", exc.name]
        except BaseException as exc:
            out[info.name] = ["error", repr(exc)]
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_every_module_imports_with_the_core_dependencies_alone() -> None:
    if not CORE_PYTHON.exists():
        pytest.fail(f"{CORE_PYTHON.relative_to(ROOT)} is missing: `bash scripts/setup.sh` builds it")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YETO_", "VIRTUAL_ENV", "PYTHONPATH"))}
    run = subprocess.run([str(CORE_PYTHON), "-c", WALK], cwd=ROOT / "tests", env=env, capture_output=True,
                         text=True, timeout=150)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) > 50, sorted(results)  # the walk found the packages
    broken = {name: got for name, got in results.items() if got is not None and got != ["missing", NEEDS.get(name)]}
    assert not broken, f"modules that do not import with the core dependencies alone: {broken}"
    stale = sorted(name for name in NEEDS if results.get(name) is None)
    assert not stale, f"NEEDS names modules that import fine now, or no longer exist: {stale}"


def test_the_core_venv_has_no_extra() -> None:
    if not CORE_PYTHON.exists():
        pytest.fail(f"{CORE_PYTHON.relative_to(ROOT)} is missing: `bash scripts/setup.sh` builds it")
    extras = ("transformers", "numba", "matplotlib", "megatron", "peft")
    probe = f"import importlib.util as u; print([m for m in {extras!r} if u.find_spec(m)])"
    run = subprocess.run([str(CORE_PYTHON), "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr
