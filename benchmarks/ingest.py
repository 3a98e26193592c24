"""Bulk ingest into the real syncer, next to raw loopback TCP moving the same bytes in the same run.

    python -m benchmarks.ingest [--mib 256] [--fragments 4] [--streams 2] [--repeat 3] [--pushes 4]

Only ratios measured in one run mean anything: absolute GB/s depend on the machine and on
whatever else runs on it. Every yeto figure is therefore paired with a raw transfer of the same
byte count taken right before it, and the last line is `ratio push_ingest/raw_loopback = X`.

What runs
---------
* **The syncer** is the product's own `syncer.service.cli.main` in a subprocess (`--learners 1 --quorum 1
  --fragments P --tape T --device cpu`), started through this file so that timestamp probes can
  be wrapped around a few of its functions without changing what they do (each wrapper calls the
  original and takes `time.time()`; lines go to stdout only outside the receive path):
  `Coordinator.post` getting the `Got` event of a PUSH (every payload byte is in the syncer's
  buffer), `PushIntake.on_push` returning with the push accepted (payload decoded into a
  float32 delta, checked finite, stored as the round's answer: ready to merge), and, for the
  breakdowns only, `Reassembler._get` creating a transfer's receive buffer, `check_finite`,
  `SyncerProtocol._pin` (allocating the global state) and `InitialCut.on_init` / `InitialCut.checked`
  (an INIT fragment taken up, then stored once the coordinator answered its check).
* **The learner side** is `yeto_core.client.SyncerClient`, the object a `LearnerSession` pushes
  and uploads through, driven directly, so no training-thread work (gathering a fragment,
  subtracting the anchor, installing broadcasts) overlaps the measurement. The model is a
  synthetic list of float32 tensors of `--mib` MiB in total, split by the product's layout into
  P equal fragments; a PUSH carries one fragment (`--mib / P` MiB), an INIT all P.
* **The raw baseline** is a plain TCP receiver in a second process (default socket options,
  `recv_into` a buffer allocated and touched once up front) and plain sender threads here: the
  same byte count striped in 4 MiB `sendall` chunks round-robin over the same number of
  streams, exactly as yeto stripes its CHUNK frames, with no framing.

What is timed (all stamps are `time.time()` on one machine, taken in two processes)
------------------------------------------------------------------------------------
* **push_ingest** = push bytes / (syncer stored the delta − `SyncerClient.submit(job)`). It
  covers the client's sender thread (queueing the chunks; an f32 push is sent from the delta's
  own memory, nothing allocated or encoded, and its codec is left unwrapped to keep it so), the
  streams, the syncer's reassembly and its decode + finiteness check. It does
  not cover the merge. Each push starts only when the previous round's BCAST has been received,
  so nothing else is on the wire. The phases printed under it split the same interval at the
  client's codec starting and finishing `encode` (the payload buffer was allocated before it),
  the client's SendTicket completing (every chunk handed to the kernel), the payload being
  reassembled, and `check_finite` starting and ending. Phases that end in the other process can
  read a fraction of a millisecond negative when a thread is scheduled late.
* **push_to_commit** (tape only, needs no probe) = push bytes / (commit record's `t` − submit):
  what the product's own event tape shows. It includes the merge (`merge_ms`) and the commit's
  bookkeeping, so it is a lower bound of ingest, printed as a cross-check.
* **init_ingest** = model bytes / (tape `init` record − the client asking for the INIT values, right
  after the handshake). The syncer writes that record right after the last fragment was copied
  into its state (no checkpoint is configured, so nothing is written in between). It includes
  the syncer allocating its parameter and momentum state when learner 0 joins, which overlaps
  the upload on that path.
* **raw_loopback** = the same bytes / (last byte received by the raw receiver − first `sendall`).

`--repeat` fresh syncers are started; each takes one INIT and `--pushes` PUSH rounds. Medians over
all samples are printed; the ratio is median(yeto) / median(raw) for the same byte count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.loopback import RawLoopback, stop_process

CHUNK = 4 * 1024 * 1024  # the product's CHUNK_BYTES; checked against it in main()
PROBE = "yeto-bench-probe "
SYNCER_ROLE = "__probed_syncer__"
MIB = 1 << 20
REPO = Path(__file__).resolve().parents[1]  # children run `-m benchmarks.ingest` from here


# ---------------------------------------------------------------------------------------------
# Role 1: the real syncer, with timestamp probes
# ---------------------------------------------------------------------------------------------
def _probed_syncer(argv: list[str]) -> int:
    """`syncer.service.cli.main(argv)` with timestamp probes wrapped around a few of its functions.

    The wrappers call the originals unchanged and only take `time.time()`; probe lines go to
    stdout after a PUSH was fully reassembled, after it was stored, and at the initial cut,
    never while a transfer is being received.
    """
    from syncer.core import initial_cut as ic
    from syncer.core import intake as it
    from syncer.core import payload as pl
    from syncer.core import protocol as pr
    from syncer.core.events import Got
    from syncer.service import coordinator as co
    from syncer.service.cli import main
    from yeto_core.wire import reassembly
    from yeto_core.wire.messages import Push

    def stamp(**fields: Any) -> None:
        sys.stdout.write(PROBE + json.dumps(fields) + "\n")
        sys.stdout.flush()

    allocs: dict[int, tuple[float, float]] = {}  # transfer id -> receive buffer allocation span
    checks: list[tuple[float, float]] = []
    orig_get = reassembly.Reassembler._get
    orig_post = co.Coordinator.post
    orig_on_push = it.PushIntake.on_push
    orig_on_decoded = it.PushIntake.on_decoded
    orig_check_finite = pl.check_finite

    def get(self: Any, transfer: int, total: int) -> Any:
        if transfer in self._transfers:  # called under the reassembler's lock
            return orig_get(self, transfer, total)
        t0 = time.time()
        inc = orig_get(self, transfer, total)
        allocs[transfer] = (t0, time.time())
        return inc

    def post(self: Any, event: Any) -> None:
        if isinstance(event, Got) and isinstance(event.msg, Push):
            t = time.time()
            a0, a1 = allocs.pop(event.msg.transfer, (t, t))
            stamp(ev="delivered", round=event.msg.round, nbytes=len(event.payload or b""), alloc_start=a0,
                  alloc_end=a1, t=t)
        orig_post(self, event)

    def check_finite(deltas: Any) -> Any:
        t0 = time.time()
        try:
            return orig_check_finite(deltas)
        finally:
            checks.append((t0, time.time()))

    started: dict[int, float] = {}  # round -> when the coordinator took the push up

    def on_push(self: Any, link: Any, msg: Any, payload: Any, *rest: Any) -> None:
        checks.clear()  # f32 chunks were screened on the reader threads already; count only what runs here
        started[msg.round] = time.time()
        orig_on_push(self, link, msg, payload, *rest)  # judges it and hands it to the decode pool

    def on_decoded(self: Any, ev: Any) -> None:
        orig_on_decoded(self, ev)  # stores the decoded, checked delta as the round's answer
        t1 = time.time()
        attempt = self.shared.rounds.attempt_of(ev.msg.round)
        accepted = attempt is not None and ev.learner_id in attempt.answers
        c0, c1 = checks[0] if checks else (t1, t1)
        stamp(ev="ingested", round=ev.msg.round, accepted=accepted, start=started.pop(ev.msg.round, t1),
              check_start=c0, check_end=c1, t=t1)

    init_spans: dict[str, float] = {"pin": 0.0, "rx_alloc": 0.0, "store": 0.0}
    orig_pin = pr.SyncerProtocol._pin
    orig_on_init = ic.InitialCut.on_init
    orig_checked = ic.InitialCut.checked
    orig_cut = ic.InitialCut._cut

    def pin(self: Any, layout: Any) -> None:
        t0 = time.time()
        orig_pin(self, layout)
        init_spans["pin"] += time.time() - t0

    cut_at: list[float] = []  # when `_cut` was entered (it writes the tape's `init` record)
    taken_up: dict[int, float] = {}  # fragment -> when its INIT was taken up (the coordinator then checks it)

    def on_init(self: Any, link: Any, msg: Any, payload: Any, *rest: Any) -> None:
        if cut_at:  # a replayed INIT after the initial cut: ignored by the syncer, not counted
            orig_on_init(self, link, msg, payload, *rest)
            return
        a0, a1 = allocs.pop(msg.transfer, (0.0, 0.0))
        init_spans["rx_alloc"] += a1 - a0
        taken_up[msg.fragment] = time.time()
        orig_on_init(self, link, msg, payload, *rest)  # asks the coordinator to check the fragment

    def checked(self: Any, ev: Any) -> None:
        t0 = taken_up.pop(ev.fragment, None)
        orig_checked(self, ev)  # stores the fragment; the last fragment's answer runs `_cut` inside
        if t0 is None:
            return
        init_spans["store"] += (cut_at[0] if cut_at else time.time()) - t0
        if cut_at:
            stamp(ev="init", round=-1, **init_spans)

    def initial_cut(self: Any) -> None:
        cut_at.append(time.time())
        orig_cut(self)

    def orphan_watchdog() -> None:
        sys.stdin.read()  # returns at EOF: the benchmark closed the pipe or died
        os.kill(os.getpid(), signal.SIGTERM)  # the syncer's own handler stops it

    threading.Thread(target=orphan_watchdog, name="bench-watchdog", daemon=True).start()
    pr.SyncerProtocol._pin = pin  # type: ignore[method-assign]
    ic.InitialCut.on_init = on_init  # type: ignore[method-assign]
    ic.InitialCut.checked = checked  # type: ignore[method-assign]
    ic.InitialCut._cut = initial_cut  # type: ignore[method-assign]
    reassembly.Reassembler._get = get  # type: ignore[method-assign]
    co.Coordinator.post = post  # type: ignore[method-assign]
    it.PushIntake.on_push = on_push  # type: ignore[method-assign]
    it.PushIntake.on_decoded = on_decoded  # type: ignore[method-assign]
    pl.check_finite = check_finite  # type: ignore[assignment]  # INIT and PUSH payloads
    return main(argv)


# ---------------------------------------------------------------------------------------------
# The yeto side
# ---------------------------------------------------------------------------------------------
class ProbedSyncer:
    """The real syncer in a subprocess; probe lines and its listening line are read off stdout."""

    def __init__(self, workdir: Path, key_file: Path, fragments: int, device: str, *, learners: int = 1,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.tape = workdir / "tape.jsonl"
        self.log_path = workdir / "syncer.log"
        self._probes: dict[tuple[str, int], dict[str, Any]] = {}
        self._probe_cv = threading.Condition()
        self._listening: queue.SimpleQueue[str] = queue.SimpleQueue()
        cmd = [
            sys.executable, "-m", "benchmarks.ingest", SYNCER_ROLE,
            "--host", "127.0.0.1", "--port", "0", "--learners", str(learners), "--quorum", str(learners),
            "--fragments", str(fragments), "--key-file", str(key_file), "--tape", str(self.tape),
            "--device", device, "--log-level", "INFO", *extra_args,
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in close()
        # stdin is a pipe only so that the child notices (EOF) if this process dies without cleaning up.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     bufsize=1, cwd=REPO)
        try:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
            try:
                line = self._listening.get(timeout=120)
            except queue.Empty:
                raise RuntimeError(f"syncer did not start; log tail:\n{self.log_tail()}") from None
            if not line:
                raise RuntimeError(f"syncer exited at start; log tail:\n{self.log_tail()}")
            self.port = int(line.rsplit(":", 1)[1])
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROBE):
                p = json.loads(line[len(PROBE) :])
                with self._probe_cv:
                    self._probes[(p["ev"], p["round"])] = p
                    self._probe_cv.notify_all()
            elif line.startswith("yeto syncer listening on "):
                self._listening.put(line.strip())
        self._listening.put("")

    def probe(self, ev: str, round_id: int, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._probe_cv:
            while (ev, round_id) not in self._probes:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"no '{ev}' probe for round {round_id}; syncer log tail:\n{self.log_tail()}")
                self._probe_cv.wait(min(left, 0.5))
            return self._probes.pop((ev, round_id))

    def tape_record(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.tape.exists():
                for line in self.tape.read_text().splitlines():
                    with contextlib.suppress(ValueError):
                        rec = json.loads(line)
                        if pred(rec):
                            return dict(rec)
            time.sleep(0.01)
        raise RuntimeError(f"expected tape record not written; syncer log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return "(no log)"

    def close(self) -> None:
        stop_process(self.proc)
        self._log.close()


@dataclass
class Samples:
    """Seconds per sample, by name; `raw_push[i]` was taken right before `push[i]`."""

    t: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.t.setdefault(name, []).append(seconds)


def _synthetic_model(mib: int, fragments: int) -> tuple[Any, list[Any], Any]:
    """Equal float32 tensors, four per fragment, so binpack makes P equal fragments."""
    import torch

    from yeto_core.layout import TensorSpec, build_layout

    tensors = 4 * fragments
    numel = (mib * MIB // 4) // tensors
    if numel < 1:
        raise SystemExit(f"--mib {mib} is too small for {fragments} fragments")
    specs = [TensorSpec(f"blocks.{i}.weight", (numel,), "float32") for i in range(tensors)]
    layout = build_layout(specs, fragments, "binpack")
    gen = torch.Generator().manual_seed(0)
    init = [torch.rand(f.numel, generator=gen) for f in layout.fragments]
    delta = torch.rand(layout.fragments[0].numel, generator=gen).mul_(1e-3)
    return layout, init, delta


class _StampedCodec:
    """The client's own codec, with a stamp before and after `encode` (which runs on the client's
    sender thread after it allocated the payload buffer)."""

    def __init__(self, inner: Any, learner: Learner) -> None:
        self._inner = inner
        self._learner = learner
        self.name, self.wire_id = inner.name, inner.wire_id
        self.block = getattr(inner, "block", 0)  # a quantized codec's block size is part of the handshake

    def encoded_nbytes(self, numel: int) -> int:
        return int(self._inner.encoded_nbytes(numel))

    def encode(self, src: Any, out: memoryview) -> None:
        t0 = time.time()
        self._inner.encode(src, out)
        self._learner.encode_span[self._learner._encode_round] = (t0, time.time())

    def decode(self, buf: memoryview, out: Any) -> None:
        self._inner.decode(buf, out)


class Learner:
    """`SyncerClient` (learner 0 by default, the one that uploads INIT) plus stamps at submit, at send
    completion and at INIT start."""

    def __init__(self, port: int, key: bytes, layout: Any, init: list[Any], streams: int, learner_id: int = 0,
                 codec: str = "f32") -> None:
        from yeto_core.client import SyncerClient
        from yeto_core.codecs import codec_by_name
        from yeto_core.sections import Endpoint, LinkSettings

        self.layout = layout
        self.init_started: float | None = None
        self.sent_at: dict[int, float] = {}
        client = SyncerClient(Endpoint(("127.0.0.1", port), key, learner_id), LinkSettings(data_streams=streams),
                              codec=codec_by_name(codec), sends_init=learner_id == 0)
        self.init = init
        pusher = client._pusher
        orig_ask_init, orig_send_push = client._init.ask, pusher._send
        self.encode_span: dict[int, tuple[float, float]] = {}
        self._encode_round = -1

        if client.codec.name != "f32":  # an f32 push is sent from the delta itself: no encode to stamp, and a
            client.codec = _StampedCodec(client.codec, self)  # wrapper would make the client copy it
            pusher._encoder.codec = client.codec

        def ask_init(*args: Any, **kwargs: Any) -> Any:  # the upload starts as its values are asked for
            if self.init_started is None:
                self.init_started = time.time()
            return orig_ask_init(*args, **kwargs)

        def send_push(job: Any) -> None:
            self._encode_round = job.pull.round
            started = time.time()
            orig_send_push(job)
            self.sent_at[job.pull.round] = time.time()
            self.encode_span.setdefault(job.pull.round, (started, started))  # f32: nothing encoded

        client._init.ask = ask_init  # type: ignore[method-assign]
        pusher._send = send_push  # type: ignore[method-assign]
        self.client = client
        self.bcast_versions: dict[int, int] = {}
        self.bcast_at: dict[tuple[int, int], float] = {}  # (fragment, version) -> when it was taken off the inbox
        self.pulls: list[Any] = []

    def start(self) -> None:
        self.client.start(self._layout_for, lambda: 0)

    def _layout_for(self, schedule: Any) -> Any:
        if (schedule.num_fragments, schedule.pattern) != (self.layout.num_fragments, self.layout.pattern):
            raise RuntimeError(f"syncer asks for {schedule.num_fragments} {schedule.pattern} fragments")
        return self.layout

    def pump(self, until: Callable[[], bool], timeout: float, what: str) -> None:
        """Drain the client's inbox (dropping broadcast payloads at once) until `until()`."""
        from yeto_core.link import InitWanted, Lost, Received
        from yeto_core.wire.messages import Bcast, Pull

        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"timed out waiting for {what}")
            try:
                item = self.client.inbox.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if isinstance(item, InitWanted):  # learner 0 seeds a syncer without state (never reseeds)
                self.client.provide_init(None if item.reseed else self.init)
            if isinstance(item, Lost):
                raise RuntimeError(f"link to the syncer lost while waiting for {what}: {item.reason}")
            if isinstance(item, Received):
                if isinstance(item.msg, Bcast):
                    self.bcast_versions[item.msg.fragment] = item.msg.version
                    self.bcast_at[(item.msg.fragment, item.msg.version)] = time.time()
                elif isinstance(item.msg, Pull):
                    self.pulls.append(item.msg)
            del item


def _run_syncer_rep(rep: int, args: argparse.Namespace, workdir: Path, key: bytes, key_file: Path, layout: Any,
                    init: list[Any], delta: Any, raw: RawLoopback, s: Samples) -> None:
    from yeto_core.client import PushJob

    model_bytes = sum(f.numel for f in layout.fragments) * 4
    push_bytes = delta.numel() * 4
    s.add("raw_init", raw.transfer(model_bytes))
    syncer = ProbedSyncer(workdir, key_file, args.fragments, args.device)
    learner = None
    try:
        learner = Learner(syncer.port, key, layout, init, args.streams)
        learner.start()
        p = layout.num_fragments
        learner.pump(lambda: len(learner.bcast_versions) == p and bool(learner.pulls), 120,
                     "the initial cut and the first PULL")
        init_rec = syncer.tape_record(lambda r: r.get("event") == "init", 10)
        join_rec = syncer.tape_record(lambda r: r.get("event") == "join", 10)
        assert learner.init_started is not None
        s.add("init", init_rec["t"] - learner.init_started)
        s.add("init_state", join_rec["t"] - learner.init_started)
        spans = syncer.probe("init", -1, 10)
        s.add("init_pin", spans["pin"])
        s.add("init_rx_alloc", spans["rx_alloc"])
        s.add("init_store", spans["store"])
        for _ in range(args.pushes):
            pull = learner.pulls.pop(0)
            time.sleep(0.05)  # let the previous round's stragglers (frees, log writes) settle
            s.add("raw_push", raw.transfer(push_bytes))
            time.sleep(0.05)
            job = PushJob(pull, pull.version, tokens=4096, steps=1, step_s=None, delta=delta)
            t_submit = time.time()
            learner.client.submit(job)
            stored = syncer.probe("ingested", pull.round, 60)
            delivered = syncer.probe("delivered", pull.round, 1)
            if not job.done.wait(10) or job.error:
                raise RuntimeError(f"push failed: {job.error}")
            if not stored["accepted"]:
                raise RuntimeError(f"syncer did not accept the push of round {pull.round}:\n{syncer.log_tail()}")
            enc0, enc1 = learner.encode_span[pull.round]
            sent = learner.sent_at[pull.round]
            s.add("push", stored["t"] - t_submit)
            s.add("ph_alloc", enc0 - t_submit)
            s.add("ph_encode", enc1 - enc0)
            s.add("ph_stream", sent - enc1)
            s.add("ph_reassembled", delivered["t"] - sent)
            s.add("ph_store", stored["t"] - delivered["t"])
            s.add("ph_rx_alloc", delivered["alloc_end"] - delivered["alloc_start"])
            s.add("ph_decode", stored["check_start"] - stored["start"])
            s.add("ph_check", stored["check_end"] - stored["check_start"])
            frag, version, rid = pull.fragment, pull.version + 1, pull.round

            def next_round_ready(frag: int = frag, version: int = version) -> bool:
                return learner.bcast_versions.get(frag) == version and bool(learner.pulls)

            def is_commit(rec: dict[str, Any], rid: int = rid) -> bool:
                return rec.get("event") == "commit" and rec.get("round") == rid

            learner.pump(next_round_ready, 120, f"the BCAST of round {rid}")
            commit = syncer.tape_record(is_commit, 10)
            s.add("push_commit", commit["t"] - t_submit)
            s.add("merge", commit["merge_ms"] / 1e3)
            if args.verbose:
                print(f"  rep {rep} round {pull.round}: raw {s.t['raw_push'][-1] * 1e3:.1f} ms, push "
                      f"{s.t['push'][-1] * 1e3:.1f} ms (alloc {(enc0 - t_submit) * 1e3:.1f}, encode "
                      f"{(enc1 - enc0) * 1e3:.1f}, stream {(sent - enc1) * 1e3:.1f} (rx alloc "
                      f"{s.t['ph_rx_alloc'][-1] * 1e3:.1f}), store "
                      f"{(stored['t'] - delivered['t']) * 1e3:.1f}), commit {s.t['push_commit'][-1] * 1e3:.1f} ms",
                      flush=True)
        if args.verbose:
            print(f"  rep {rep} INIT: raw {s.t['raw_init'][-1] * 1e3:.1f} ms, init {s.t['init'][-1] * 1e3:.1f} ms "
                  f"(syncer state allocated after {s.t['init_state'][-1] * 1e3:.1f} ms)", flush=True)
    finally:
        try:
            if learner is not None:
                learner.client.close("benchmark done")
        finally:
            syncer.close()


def _gbps(nbytes: int, seconds: list[float]) -> list[float]:
    return [nbytes / t / 1e9 for t in seconds]


def _row(name: str, values: list[float], unit: str = "GB/s") -> str:
    med = statistics.median(values)
    return f"  {name:<46} {med:8.2f} {unit:<5} [{min(values):.2f} .. {max(values):.2f}, n={len(values)}]"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ingest", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="model size in MiB of float32 (default 256)")
    ap.add_argument("--fragments", type=int, default=4, help="P; a PUSH carries one fragment (default 4)")
    ap.add_argument("--streams", type=int, default=2, help="data streams, and raw streams (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh syncers, one INIT each (default 3)")
    ap.add_argument("--pushes", type=int, default=4, help="PUSH rounds per syncer (default 4)")
    ap.add_argument("--device", default="cpu", help="syncer merge device (default cpu)")
    ap.add_argument("--keep", metavar="DIR", help="keep each syncer's tape and log under DIR")
    ap.add_argument("--verbose", action="store_true", help="print every sample as it is taken")
    args = ap.parse_args()
    if min(args.mib, args.fragments, args.streams, args.repeat, args.pushes) < 1:
        ap.error("every count must be >= 1")

    from yeto_core.wire.messages import CHUNK_BYTES

    if CHUNK_BYTES != CHUNK:
        raise SystemExit(f"the product's chunk is {CHUNK_BYTES} bytes; this benchmark assumes {CHUNK}")
    import tqdm  # noqa: F401 - the client imports it lazily inside the timed INIT upload; pay that here

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the finally blocks
    t_begin = time.monotonic()
    layout, init, delta = _synthetic_model(args.mib, args.fragments)
    model_bytes = sum(f.numel for f in layout.fragments) * 4
    push_bytes = delta.numel() * 4
    if any(f.numel != delta.numel() for f in layout.fragments):
        raise SystemExit("the synthetic layout did not come out in equal fragments")
    s = Samples()
    alloc_ms = []
    for _ in range(3):  # what a fresh, zero-filled buffer of one PUSH costs on this machine right now
        t0 = time.perf_counter()
        buf = bytearray(push_bytes)
        alloc_ms.append((time.perf_counter() - t0) * 1e3)
        del buf
    raw = RawLoopback(model_bytes, args.streams)
    try:
        with tempfile.TemporaryDirectory(prefix="yeto-ingest-") as tmp_dir:
            tmp = args.keep or tmp_dir
            Path(tmp).mkdir(parents=True, exist_ok=True)
            key = os.urandom(16).hex().encode()
            key_file = Path(tmp) / "key"
            key_file.write_bytes(key)
            for rep in range(args.repeat):
                workdir = Path(tmp) / f"rep{rep}"
                workdir.mkdir(exist_ok=True)
                (workdir / "tape.jsonl").unlink(missing_ok=True)
                _run_syncer_rep(rep, args, workdir, key, key_file, layout, init, delta, raw, s)
    finally:
        raw.close()

    t = s.t
    push_gbps, raw_push_gbps = _gbps(push_bytes, t["push"]), _gbps(push_bytes, t["raw_push"])
    init_gbps, raw_init_gbps = _gbps(model_bytes, t["init"]), _gbps(model_bytes, t["raw_init"])
    ms = {k: [x * 1e3 for x in v] for k, v in t.items()}
    print(f"yeto ingest vs raw loopback: model {model_bytes / MIB:.0f} MiB f32 in {args.fragments} fragments "
          f"(PUSH = {push_bytes / MIB:.0f} MiB), {args.streams} data streams, {args.repeat} syncers x "
          f"{args.pushes} pushes, {time.monotonic() - t_begin:.0f} s")
    print(f"  {'':<46} {'median':>8}       [min .. max, n]")
    print(f"PUSH, {push_bytes / MIB:.0f} MiB each")
    print(_row("raw loopback (same bytes, same streams)", raw_push_gbps))
    print(_row("push_ingest: submit -> delta stored", push_gbps))
    print(_row("push_to_commit (tape t, includes the merge)", _gbps(push_bytes, t["push_commit"])))
    print(_row("raw loopback, time", ms["raw_push"], "ms"))
    print(_row("push_ingest, time", ms["push"], "ms"))
    print(_row("  client: allocate the payload buffer", ms["ph_alloc"], "ms"))
    print(_row("  client: encode the delta (f32: sent as it is, 0)", ms["ph_encode"], "ms"))
    print(_row("  stream until the last chunk is in the kernel", ms["ph_stream"], "ms"))
    print(_row("    within it, syncer allocates the rx buffer", ms["ph_rx_alloc"], "ms"))
    print(_row("  syncer: payload reassembled", ms["ph_reassembled"], "ms"))
    print(_row("  syncer: decoded, checked, stored", ms["ph_store"], "ms"))
    print(_row("    of which: decode into a new f32 tensor", ms["ph_decode"], "ms"))
    print(_row("    of which: finiteness check (here; f32 is screened on arrival)", ms["ph_check"], "ms"))
    print(_row("merge_ms from the tape (not ingest)", ms["merge"], "ms"))
    print(_row(f"reference: fresh bytearray({push_bytes / MIB:.0f} MiB) here", alloc_ms, "ms"))
    print(f"INIT, {model_bytes / MIB:.0f} MiB")
    print(_row("raw loopback (same bytes, same streams)", raw_init_gbps))
    print(_row("init_ingest: first INIT sent -> initial cut", init_gbps))
    print(_row("raw loopback, time", ms["raw_init"], "ms"))
    print(_row("init_ingest, time", ms["init"], "ms"))
    print(_row("  first INIT sent -> tape 'join' (state pinned)", ms["init_state"], "ms"))
    print(_row("  syncer: allocate params + momentum (zeros)", ms["init_pin"], "ms"))
    print(_row("  syncer: rx buffer allocations, all fragments", ms["init_rx_alloc"], "ms"))
    print(_row("  syncer: check + copy, all fragments", ms["init_store"], "ms"))
    init_ratio = statistics.median(init_gbps) / statistics.median(raw_init_gbps)
    push_ratio = statistics.median(push_gbps) / statistics.median(raw_push_gbps)
    paired = statistics.median(r / y for r, y in zip(t["raw_push"], t["push"], strict=True))
    print(f"(median of the per-push paired ratios: {paired:.2f})")
    print(f"ratio init_ingest/raw_loopback = {init_ratio:.2f}")
    print(f"ratio push_ingest/raw_loopback = {push_ratio:.2f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == SYNCER_ROLE:
        sys.exit(_probed_syncer(sys.argv[2:]))
    sys.exit(main())
