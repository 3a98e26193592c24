"""Where a yeto plugin ends the process it was started in: `yeto_core` raises typed errors and
never exits a process itself; the plugins, which start an island inside a trainer's process (the
HF Trainer's callback, Megatron's, verl's and Miles' workers), turn the one error that asks for
an exit code of its own into that exit.

    with island_exit():
        island.start()

`ProbeFailed` (the link to the syncer measured below the island's minimum, DESIGN §7.6) prints
its one line on stderr and exits with its code, 75 (EX_TEMPFAIL), so a supervisor may place the
island elsewhere. A `SettingsError` found only once the trainer's objects exist (a setting the
trainer's optimizer cannot serve) prints its line and exits 2, as a bad setting does at start.
Every other error goes on as it is.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from yeto_core.refusal import ProbeFailed
from yeto_core.setting_names import SettingsError

USAGE_EXIT_CODE = 2


@contextlib.contextmanager
def island_exit() -> Iterator[None]:
    try:
        yield
    except ProbeFailed as exc:
        print(exc, file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None


@contextlib.contextmanager
def settings_exit() -> Iterator[None]:
    try:
        yield
    except SettingsError as exc:
        print(f"yeto: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(USAGE_EXIT_CODE) from None
