"""Chaos harness: goodput and uptime of a run with faults vs the same run without.

    python -m benchmarks.chaos [--seconds 90] [--learners 3] [--kill-every 30] [--syncer-restarts 1] [--seed 0]

Both arms run in one invocation, fault-free first, then with faults, with the same seed and
settings. Each arm starts the real syncer (`python -m syncer`, a subprocess on 127.0.0.1, `--port
0`, `--device cpu`, quorum all M unless `--quorum`, no round budget, `--checkpoint-every 1`, one
`--tape` file per arm that every incarnation appends to) and M learner processes
(`benchmarks/chaos_learner.py`: a LearnerSession over a small MLP, each step paced to `--step-s`
of wall time, redial backoff capped at 1 s). The arm's window is `--seconds` long and starts at
the initial cut (the tape's `init` record).

Faults (fault arm only), at times drawn from `random.Random(--seed)`, relative to the window:

* **learner kill**: about every `--kill-every` s (each gap uniform in [0.5, 1.5] x that), SIGKILL
  a random running learner; restart it with the same learner id `--restart-delay` s later;
* **SIGSTOP**: `--stops` times (default: one per full minute of `--seconds`), SIGSTOP a random
  running learner for `--stop-s` s, then SIGCONT it;
* **syncer restart**: `--syncer-restarts` times (default 1), SIGKILL the syncer and start it again
  `--syncer-down-s` s later on the same port with `--resume --checkpoint` (same tape file).

Every process is started by this harness and stopped by its pid when the arm ends (SIGTERM to
the learners, which ask for the final cut; then the syncer), or on any error.

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
  `retry` records on the tape.

The last two lines are `ratio uptime faults/fault-free = X` and `ratio goodput faults/fault-free
= X`. Whatever misbehaved (unexpected exits, tracebacks, errors in the syncer's log) is listed
under `notes` before the table. `--keep DIR` keeps the tapes and every process's output;
`--trace` makes the learners also print a JSON line per push and per fragment install.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    notes: list[str] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.steps_merged / self.steps_computed if self.steps_computed else 0.0

    @property
    def rounds_per_min(self) -> float:
        return self.rounds * 60.0 / self.seconds


class Runner:
    """The processes of one arm; `close()` stops every one it started."""

    def __init__(self, args: argparse.Namespace, workdir: Path, faults: bool) -> None:
        self.args = args
        self.workdir = workdir
        self.faults = faults
        self.key_file = workdir / "syncer.key"
        self.key_file.write_text(secrets.token_hex(32))
        self.tape = workdir / "tape.jsonl"
        self.checkpoint = workdir / "syncer.safetensors"
        self.children: list[Child] = []
        self.syncer: Child | None = None
        self.learners: dict[int, Child] = {}
        self.port = 0
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
                "1", "--tape", str(self.tape), "--key-file", str(self.key_file), "--final-timeout-s", "10"]
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
                str(a.step_s), "--seed", str(a.seed), "--deadline-s", str(a.seconds + 180)]
        argv += ["--trace"] if a.trace else []
        self.learners[lid] = self.spawn(f"learner{lid}", argv)

    def running_learners(self) -> list[int]:
        return sorted(lid for lid, c in self.learners.items() if c.alive() and not c.stopped)

    # -- the arm ---------------------------------------------------------------------------
    def schedule(self) -> list[tuple[float, str]]:
        """(seconds into the window, action) of every fault, from the seed; empty without faults."""
        if not self.faults:
            return []
        a = self.args
        rng = random.Random(a.seed)
        events: list[tuple[float, str]] = []
        t = a.kill_every * rng.uniform(0.5, 1.5)
        while a.kill_every > 0 and t < a.seconds - 1:
            events.append((t, "kill"))
            t += a.kill_every * rng.uniform(0.5, 1.5)
        stops = a.stops if a.stops >= 0 else int(a.seconds // 60)
        events += [(rng.uniform(0.1, 0.9) * a.seconds, "sigstop") for _ in range(stops)]
        restarts = [rng.uniform(0.3, 0.7) * a.seconds for _ in range(a.syncer_restarts)]
        events += [(t, "syncer-kill") for t in restarts]
        return sorted(events)

    def run(self) -> Arm:
        a = self.args
        self.start_syncer(resume=False)
        for lid in range(a.learners):
            self.start_learner(lid)
        t_init = self.wait_init(timeout=120.0)
        offset = t_init - time.time() + time.monotonic()  # the initial cut on the monotonic clock
        pending: list[tuple[float, str, Any]] = [(offset + t, what, None) for t, what in self.schedule()]
        end = offset + a.seconds
        while True:
            now = time.monotonic()
            if now >= end:
                break
            pending.sort(key=lambda e: e[0])
            while pending and pending[0][0] <= now:
                _, what, target = pending.pop(0)
                pending += self.act(what, target, now)
            self.watch(now, pending)
            time.sleep(0.02)
        self.finish()
        self.measure(t_init)
        return self.arm

    def act(self, what: str, target: Any, now: float) -> list[tuple[float, str, Any]]:
        """Do one fault action; returns the follow-up actions it schedules."""
        a, arm = self.args, self.arm
        rng = random.Random(f"{a.seed}:{what}:{now:.3f}")
        if what in ("kill", "sigstop"):
            candidates = self.running_learners()
            if not candidates:
                arm.notes.append(f"{what} at {now:.1f}: no running learner to hit; skipped")
                return []
            lid = rng.choice(candidates)
            child = self.learners[lid]
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
            self.syncer.expected_exit = True
            self.syncer.signal(signal.SIGKILL)
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
        if self.syncer is not None and not self.syncer.alive() and not syncer_due:
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
        for child in self.children:
            if child.name.startswith("learner"):
                arm.incarnations += 1
                counts = [int(e["steps"]) for e in json_lines(child.out) if "steps" in e]
                arm.steps_computed += max(counts, default=0)
                done = [e for e in json_lines(child.out) if e.get("event") == "learner_done"]
                if done and not done[0].get("finished"):
                    arm.notes.append(f"{child.name} pid {child.popen.pid} ended without the final cut")
            if not child.expected_exit:
                arm.notes.append(f"{child.name} pid {child.popen.pid} exited unexpectedly "
                                 f"({child.popen.returncode})")
            bad = [line for line in child.err.read_text(errors="replace").splitlines() if BAD_LOG.search(line)]
            if bad:
                arm.notes.append(f"{child.name} pid {child.popen.pid}: {len(bad)} bad log line(s), first: {bad[0]}")
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
        window = [rec for rec in last.values() if t_init <= rec["t"] < t_init + a.seconds]
        arm.rounds = len(window)
        bins = max(1, int(a.seconds))
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


def run_arm(args: argparse.Namespace, workdir: Path, faults: bool) -> Arm:
    workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(args, workdir, faults)
    try:
        return runner.run()
    finally:
        runner.close()


def ratio(x: float, y: float) -> float:
    return x / y if y else float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = p.add_argument
    add("--seconds", type=float, default=90.0, help="measured window per arm, from the initial cut (default 90)")
    add("--learners", type=int, default=3, help="M, learner processes (default 3)")
    add("--quorum", type=int, default=0, help="K of the syncer (default 0: all M, the syncer's default)")
    add("--fragments", type=int, default=4, help="P (default 4)")
    add("--sync-interval", type=int, default=24, help="H, learner steps per fragment round trip (default 24)")
    add("--step-s", type=float, default=0.02, help="wall time of one learner step (default 0.02)")
    add("--seed", type=int, default=0, help="seeds the fault times and targets (default 0)")
    add("--kill-every", type=float, default=30.0, help="mean seconds between learner SIGKILLs (default 30; 0: none)")
    add("--restart-delay", type=float, default=1.0, help="seconds before a killed learner restarts (default 1)")
    add("--stops", type=int, default=-1, help="SIGSTOPs per arm (default: one per full minute of --seconds)")
    add("--stop-s", type=float, default=3.0, help="seconds a learner stays stopped (default 3)")
    add("--syncer-restarts", type=int, default=1, help="syncer SIGKILL + resume per arm (default 1)")
    add("--syncer-down-s", type=float, default=2.0, help="seconds before the killed syncer restarts (default 2)")
    add("--keep", type=Path, help="keep tapes and process output in this directory")
    add("--verbose", action="store_true", help="print the longest gaps between commits")
    add("--trace", action="store_true", help="learners also print each push and install (kept with --keep)")
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every arm's `finally` stops the processes it started.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(143))
    if not 0 <= args.quorum <= args.learners:
        p.error("--quorum must be in 0..--learners (0: all)")
    print(f"{args.learners} learners, quorum {args.quorum or args.learners}, P={args.fragments}, "
          f"H={args.sync_interval}, step {args.step_s * 1000:g} ms; {args.seconds:g} s per arm; faults: learner "
          f"SIGKILL every ~{args.kill_every:g} s, {args.syncer_restarts} syncer restart(s), seed {args.seed}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="yeto-chaos-") as tmp:
        base = args.keep or Path(tmp)
        arms = [run_arm(args, base / "fault-free", False), run_arm(args, base / "faults", True)]
    for arm in arms:
        for note in arm.notes:
            print(f"notes [{arm.name}]: {note}")
    rows: list[tuple[str, Callable[[Arm], str]]] = [
        ("window seconds", lambda a: f"{a.seconds:g}"),
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
    print(f"{'metric':<32} {'fault-free':>12} {'faults':>12}")
    for name, cell in rows:
        print(f"{name:<32} {cell(arms[0]):>12} {cell(arms[1]):>12}")
    clean, chaos = arms
    print(f"ratio uptime faults/fault-free = {ratio(chaos.uptime, clean.uptime):.3f}")
    print(f"ratio goodput faults/fault-free = {ratio(chaos.goodput, clean.goodput):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
