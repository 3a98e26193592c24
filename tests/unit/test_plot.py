"""`yeto-plot`: bad tapes are one line and exit 2. (A real run's tape is plotted by the metrics
endpoint's integration test, which checks the PNGs.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from syncer.tools.plot import PLOTS, main

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def check_plots(out: Path) -> None:
    for name in PLOTS:
        assert png_size(out / f"{name}.png") == (900, 450) and (out / f"{name}.png").stat().st_size > 10_000, name


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


COMMIT = {"event": "commit", "round": 0, "fragment": 0, "version": 1, "t": 2.0, "learners": [0], "tokens": [8],
          "weights": [1.0], "base_versions": [0], "wait_ms": 5.0, "grace_ms": 0.0, "merge_ms": 1.0}


@pytest.mark.parametrize(("lines", "says"), [
    (['{"event": "join", "t": 1.0}', "not json", json.dumps(COMMIT)], "line 2 is corrupt"),
    (["[1, 2]", json.dumps(COMMIT)], "line 1 is corrupt: expected a JSON object, got list"),
    (['{"step": 3, "loss": 2.5}'], "is not a yeto event tape"),
    (['{"event": "join", "learner": 0, "t": 1.0}'], "holds no committed round yet"),
    ([], "holds no committed round yet"),
], ids=["corrupt", "list", "foreign", "no-commit", "empty"])
def test_a_tape_that_cannot_be_plotted_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   lines: list[str], says: str) -> None:
    assert main([str(write(tmp_path / "tape.jsonl", lines)), "--out", str(tmp_path / "plots")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("yeto-plot: ") and says in err[0], err
    assert not (tmp_path / "plots").exists()


def test_a_missing_tape_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "syncer.tools.plot", str(tmp_path / "nope.jsonl"), "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "does not exist" in done.stderr


def test_a_torn_last_line_is_skipped_and_the_rest_plotted(tmp_path: Path) -> None:
    tape = tmp_path / "tape.jsonl"
    tape.write_text(json.dumps({"event": "launch", "round": 0, "attempt": 1, "t": 1.0}) + "\n" + json.dumps(COMMIT)
                    + "\n" + '{"event": "comm')
    assert main([str(tape), "--out", str(tmp_path / "plots")]) == 0
    check_plots(tmp_path / "plots")
