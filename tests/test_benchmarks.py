"""The benchmarks still run end to end (tiny sizes; speed is not checked here, only that each
prints its closing ratio line)."""

import json
import math
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
    ("benchmarks.merge", ["--elements", "2M", "--learners", "2", "--repeat", "1"], "ratio merge/copy = "),
    ("benchmarks.merge_methods", ["--sizes", "1M", "--learners", "2", "--repeat", "1"],
     "ratio rda/average in a round = "),
    ("benchmarks.rl_sweep", ["--mib", "8", "--iterations", "2"], "ratio sweep/raw_loopback = "),
    # the GPU check's merge script, dry-run on the CPU (the device checked is the CPU itself)
    ("benchmarks.gpu.merge_check", ["--device", "cpu", "--mib", "1", "--learners", "2", "--repeat", "1"],
     "gpu merge check: ok"),
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


@pytest.mark.timeout(240)
def test_chaos_learning_runs(tmp_path: Path) -> None:
    # The learning mode, shortened: two learners train the small Llama 150 steps each, once without
    # faults and once with a learner kill, a SIGSTOP and a syncer restart. A killed learner is back
    # within --rejoin-s (12 s), inside the syncer's rejoin window, so the syncer waits for it even
    # when the other learner has finished. Only sanity, not the ratio.
    args = ["--steps", "150", "--learners", "2", "--step-s", "0.2", "--kill-every", "3", "--rejoin-s", "12",
            "--restart-delay", "0.5", "--stops", "1", "--stop-s", "1", "--syncer-down-s", "1",
            "--json", str(tmp_path / "chaos.json")]
    out = subprocess.run([sys.executable, "-m", "benchmarks.chaos", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=220)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("final eval loss fault-free ") and last.endswith("(goal <= 1.03)"), out.stdout[-2000:]
    data = json.loads((tmp_path / "chaos.json").read_text())
    clean, chaos = data["arms"]["fault-free"], data["arms"]["faults"]
    # the fault-free arm trained every id to its budget and ended on one final cut, better than the start
    assert clean["steps_per_id"] == {"0": 150, "1": 150} and clean["final"]["agreed"], out.stdout
    for arm in (clean, chaos):
        assert arm["final"]["loss"] is not None and 0 < arm["final"]["loss"] < math.log(256), out.stdout
    assert chaos["learner_kills"] >= 1 and chaos["sigstops"] == 1 and chaos["syncer_restarts"] == 1, out.stdout
    assert {what for _t, what, _lid in chaos["faults"]} == {"kill", "sigstop", "syncer-kill"}, chaos["faults"]
    loss = data["final_eval_loss"]
    assert loss["ratio"] == pytest.approx(loss["faults"] / loss["fault-free"]) and loss["goal"] == 1.03


@pytest.mark.timeout(240)
def test_compare_diloco_quick_runs(tmp_path: Path) -> None:
    # The convergence benchmark's quick mode, shortened: it runs, and its JSON and figure are sane.
    out = subprocess.run([sys.executable, "-m", "benchmarks.compare_diloco", "--quick", "--steps", "36",
                          "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("ratio yeto-default/dp eval loss = "), out.stdout[-2000:]
    data = json.loads((tmp_path / "compare_diloco.json").read_text())
    assert set(data["runs"]) == {"dp", "alone", "yeto-default"}, data["runs"].keys()
    runs = {name: rs[0] for name, rs in data["runs"].items()}
    for name, run in runs.items():
        first = run["curve"][0][1]
        assert math.isfinite(run["final_loss"]) and 0 < run["final_loss"] < first, (name, run["final_loss"], first)
        assert run["steps"] == 36, (name, run["steps"])
    assert runs["dp"]["tokens"] == runs["yeto-default"]["tokens"] == 2 * runs["alone"]["tokens"]
    assert runs["yeto-default"]["rounds"] == 36 // 6  # lockstep: one round per boundary, H/P = 6 steps
    summary = data["summary"]
    ratio = runs["yeto-default"]["final_loss"] / runs["dp"]["final_loss"]
    assert summary["yeto-default"]["ratio_dp"] == pytest.approx(ratio)
    assert (tmp_path / "compare_diloco.png").stat().st_size > 10_000


@pytest.mark.timeout(240)
def test_scale_quick_runs(tmp_path: Path) -> None:
    # Two small sizes, M = 2: every measure is taken and every ratio is a positive finite number.
    out = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("worst ratio at 16 MiB: "), out.stdout[-2000:]
    doc = json.loads((tmp_path / "scale.json").read_text())
    assert doc["sizes"] == [4 << 20, 16 << 20] and doc["learners"] == [2]
    for speeds in doc["speeds"]:
        assert set(speeds) == {"ckpt_write", "ckpt_read", "init@M2", "push@M2", "fanout@M2", "merge_rda@M2",
                               "merge_average@M2"}
        assert all(math.isfinite(v) and v > 0 for v in speeds.values()), speeds
    for row in doc["rows"]:
        assert row["m2"]["syncer_rss"] > 0 and row["island_pushes"] >= 8
        assert math.isfinite(row["island_rss"])
        assert row["m2"]["raw_init_fresh"] > 0  # raw loopback into memory new to the receiver


@pytest.mark.timeout(240)
def test_stall_quick_runs(tmp_path: Path) -> None:
    # One pair of short HF Trainer runs of the main job's model, without and with yeto attached.
    out = subprocess.run([sys.executable, "-m", "benchmarks.stall", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("stall at H=24: median "), out.stdout[-2000:]
    (row,) = json.loads((tmp_path / "stall.json").read_text())
    assert row["model"] == "main" and row["steps_each"] >= 20
    for key in ("median_without", "median_with", "p99_without", "p99_with", "median_ratio", "p99_ratio"):
        assert math.isfinite(row[key]) and row[key] > 0, row
    assert 0 < row["in_yeto_share"] < 1
