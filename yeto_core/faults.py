"""Named fault points: places in the syncer and the client where a test can make the process
die, freeze or exit, to prove that nothing committed is lost whatever the moment of a crash.

A point is armed by the `YETO_FAULT` setting of the process that should fail (read with the
other settings, `yeto_core.settings`), which builds one `FaultInjector` at start-up and passes it
to the objects that hold the points:

    YETO_FAULT=mid-merge            SIGKILL this process the first time it reaches mid-merge
    YETO_FAULT=mid-bcast@3          ... the third time
    YETO_FAULT=mid-stripe@2:stop    SIGSTOP itself instead (a frozen process, sockets open)
    YETO_FAULT=before-push:exit     os._exit(FAULT_EXIT_CODE) instead

Without the setting the injector is `NO_FAULTS`: a point reached costs one attribute check. A
malformed value fails at start-up, like any bad setting, naming YETO_FAULT and what is wrong.

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
* ``iso-start``: an isotropic-merge worker (`syncer.merge.iso_worker`) started, not yet ready.
* ``iso-job``: that worker read a whole matrix and has not answered it. The syncer's setting arms
  these two in its first worker only (`syncer.merge.iso_pool`); the syncer itself never reaches them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

POINTS = ("mid-init", "before-push", "mid-stripe", "mid-merge", "mid-checkpoint", "mid-bcast", "mid-final",
          "iso-start", "iso-job")
WORKER_POINTS = ("iso-start", "iso-job")  # reached in an iso worker process, never in the syncer
ACTIONS = ("kill", "stop", "exit")
ENV = "YETO_FAULT"
FAULT_EXIT_CODE = 86
FAULT_SEND_WAIT_S = 5.0  # how long a point that fires "after sending to some" waits for those bytes to leave


class FaultSpecError(ValueError):
    """A malformed arming value; `reason` is what is wrong, without the setting's name."""

    def __init__(self, value: str, reason: str) -> None:
        super().__init__(f"{ENV}={value!r}: {reason}")
        self.reason = reason


def parse(value: str) -> tuple[str, int, str]:
    """`point[@n][:action]` → (point, n, action); ValueError naming what is wrong."""
    spec, _, action = value.strip().partition(":")
    point, _, nth = spec.partition("@")
    if point not in POINTS:
        raise FaultSpecError(value, f"unknown fault point {point!r} (known: {', '.join(POINTS)})")
    action = action or "kill"
    if action not in ACTIONS:
        raise FaultSpecError(value, f"unknown action {action!r} (known: {', '.join(ACTIONS)})")
    try:
        n = int(nth) if nth else 1
    except ValueError:
        n = 0
    if n < 1:
        raise FaultSpecError(value, "the occurrence after '@' must be a whole number >= 1")
    return point, n, action


class FaultInjector:
    """One process's armed fault, if any, and how often its point was reached so far.

    Built once from the `YETO_FAULT` setting and handed to whoever holds a point; an empty spec
    arms nothing. Safe to share between threads: the occurrences are counted under a lock."""

    def __init__(self, spec: str = "") -> None:
        self.spec = spec
        self._armed: tuple[str, int, str] | None = parse(spec) if spec.strip() else None
        self._lock = threading.Lock()
        self._seen = 0  # times the armed point was reached

    def __repr__(self) -> str:
        return f"FaultInjector({self.spec!r})"

    def armed(self, name: str) -> bool:
        """Whether `name` is the armed point (its occurrence may still be ahead)."""
        return self._armed is not None and self._armed[0] == name

    def point(self, name: str) -> None:
        """Reached `name`: fail here if this injector is armed for this occurrence of it."""
        armed = self._armed
        if armed is None or armed[0] != name:
            return
        with self._lock:
            self._seen += 1
            if self._seen != armed[1]:
                return
        action = armed[2]
        print(f"yeto: fault point {name} reached (occurrence {armed[1]}): {action}", file=sys.stderr, flush=True)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os._exit(FAULT_EXIT_CODE)


NO_FAULTS = FaultInjector()  # never fires: the default of every object that holds a point

