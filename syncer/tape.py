"""The syncer's event tape: one JSON object per line, appended in commit order (SPEC §3.8).

Every record is written whole (keys sorted, newline-terminated), flushed and fsynced before
``append`` returns, so a crash can tear at most the last line. ``read_tape`` ignores such a torn
tail; a resumed syncer reopening the tape cuts it off first, so the next record starts on a
line of its own instead of being glued onto the fragment.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any


class TapeError(ValueError):
    """A tape line in the middle of the file is not a JSON object."""


def _default(obj: Any) -> Any:
    # Scalars from numpy/torch reach the tape through merge statistics; store their values.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"event tape cannot record a value of type {type(obj).__name__}")


def _encode(record: Mapping[str, Any]) -> bytes:
    return (json.dumps(dict(record), sort_keys=True, default=_default) + "\n").encode("utf-8")


def _parse_line(raw: bytes) -> dict[str, Any]:
    value = json.loads(raw.decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


class EventTape:
    """Append-only JSONL writer; ``EventTape(None)`` is a disabled tape whose appends do nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._repair_tail(self.path)
            self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the tape's life

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @staticmethod
    def _repair_tail(path: Path) -> None:
        """Make the file end on a line boundary before appending to it."""
        if not path.exists() or path.stat().st_size == 0:
            return
        with open(path, "r+b") as f:
            data = f.read()
            if data.endswith(b"\n"):
                return
            start = data.rfind(b"\n") + 1
            try:
                _parse_line(data[start:])
            except ValueError:
                f.truncate(start)  # a torn record that never finished: drop it
            else:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")  # a whole record that only lost its newline: keep it
            f.flush()
            os.fsync(f.fileno())

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one record durably; adds ``"t"`` (unix time, seconds) when the record has none."""
        if self.path is None:
            return
        if "t" not in record:
            record = {**record, "t": time.time()}
        line = _encode(record)
        with self._lock:
            if self._file is None:
                raise ValueError(f"event tape {self.path} is closed")
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> EventTape:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_tape(path: Path) -> list[dict[str, Any]]:
    """Read every record; a torn final line is ignored, a corrupt earlier line raises TapeError."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"event tape {path} does not exist")
    lines = path.read_bytes().split(b"\n")
    records: list[dict[str, Any]] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            records.append(_parse_line(raw))
        except ValueError as exc:
            if number == len(lines):  # no newline after it: a write the crash cut short
                break
            raise TapeError(f"event tape {path} line {number} is corrupt: {exc}") from exc
    return records
