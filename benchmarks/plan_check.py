"""yeto-plan's predictions against runs measured on this machine: round time and bytes per round.

    python -m benchmarks.plan_check [--quick] [--only main,straggler,wire,netns] [--keep DIR]

Each case measures, in the same run, what the planner takes as input (every island's step time,
the link by yeto's bandwidth probe or a raw loopback transfer of the same bytes, the merge rate the
run's syncer reached by its tape's `merge_ms`, a tape fsync by `benchmarks.wire`), asks
`syncer.tools.plan.predict` what the run's own configuration costs, and prints the prediction beside
what the run did:

1. **main**: the main job's syncer and two HF tiny-Llama islands (`examples/main_job.py`, H=24,
   P=4, f32, quorum 2, a checkpoint every round): compute-bound. Round time from the tape's commits
   between the first cycle and the first learner's DONE; bytes from the learners' `bytes_pushed`.
2. **straggler**: `benchmarks/straggler.py`'s three paced islands (20, 20 and 100 ms steps, H=8,
   P=4), quorum 2 of 3 with 0.2 s of grace, then quorum 3: the pacing and the K-th island.
3. **wire**: `benchmarks/wire.py`'s f32 PUSH path, one learner, a 64 MiB model in 4 fragments on
   loopback: push upload and push → commit (upload + merge + commit), after each fragment's first
   merge, against the raw loopback rate of the same bytes taken right before each push.
4. **netns**: the syncer and two learners (an 8×256² MLP, 20 ms steps, H=8, P=4) in two network
   namespaces joined by a veth pair shaped by tc tbf (20 Mbit/s each way): link-bound, f32, and
   int8 pushes with bf16 downlink deltas. The link is measured by `yeto-plan --probe`
   run in the learners' namespace; line bytes by the qdiscs' counters (headers and ACKs in).
   Needs root, iproute2 and the tbf qdisc; otherwise the case says why it was skipped.

The last line is `within 25%: N of M`. Absolute figures move with the load on the machine; every
prediction uses inputs measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$")
TOLERANCE = 0.25
LOOPBACK_BPS = 1e9  # a nominal loopback rate where the link is far from the bottleneck
TBF_LATENCY_S = 0.2  # the shaped link's buffer: tbf drops what would wait longer (tests/integration/netns.py's)


@dataclass
class Row:
    case: str
    what: str
    predicted: float
    measured: float | None
    unit: str = "s"
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.measured is None or not self.predicted else self.measured / self.predicted

    @property
    def within(self) -> bool | None:
        return None if self.ratio is None else abs(self.ratio - 1) <= TOLERANCE


@dataclass
class Calibration:
    commit_s: float
    checkpoint_bps: float
    lines: list[str] = field(default_factory=list)


def say(text: str) -> None:
    print(text, flush=True)


def key_file(directory: Path) -> Path:
    path = directory / "key"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


def calibrate(workdir: Path) -> Calibration:
    """The syncer host's inputs besides the merge: one tape record's fsync (`benchmarks.wire`) and
    the disk's write rate for checkpoints."""
    from benchmarks.wire import _fsync_ms

    fsync_ms = statistics.median(_fsync_ms(workdir))
    probe = workdir / "disk-probe"
    data = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with probe.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    disk_bps = len(data) / (time.perf_counter() - t0)
    probe.unlink()
    line = f"calibration: tape fsync {fsync_ms:.1f} ms; disk {disk_bps / 1e6:.0f} MB/s"
    return Calibration(fsync_ms / 1000, disk_bps, [line])


def syncer_merge_bps(commits: list[dict[str, Any]], sizes: tuple[int, ...]) -> float:
    """The merge rate the run's own syncer reached (its tape's `merge_ms`), in the planner's terms:
    (answers + MERGE_PASSES) passes over each fragment's f32 values a second. Measured outside the
    syncer, the same merge moved 5x with the machine's load (docs/planner.md), so the run's own
    syncer is the measurement."""
    from syncer.tools.plan import MERGE_PASSES

    rates = [4 * sizes[c["fragment"]] * (len(c["learners"]) + MERGE_PASSES) / (c["merge_ms"] / 1000)
             for c in commits if c["merge_ms"] > 0]
    return statistics.median(rates)


def model_of(name: str, named: Any, embedding: tuple[str, ...] = ()) -> Any:
    from syncer.tools.plan import Model, Tensor

    tensors = tuple(Tensor(n, p.numel(), n in embedding) for n, p in named)
    return Model(name, tensors, sum(t.numel for t in tensors))


def commits_between(tape: Path, t0: float, t1: float) -> list[dict[str, Any]]:
    from syncer.durability.tape import read_tape

    return [r for r in read_tape(tape) if r.get("event") == "commit" and t0 <= r["t"] <= t1]


# ---- 1. the main job ---------------------------------------------------------------------------------


def case_main(args: argparse.Namespace, workdir: Path, cal: Calibration) -> list[Row]:
    from benchmarks.procs import stop
    from syncer.durability.tape import read_tape
    from syncer.tools.plan import Choice, Island, Model, Setup, SyncerHost, fragment_params, predict
    from syncer.tools.plan_model import decoder_tensors

    spec = importlib.util.spec_from_file_location("main_job", ROOT / "examples" / "main_job.py")
    assert spec is not None and spec.loader is not None
    main_job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main_job)
    run = workdir / "main"
    run.mkdir(parents=True)
    key_file(run)
    steps = 48 if args.quick else 96  # whole cycles of the 4 fragments (a push every 6 steps)
    say(f"main: the main job's syncer and {main_job.LEARNERS} HF tiny-Llama learners, {steps} steps each")
    procs: list[subprocess.Popen[str]] = []
    progress: list[list[tuple[float, int]]] = [[] for _ in range(main_job.LEARNERS)]
    try:
        # the main job's own syncer command; when it serves a status page, on a free port (0)
        ports = [0] if len(inspect.signature(main_job.start_syncer).parameters) > 1 else []
        syncer, address, *_ = main_job.start_syncer(run, *ports)
        procs.append(syncer)
        learners = [main_job.start_learner(i, run, address, argparse.Namespace(max_steps=steps))
                    for i in range(main_job.LEARNERS)]
        procs += [ln.proc for ln in learners]
        deadline = time.monotonic() + 900
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"main: the main job did not finish in 900 s (logs in {run})")
            for ln, seen in zip(learners, progress, strict=True):
                if ln.final_eval is None and (not seen or seen[-1][1] != ln.step):
                    seen.append((time.time(), ln.step))  # a train event every 10 steps
            time.sleep(0.1)
    finally:
        for p in procs:
            stop(p)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"main: exit codes {[p.returncode for p in procs]} (logs in {run})")
    step_s = []
    for seen in progress:
        (ta, sa), (tb, sb) = next(x for x in seen if x[1] >= 10), seen[-1]
        step_s.append((tb - ta) / (sb - sa))
    records = read_tape(run / "tape.jsonl")
    end = min(r["t"] for r in records if r.get("event") == "done")
    window = [r for r in records if r.get("event") == "commit" and r["round"] >= main_job.FRAGMENTS and r["t"] < end]
    measured_round = (window[-1]["t"] - window[0]["t"]) / (len(window) - 1)
    finals = [json.loads(line) for ln in learners for line in ln.lines
              if line.startswith('{"event": "eval"') and '"final"' in line]
    per_push = sum(f["bytes_pushed"] for f in finals) / sum(f["pushes"] for f in finals)
    answers = statistics.mean(len(c["learners"]) for c in window)

    hidden = 128  # examples/hf_tiny_llama.py build_model at its defaults
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": hidden,
              "intermediate_size": hidden * 8 // 3 // 8 * 8, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "tie_word_embeddings": True}
    tensors = tuple(decoder_tensors(config))
    model = Model("hf_tiny_llama", tensors, sum(t.numel for t in tensors))
    merge_bps = syncer_merge_bps(window, fragment_params(model, main_job.FRAGMENTS))
    host = SyncerHost(memory_bytes=1 << 40, merge_bps=merge_bps, commit_s=cal.commit_s, checkpoint_every=1,
                      checkpoint_bps=cal.checkpoint_bps)
    islands = tuple(Island(LOOPBACK_BPS, LOOPBACK_BPS, s) for s in step_s)
    pred = predict(Setup(model, islands, main_job.LEARNERS, host), Choice(24, "f32", "f32", main_job.FRAGMENTS, 2))
    steps_note = ", ".join(f"{s * 1000:.0f}" for s in step_s)
    return [Row("main", "round time", pred.round_s, measured_round, "s",
                f"{len(window)} commits; steps {steps_note} ms; set by {pred.bound}"),
            Row("main", "up bytes per round", pred.up_bytes_per_round, per_push * answers, "B",
                f"learners' bytes_pushed/push x {answers:.2f} answers/round")]


# ---- 2. the straggler ----------------------------------------------------------------------------------


def straggler_arm(name: str, quorum: int, seconds: float, workdir: Path, cal: Calibration) -> list[Row]:
    import torch

    from benchmarks import straggler
    from syncer.tools.plan import Choice, Island, Setup, SyncerHost, fragment_params, predict

    torch.set_num_threads(1)
    keys = key_file(workdir)
    proc, address, tape = straggler.start_syncer(workdir, keys, quorum, 0.2, name)
    periods = (0.02, 0.02, 0.1)
    islands = [straggler.Island(address, keys, i, p) for i, p in enumerate(periods)]
    halt = threading.Event()
    threads = [threading.Thread(target=i.run, args=(halt,), daemon=True) for i in islands]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 90
        while sum(r.get("event") == "commit" for r in straggler.read_tape(tape)) < 2 * straggler.FRAGMENTS:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"straggler {name}: no rounds within 90 s")
            time.sleep(0.05)
        t0 = time.time()
        before = [(i.session.stats.steps, i.session.stats.bytes_pushed) for i in islands]
        time.sleep(seconds)
        t1 = time.time()
        after = [(i.session.stats.steps, i.session.stats.bytes_pushed) for i in islands]
    finally:
        straggler.stop_islands(halt, threads, islands, proc)
    straggler.raise_island_error(islands)
    commits = commits_between(tape, t0, t1)
    step_s = [(t1 - t0) / (a[0] - b[0]) for a, b in zip(after, before, strict=True)]
    pushed = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    model = model_of("straggler MLP", islands[0].model.named_parameters())
    merge_bps = syncer_merge_bps(commits, fragment_params(model, straggler.FRAGMENTS))
    host = SyncerHost(memory_bytes=1 << 40, merge_bps=merge_bps, commit_s=cal.commit_s)
    setup = Setup(model, tuple(Island(LOOPBACK_BPS, LOOPBACK_BPS, s) for s in step_s), quorum, host, grace_cap_s=0.2)
    pred = predict(setup, Choice(straggler.SYNC_INTERVAL, "f32", "f32", straggler.FRAGMENTS, 2))
    steps_note = ", ".join(f"{s * 1000:.1f}" for s in step_s)
    case = f"straggler {name}"
    return [Row(case, "round time", pred.round_s, (t1 - t0) / len(commits), "s",
                f"quorum {quorum} of 3, {len(commits)} commits; steps {steps_note} ms; set by {pred.bound}"),
            Row(case, "up bytes per round", pred.up_bytes_per_round, pushed / len(commits), "B",
                f"pushes/round predicted {sum(pred.pushes_per_round):.2f}")]


def case_straggler(args: argparse.Namespace, workdir: Path, cal: Calibration) -> list[Row]:
    seconds = 6.0 if args.quick else 12.0
    say(f"straggler: 3 paced islands (20, 20, 100 ms steps), quorum 2 then 3, {seconds:g} s each")
    rows = []
    for name, quorum in (("decoupled", 2), ("lock-step", 3)):
        arm = workdir / f"straggler-{name}"
        arm.mkdir(parents=True)
        rows += straggler_arm(name, quorum, seconds, arm, cal)
    return rows


# ---- 3. the wire ------------------------------------------------------------------------------------------


def case_wire(args: argparse.Namespace, workdir: Path, cal: Calibration) -> list[Row]:
    from benchmarks import ingest, wire
    from benchmarks.loopback import RawLoopback
    from syncer.durability.tape import read_tape
    from syncer.tools.plan import Choice, Island, Model, Setup, SyncerHost, Tensor, predict

    mib, fragments, pushes = 64, 4, (8 if args.quick else 12)
    say(f"wire: f32 pushes of one learner, a {mib} MiB model in {fragments} fragments, {pushes} pushes")
    layout, init, delta = ingest._synthetic_model(mib, fragments)
    push_bytes = delta.numel() * 4
    samples = ingest.Samples()
    keys = key_file(workdir)
    raw = RawLoopback(push_bytes, 2)
    try:
        ns = argparse.Namespace(fragments=fragments, streams=2, pushes=pushes, device="cpu", verbose=False)
        wire._push_section(ns, workdir, keys.read_bytes(), keys, layout, init, delta, raw, samples)
    finally:
        raw.close()
    # the link and the uploads over every push; commits after each fragment's first merge, which
    # faults its pages in
    t = {k: statistics.median(v) for k, v in samples.t.items()}
    warm = slice(fragments, None)
    t["push_commit"] = statistics.median(samples.t["push_commit"][warm])
    rate = push_bytes / t["raw_push"]
    model = Model("synthetic", tuple(Tensor(s.name, s.numel) for s in layout.specs), layout.total_numel)
    commits = [r for r in read_tape(workdir / "push" / "tape.jsonl") if r.get("event") == "commit"]
    merge_bps = syncer_merge_bps(commits[fragments:], tuple(f.numel for f in layout.fragments))
    host = SyncerHost(memory_bytes=1 << 40, merge_bps=merge_bps, commit_s=cal.commit_s)
    # The driver pushes as soon as it holds a pull: no step cadence, no boundary to wait for.
    setup = Setup(model, (Island(rate, rate, 1e-9),), 1, host)
    pred = predict(setup, Choice(fragments, "f32", "f32", fragments, 2))
    return [Row("wire", "push upload (submit -> stored)", pred.upload_s, t["push"], "s",
                f"raw loopback {rate / 1e9:.2f} GB/s, {len(samples.t['push'])} pushes"),
            Row("wire", "round latency (push -> commit)", pred.latency_s, t["push_commit"], "s",
                f"upload + merge and commit {pred.serial_s * 1000:.0f} ms (syncer merge {merge_bps / 1e9:.2f} GB/s), "
                f"{len(samples.t['push_commit'][warm])} warm pushes")]


# ---- 4. a shaped link between network namespaces ------------------------------------------------------------


class Namespaces:
    """Two network namespaces joined by a veth pair, each end's egress shaped by tc tbf."""

    def __init__(self, rate: str) -> None:
        tag = secrets.token_hex(3)
        self.syncer_ns, self.learner_ns = f"yeto-plan-s-{tag}", f"yeto-plan-l-{tag}"
        self.veth = (f"yp{tag}s", f"yp{tag}l")
        n = secrets.randbelow(200) + 20
        self.syncer_ip, self.learner_ip = f"10.214.{n}.1", f"10.214.{n}.2"
        self.created: list[str] = []
        try:
            for ns in (self.syncer_ns, self.learner_ns):
                self._must("ip", "netns", "add", ns)
                self.created.append(ns)
            a, b = self.veth
            self._must("ip", "link", "add", a, "netns", self.syncer_ns, "type", "veth", "peer", "name", b,
                       "netns", self.learner_ns)
            for ns, dev, ip in ((self.syncer_ns, a, self.syncer_ip), (self.learner_ns, b, self.learner_ip)):
                self._must("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                self._must("ip", "-n", ns, "link", "set", dev, "up")
                self._must("ip", "-n", ns, "link", "set", "lo", "up")
                self._must("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                           "burst", "64kb", "latency", f"{TBF_LATENCY_S * 1000:.0f}ms")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _must(*argv: str) -> str:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
        if done.returncode:
            raise RuntimeError(f"`{' '.join(argv)}` exited with {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def sent_bytes(self) -> tuple[int, int]:
        """Bytes each end's qdisc has sent: (learners -> syncer, syncer -> learners)."""
        out = []
        for ns, dev in ((self.learner_ns, self.veth[1]), (self.syncer_ns, self.veth[0])):
            text = self._must("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev)
            m = re.search(r"Sent (\d+) bytes", text)
            if m is None:
                raise RuntimeError(f"no byte count in `tc -s qdisc show dev {dev}`: {text!r}")
            out.append(int(m.group(1)))
        return out[0], out[1]

    def argv(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for ns in reversed(self.created):
            with contextlib.suppress(Exception):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20, check=False)
        self.created.clear()


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return f"network namespaces need root (euid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` tool (iproute2) is not installed"
    try:
        Namespaces("20mbit").close()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot build a tbf-shaped namespace pair here: {exc}"
    return None


class Watched:
    """A child process whose stdout JSON lines are kept, with the time each arrived."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.err = log.open("wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True)
        self.lines: list[str] = []
        self.events: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    self.events.append(json.loads(line))

    def stop(self) -> None:
        from benchmarks.procs import stop

        stop(self.proc)
        self.err.close()


def mlp(width: int, layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    parts: list[torch.nn.Module] = []
    for _ in range(layers):
        parts += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*parts[:-1])


def netns_arm(codec: str, downlink: str, seconds: float, workdir: Path, cal: Calibration) -> list[Row]:
    from safetensors.torch import save_file

    from syncer.tools.plan import Choice, Island, Setup, SyncerHost, fragment_params, predict
    from syncer.tools.plan_model import load_model

    rate, h, fragments, period = "20mbit", 8, 4, 0.02
    keys = key_file(workdir)
    model = mlp(256, 8)
    model_file = workdir / "mlp.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(model_file))
    tape = workdir / "tape.jsonl"
    net = Namespaces(rate)
    children: list[Watched] = []
    try:
        syncer = Watched(net.argv(net.syncer_ns, [
            sys.executable, "-m", "syncer", "--host", net.syncer_ip, "--port", "0", "--learners", "2", "--quorum", "2",
            "--fragments", str(fragments), "--sync-interval-steps", str(h), "--pipeline", "2", "--device", "cpu",
            "--tape", str(tape), "--key-file", str(keys), "--log-level", "WARNING"]), workdir / "syncer.log")
        children.append(syncer)
        address = None
        deadline = time.monotonic() + 60
        while address is None:
            address = next((f"{m.group(1)}:{m.group(2)}" for m in map(LISTENING.match, syncer.lines) if m), None)
            if time.monotonic() > deadline or syncer.proc.poll() is not None:
                raise RuntimeError(f"netns: the syncer did not start (see {workdir / 'syncer.log'})")
            time.sleep(0.05)
        # The link as a user would measure it: yeto-plan's --probe, from the learners' namespace.
        probe = subprocess.run(net.argv(net.learner_ns, [
            sys.executable, "-m", "syncer.tools.plan_cli", "--probe", address, "--key-file", str(keys),
            "--probe-mib", "2",
            "--model", str(model_file), "--islands", "2", "--step-s", str(period), "--h", str(h), "--codec", codec,
            "--downlink", downlink, "--fragments", str(fragments), "--pipeline", "2", "--syncer-memory-gib", "4",
            "--json"]), cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        if probe.returncode:
            raise RuntimeError(f"netns: yeto-plan --probe exited with {probe.returncode}: {probe.stderr.strip()}")
        probed = json.loads(probe.stdout)["islands"][0]
        for i in range(2):
            children.append(Watched(net.argv(net.learner_ns, [
                sys.executable, "-m", "benchmarks.plan_check", "learner", "--syncer", address, "--key-file", str(keys),
                "--learner-id", str(i), "--codec", codec, "--downlink", downlink, "--period-s", str(period),
                "--sync-interval", str(h)]), workdir / f"learner{i}.log"))
        from syncer.durability.tape import read_tape

        deadline = time.monotonic() + 120
        while not tape.exists() or sum(r.get("event") == "commit" for r in read_tape(tape)) < 2 * fragments:
            if time.monotonic() > deadline or any(c.proc.poll() is not None for c in children):
                raise RuntimeError(f"netns: no rounds within 120 s (logs in {workdir})")
            time.sleep(0.1)
        # the qdiscs' counters four times a second, to read them at commit times (a whole number of
        # pipeline batches: rounds in flight commit together)
        counters: list[tuple[float, int, int]] = []
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                counters.append((time.time(), *net.sent_bytes()))
                sampling.wait(0.25)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.time()
        progress0 = [c.events[-1] for c in children[1:]]
        time.sleep(seconds)
        progress1 = [c.events[-1] for c in children[1:]]
        t1 = time.time()
        sampling.set()
        sampler.join(5)
    finally:
        for c in reversed(children):
            c.stop()
        net.close()
    commits = commits_between(tape, max(t0, counters[0][0]), min(t1, counters[-1][0]))
    n = (len(commits) - 1) // 2 * 2  # rounds between the first and the last commit counted, even
    first, last = commits[0], commits[n]
    step_s = [(b["t"] - a["t"]) / (b["steps"] - a["steps"]) for a, b in zip(progress0, progress1, strict=True)]
    per_push = (sum(b["bytes_pushed"] - a["bytes_pushed"] for a, b in zip(progress0, progress1, strict=True)) /
                sum(b["pushes"] - a["pushes"] for a, b in zip(progress0, progress1, strict=True)))
    answers = statistics.mean(len(c["learners"]) for c in commits)
    line_up = (interpolate(counters, last["t"], 1) - interpolate(counters, first["t"], 1)) / n
    line_down = (interpolate(counters, last["t"], 2) - interpolate(counters, first["t"], 2)) / n
    up, down = probed["up_bps"], probed["down_bps"]
    # Both learners share the one shaped veth: it is each island's link and the syncer's.
    model = load_model(str(model_file), None, 0, ())
    host = SyncerHost(memory_bytes=1 << 40, link_in_bps=up, link_out_bps=down,
                      merge_bps=syncer_merge_bps(commits, fragment_params(model, fragments)), commit_s=cal.commit_s)
    # the tbf's `latency 200ms` bounds its queue: the standing queue a PULL waits out on the busy downlink
    setup = Setup(model, tuple(Island(up, down, s) for s in step_s), 2, host, queue_s=TBF_LATENCY_S)
    pred = predict(setup, Choice(h, codec, downlink, fragments, 2))
    case = f"netns {codec}/{downlink}"
    note = (f"tbf {rate}, probed {up * 8e-6:.1f}/{down * 8e-6:.1f} Mbit/s up/down, {n} rounds; steps "
            f"{', '.join(f'{s * 1000:.1f}' for s in step_s)} ms; set by {pred.bound}")
    return [Row(case, "round time", pred.round_s, (last["t"] - first["t"]) / n, "s", note),
            Row(case, "up bytes per round (pushes)", pred.up_bytes_per_round, per_push * answers, "B",
                f"learners' bytes_pushed/push x {answers:.2f} answers/round"),
            Row(case, "up line bytes per round", pred.up_wire_bytes_per_round, line_up, "B",
                "tc qdisc counter, learners' end"),
            Row(case, "down line bytes per round", pred.down_wire_bytes_per_round, line_down, "B",
                "tc qdisc counter, syncer's end")]


def interpolate(samples: list[tuple[float, int, int]], t: float, column: int) -> float:
    """Column `column` of time-stamped counter samples, linearly interpolated at time `t`."""
    for (ta, *a), (tb, *b) in itertools.pairwise(samples):
        if ta <= t <= tb:
            return a[column - 1] + (b[column - 1] - a[column - 1]) * (t - ta) / max(tb - ta, 1e-9)
    raise ValueError(f"time {t} is outside the samples")


def case_netns(args: argparse.Namespace, workdir: Path, cal: Calibration) -> list[Row]:
    why = netns_unavailable()
    if why is not None:
        say(f"netns: skipped: {why}")
        return [Row("netns", "skipped", 0.0, None, "", why)]
    seconds = 12.0 if args.quick else 20.0
    arms = [("f32", "f32")] if args.quick else [("f32", "f32"), ("int8", "bf16")]
    say(f"netns: 2 learners behind a 20 Mbit/s tbf-shaped veth, {seconds:g} s per arm: "
        f"{', '.join('/'.join(a) for a in arms)}")
    rows = []
    for codec, downlink in arms:
        arm = workdir / f"netns-{codec}"
        arm.mkdir(parents=True)
        rows += netns_arm(codec, downlink, seconds, arm, cal)
    return rows


def learner_main(argv: list[str]) -> int:
    """A paced learner for the netns case: an MLP, real SGD steps, a JSON progress line twice a second."""
    import torch

    from yeto_core.learner import LearnerSession
    from yeto_core.settings import LearnerSettings, load_settings

    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_check learner")
    ap.add_argument("--syncer", required=True)
    ap.add_argument("--key-file", required=True)
    ap.add_argument("--learner-id", type=int, required=True)
    ap.add_argument("--codec", default="f32")
    ap.add_argument("--downlink", default="f32")
    ap.add_argument("--period-s", type=float, default=0.02)
    ap.add_argument("--sync-interval", type=int, default=8)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = mlp(256, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    settings = load_settings(LearnerSettings, syncer=args.syncer, key_file=args.key_file, learner_id=args.learner_id,
                             sync_interval=args.sync_interval, wire_dtype=args.codec,
                             downlink_dtype=args.downlink, init_timeout_s=60, final_timeout_s=5,
                             reconnect_max_s=1, connect_timeout_s=10)
    session = LearnerSession(settings, list(model.named_parameters()))
    halt = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: halt.set())
    gen = torch.Generator().manual_seed(args.learner_id)
    try:
        session.start()
        last = 0.0
        while not halt.is_set():
            t0 = time.monotonic()
            x = torch.randn(16, 256, generator=gen)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if session.step(tokens=16):
                break
            if time.monotonic() - last >= 0.5:
                last = time.monotonic()
                stats = session.stats
                print(json.dumps({"t": time.time(), "steps": stats.steps, "bytes_pushed": stats.bytes_pushed,
                                  "pushes": stats.pushes}), flush=True)
            time.sleep(max(0.0005, args.period_s - (time.monotonic() - t0)))
    finally:
        session.close()
    return 0


# ---- the table ---------------------------------------------------------------------------------------------------


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.3f} s"
    if unit == "B":
        return f"{value / 1e6:.3f} MB" if value >= 1e5 else f"{value / 1e3:.2f} kB"
    return f"{value:g}"


def table(rows: list[Row]) -> list[str]:
    head = "| case | quantity | predicted | measured | measured/predicted | within 25% | notes |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        within = "-" if r.within is None else ("yes" if r.within else "**no**")
        lines.append(f"| {r.case} | {r.what} | {fmt(r.predicted, r.unit) if r.measured is not None else '-'} | "
                     f"{fmt(r.measured, r.unit)} | {ratio} | {within} | {r.note} |")
    return lines


CASES = {"main": case_main, "straggler": case_straggler, "wire": case_wire, "netns": case_netns}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["learner"]:
        return learner_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs and one netns arm (~2 minutes)")
    ap.add_argument("--only", default=",".join(CASES), help="comma list of cases: " + ", ".join(CASES))
    ap.add_argument("--keep", type=Path, help="keep every run's tapes and logs under this directory")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; the cases are {', '.join(CASES)}")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the finally blocks
    started = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="yeto-plan-check-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name in names:
            t0 = time.monotonic()
            case_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
            cal = calibrate(case_dir)  # right before the case: the machine's load moves
            say(f"{name}: {cal.lines[0]}")
            try:
                rows += CASES[name](args, case_dir, cal)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                say(f"{name}: failed: {exc}")
                rows.append(Row(name, "failed", 0.0, None, "", str(exc).splitlines()[0]))
            say(f"{name}: {time.monotonic() - t0:.0f} s")
    say("")
    for line in table(rows):
        say(line)
    checked = [r for r in rows if r.within is not None]
    say(f"\n{time.monotonic() - started:.0f} s in all; within 25%: {sum(bool(r.within) for r in checked)} of "
        f"{len(checked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
