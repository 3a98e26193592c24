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
    ("benchmarks.lora_bytes", ["--rounds", "4", "--hidden", "32", "--layers", "2"],
     "ratio lora/full bytes per push = "),
    ("benchmarks.wire", ["--mib", "16", "--pushes", "1", "--learners", "2", "--rounds", "1", "--elements", "1M",
                         "--repeat", "1"], "ratio push_ingest_f32/raw_loopback = "),
])
def test_benchmark_runs(module: str, args: list[str], last: str) -> None:
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith(last), out.stdout[-2000:]


@pytest.mark.timeout(120)
def test_chaos_runs() -> None:
    # A short chaos run: learner kills, one SIGSTOP and one syncer restart in the fault arm.
    args = ["--seconds", "8", "--kill-every", "3", "--stops", "1", "--stop-s", "1", "--syncer-down-s", "1"]
    out = subprocess.run([sys.executable, "-m", "benchmarks.chaos", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=110)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2].startswith("ratio uptime faults/fault-free = "), out.stdout[-2000:]
    assert lines[-1].startswith("ratio goodput faults/fault-free = "), out.stdout[-2000:]
    rows = {line[:32].strip(): line[32:].split() for line in lines if not line.startswith(("ratio", "notes"))}
    for name in ("goodput", "uptime (1 s bins with a commit)"):
        for value in rows[name]:
            assert 0.0 < float(value) <= 1.0, f"{name} = {value}\n{out.stdout}"
    assert rows["syncer restarts"] == ["0", "1"], out.stdout
    assert rows["SIGSTOPs"] == ["0", "1"], out.stdout
    assert int(rows["learner SIGKILLs"][0]) == 0 < int(rows["learner SIGKILLs"][1]), out.stdout
