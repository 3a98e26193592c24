from __future__ import annotations

import json
from pathlib import Path

import pytest

from syncer.tape import EventTape, TapeError, read_tape

pytestmark = pytest.mark.unit


def test_append_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    with EventTape(path) as tape:
        tape.append({"event": "merge", "fragment": 1, "version": 3, "weights": [0.25, 0.75]})
        tape.append({"event": "merge", "fragment": 2, "version": 1, "t": 12.5})
    records = read_tape(path)
    assert [r["fragment"] for r in records] == [1, 2]
    assert records[0]["weights"] == [0.25, 0.75]
    assert isinstance(records[0]["t"], float)
    assert records[1]["t"] == 12.5  # a caller's own timestamp is kept


def test_keys_sorted_one_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    with EventTape(path) as tape:
        tape.append({"zeta": 1, "alpha": 2, "mid": {"b": 1, "a": 2}})
    text = path.read_text()
    assert text.endswith("\n") and text.count("\n") == 1
    line = json.loads(text)
    assert list(line) == sorted(line)
    assert text.index('"alpha"') < text.index('"mid"') < text.index('"t"') < text.index('"zeta"')
    assert text.index('"a"') < text.index('"b"')


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    with EventTape(path) as tape:
        tape.append({"n": 1})
        tape.append({"n": 2})
    with open(path, "ab") as f:
        f.write(b'{"n": 3, "norms": [1.0, 2')
    assert [r["n"] for r in read_tape(path)] == [1, 2]


def test_corrupt_middle_line_raises(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    path.write_text('{"n": 1}\n{"n": 2, oops\n{"n": 3}\n')
    with pytest.raises(TapeError, match=r"line 2 is corrupt"):
        read_tape(path)


def test_non_object_line_raises(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    path.write_text('{"n": 1}\n[1, 2]\n{"n": 3}\n')
    with pytest.raises(TapeError, match=r"line 2"):
        read_tape(path)


def test_disabled_tape_is_a_no_op(tmp_path: Path) -> None:
    tape = EventTape(None)
    assert not tape.enabled
    tape.append({"n": 1})
    tape.close()
    assert list(tmp_path.iterdir()) == []


def test_reopen_appends(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    with EventTape(path) as tape:
        tape.append({"n": 1})
    with EventTape(path) as tape:
        tape.append({"n": 2})
    assert [r["n"] for r in read_tape(path)] == [1, 2]


def test_reopen_after_torn_write_starts_a_clean_line(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    with EventTape(path) as tape:
        tape.append({"n": 1})
    with open(path, "ab") as f:
        f.write(b'{"n": 2, "wei')
    with EventTape(path) as tape:
        tape.append({"n": 3})
    assert [r["n"] for r in read_tape(path)] == [1, 3]


def test_reopen_keeps_a_whole_record_missing_its_newline(tmp_path: Path) -> None:
    path = tmp_path / "tape.jsonl"
    path.write_bytes(b'{"n": 1}\n{"n": 2}')
    with EventTape(path) as tape:
        tape.append({"n": 3})
    assert [r["n"] for r in read_tape(path)] == [1, 2, 3]


def test_append_after_close_raises(tmp_path: Path) -> None:
    tape = EventTape(tmp_path / "tape.jsonl")
    tape.close()
    with pytest.raises(ValueError, match="closed"):
        tape.append({"n": 1})


def test_missing_tape_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_tape(tmp_path / "nope.jsonl")
