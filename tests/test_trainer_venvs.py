"""The tests of a trainer whose pins clash with ours run in that trainer's own venv, which `scripts/setup.sh`
builds: verl 0.9.1 (`tests/rl/verl` in `.venv-verl`) and ms-swift 4.6.0 (`tests/ms_swift` in `.venv-swift`) each
pin a transformers older than the one the main venv's hf extra installs. This test is how the one test
command runs them: it starts that venv's pytest on that directory and passes when it passes, with its
output in the failure otherwise, and only when no test there was skipped. The main run never collects
those directories itself (`--ignore` in pyproject's addopts)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 540  # each suite's deadline on 2 cores, not its goal (verl: about 5 minutes; swift: about 1)
TAIL_CHARS = 12000
SUITES = {"verl": (".venv-verl", "tests/rl/verl"), "swift": (".venv-swift", "tests/ms_swift")}


@pytest.mark.timeout(BUDGET_S + 60)
@pytest.mark.parametrize("trainer", sorted(SUITES))
def test_the_trainers_suite_passes_in_its_own_venv(trainer: str) -> None:
    venv, suite = SUITES[trainer]
    python = ROOT / venv / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{venv} is missing: `bash scripts/setup.sh` builds it")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YETO_", "VIRTUAL_ENV", "PYTHONPATH"))}
    started = time.monotonic()
    try:
        run = subprocess.run([str(python), "-m", "pytest", "-o", "addopts=-ra", "-p", "no:cacheprovider",
                              suite], cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUDGET_S)
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed it
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"the {trainer} suite ran past {BUDGET_S} s\n{out[-TAIL_CHARS:]}")
    took = time.monotonic() - started
    out = run.stdout + run.stderr
    print(out[-TAIL_CHARS:])  # shown with -rP, and in the failure below
    assert run.returncode == 0, f"the {trainer} suite failed (exit {run.returncode}, {took:.0f} s)\n{out[-TAIL_CHARS:]}"
    summary = [line for line in out.splitlines() if " passed" in line or " skipped" in line][-1:]
    assert summary and " passed" in summary[0] and "skipped" not in summary[0], out[-TAIL_CHARS:]  # none left out
