"""`compare_diloco --collect`: pieces of the matrix run apart, read back as one table and figure."""

import json
from pathlib import Path

import pytest

from benchmarks import compare_diloco


def _runs(loss: float, seeds: int = 3) -> list[dict[str, object]]:
    curve = [[0, 5.0], [100, 2.5], [200, 2.0]]
    return [{"seed": s, "final_loss": loss + 0.01 * s, "curve": curve, "train_s": 10.0} for s in range(seeds)]


def _piece(path: Path, cell: str, arms: dict[str, float]) -> Path:
    path.write_text(json.dumps({"runs": {f"{cell}:{arm}": _runs(loss) for arm, loss in arms.items()}}))
    return path


@pytest.mark.timeout(60)
def test_pieces_read_back_as_one_matrix_and_a_later_file_wins(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    a = _piece(tmp_path / "a.json", "neox-help-constant-h24-m2", {"dp": 1.50, "alone": 1.70, "yeto": 1.60})
    b = _piece(tmp_path / "b.json", "neox-help-constant-h24-m2", {"yeto": 1.51, "yeto-unpaced": 1.52})
    c = _piece(tmp_path / "c.json", "llama-code-constant-h24-m4", {"dp": 1.50, "alone": 1.75, "yeto": 1.58})
    out = tmp_path / "out"
    assert compare_diloco.main(["--collect", str(a), str(b), str(c), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 results" in printed and printed.strip().splitlines()[-1] == "matrix goals met: 2 of 3"
    table = {(r["cell"], r["arm"]): r for r in json.loads((out / "compare_diloco.json").read_text())["matrix"]}
    assert set(table) == {("neox-help-constant-h24-m2", "yeto"), ("neox-help-constant-h24-m2", "yeto-unpaced"),
                          ("llama-code-constant-h24-m4", "yeto")}
    assert table[("neox-help-constant-h24-m2", "yeto")]["mean"] == pytest.approx(1.52)  # b's runs replaced a's
    assert (out / "compare_diloco_matrix.png").stat().st_size > 10_000


@pytest.mark.timeout(60)
def test_collect_refuses_what_is_not_a_result_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        compare_diloco.main(["--collect", str(tmp_path / "absent.json"), "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--collect: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert compare_diloco.main(["--collect", str(bad), "--out", str(tmp_path)]) == 2
    assert "not a compare_diloco.json" in capsys.readouterr().err
    empty = _piece(tmp_path / "empty.json", "neox-help-constant-h24-m2", {"yeto": 1.5})
    assert compare_diloco.main(["--collect", str(empty), "--out", str(tmp_path)]) == 2
    assert "no matrix cell with its dp runs" in capsys.readouterr().err
