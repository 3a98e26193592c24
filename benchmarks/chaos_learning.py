"""The learning mode of the chaos harness (`python -m benchmarks.chaos --steps N`): the step budget
every learner id trains to, when a fault may still be made, and the final cut's loss. Torch-free:
the harness never imports torch; `benchmarks/chaos_learner.py` does the training.

Every learner id trains exactly N optimizer steps over all its incarnations. After each step a
learner replaces its id's progress file (the id's step count, as text) atomically; a restarted
incarnation reads it and goes on from there: the count, the data order and the learning-rate
schedule continue where the killed one got to, while its optimizer state and its steps not yet
pushed are lost with it.

A syncer finalizes once every learner connected to it has finished and none that left while
training may still come back (`--rejoin-wait-s`, `REJOIN_WAIT_S` here), so a killed learner that
is back within that window trains its remaining steps into the final cut. The faults fall in the
first `FAULT_SHARE` of the fault-free arm's duration, and a kill is made only while it can be made
up: a learner while another one is training, and its restart (twice the slowest start of the
fault-free arm) takes less than the rejoin window or than that other learner's steps left; the
syncer only while no learner has finished and every one training has more left than
the syncer needs to come back and be redialed. A fault that does not fit is skipped and named in
the notes.

The final cut's held-out loss is learner 0's: it evaluates the model it installed last. Every
learner prints a digest of its final parameters, so the harness checks that all of them ended on
the same final cut.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

LOSS_GOAL = 1.03  # churn costs at most 3% of the final eval loss at equal tokens
FAULT_SHARE = 0.8  # of the fault-free arm's duration, from the initial cut
REJOIN_WAIT_S = 60.0  # the syncer's --rejoin-wait-s: how long it waits for a killed learner at the end
REDIAL_S = 2.0  # a learner redials a restarted syncer within this (backoff capped at 1 s, then the handshake)


def read_progress(path: Path) -> int:
    """The optimizer steps a learner id has taken so far, over all its incarnations (0: none)."""
    try:
        return int(path.read_text() or 0)
    except FileNotFoundError:
        return 0


def write_progress(path: Path, steps: int) -> None:
    """Replace the count at once: a SIGKILL leaves the old count or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(steps))
    os.replace(tmp, path)


def add_args(parser: argparse.ArgumentParser) -> None:
    """The harness's flags of the learning mode (each learner gets them as they are)."""
    group = parser.add_argument_group("learning mode (--steps N > 0)")
    add = group.add_argument
    add("--steps", type=int, default=0,
        help="optimizer steps per learner id; > 0 trains a small Llama to equal tokens instead of the window "
             "(default 0)")
    add("--hidden", type=int, default=64, help="the Llama's width (default 64)")
    add("--layers", type=int, default=2, help="its layers (default 2)")
    add("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    add("--batch", type=int, default=16, help="sequences per step and learner (default 16)")
    add("--lr", type=float, default=1.5e-3, help="AdamW learning rate after the warm-up (default 1.5e-3)")
    add("--warmup", type=int, default=20, help="steps of linear learning-rate warm-up (default 20)")
    add("--rejoin-s", type=float, default=0.0,
        help="seconds from a SIGKILL to the learner (or the syncer) being back, for placing kills (default 0: "
             "measured in the fault-free arm)")


@dataclass(frozen=True)
class Timing:
    """Where the faults of an arm may fall, in seconds: within `horizon` of the initial cut; a killed
    learner trains again `learner_away_s` after its kill, a killed syncer's learners are back
    `syncer_away_s` after its kill (0: not measured, the window mode)."""

    horizon: float
    learner_away_s: float = 0.0
    syncer_away_s: float = 0.0

    @classmethod
    def after(cls, args: argparse.Namespace, seconds: float, learner_start_s: float, syncer_start_s: float) -> Timing:
        """From the fault-free arm: its duration and its slowest learner and syncer starts."""
        if args.rejoin_s > 0:
            return cls(FAULT_SHARE * seconds, args.rejoin_s, args.rejoin_s)
        return cls(FAULT_SHARE * seconds, 2 * learner_start_s + args.restart_delay,
                   1.5 * syncer_start_s + args.syncer_down_s + REDIAL_S)


@dataclass
class FinalCut:
    loss: float  # learner 0's held-out loss on the model it installed last (NaN: none reported)
    agreed: bool  # every learner id ended on the final cut, and all hold the same parameters


class Proc(Protocol):
    """What the budget looks at in one of the harness's processes (`chaos.Child`)."""

    popen: subprocess.Popen[bytes]
    stopped: bool
    expected_exit: bool

    def alive(self) -> bool: ...

    def started(self) -> float | None: ...


class StepBudget:
    """The N steps of every learner id in one arm's work directory, and what follows from them:
    which learners a fault may hit, and when the arm is over."""

    def __init__(self, args: argparse.Namespace, workdir: Path, timing: Timing) -> None:
        self.args = args
        self.steps = args.steps
        self.workdir = workdir
        self.timing = timing
        # the longest an arm may take; also how long a learner waits for the final cut
        self.limit = 3 * args.steps * args.step_s + 240
        self.finalized_at: float | None = None  # when the syncer was first seen to have finalized

    def taken(self, lid: int) -> int:
        return read_progress(self.workdir / f"progress{lid}")

    def training(self, lid: int) -> bool:
        return self.taken(lid) < self.steps

    def left_s(self, lid: int) -> float:
        """Wall time the id's steps left take at the pace (a lower bound: a step may take longer)."""
        return (self.steps - self.taken(lid)) * self.args.step_s

    def per_id(self) -> dict[int, int]:
        return {lid: self.taken(lid) for lid in range(self.args.learners)}

    def learner_argv(self, lid: int) -> list[str]:
        """What `chaos_learner` needs beyond the window mode's flags."""
        a = self.args
        return ["--steps", str(a.steps), "--progress-file", str(self.workdir / f"progress{lid}"),
                "--shards", str(a.learners), "--hidden", str(a.hidden), "--layers", str(a.layers),
                "--seq-len", str(a.seq_len), "--batch", str(a.batch), "--lr", str(a.lr), "--warmup", str(a.warmup),
                "--final-timeout-s", str(round(self.limit))]

    def training_now(self, learners: Mapping[int, Proc]) -> set[int]:
        """Learners that joined (not one still restarting) and are short of their steps."""
        return {lid for lid, c in learners.items() if c.alive() and c.started() is not None and self.training(lid)}

    def targets(self, what: str, running: list[int], learners: Mapping[int, Proc]) -> list[int]:
        """Of the running learners, those a `kill` or `sigstop` may hit now: training, and for a kill
        only while another learner is training, and the syncer will wait for the target to be back
        (its restart is quicker than the rejoin window, or that other learner outlasts it)."""
        now = self.training_now(learners)
        away = self.timing.learner_away_s
        return [lid for lid in running if lid in now
                and (what != "kill" or any(away < REJOIN_WAIT_S or self.left_s(o) > away for o in now - {lid}))]

    def may_kill_syncer(self, learners: Mapping[int, Proc]) -> bool:
        """No learner has finished (it would say DONE to the restarted syncer, maybe first), and every
        one training now has more steps left than the syncer is away."""
        return (all(self.training(lid) for lid in range(self.args.learners))
                and all(self.left_s(lid) > self.timing.syncer_away_s for lid in self.training_now(learners)))

    def ended(self, learners: Mapping[int, Proc], syncer: Proc | None, restart_due: bool, now: float,
              notes: list[str]) -> bool:
        """Every id's last incarnation exited by itself and no restart is due; or the syncer finalized
        and its learners had 15 s to take the final cut and exit."""
        for child in learners.values():
            child.expected_exit = child.expected_exit or child.popen.poll() == 0  # its steps and the final cut
        if syncer is not None and syncer.popen.poll() == 0:
            self.finalized_at = self.finalized_at or now
            if any(c.alive() for c in learners.values()):
                if now < self.finalized_at + 15:
                    return False
                notes.append("the syncer finalized while a learner still ran")
            return True
        return not restart_due and all(c.popen.poll() == 0 for c in learners.values())

    def final_cut(self, done: dict[int, dict[str, Any]], notes: list[str]) -> FinalCut:
        """Judge the `learner_done` records of every id's last incarnation; what is wrong goes to `notes`."""
        missing = sorted(set(range(self.args.learners)) - set(done))
        if missing:
            notes.append(f"learner id(s) {missing} printed no learner_done")
        unfinished = sorted(lid for lid, rec in done.items() if not rec.get("finished"))
        if unfinished:
            notes.append(f"learner id(s) {unfinished} did not install the final cut")
        digests = {rec.get("digest") for rec in done.values()}
        if len(digests) > 1:
            notes.append(f"the learners ended on {len(digests)} different models")
        short = {lid: n for lid, n in self.per_id().items() if n != self.steps}
        if short:
            notes.append(f"learner ids took other step counts than {self.steps}: {short}")
        loss = float(done.get(0, {}).get("eval_loss", math.nan))
        return FinalCut(loss, not missing and not unfinished and len(digests) == 1 and not short)


def describe(args: argparse.Namespace) -> str:
    return (f"{args.steps} steps per learner id of a Llama {args.hidden}x{args.layers}, seq {args.seq_len}, "
            f"batch {args.batch}, lr {args.lr:g}")


# The learning mode's rows of the harness's table, of an arm (`chaos.Arm`).
ROWS: list[tuple[str, Callable[[Any], str]]] = [
    ("optimizer steps per learner id", lambda a: "/".join(str(n) for n in a.steps_per_id.values())),
    ("late steps (over --step-s)", lambda a: str(a.late_steps)),
    ("all ended on one final cut", lambda a: "yes" if a.final and a.final.agreed else "no"),
    ("final eval loss (held-out)", lambda a: f"{a.final.loss:.4f}" if a.final else "-"),
]


def loss_summary(clean: FinalCut, chaos: FinalCut) -> tuple[str, dict[str, float | None]]:
    """The closing line and its JSON: both arms' final eval loss and their ratio against the goal."""
    x, y = clean.loss, chaos.loss
    ratio = y / x if x else math.inf
    line = f"final eval loss fault-free {x:.4f}, with faults {y:.4f}, ratio {ratio:.4f} (goal <= {LOSS_GOAL})"
    return line, {"fault-free": finite(x), "faults": finite(y), "ratio": finite(ratio), "goal": LOSS_GOAL}


def finite(x: float) -> float | None:
    """JSON has no NaN: a loss that is not a number is null."""
    return x if math.isfinite(x) else None
