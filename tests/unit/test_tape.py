from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import syncer.durability.tape as tape_module
from syncer.durability.tape import EventTape, TapeError, read_tape

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


class FullDisk:
    """os.write that fails with ENOSPC while `full`, after writing part of what it was given (as a
    real full disk can), so the tape must cut the torn bytes off again."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self._real = os.write
        monkeypatch.setattr(tape_module.os, "write", self)

    def __call__(self, fd: int, data: bytes | memoryview) -> int:
        if self.full:
            self._real(fd, bytes(data[: max(1, len(data) // 2)]))
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._real(fd, data)


def test_a_full_disk_holds_the_records_and_writes_them_in_order_once_it_has_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tape.jsonl"
    disk = FullDisk(monkeypatch)
    with EventTape(path) as tape, caplog.at_level(logging.WARNING, logger="yeto.syncer.tape"):
        tape.append({"event": "commit", "round": 0})
        disk.full = True
        for r in (1, 2, 3):
            tape.append({"event": "commit", "round": r})
        assert tape.held == 3
        assert [r["round"] for r in read_tape(path)] == [0]  # no torn line left behind
        assert path.read_bytes().endswith(b"\n")
        disk.full = False
        tape.append({"event": "commit", "round": 4})
        assert tape.held == 0
    assert [r["round"] for r in read_tape(path)] == [0, 1, 2, 3, 4]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0].getMessage()
    assert str(path) in errors[0].getMessage()
    assert any("written again: 4 held record(s)" in r.getMessage() for r in caplog.records)


def test_past_the_hold_limit_the_oldest_go_and_a_gap_record_says_how_many(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tape_module, "HELD_MAX", 3)
    path = tmp_path / "tape.jsonl"
    disk = FullDisk(monkeypatch)
    with EventTape(path) as tape:
        disk.full = True
        for r in range(5):
            tape.append({"event": "commit", "round": r})
        assert tape.held == 3
        disk.full = False
    records = read_tape(path)  # close() wrote what was held
    assert records[0]["event"] == "tape_gap" and records[0]["lost"] == 2
    assert [r["round"] for r in records[1:]] == [2, 3, 4]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_a_real_full_disk_loses_no_record(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(root)], capture_output=True,
                      timeout=30, check=False).returncode:
        pytest.skip("mount -t tmpfs failed")
    try:
        filler = root / "filler"
        with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
            for _ in range(64):
                f.write(b"\0" * 4096)
        written = 0
        with EventTape(root / "tape.jsonl") as tape:
            for r in range(200):  # the tape file's last page fills within a few records
                tape.append({"event": "commit", "round": r, "pad": "x" * 500})
                written += 1
                if tape.held:
                    break
            assert tape.held, "the tape never met the full disk"
            filler.unlink()
            tape.append({"event": "commit", "round": written, "pad": ""})
            assert tape.held == 0
        assert [rec["round"] for rec in read_tape(root / "tape.jsonl")] == list(range(written + 1))
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True, timeout=30, check=False)
