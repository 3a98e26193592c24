"""ruff and mypy are part of the suite, so the one test command checks what CI checks."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    found = BIN / name
    if found.exists():
        return str(found)
    other = shutil.which(name)
    if other is None:
        pytest.fail(f"{name} is not installed; run scripts/setup.sh (it installs the dev extra)")
    return other


@pytest.mark.timeout(180)
def test_ruff_clean() -> None:
    out = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_mypy_clean() -> None:
    out = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
