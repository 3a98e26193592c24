"""Named fault points: places in the syncer and the client where a test can make the process
die, freeze or exit, to prove that nothing committed is lost whatever the moment of a crash.

A point is armed through the environment of the process that should fail:

    YETO_FAULT=mid-merge            SIGKILL this process the first time it reaches mid-merge
    YETO_FAULT=mid-bcast@3          ... the third time
    YETO_FAULT=mid-stripe@2:stop    SIGSTOP itself instead (a frozen process, sockets open)
    YETO_FAULT=before-push:exit     os._exit(FAULT_EXIT_CODE) instead

An unset variable costs one dictionary lookup per point reached. A malformed value or an
unknown point name is reported once on stderr and arms nothing: fault injection must never be
the reason a real run stops.

The points (each says what has and has not happened when it fires):

* ``mid-init``: the syncer received an INIT fragment, not all of them (no initial cut yet); the
  client sent its first INIT fragment, not the others.
* ``before-push``: the syncer received a whole PUSH and has not judged it; the client has a push
  to send and has sent no byte of it.
* ``mid-stripe``: a bulk transfer is partly received (at least one chunk in, one missing), in
  whichever process reads it.
* ``mid-merge``: the syncer merged a round into its in-memory state; nothing of it is durable
  or sent (no version bump, checkpoint, tape record or broadcast).
* ``mid-checkpoint``: a checkpoint's temporary file is written and synced, not yet renamed over
  the previous checkpoint.
* ``mid-bcast``: the syncer sent a round's broadcast to some learners, not to all (with one
  learner: before sending it).
* ``mid-final``: the final cut is written; the syncer sent FINAL to some learners, not to all.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

POINTS = ("mid-init", "before-push", "mid-stripe", "mid-merge", "mid-checkpoint", "mid-bcast", "mid-final")
ACTIONS = ("kill", "stop", "exit")
ENV = "YETO_FAULT"
FAULT_EXIT_CODE = 86
FAULT_SEND_WAIT_S = 5.0  # how long a point that fires "after sending to some" waits for those bytes to leave

_lock = threading.Lock()
_parsed_from: str | None = None
_armed: tuple[str, int, str] | None = None  # (point, occurrence, action)
_seen: dict[str, int] = {}


def parse(value: str) -> tuple[str, int, str]:
    """`point[@n][:action]` → (point, n, action); ValueError naming what is wrong."""
    spec, _, action = value.strip().partition(":")
    point, _, nth = spec.partition("@")
    if point not in POINTS:
        raise ValueError(f"{ENV}={value!r}: unknown fault point {point!r} (known: {', '.join(POINTS)})")
    action = action or "kill"
    if action not in ACTIONS:
        raise ValueError(f"{ENV}={value!r}: unknown action {action!r} (known: {', '.join(ACTIONS)})")
    try:
        n = int(nth) if nth else 1
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={value!r}: the occurrence after '@' must be a whole number >= 1")
    return point, n, action


def _current() -> tuple[str, int, str] | None:
    global _parsed_from, _armed
    value = os.environ.get(ENV, "")
    if value != _parsed_from:  # (re)armed: start counting afresh
        _parsed_from, _armed = value, None
        _seen.clear()
        if value:
            try:
                _armed = parse(value)
            except ValueError as exc:
                print(f"yeto: {exc}; no fault armed", file=sys.stderr, flush=True)
    return _armed


def armed(name: str) -> bool:
    """Whether `name` is the armed point (its occurrence may still be ahead)."""
    if not os.environ.get(ENV):
        return False
    with _lock:
        current = _current()
    return current is not None and current[0] == name


def fault_point(name: str) -> None:
    """Reached `name`: fail here if the environment armed this point for this occurrence."""
    if not os.environ.get(ENV):
        return
    with _lock:
        armed = _current()
        if armed is None or armed[0] != name:
            return
        _seen[name] = _seen.get(name, 0) + 1
        if _seen[name] != armed[1]:
            return
    action = armed[2]
    print(f"yeto: fault point {name} reached (occurrence {armed[1]}): {action}", file=sys.stderr, flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        os._exit(FAULT_EXIT_CODE)
