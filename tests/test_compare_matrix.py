"""compare_diloco's matrix mode end to end on one small cell: dp, alone, yeto lockstep and unpaced."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CELL = "gpt2-help-cosine-h24-m2"


@pytest.mark.timeout(300)
def test_one_cell_lockstep_and_unpaced(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.compare_diloco", "--cells", CELL, "--seeds", "1",
                          "--steps", "24", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("matrix goals met: "), out.stdout[-2000:]
    data = json.loads((tmp_path / "compare_diloco.json").read_text())
    runs = {name.split(":")[1]: rs[0] for name, rs in data["runs"].items()}
    assert set(runs) == {"dp", "alone", "yeto", "yeto-unpaced"}
    for name, run in runs.items():
        assert math.isfinite(run["final_loss"]) and run["final_loss"] < run["curve"][0][1], (name, run)
    tokens = {name: run["tokens"] for name, run in runs.items()}
    assert tokens["dp"] == tokens["yeto"] == tokens["yeto-unpaced"] == 2 * tokens["alone"]
    assert runs["yeto"]["rounds"] == 24 // 6  # lockstep: one round per boundary
    assert runs["yeto-unpaced"]["island_steps"] == [24, 24] and runs["yeto-unpaced"]["rounds"] >= 1
    assert {r["arm"] for r in data["matrix"]} == {"yeto", "yeto-unpaced"}
    assert data["shapes"][f"{CELL}:yeto"]["family"] == "gpt2"
    assert (tmp_path / "compare_diloco_matrix.png").stat().st_size > 10_000


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [["--cells", "resnet-*"], ["--matrix", "--quick"], ["--steps", "0"]])
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.compare_diloco", *args, "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.strip().splitlines()[-1].startswith("compare_diloco")


@pytest.mark.timeout(300)
def test_slow_cell_arms_see_equal_tokens_and_the_slow_island_takes_fewer_steps(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.compare_diloco", "--cells", "*-slow", "--seeds", "1",
                          "--steps", "12", "--arms", "yeto-slow,drop", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "compare_diloco.json").read_text())
    runs = {name.split(":")[1]: rs[0] for name, rs in data["runs"].items()}
    assert set(runs) == {"dp", "alone", "yeto-slow", "drop"}
    steps = runs["dp"]["steps"]
    assert runs["yeto-slow"]["tokens"] == runs["drop"]["tokens"] == runs["dp"]["tokens"] == 4 * runs["alone"]["tokens"]
    assert sum(runs["yeto-slow"]["island_steps"]) == sum(runs["drop"]["island_steps"]) == 4 * steps
    *fast, slow = runs["yeto-slow"]["island_steps"]
    assert slow < min(fast), runs["yeto-slow"]["island_steps"]  # the fast islands took the steps it could not
    assert len(runs["drop"]["island_steps"]) == 3
