"""Processes a benchmark starts, ended by their pid."""

from __future__ import annotations

import contextlib
import subprocess


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; nothing happens to a process that has exited."""
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait(timeout=grace_s)
