"""A command's exit status, stderr, wall time and peak RSS, for the tests that bound a tool's memory.

The command runs under a small Python launcher that reports `getrusage(RUSAGE_CHILDREN).ru_maxrss`
once the command exits. Measuring the test process's own child instead would count the test
process's memory: a forked child's RSS starts as its parent's (torch and all) until it execs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = """import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def run_measured(argv: list[str], cwd: Path, timeout: float = 120) -> tuple[int, str, float, int]:
    """Run `argv` (its stdout discarded): exit status, stderr, wall seconds, peak RSS in bytes (Linux)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", LAUNCHER, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=True)
    seconds = time.perf_counter() - start
    code, kib = (int(v) for v in done.stdout.split())
    return code, done.stderr, seconds, kib * 1024
