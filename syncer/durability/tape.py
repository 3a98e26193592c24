"""The syncer's event tape: one JSON object per line, appended in commit order (DESIGN §6.4).

Every record is written whole (keys sorted, newline-terminated), flushed and fsynced before
``append`` returns, so a crash can tear at most the last line. ``read_tape`` ignores such a torn
tail; a resumed syncer reopening the tape cuts it off first, so the next record starts on a
line of its own instead of being glued onto the fragment.

The tape is the run's account, not its state (that is the checkpoint), so a tape that cannot be
written (a full disk, an I/O error) does not stop training. The failed bytes are cut off again,
the records are held in memory in order (at most ``HELD_MAX``; past that the oldest go, and a
``tape_gap`` record says how many when writing resumes) and each later append tries again. One
error when the trouble starts, one warning when the tape is written again.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger("yeto.syncer.tape")

HELD_MAX = 10_000
"""Records held in memory while the tape cannot be written (a commit record is ~1 KiB)."""


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
        self._fd: int | None = None
        self._size = 0  # bytes of whole records in the file
        self._held: collections.deque[bytes] = collections.deque()
        self._lost = 0  # held records dropped for room since the tape was last written
        self._failing = False
        self.listeners: list[Callable[[Mapping[str, Any]], None]] = []  # e.g. the metrics (syncer/service/metrics.py)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._repair_tail(self.path)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._size = os.fstat(self._fd).st_size

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @property
    def held(self) -> int:
        """Records waiting in memory for the tape to be writable again."""
        return len(self._held)

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
        """Write one record durably; adds ``"t"`` (unix time, seconds) when the record has none.
        If the file cannot be written, the record is held and written with the next one that can.
        Every listener sees the record first (with or without a file)."""
        if "t" not in record:
            record = {**record, "t": time.time()}
        for listener in self.listeners:
            listener(record)
        if self.path is None:
            return
        line = _encode(record)
        with self._lock:
            if self._fd is None:
                raise ValueError(f"event tape {self.path} is closed")
            self._held.append(line)
            self._write_held(self._fd)

    def _write_held(self, fd: int) -> bool:
        gap = _encode({"event": "tape_gap", "lost": self._lost, "t": time.time()}) if self._lost else b""
        blob = gap + b"".join(self._held)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):  # no half record stays behind to glue the next onto
                os.ftruncate(fd, self._size)
            while len(self._held) > HELD_MAX:
                self._held.popleft()
                self._lost += 1
            if not self._failing:
                self._failing = True
                log.error("event tape %s cannot be written: %s; holding its records in memory (at most %d) "
                          "and trying again with each new one", self.path, exc, HELD_MAX)
            return False
        self._size += len(blob)
        if self._failing:
            self._failing = False
            log.warning("event tape %s written again: %d held record(s)%s", self.path, len(self._held),
                        f", {self._lost} lost for room (a tape_gap record says so)" if self._lost else "")
        self._held.clear()
        self._lost = 0
        return True

    def close(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            if self._held and not self._write_held(self._fd):
                log.error("event tape %s: %d record(s) could not be written before closing", self.path,
                          len(self._held) + self._lost)
            os.close(self._fd)
            self._fd = None

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
