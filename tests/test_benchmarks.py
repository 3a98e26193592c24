"""The benchmarks still run end to end (tiny sizes; speed is not checked here, only that each
prints its closing ratio line)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("module", "args", "last"), [
    ("benchmarks.ingest", ["--mib", "16", "--repeat", "1", "--pushes", "1"], "ratio push_ingest/raw_loopback = "),
    ("benchmarks.straggler", ["--seconds", "3"], "ratio decoupled/lock-step rounds per minute = "),
    ("benchmarks.wire", ["--mib", "16", "--pushes", "1", "--learners", "2", "--rounds", "1", "--elements", "1M",
                         "--repeat", "1"], "ratio push_ingest_f32/raw_loopback = "),
])
def test_benchmark_runs(module: str, args: list[str], last: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith(last), out.stdout[-2000:]
