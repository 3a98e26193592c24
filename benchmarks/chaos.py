"""Chaos harness: what faults cost a run, against the same run without them: goodput and uptime
over a time window, or (`--steps N`) the final eval loss of a small language model at equal tokens.

    python -m benchmarks.chaos [--seconds 90] [--learners 3] [--kill-every 30] [--syncer-restarts 1] [--seed 0]
    python -m benchmarks.chaos --steps 400 --kill-every 20      # the learning mode (~5 min)

Both arms run in one invocation, fault-free first, then with faults, with the same seed and
settings. Each arm starts the real syncer (`python -m syncer`, a subprocess on 127.0.0.1, `--port
0`, `--device cpu`, the syncer's default quorum unless `--quorum`, no round budget,
`--checkpoint-every 1`, one `--tape` file per arm that every incarnation appends to) and M learner processes
(`benchmarks/chaos_learner.py`, each step paced to `--step-s` of wall time, redial backoff capped
at 1 s): by default a LearnerSession over a small MLP, trained for a window of `--seconds` from
the initial cut (the tape's `init` record).

Learning mode (`--steps N`, `benchmarks/chaos_learning.py`): the learners train the small Llama
of `examples/hf_tiny_llama.py` on its byte tokens, each id on its own shard (AdamW, warm-up,
gradient clipping at 1.0, one torch thread, `--step-s` 0.25 unless given), and each learner id
takes exactly N optimizer steps over all its incarnations: a restarted one continues the count,
the data order and the schedule from the id's progress file, with a fresh optimizer and the
global model it receives on joining. The arm ends when every id has taken N steps and the final
cut; its window runs from the initial cut to the last id's last step. The faults fall in the
first 80% of the fault-free arm's window, and a kill only where the killed process can be back
before the learners still training end (else it is skipped and noted).

Faults (fault arm only), at times drawn from `random.Random(--seed)`, relative to the initial cut,
within the window (learning mode: within 80% of the fault-free arm's):

* **learner kill**: about every `--kill-every` s (each gap uniform in [0.5, 1.5] x that), SIGKILL
  a random running learner; restart it with the same learner id `--restart-delay` s later;
* **SIGSTOP**: `--stops` times (default: one per full minute of that span), SIGSTOP a random
  running learner for `--stop-s` s, then SIGCONT it;
* **syncer restart**: `--syncer-restarts` times (default 1), SIGKILL the syncer and start it again
  `--syncer-down-s` s later on the same port with `--resume --checkpoint` (same tape file).

Every process is started by this harness and stopped by its pid when the arm ends (SIGTERM to
the learners, which ask for the final cut; then the syncer; learning mode: they end by
themselves), or on any error.

What is measured, per arm:

* **steps computed**: every learner incarnation prints its cumulative step count after each step;
  the last count of each incarnation (also of SIGKILLed ones) summed over all incarnations;
* **steps merged**: from the tape's `commit` records, each round id counted once (the last commit
  of a round wins, so a round redone after a resume is not counted twice): sum of the `steps` of
  every answer, divided by P (the fragments): an answer carries the steps its learner trained
  since it installed that fragment, so each computed step reaches the global model once per
  fragment. A learner credits the steps it trains between a push and the install of that round's
  broadcast to its next push of the fragment, so only steps not yet pushed when an arm ends, or
  lost with a SIGKILLed learner, or in a round committed without that learner, are missing;
* **goodput** = steps merged / steps computed (computed and merged over the whole arm, up to the
  learners' exit);
* **uptime** = fraction of the window's 1 s bins (from the initial cut) holding at least one
  commit record (by its tape time `t`);
* **rounds/min**: distinct rounds whose commit falls in the window, per minute; learner
  SIGKILLs and restarts (a restart due after the window is not made), syncer restarts, SIGSTOPs;
  `retry` records on the tape;
* learning mode: each id's step count, the steps that overran `--step-s` (then the machine set
  the pace), whether every id ended on the same final cut (digests of the parameters), and the
  **final eval loss**: learner 0's held-out loss of the final cut it installed.

The last two lines are `ratio uptime faults/fault-free = X` and `ratio goodput faults/fault-free
= X`; the learning mode adds `final eval loss fault-free X, with faults Y, ratio Z (goal <= 1.03)`.
Whatever misbehaved (unexpected exits, tracebacks, errors in the syncer's log, skipped faults) is
listed under `notes` before the table. `--json FILE` also writes every number of both arms, the
faults made (seconds from the initial cut, kind, learner id) and the ratios; `--keep DIR` keeps
the tapes and every process's output; `--trace` makes the learners also print a JSON line per
push and per fragment install.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import chaos_learning
from benchmarks.chaos_learning import REJOIN_WAIT_S, FinalCut, StepBudget, Timing

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$")
BAD_LOG = re.compile(r"Traceback|terminate called|Fatal Python error| ERROR ")


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    return env


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    out: Path
    err: Path
    expected_exit: bool = False  # set when the harness kills it on purpose
    stopped: bool = False
    spawned: float = field(default_factory=time.time)

    def started(self) -> float | None:
        """Seconds from spawn to its `started` line (a learner that joined the run); None before it."""
        lines = [e for e in json_lines(self.out) if e.get("event") == "started"]
        return lines[0]["t"] - self.spawned if lines else None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        """SIGCONT (if stopped), SIGTERM, then SIGKILL, by pid; never raises."""
        if not self.alive():
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace)


@dataclass
class Arm:
    name: str
    seconds: float
    steps_computed: int = 0
    steps_merged: float = 0.0
    rounds: int = 0
    uptime: float = 0.0
    retries: int = 0
    learner_kills: int = 0
    learner_restarts: int = 0
    syncer_restarts: int = 0
    sigstops: int = 0
    incarnations: int = 0
    steps_per_id: dict[int, int] = field(default_factory=dict)  # learning mode: each id's count at the end
    learner_start_s: float = 0.0  # the longest a learner took from its spawn to training
    syncer_start_s: float = 0.0  # the longest a syncer took from its spawn to listening
    late_steps: int = 0  # steps whose compute overran --step-s (then the pace is the machine's)
    final: FinalCut | None = None  # learning mode: the final cut's held-out loss
    faults: list[tuple[float, str, int | None]] = field(default_factory=list)  # (s from the initial cut, what, id)
    notes: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.steps_merged / self.steps_computed if self.steps_computed else 0.0

    @property
    def rounds_per_min(self) -> float:
        return self.rounds * 60.0 / self.seconds


class Runner:
    """The processes of one arm; `close()` stops every one it started."""

    def __init__(self, args: argparse.Namespace, workdir: Path, faults: bool, timing: Timing) -> None:
        self.args = args
        self.workdir = workdir
        self.faults = faults
        self.timing = timing
        self.budget = StepBudget(args, workdir, timing) if args.steps > 0 else None  # the learning mode
        self.limit = self.budget.limit if self.budget else args.seconds
        self.key_file = workdir / "syncer.key"
        self.key_file.write_text(secrets.token_hex(32))
        self.key_file.chmod(0o600)  # a key file others may read is warned about
        self.tape = workdir / "tape.jsonl"
        self.checkpoint = workdir / "syncer.safetensors"
        self.children: list[Child] = []
        self.syncer: Child | None = None
        self.learners: dict[int, Child] = {}
        self.port = 0
        self.offset = 0.0  # the initial cut on the monotonic clock
        self.arm = Arm("faults" if faults else "fault-free", args.seconds)

    def spawn(self, name: str, argv: list[str]) -> Child:
        tag = f"{name}.{sum(c.name == name for c in self.children)}"
        out, err = self.workdir / f"{tag}.out", self.workdir / f"{tag}.err"
        with out.open("wb") as fo, err.open("wb") as fe:
            popen = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=fo, stderr=fe)
        child = Child(name, popen, out, err)
        self.children.append(child)
        return child

    def close(self, grace: float = 3.0) -> None:
        """SIGCONT + SIGTERM to every live child at once, one shared deadline, then SIGKILL, by pid."""
        live = [c for c in self.children if c.alive()]
        for child in live:
            child.signal(signal.SIGCONT)
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for child in live:
            child.stop(grace=2.0)  # SIGKILL whatever is still there

    # -- the syncer ------------------------------------------------------------------------
    def start_syncer(self, resume: bool, timeout: float = 60.0) -> None:
        a = self.args
        argv = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", str(self.port), "--learners",
                str(a.learners), "--quorum", str(a.quorum), "--fragments", str(a.fragments), "--sync-interval-steps",
                str(a.sync_interval), "--device", "cpu", "--checkpoint", str(self.checkpoint), "--checkpoint-every",
                "1", "--tape", str(self.tape), "--key-file", str(self.key_file), "--final-timeout-s", "10",
                "--rejoin-wait-s", str(REJOIN_WAIT_S)]
        if resume:
            argv.append("--resume")
        deadline = time.monotonic() + timeout
        while True:
            child = self.spawn("syncer", argv)
            while True:
                for line in child.out.read_text(errors="replace").splitlines():
                    m = LISTENING.match(line)
                    if m:
                        self.port = int(m.group(2))
                        self.syncer = child
                        self.arm.syncer_start_s = max(self.arm.syncer_start_s, time.time() - child.spawned)
                        return
                if not child.alive():
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the syncer printed no listening line within {timeout:.0f} s: {tail(child)}")
                time.sleep(0.05)
            # a restart may find the port of the killed syncer still taken for a moment: retry
            if "cannot listen" in child.err.read_text(errors="replace") and time.monotonic() < deadline:
                child.expected_exit = True
                time.sleep(0.2)
                continue
            raise RuntimeError(f"the syncer exited with {child.popen.poll()} before listening: {tail(child)}")

    # -- learners --------------------------------------------------------------------------
    def start_learner(self, lid: int) -> None:
        a = self.args
        argv = [sys.executable, "-m", "benchmarks.chaos_learner", "--syncer", f"127.0.0.1:{self.port}", "--key-file",
                str(self.key_file), "--learner-id", str(lid), "--sync-interval", str(a.sync_interval), "--step-s",
                str(a.step_s), "--seed", str(a.seed), "--deadline-s", str(self.limit + 180)]
        argv += ["--trace"] if a.trace else []
        argv += self.budget.learner_argv(lid) if self.budget else []
        self.learners[lid] = self.spawn(f"learner{lid}", argv)

    def running_learners(self) -> list[int]:
        """Learners a fault may hit: running, not stopped and (learning mode) short of their steps."""
        return sorted(lid for lid, c in self.learners.items() if c.alive() and not c.stopped
                      and (self.budget is None or self.budget.training(lid)))

    # -- the arm ---------------------------------------------------------------------------
    def schedule(self) -> list[tuple[float, str]]:
        """(seconds into the window, action) of every fault, from the seed; empty without faults."""
        if not self.faults:
            return []
        a, span = self.args, self.timing.horizon
        rng = random.Random(a.seed)
        events: list[tuple[float, str]] = []
        t = a.kill_every * rng.uniform(0.5, 1.5)
        while a.kill_every > 0 and t < span - 1:
            events.append((t, "kill"))
            t += a.kill_every * rng.uniform(0.5, 1.5)
        stops = a.stops if a.stops >= 0 else int(span // 60)
        events += [(rng.uniform(0.1, 0.9) * span, "sigstop") for _ in range(stops)]
        restarts = [rng.uniform(0.3, 0.7) * span for _ in range(a.syncer_restarts)]
        events += [(t, "syncer-kill") for t in restarts]
        return sorted(events)

    def run(self) -> Arm:
        a = self.args
        self.start_syncer(resume=False)
        for lid in range(a.learners):
            self.start_learner(lid)
        t_init = self.wait_init(timeout=120.0)
        offset = t_init - time.time() + time.monotonic()  # the initial cut on the monotonic clock
        self.offset = offset
        pending: list[tuple[float, str, Any]] = [(offset + t, what, None) for t, what in self.schedule()]
        end = offset + self.limit
        while True:
            now = time.monotonic()
            restart_due = any(w == "restart" for _, w, _t in pending)
            if self.budget and self.budget.ended(self.learners, self.syncer, restart_due, now, self.arm.notes):
                break
            if now >= end:
                if self.budget:
                    self.arm.notes.append(f"not every learner finished within {self.limit:.0f} s; stopped them")
                break
            pending.sort(key=lambda e: e[0])
            while pending and pending[0][0] <= now:
                when, what, target = pending.pop(0)
                pending += self.act(what, target, now, when - offset)
            self.watch(now, pending)
            time.sleep(0.02)
        self.finish()
        self.measure(t_init)
        return self.arm

    def act(self, what: str, target: Any, now: float, when: float) -> list[tuple[float, str, Any]]:
        """Do one fault action, due `when` s after the initial cut; returns the follow-ups it schedules."""
        a, arm = self.args, self.arm
        rng = random.Random(f"{a.seed}:{what}:{when:.3f}")
        if what in ("kill", "sigstop"):
            candidates = self.running_learners()
            if self.budget:
                candidates = self.budget.targets(what, candidates, self.learners)
            if not candidates:
                late = f" (the others end before a restart, ~{self.timing.learner_away_s:.0f} s)" if self.budget else ""
                arm.notes.append(f"{what} at {when:.1f} s: no running learner to hit{late}; skipped")
                return []
            lid = rng.choice(candidates)
            child = self.learners[lid]
            arm.faults.append((round(now - self.offset, 2), what, lid))
            if what == "kill":
                child.expected_exit = True
                child.signal(signal.SIGKILL)
                arm.learner_kills += 1
                return [(now + a.restart_delay, "restart", lid)]
            child.stopped = True
            child.signal(signal.SIGSTOP)
            arm.sigstops += 1
            return [(now + a.stop_s, "sigcont", child)]
        if what == "restart":
            self.start_learner(int(target))
            arm.learner_restarts += 1
        elif what == "sigcont":
            target.stopped = False
            target.signal(signal.SIGCONT)
        elif what == "syncer-kill":
            assert self.syncer is not None
            if self.budget and not self.budget.may_kill_syncer(self.learners):
                arm.notes.append(f"syncer kill at {when:.1f} s skipped: a learner ends before the syncer is back "
                                 f"(~{self.timing.syncer_away_s:.0f} s)")
                return []
            self.syncer.expected_exit = True
            self.syncer.signal(signal.SIGKILL)
            arm.faults.append((round(now - self.offset, 2), what, None))
            return [(now + a.syncer_down_s, "syncer-start", None)]
        elif what == "syncer-start":
            with contextlib.suppress(subprocess.TimeoutExpired):
                assert self.syncer is not None
                self.syncer.popen.wait(timeout=10)
            self.start_syncer(resume=True)
            arm.syncer_restarts += 1
        return []

    def watch(self, now: float, pending: list[tuple[float, str, Any]]) -> None:
        """Note (and repair) processes that died without being told to."""
        restarting = {t for _, w, t in pending if w == "restart"}
        syncer_due = any(w == "syncer-start" for _, w, _t in pending)
        if self.budget and self.syncer is not None and self.syncer.popen.poll() == 0:
            self.syncer.expected_exit = True  # it finalized: every learner still connected had finished
        if self.syncer is not None and not self.syncer.alive() and not syncer_due and not self.syncer.expected_exit:
            code = self.syncer.popen.poll()
            self.arm.notes.append(f"the syncer exited by itself with {code}: {tail(self.syncer)}")
            self.syncer.expected_exit = True
            self.start_syncer(resume=True)
        for lid, child in list(self.learners.items()):
            if not child.alive() and not child.expected_exit and lid not in restarting:
                self.arm.notes.append(f"learner {lid} exited by itself with {child.popen.poll()}: {tail(child)}")
                child.expected_exit = True
                self.start_learner(lid)

    def wait_init(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in read_tape(self.tape):
                if rec.get("event") == "init":
                    return float(rec["t"])
            assert self.syncer is not None
            if not self.syncer.alive():
                raise RuntimeError(f"the syncer exited before the initial cut: {tail(self.syncer)}")
            time.sleep(0.05)
        raise RuntimeError(f"no initial cut within {timeout:.0f} s")

    def finish(self) -> None:
        """End of the window: SIGCONT, then SIGTERM every learner (they ask for the final cut and exit);
        the syncer finalizes once all of them are done, else it is stopped too."""
        learners = [c for c in self.children if c.name.startswith("learner") and c.alive()]
        for child in learners:
            child.expected_exit = True
            child.stopped = False
            child.signal(signal.SIGCONT)
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30.0
        for child in learners:
            try:
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.arm.notes.append(f"{child.name} (pid {child.popen.pid}) did not exit 30 s after SIGTERM")
                child.stop()
            if child.popen.returncode not in (0, None):
                self.arm.notes.append(f"{child.name} exited with {child.popen.returncode} after SIGTERM")
        if self.syncer is not None:
            self.syncer.expected_exit = True  # it finalizes and exits once every learner is done
        if self.syncer is not None and self.syncer.alive():
            try:
                self.syncer.popen.wait(timeout=20.0)
            except subprocess.TimeoutExpired:
                self.arm.notes.append("the syncer did not exit 20 s after every learner finished; stopped it")
            self.syncer.stop()

    def measure(self, t_init: float) -> None:
        a, arm = self.args, self.arm
        reached: list[float] = []  # learning mode: when each id took its last step
        for child in self.children:
            if child.name.startswith("learner"):
                arm.incarnations += 1
                lines = json_lines(child.out)
                counts = [int(e["steps"]) for e in lines if "steps" in e]
                arm.steps_computed += max(counts, default=0)
                done = [e for e in lines if e.get("event") == "learner_done"]
                if done and not done[0].get("finished"):
                    arm.notes.append(f"{child.name} pid {child.popen.pid} ended without the final cut")
                arm.late_steps += sum(int(e.get("late_steps", 0)) for e in done)
                arm.learner_start_s = max(arm.learner_start_s, child.started() or 0.0)
                reached += [e["t"] - t_init for e in lines if e.get("event") == "steps" and e.get("total") == a.steps]
            if not child.expected_exit:
                arm.notes.append(f"{child.name} pid {child.popen.pid} exited unexpectedly "
                                 f"({child.popen.returncode})")
            bad = [line for line in child.err.read_text(errors="replace").splitlines() if BAD_LOG.search(line)]
            if bad:
                arm.notes.append(f"{child.name} pid {child.popen.pid}: {len(bad)} bad log line(s), first: {bad[0]}")
        if self.budget:  # the window: from the initial cut to the last id's last step
            arm.seconds = max(reached, default=self.limit)
            arm.steps_per_id = self.budget.per_id()
            ends = {lid: [e for e in json_lines(c.out) if e.get("event") == "learner_done"] for lid, c in
                    self.learners.items()}
            arm.final = self.budget.final_cut({lid: recs[-1] for lid, recs in ends.items() if recs}, arm.notes)
        records = read_tape(self.tape)
        last: dict[int, dict[str, Any]] = {}
        for rec in records:
            if rec.get("event") == "commit":
                last[int(rec["round"])] = rec  # the last commit of a round wins
        redone = sum(1 for r in records if r.get("event") == "commit") - len(last)
        if redone:
            arm.notes.append(f"{redone} round(s) committed twice (redone after a resume); counted once")
        arm.steps_merged = sum(sum(rec["steps"]) for rec in last.values()) / a.fragments
        arm.retries = sum(1 for r in records if r.get("event") == "retry")
        window = [rec for rec in last.values() if t_init <= rec["t"] < t_init + arm.seconds]
        arm.rounds = len(window)
        bins = max(1, int(arm.seconds))
        filled = {int(rec["t"] - t_init) for rec in window}
        arm.uptime = len(filled & set(range(bins))) / bins
        if a.verbose:
            times = sorted(r["t"] for r in window)
            gaps = sorted((b - x for x, b in itertools.pairwise(times)), reverse=True)
            print(f"{arm.name}: longest gaps between commits {[round(g, 2) for g in gaps[:5]]} s", flush=True)


def tail(child: Child, lines: int = 8) -> str:
    text = child.err.read_text(errors="replace").splitlines()[-lines:]
    return f"[{child.name} pid {child.popen.pid} stderr tail] " + " | ".join(text)


def json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict):
                out.append(obj)
    return out


def read_tape(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a tape that may still be growing (a torn last line is skipped)."""
    if not path.exists():
        return []
    records = []
    for raw in path.read_bytes().split(b"\n")[:-1]:
        with contextlib.suppress(ValueError):
            if raw.strip():
                records.append(json.loads(raw))
    return records


def run_arm(args: argparse.Namespace, workdir: Path, faults: bool, timing: Timing) -> Arm:
    workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(args, workdir, faults, timing)
    try:
        return runner.run()
    finally:
        runner.close()


def ratio(x: float, y: float) -> float:
    return x / y if y else float("inf")


def report_json(args: argparse.Namespace, arms: list[Arm], path: Path) -> None:
    clean, chaos = arms
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    finite = chaos_learning.finite
    out: dict[str, Any] = {"settings": settings, "arms": {}, "ratio_uptime": finite(ratio(chaos.uptime, clean.uptime)),
                           "ratio_goodput": finite(ratio(chaos.goodput, clean.goodput))}
    for arm in arms:
        row = asdict(arm)
        row.update(goodput=arm.goodput, rounds_per_min=arm.rounds_per_min)
        if arm.final is not None:
            row["final"]["loss"] = finite(arm.final.loss)
        out["arms"][arm.name] = row
    if clean.final is not None and chaos.final is not None:
        out["final_eval_loss"] = chaos_learning.loss_summary(clean.final, chaos.final)[1]
    path.write_text(json.dumps(out, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = p.add_argument
    add("--seconds", type=float, default=90.0, help="measured window per arm, from the initial cut (default 90)")
    add("--learners", type=int, default=3, help="M, learner processes (default 3)")
    add("--quorum", type=int, default=0, help="K of the syncer (default 0: the syncer's own, M − ⌊M/4⌋)")
    add("--fragments", type=int, default=4, help="P (default 4)")
    add("--sync-interval", type=int, default=24, help="H, learner steps per fragment round trip (default 24)")
    add("--step-s", type=float, help="wall time of one learner step (default 0.02; with --steps 0.25)")
    add("--seed", type=int, default=0, help="seeds the fault times and targets (default 0)")
    add("--kill-every", type=float, default=30.0, help="mean seconds between learner SIGKILLs (default 30; 0: none)")
    add("--restart-delay", type=float, default=1.0, help="seconds before a killed learner restarts (default 1)")
    add("--stops", type=int, default=-1, help="SIGSTOPs per arm (default: one per full minute of the fault span)")
    add("--stop-s", type=float, default=3.0, help="seconds a learner stays stopped (default 3)")
    add("--syncer-restarts", type=int, default=1, help="syncer SIGKILL + resume per arm (default 1)")
    add("--syncer-down-s", type=float, default=2.0, help="seconds before the killed syncer restarts (default 2)")
    add("--keep", type=Path, help="keep tapes and process output in this directory")
    add("--json", type=Path, help="also write every number of both arms to this JSON file")
    add("--verbose", action="store_true", help="print the longest gaps between commits")
    add("--trace", action="store_true", help="learners also print each push and install (kept with --keep)")
    chaos_learning.add_args(p)
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every arm's `finally` stops the processes it started.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    if not 0 <= args.quorum <= args.learners:
        p.error("--quorum must be in 0..--learners (0: the syncer's default)")
    if args.steps < 0:
        p.error("--steps must be >= 0 (0: the goodput window of --seconds)")
    learning = args.steps > 0
    if args.step_s is None:
        args.step_s = 0.25 if learning else 0.02
    span = chaos_learning.describe(args) if learning else f"{args.seconds:g} s per arm"
    print(f"{args.learners} learners, quorum {args.quorum or args.learners}, P={args.fragments}, "
          f"H={args.sync_interval}, step {args.step_s * 1000:g} ms; {span}; faults: learner "
          f"SIGKILL every ~{args.kill_every:g} s, {args.syncer_restarts} syncer restart(s), seed {args.seed}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="yeto-chaos-") as tmp:
        base = args.keep or Path(tmp)
        clean = run_arm(args, base / "fault-free", False, Timing(args.seconds))
        timing = Timing(args.seconds)
        if learning:  # the faults fall in the fault-free arm's span, and only where they can be made up
            timing = Timing.after(args, clean.seconds, clean.learner_start_s, clean.syncer_start_s)
            print(f"fault-free arm: {clean.seconds:.1f} s from the initial cut to the last step; slowest start: "
                  f"learner {clean.learner_start_s:.1f} s, syncer {clean.syncer_start_s:.1f} s; faults in the first "
                  f"{timing.horizon:.1f} s of the next arm", flush=True)
        arms = [clean, run_arm(args, base / "faults", True, timing)]
    for arm in arms:
        for note in arm.notes:
            print(f"notes [{arm.name}]: {note}")
    rows: list[tuple[str, Callable[[Arm], str]]] = [
        ("window seconds", lambda a: f"{a.seconds:g}" if not learning else f"{a.seconds:.1f}"),
        ("learner steps computed", lambda a: str(a.steps_computed)),
        ("learner steps merged", lambda a: f"{a.steps_merged:.1f}"),
        ("goodput", lambda a: f"{a.goodput:.3f}"),
        ("uptime (1 s bins with a commit)", lambda a: f"{a.uptime:.3f}"),
        ("committed rounds in window", lambda a: str(a.rounds)),
        ("committed rounds/min", lambda a: f"{a.rounds_per_min:.1f}"),
        ("round retries (tape)", lambda a: str(a.retries)),
        ("learner SIGKILLs", lambda a: str(a.learner_kills)),
        ("learner restarts", lambda a: str(a.learner_restarts)),
        ("learner incarnations", lambda a: str(a.incarnations)),
        ("syncer restarts", lambda a: str(a.syncer_restarts)),
        ("SIGSTOPs", lambda a: str(a.sigstops)),
    ]
    rows += chaos_learning.ROWS if learning else []
    print(f"{'metric':<32} {'fault-free':>12} {'faults':>12}")
    for name, cell in rows:
        print(f"{name:<32} {cell(arms[0]):>12} {cell(arms[1]):>12}")
    chaos = arms[1]
    print(f"ratio uptime faults/fault-free = {ratio(chaos.uptime, clean.uptime):.3f}")
    print(f"ratio goodput faults/fault-free = {ratio(chaos.goodput, clean.goodput):.3f}")
    if clean.final is not None and chaos.final is not None:
        print(chaos_learning.loss_summary(clean.final, chaos.final)[0])
    if args.json:
        report_json(args, arms, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
