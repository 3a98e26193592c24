"""`yeto-plot` on tapes and outputs it cannot use: exit 2, one line on stderr naming the tape and its
line (or the --out), no traceback, nothing written; and the bounded series it keeps of a long tape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from syncer.tools.plot import main
from syncer.tools.plot_account import MAX_LINE_BYTES, MAX_SERIES, OTHERS, POINTS, Account, Bars, Rates, Series

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]

COMMIT = {"event": "commit", "round": 0, "attempt": 1, "fragment": 0, "version": 1, "t": 2.0, "learners": [0, 1],
          "tokens": [8, 8], "weights": [0.5, 0.5], "base_versions": [0, 0], "wait_ms": 5.0, "grace_ms": 0.0,
          "merge_ms": 1.0, "delta_norms": [0.5, 0.7], "consensus_js": 0.1}
LAUNCH = {"event": "launch", "round": 0, "attempt": 1, "fragment": 0, "t": 1.0}


def commit(**changes: object) -> str:
    return json.dumps({**COMMIT, **changes})


def plot(capsys: pytest.CaptureFixture[str], tape: Path, out: Path) -> tuple[int, list[str]]:
    code = main([str(tape), "--out", str(out)])
    return code, capsys.readouterr().err.strip().splitlines()


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(("bad", "says"), [
    (commit(tokens="eight"), "commit field 'tokens' must be a list of numbers"),
    (commit(tokens=[8, "8"]), "commit field 'tokens' must be a list of numbers in [0, 1e+15], not one holding '8'"),
    (commit(learners=[True, 1]), "commit field 'learners' must be a list of integers"),
    (commit(learners=[0.5]), "commit field 'learners' must be a list of integers"),
    (commit(round=-1), "commit field 'round' must be an integer"),
    (commit(round=1.5), "commit field 'round' must be an integer"),
    (commit(round=None), "commit record has no 'round'"),
    (commit(fragment=[0]), "commit field 'fragment' must be an integer"),
    (commit(merge_ms="fast"), "commit field 'merge_ms' must be a number"),
    (commit(wait_ms=-5), "commit field 'wait_ms' must be a number in [0, 1e+15]"),
    (commit(weights={"0": 1}), "commit field 'weights' must be a list of numbers"),
    (commit(base_versions=[10**400]), "commit field 'base_versions' must be a list of integers"),
    (commit(t="now"), "commit field 't' must be a number"),
    (commit(t=1e300), "commit field 't' must be a number in [0, 1e+11]"),
    (json.dumps({**LAUNCH, "round": "zero"}), "launch field 'round' must be an integer"),
    (json.dumps({**LAUNCH, "attempt": [1]}), "launch field 'attempt' must be an integer"),
    ('{"event": "commit", "round": 0, "t": 2.0, "merge_ms": NaN}', "is corrupt: NaN is not a number"),
    ('{"event": "commit", "round": 0, "t": 2.0, "tokens": [Infinity]}', "is corrupt: Infinity is not a number"),
    ('{"event": "carry", "t": -Infinity}', "is corrupt: -Infinity is not a number"),
    ('{"event": "commit", "round": 0, "t": 2.0, "merge_ms": 1e999}', "commit field 'merge_ms' must be a number"),
    ("[" * 100_000 + "]" * 100_000, "is corrupt: nested too deeply"),
    ('{"a": ' * 50_000 + "1" + "}" * 50_000, "is corrupt: nested too deeply"),
    ('{"event": "commit", "round": 0, "t": 2.0, "pad": "' + "x" * MAX_LINE_BYTES + '"}',
     f"is longer than {MAX_LINE_BYTES} bytes"),
], ids=["tokens-str", "tokens-item", "learner-bool", "learner-float", "round-negative", "round-float", "round-null",
        "fragment-list", "merge-str", "wait-negative", "weights-dict", "huge-int", "t-str", "t-huge", "launch-round",
        "launch-attempt", "nan", "infinity", "minus-infinity", "1e999", "deep-list", "deep-object", "too-long"])
def test_a_bad_line_is_one_line_naming_the_tape_and_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            bad: str, says: str) -> None:
    tape = write(tmp_path / "run-tape.jsonl", [json.dumps(LAUNCH), commit(round=0), bad, commit(round=1, t=3.0)])
    code, err = plot(capsys, tape, tmp_path / "plots")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("yeto-plot: ") and f"{tape} line 3" in err[0] and says in err[0], err
    assert not (tmp_path / "plots").exists()


def test_a_foreign_record_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = write(tmp_path / "metrics.jsonl", [commit(), '{"step": 3, "loss": 2.5}'])
    code, err = plot(capsys, tape, tmp_path / "plots")
    assert code == 2 and len(err) == 1 and "is not a yeto event tape: line 2 has no 'event' and 't'" in err[0], err


def test_a_tape_that_is_not_a_readable_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = plot(capsys, tmp_path, tmp_path / "plots")
    assert code == 2 and len(err) == 1 and f"{tmp_path} is not a regular file" in err[0], err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it would wait for a writer forever
    code, err = plot(capsys, fifo, tmp_path / "plots")
    assert code == 2 and len(err) == 1 and "fifo is not a regular file" in err[0], err
    code, err = plot(capsys, Path("/dev/zero"), tmp_path / "plots")
    assert code == 2 and len(err) == 1 and "/dev/zero is not a regular file" in err[0], err
    assert not (tmp_path / "plots").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the mode bits say")
def test_unreadable_tape_and_unwritable_out_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = write(tmp_path / "tape.jsonl", [commit()])
    tape.chmod(0)
    code, err = plot(capsys, tape, tmp_path / "plots")
    assert code == 2 and len(err) == 1 and "tape.jsonl: cannot read it (Permission denied)" in err[0], err
    tape.chmod(0o644)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, err = plot(capsys, tape, locked / "plots")
    assert code == 2 and len(err) == 1 and f"--out {locked / 'plots'}: {locked} is not writable" in err[0], err


def test_an_out_that_cannot_be_a_directory_is_one_line_before_the_tape_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tape = write(tmp_path / "tape.jsonl", [json.dumps(LAUNCH), commit()])
    regular = tmp_path / "regular"
    regular.write_text("")
    for out in (regular / "plots", regular / "deeper" / "plots", regular):
        code, err = plot(capsys, tape, out)
        assert code == 2 and len(err) == 1 and f"--out {out}: {regular} is not a directory" in err[0], (out, err)
    assert regular.read_text() == ""
    (tmp_path / "plots" / "rounds.png").mkdir(parents=True)  # a PNG's place taken by a directory
    code, err = plot(capsys, tape, tmp_path / "plots")
    assert code == 2 and len(err) == 1 and "cannot write rounds.png" in err[0], err


def test_the_console_entry_answers_in_one_line_without_a_traceback(tmp_path: Path) -> None:
    tape = write(tmp_path / "tape.jsonl", [commit(), "[" * 100_000 + "]" * 100_000, commit(round=1)])
    plots = str(tmp_path / "plots")
    for argv, says in (([str(tape), "--out", plots], "tape.jsonl line 2 is corrupt: nested too deeply"),
                       ([str(tape)], "the following arguments are required: --out"),
                       ([str(tape), "--out"], "argument --out: expected one argument")):
        done = subprocess.run([sys.executable, "-m", "syncer.tools.plot", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=50, check=False)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("yeto-plot: ") and says in done.stderr and done.stdout == "", done.stderr


# ---- what is kept of a long tape ----------------------------------------------------------------------------


def test_a_series_keeps_at_most_its_points_with_their_means_and_extremes() -> None:
    s = Series()
    n = POINTS * 8 + 3
    for i in range(n):
        s.add(float(i), float(i % 10))
    x, y, lo, hi = s.points()
    assert s.count == n and s.stride == 16 and POINTS // 2 <= len(x) <= POINTS
    assert x[0] == (16 - 1) / 2 and y[0] == sum(i % 10 for i in range(16)) / 16 and (lo[0], hi[0]) == (0.0, 9.0)
    assert x[-1] == n - 2  # the partly filled last point: the mean of the last 3
    assert sum(v * 16 for v in x[:-1]) + (n - 3 + n - 2 + n - 1) == pytest.approx(sum(range(n)))


def test_bars_merge_into_spans_with_their_grace_and_busy_time() -> None:
    bars = Bars()
    for r in range(POINTS * 4):
        bars.add(10.0 * r, 10.0 * r + 4.0, 1.0)  # open 4 s of every 10
    kept = bars.bars()
    assert bars.stride == 8 and len(kept) == POINTS // 2  # the 4·POINTS-th round filled it a third time
    assert kept[0] == (0.0, 74.0, 8.0, 32.0) and kept[-1] == (10.0 * (POINTS * 4 - 8), 10.0 * POINTS * 4 - 6, 8.0, 32.0)


def test_rates_double_their_bins_and_keep_every_commit() -> None:
    rates = Rates()
    for r in range(100_000):
        rates.add(1000.0 + 0.5 * r, 10.0)
    assert len(rates.commits) <= POINTS and sum(rates.commits) == 100_000 and sum(rates.tokens) == 1_000_000
    centres, rounds, tokens = rates.windows()
    assert 10 <= len(centres) <= 20
    assert rounds == pytest.approx([120.0] * len(rounds), rel=0.01)  # one commit every half second
    assert tokens == pytest.approx([20.0] * len(tokens), rel=0.01)


def test_learners_and_fragments_past_the_cap_share_one_series() -> None:
    account = Account()
    for r in range(3):
        account.add({**COMMIT, "round": r, "fragment": r * 100, "t": 2.0 + r,
                     "learners": list(range(MAX_SERIES + 10)), "tokens": [1] * (MAX_SERIES + 10),
                     "weights": [0.1] * (MAX_SERIES + 10), "base_versions": [0] * (MAX_SERIES + 10)})
    assert len(account.weights) == MAX_SERIES + 1 and OTHERS in account.weights
    assert account.weights[OTHERS].count == 3 * 10
    assert account.token_totals[OTHERS] == 3 * 10 and account.token_totals[0] == 3
    assert set(account.bars) == {0, 100, 200}
