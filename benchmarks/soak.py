"""Soak: a real run under churn for `--minutes`; does the syncer leak, and is anything lost?

    python -m benchmarks.soak [--minutes 30] [--seed 0] [--out runs/soak]

The real `python -m syncer` (checkpoint every round, one tape) and two `examples/hf_tiny_llama.py`
learners on the main job's model train on loopback while, every 15-40 s, one fault is picked at
random (seeded):

* **learner kill**: SIGKILL a learner and start it again under its id (a fresh process);
* **learner freeze**: SIGSTOP a learner for 5-40 s (past the peer timeout or not), then SIGCONT;
* **syncer kill**: SIGKILL the syncer and start it again with `--resume` on the same port;
* **handshake flood**: 100 connections that never finish a handshake (each trickling a byte a
  second, reopened when cut), for 10 s.

Then the churn stops and the run ends as any run does: each learner's last incarnation trains 30
more steps and takes the final cut. The syncer's resident memory, threads and open descriptors
are sampled every 5 s while no fault is under way (12 s after the last one, so a flood's sockets
are gone); it prints them for the syncer incarnation sampled over the longest span, at its first
sample once warm (a minute in) and at its last, then the rounds committed against
those the final checkpoint says exist, and whether every learner finished bit-identical with the
final checkpoint. Goal: memory and descriptors flat (within 10%), every round committed
once, nothing lost. Exit status 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from benchmarks.procs import stop

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$")
LEARNERS = 2
FRAGMENTS = 4
FINAL_STEPS = 30
WARM_S = 60.0  # a syncer incarnation is sampled once it has run this long
SAMPLE_S = 5.0  # between samples, while no fault is under way
SETTLE_S = 12.0  # after a fault, longer than a handshake deadline: the flood's sockets are gone
EVENTS = ("learner-kill", "learner-freeze", "syncer-kill", "flood")


@dataclass
class Sample:
    rss_mib: float
    threads: int
    descriptors: int

    def __str__(self) -> str:
        return f"RSS {self.rss_mib:.1f} MiB, {self.threads} threads, {self.descriptors} descriptors"


def sample(pid: int) -> Sample:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kib = int(fields["VmRSS"].split()[0])
    return Sample(rss_kib / 1024, int(fields["Threads"]), len(os.listdir(f"/proc/{pid}/fd")))


class Syncer:
    def __init__(self, run: Path) -> None:
        self.run = run
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0
        self.started_at = 0.0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", str(self.port), "--learners",
               str(LEARNERS), "--quorum", "1", "--fragments", str(FRAGMENTS), "--checkpoint",
               str(self.run / "syncer.ckpt"), "--tape", str(self.run / "tape.jsonl"), "--key-file",
               str(self.run / "key"), "--final-timeout-s", "120", *(["--resume"] if self.starts else [])]
        deadline = time.monotonic() + 60
        while True:  # a restart may find the killed syncer's port not yet free
            log = open(self.run / f"syncer.{self.starts}.log", "w")  # noqa: SIM115 - lives with the process
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            match = LISTENING.match(line)
            if match:
                self.proc, self.port = proc, int(match.group(2))
                self.starts += 1
                self.started_at = time.monotonic()
                threading.Thread(target=_drain, args=(proc.stdout,), daemon=True).start()
                return
            stop(proc)
            if time.monotonic() > deadline:
                raise SystemExit(f"the syncer did not start; see {self.run}/syncer.{self.starts}.log")
            time.sleep(0.5)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)


@dataclass
class Learner:
    index: int
    run: Path
    proc: subprocess.Popen[str] | None = None
    incarnation: int = 0
    out_dir: Path = field(default_factory=Path)
    last: dict[str, Any] = field(default_factory=dict)

    def start(self, port: int, max_steps: int) -> None:
        self.out_dir = self.run / f"learner{self.index}.{self.incarnation}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
        env.update(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=str(self.run / "key"),
                   YETO_DILOCO_LEARNER_ID=str(self.index), YETO_DILOCO_RECONNECT_MAX_S="2",
                   YETO_DILOCO_FINAL_TIMEOUT_S="300", YETO_DILOCO_INIT_TIMEOUT_S="300", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(ROOT / "examples" / "hf_tiny_llama.py"), "--output-dir", str(self.out_dir),
               "--max-steps", str(max_steps), "--num-shards", str(LEARNERS)]
        err = open(self.run / f"learner{self.index}.{self.incarnation}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        self.incarnation += 1
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            if line.startswith('{"'):
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event.get("event") == "eval" and event.get("phase") == "final":
                    self.last = event


def _drain(stream: IO[str]) -> None:
    for _ in stream:
        pass


def flood(port: int, seconds: float, size: int = 100) -> int:
    """`size` connections that never finish a handshake, for `seconds`; returns how many opened."""
    socks: list[socket.socket | None] = [None] * size
    opened = 0
    deadline = time.monotonic() + seconds
    last_byte = 0.0
    try:
        while time.monotonic() < deadline:
            trickle = time.monotonic() - last_byte >= 1.0
            if trickle:
                last_byte = time.monotonic()
            for i, sock in enumerate(socks):
                if sock is None:
                    try:
                        sock = socket.create_connection(("127.0.0.1", port), timeout=0.5)
                    except OSError:
                        continue
                    sock.setblocking(False)
                    socks[i] = sock
                    opened += 1
                    continue
                try:
                    while sock.recv(65536):
                        pass
                    sock.close()  # EOF: cut by the syncer; reopened on the next pass
                    socks[i] = None
                except BlockingIOError:
                    if trickle:
                        try:
                            sock.send(b"\x00")
                        except OSError:
                            sock.close()
                            socks[i] = None
                except OSError:
                    sock.close()
                    socks[i] = None
            time.sleep(0.1)
    finally:
        for sock in socks:
            if sock is not None:
                sock.close()
    return opened


def committed(tape: Path) -> list[int]:
    rounds = []
    for line in tape.read_text().splitlines():
        if '"event": "commit"' in line:
            rounds.append(json.loads(line)["round"])
    return rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="length of the churn (default 30)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "soak", help="logs, checkpoint and tape")
    args = p.parse_args(argv)
    run = args.out.resolve()
    run.mkdir(parents=True, exist_ok=True)
    for old in run.iterdir():
        if old.is_file():
            old.unlink()
    (run / "key").write_text(secrets.token_hex(32))
    (run / "key").chmod(0o600)
    rng = random.Random(args.seed)
    syncer = Syncer(run)
    learners = [Learner(i, run) for i in range(LEARNERS)]
    counts = dict.fromkeys(EVENTS, 0)
    # Per syncer start: (time and sample once warm, time and sample last seen).
    spans: dict[int, tuple[tuple[float, Sample], tuple[float, Sample]]] = {}

    def observe() -> None:
        assert syncer.proc is not None
        now = time.monotonic()
        if now - syncer.started_at < WARM_S or syncer.proc.poll() is not None:
            return
        seen = (now, sample(syncer.proc.pid))
        first = spans.get(syncer.starts, (seen, seen))[0]
        spans[syncer.starts] = (first, seen)
    try:
        syncer.start()
        for ln in learners:
            ln.start(syncer.port, 1_000_000)
        print(f"soak: syncer on 127.0.0.1:{syncer.port}, {LEARNERS} learners, {args.minutes:g} min of churn "
              f"(seed {args.seed}); logs in {run}", flush=True)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        last_fault = time.monotonic()
        while time.monotonic() < end:
            until = min(time.monotonic() + rng.uniform(15, 40), end)
            while time.monotonic() < until:  # calm: sample every few seconds, once the last fault has settled
                time.sleep(min(SAMPLE_S, max(0.0, until - time.monotonic())))
                if time.monotonic() - last_fault >= SETTLE_S:
                    observe()
            if time.monotonic() >= end:
                break
            event = rng.choice(EVENTS)
            counts[event] += 1
            victim = rng.choice(learners)
            assert syncer.proc is not None and victim.proc is not None
            if event == "learner-kill":
                victim.proc.kill()
                victim.proc.wait(timeout=30)
                victim.start(syncer.port, 1_000_000)
                what = f"learner {victim.index} killed and restarted"
            elif event == "learner-freeze":
                frozen = rng.uniform(5, 40)
                os.kill(victim.proc.pid, signal.SIGSTOP)
                time.sleep(frozen)
                os.kill(victim.proc.pid, signal.SIGCONT)
                what = f"learner {victim.index} frozen for {frozen:.0f} s"
            elif event == "syncer-kill":
                syncer.kill()
                syncer.start()
                what = f"syncer killed and resumed (start {syncer.starts})"
            else:
                opened = flood(syncer.port, 10.0)
                what = f"handshake flood: {opened} connections in 10 s"
            so_far = len(committed(run / "tape.jsonl"))
            print(f"[{time.monotonic() - t0:6.0f}s] {what}; {so_far} commits so far", flush=True)
            last_fault = time.monotonic()

        # The end of the run: each learner's last incarnation trains FINAL_STEPS more and takes the final cut.
        print(f"churn over ({', '.join(f'{k} {v}' for k, v in counts.items())}); finishing", flush=True)
        for ln in learners:
            assert ln.proc is not None
            ln.proc.kill()
            ln.proc.wait(timeout=30)
            ln.start(syncer.port, FINAL_STEPS)
        codes = [ln.proc.wait(timeout=600) for ln in learners if ln.proc is not None]
        assert syncer.proc is not None
        syncer_code = syncer.proc.wait(timeout=300)
    finally:
        for ln in learners:
            if ln.proc is not None:
                stop(ln.proc)
        if syncer.proc is not None:
            stop(syncer.proc)

    from safetensors.torch import load_file

    from syncer.durability.checkpoint import load_checkpoint

    state = load_checkpoint(run / "syncer.ckpt")
    rounds = committed(run / "tape.jsonl")
    distinct = sorted(set(rounds))
    missing = sorted(set(range(state.next_round)) - set(rounds))
    ckpt = load_file(str(run / "syncer.ckpt"))
    identical = []
    for ln in learners:
        model = load_file(str(ln.out_dir / "model.safetensors"))
        identical.append(all(k in model and model[k].equal(v) for k, v in
                             ((n.removeprefix("param/"), t) for n, t in ckpt.items() if n.startswith("param/"))))
    start, ((t_warm, warm), (t_late, late)) = max(spans.items(), key=lambda kv: kv[1][1][0] - kv[1][0][0],
                                                  default=(0, ((0.0, Sample(1, 0, 1)), (0.0, Sample(1, 0, 1)))))
    rss = late.rss_mib / warm.rss_mib
    fds = late.descriptors / warm.descriptors
    print("\n== soak ==")
    print(f"faults: {', '.join(f'{k} {v}' for k, v in counts.items())}; syncer starts {syncer.starts}")
    print(f"syncer start {start}, the longest-lived, over {t_late - t_warm:.0f} s of churn:")
    print(f"  warm (a minute in): {warm}")
    print(f"  last seen:          {late}")
    print(f"ratio end/warm: RSS {rss:.3f}, descriptors {fds:.3f}, threads {late.threads}/{warm.threads}")
    print(f"rounds: final checkpoint at round {state.next_round} (finalized {state.finalized}); {len(rounds)} "
          f"commit records, {len(distinct)} distinct, missing {missing[:10]}{'...' if len(missing) > 10 else ''}")
    print(f"learner exits {codes}, syncer exit {syncer_code}; final cut installed "
          f"{[bool(ln.last.get('final_cut')) for ln in learners]}; bit-identical with the checkpoint {identical}")
    ok = (0.9 <= rss <= 1.1 and 0.9 <= fds <= 1.1 and not missing and state.finalized and all(identical)
          and codes == [0] * LEARNERS and syncer_code == 0)
    print(f"soak {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
