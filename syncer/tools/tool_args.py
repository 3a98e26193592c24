"""Command lines of the user tools (`yeto-plan`, `yeto-plot`, `yeto-export`): a usage error is one line.

argparse answers a bad flag with its whole usage block and then the error; these tools answer
every bad input the same way, with one line naming it and exit status 2, so a script (or a
person) reading stderr gets the reason and nothing else. ``--help`` still prints the usage.
`unwritable_dir` checks an output directory before any work is done for it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn


def one_line(text: str) -> str:
    """`text` with its line breaks escaped (a path may hold one), so it prints as one line."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


class ToolParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(one_line(f"{self.prog}: {message} (see {self.prog} --help)"), file=sys.stderr)
        sys.exit(2)


def unwritable_dir(path: Path) -> str | None:
    """Why `path` cannot be, or be made, a directory this process writes into; None when it can.
    Nothing is created: the nearest existing ancestor must be a writable directory."""
    try:
        there = path.absolute()
        while not there.exists() and there.parent != there:
            there = there.parent
        if not there.is_dir():
            return f"{there} is not a directory"
        if not os.access(there, os.W_OK | os.X_OK):
            return f"{there} is not writable"
    except OSError as exc:
        return f"{exc.strerror}"
    return None
