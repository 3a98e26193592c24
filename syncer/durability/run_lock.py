"""One writer per run (DESIGN §6.2): a syncer holds its checkpoint and its tape for its whole life.

Two syncers on one `--checkpoint` both commit and both write it, so the file ends holding
whichever model wrote last; two on one `--tape` interleave their records. So each path is locked
before anything reads or writes it, with an advisory `flock(LOCK_EX | LOCK_NB)` on a sidecar file
beside it, `<path>.lock`: the checkpoint is replaced by a rename at every write, and a lock on
the file itself would stay with the replaced inode. The holder writes its pid, host name and
start time into the lock file, so a second syncer stops at once and says who holds the path.

The kernel drops a process's flock when the process ends, however it ends, so a lock file left
behind by a killed syncer does not block the next one (its `--resume` takes the path over). The
descriptors are close-on-exec: a child process (an iso worker) cannot keep the lock alive after
the syncer is gone.

A clean exit removes the lock file. Removing a lock file is only safe when every taker checks,
after it got the lock, that the file it locked is still the one at the path: a taker that opened
the file just before the holder removed it would otherwise lock an unnamed inode while a third
process creates and locks a new file at the path. `RunLock` does that check (and opens the path
again when the file changed), and the holder removes the file while it still holds the lock.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

log = logging.getLogger("yeto.syncer")

TAKE_ATTEMPTS = 100  # times the lock file may be replaced under a taker before it gives up
INFO_BYTES = 4096  # the most of a lock file read for its holder's description


class RunLockError(Exception):
    """A path of the run is held by another live syncer, or cannot be locked (the message says which)."""


@dataclass(frozen=True)
class _Held:
    flag: str
    lock_path: Path
    fd: int


def lock_path_of(path: Path) -> Path:
    """The sidecar lock file of `path`."""
    return path.with_name(path.name + ".lock")


def holder_description(raw: bytes) -> str:
    """Who a lock file says holds it: "syncer pid 1234 on host h (since ...)", or a plain phrase."""
    try:
        info = json.loads(raw.decode("utf-8"))
        return f"syncer pid {int(info['pid'])} on host {info['host']} (since {info['since']})"
    except (ValueError, KeyError, TypeError):
        return "another syncer (its lock file does not say which yet)"


def _same_file(fd: int, path: Path) -> bool:
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


class RunLock:
    """The locks of one syncer's paths; `release` (or leaving the `with` block) frees them all."""

    def __init__(self) -> None:
        self._held: list[_Held] = []

    def acquire(self, flag: str, path: Path) -> None:
        """Lock `path` (named by `flag` in messages) for this process, or raise RunLockError with one
        line naming the path and its holder. The directory of `path` is made if it is missing."""
        path = Path(path)
        lock_path = lock_path_of(path)
        for held in self._held:
            if held.lock_path.resolve() == lock_path.resolve():
                raise RunLockError(f"{held.flag} and {flag} name the same file {path}; give each its own path")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunLockError(f"{flag} {path}: cannot make its directory: {exc.strerror}") from exc
        for _ in range(TAKE_ATTEMPTS):
            fd = self._open(flag, lock_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = holder_description(os.pread(fd, INFO_BYTES, 0))
                os.close(fd)
                raise RunLockError(f"{flag} {path} is in use by {holder}; stop it or choose another path") from None
            except OSError as exc:  # e.g. a file system without locks
                os.close(fd)
                raise RunLockError(f"{flag} {path}: cannot lock {lock_path}: {exc.strerror}") from exc
            if _same_file(fd, lock_path):
                self._describe_self(fd, lock_path)
                self._held.append(_Held(flag, lock_path, fd))
                return
            os.close(fd)  # its holder removed it between our open and our lock: lock the file there now
        raise RunLockError(f"{flag} {path}: its lock file {lock_path} kept being replaced; is another syncer "
                           "starting on it in a loop?")

    @staticmethod
    def _open(flag: str, lock_path: Path) -> int:
        try:
            return os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RunLockError(f"{flag}: cannot open its lock file {lock_path}: {exc.strerror}") from exc

    @staticmethod
    def _describe_self(fd: int, lock_path: Path) -> None:
        """Write who holds the lock into the file; best effort (a full disk still lets the lock work)."""
        previous = os.pread(fd, INFO_BYTES, 0)
        if previous.strip():
            log.info("%s was left behind by %s, which holds it no more; taking it over", lock_path,
                     holder_description(previous))
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n"
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.encode("utf-8"), 0)
        except OSError as exc:
            log.warning("%s is locked but could not say who holds it: %s", lock_path, exc.strerror)

    def release(self) -> None:
        """Remove each lock file (while still holding its lock, so no taker is left holding an
        unnamed file) and release it. Idempotent."""
        while self._held:
            held = self._held.pop()
            with contextlib.suppress(OSError):
                if _same_file(held.fd, held.lock_path):  # not a file a later syncer made after ours was removed
                    held.lock_path.unlink()
            os.close(held.fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
