"""The wire in one run: PUSH ingest, BCAST fan-out, bytes per push per codec, codec speed.

    python -m benchmarks.wire [--mib 256] [--fragments 4] [--streams 2] [--pushes 12]
                              [--learners 3] [--rounds 8] [--elements 64M] [--repeat 3]

Only ratios measured in one run mean anything (absolute GB/s move with the machine and with
whatever else runs on it), so every yeto figure is paired with a baseline taken in the same run.
The last line is `ratio push_ingest_f32/raw_loopback = X`.

1. **PUSH ingest, f32.** The real syncer (`syncer.service.cli.main` in a subprocess, with the timestamp
   probes of `benchmarks.ingest`), learner 0 driven through `SyncerClient` with its own F32 codec
   (the product's path: an f32 delta is its own wire bytes, no encode copy). push_ingest = fragment
   bytes / (syncer stored the decoded, checked delta − `SyncerClient.submit`), exactly as in
   `benchmarks.ingest`; each push is paired with a raw loopback transfer of the same bytes over
   the same number of streams (`benchmarks.loopback.RawLoopback`) taken right before it. The
   part spent on the syncer's coordinator thread (judge, check, store: the one serial resource
   that every learner's pushes share) is printed under it; the NaN/Inf screen of f32 chunks runs
   on the connection's reader threads as they land, inside the transfer.
2. **BCAST fan-out.** A second syncer with `--learners N --quorum N --pipeline 1` and N
   `SyncerClient`s in this process (learner 0 uploads the INIT). Every round all N push, the
   syncer merges and commits, then broadcasts the new fragment (exact f32) to all N. fan-out =
   N × fragment bytes / (last learner's client has the whole BCAST payload reassembled and handed
   to its inbox − the commit record's `t` on the tape). The interval therefore also holds the
   tape's fsync of the commit record (the reference row below measures an fsync here); the
   broadcast itself sends the committed parameters' bytes without a copy. The baseline is one raw
   transfer of N × fragment bytes over N × streams (one receiver process, like the N clients in
   this one), taken right before each round.
3. **Bytes on the wire per push** for each codec (`encoded_nbytes` of one fragment, block
   `--block`), plus the PUSH frame and the CHUNK frame headers, relative to f32 and as bits per
   parameter; and each downlink delta codec's BCAST (block 128, as the syncer sends it) relative
   to a FULL broadcast, also averaged with one FULL every `--full-every` versions when that is set
   (the syncer sends none by default).
4. **Codec speed**: each codec's `encode` (f32 tensor → preallocated wire buffer) and `decode`
   (→ preallocated f32 tensor) over `--elements` values, best of `--repeat`, as GB/s of f32 bytes,
   next to torch `copy_` into a preallocated tensor of the same size in the same run, at torch's
   thread count (the codecs use as many), and the slowest of them over `copy_`.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.ingest import (
    CHUNK,
    MIB,
    Learner,
    ProbedSyncer,
    Samples,
    _gbps,
    _row,
    _synthetic_model,
)
from benchmarks.loopback import RawLoopback

CODEC_NAMES = ("f32", "bf16", "int8", "int4", "e3m0", "int4-log", "int2")


def parse_count(text: str) -> int:
    """`64M`, `1M`, `4096`, `1e6` -> an element count (M = 2**20, K = 2**10)."""
    text = text.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(text[-1:].lower(), 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


# ---------------------------------------------------------------------------------------------
# 1. PUSH ingest, f32
# ---------------------------------------------------------------------------------------------
def _push_section(args: argparse.Namespace, tmp: Path, key: bytes, key_file: Path, layout: Any, init: list[Any],
                  delta: Any, raw: RawLoopback, s: Samples) -> None:
    from yeto_core.client import PushJob

    push_bytes = delta.numel() * 4
    workdir = tmp / "push"
    workdir.mkdir()
    syncer = ProbedSyncer(workdir, key_file, args.fragments, args.device)
    learner = None
    try:
        learner = Learner(syncer.port, key, layout, init, args.streams)  # f32 stays unwrapped: no copy
        learner.start()
        p = layout.num_fragments
        learner.pump(lambda: len(learner.bcast_versions) == p and bool(learner.pulls), 120,
                     "the initial cut and the first PULL")
        for _ in range(args.pushes):
            pull = learner.pulls.pop(0)
            time.sleep(0.05)
            s.add("raw_push", raw.transfer(push_bytes))
            time.sleep(0.05)
            job = PushJob(pull, pull.version, tokens=4096, steps=1, step_s=None, delta=delta)
            t_submit = time.time()
            learner.client.submit(job)
            stored = syncer.probe("ingested", pull.round, 60)
            syncer.probe("delivered", pull.round, 1)
            if not job.done.wait(10) or job.error:
                raise RuntimeError(f"push failed: {job.error}")
            if not stored["accepted"]:
                raise RuntimeError(f"syncer did not accept the push of round {pull.round}:\n{syncer.log_tail()}")
            s.add("push", stored["t"] - t_submit)
            s.add("push_coordinator", stored["t"] - stored["start"])
            frag, version, rid = pull.fragment, pull.version + 1, pull.round
            learner.pump(lambda: learner.bcast_versions.get(frag) == version and bool(learner.pulls),  # noqa: B023
                         120, f"the BCAST of round {rid}")
            commit = syncer.tape_record(lambda r: r.get("event") == "commit" and r.get("round") == rid, 10)  # noqa: B023
            s.add("push_commit", commit["t"] - t_submit)
            if args.verbose:
                print(f"  push round {rid}: raw {s.t['raw_push'][-1] * 1e3:.1f} ms, "
                      f"push {s.t['push'][-1] * 1e3:.1f} ms", flush=True)
    finally:
        try:
            if learner is not None:
                learner.client.close("benchmark done")
        finally:
            syncer.close()


# ---------------------------------------------------------------------------------------------
# 2. BCAST fan-out to N learners
# ---------------------------------------------------------------------------------------------
def _stamp_bcasts(learner: Learner, stamps: dict[tuple[int, int, int], float]) -> None:
    """Stamp when the client has a BCAST's whole payload (its handler ran; the inbox has it)."""
    from yeto_core.wire.messages import Bcast

    client = learner.client
    orig = client._on_message
    lid = client.learner_id

    def on_message(msg: Any, payload: Any) -> None:
        orig(msg, payload)
        if isinstance(msg, Bcast):
            stamps[(lid, msg.fragment, msg.version)] = time.time()

    client._on_message = on_message  # type: ignore[method-assign]  # the link binds it at each dial


def _fanout_section(args: argparse.Namespace, tmp: Path, key: bytes, key_file: Path, layout: Any, init: list[Any],
                    delta: Any, raw: RawLoopback, s: Samples) -> None:
    from yeto_core.client import PushJob

    n = args.learners
    push_bytes = delta.numel() * 4
    workdir = tmp / "fanout"
    workdir.mkdir()
    syncer = ProbedSyncer(workdir, key_file, args.fragments, args.device, learners=n,
                          extra_args=("--pipeline", "1"))
    learners: list[Learner] = []
    stamps: dict[tuple[int, int, int], float] = {}
    try:
        # Learners 1..N-1 first, so that every one is live when the initial cut launches round 0.
        for lid in [*range(1, n), 0]:
            lr = Learner(syncer.port, key, layout, init, args.streams, learner_id=lid)
            _stamp_bcasts(lr, stamps)
            learners.append(lr)
            lr.start()
            if lid != 0:
                deadline = time.monotonic() + 60
                while not lr.client.connected:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"learner {lid} did not connect:\n{syncer.log_tail()}")
                    time.sleep(0.01)
        p = layout.num_fragments
        # Learner 0 first: its pump answers the link's INIT request, which the initial cut waits on.
        for lr in sorted(learners, key=lambda lr: lr.client.learner_id):
            lr.pump(lambda: len(lr.bcast_versions) == p and bool(lr.pulls), 120,  # noqa: B023 - called at once
                    f"learner {lr.client.learner_id}'s initial state and first PULL")
        for _ in range(args.rounds):
            pulls = [lr.pulls.pop(0) for lr in learners]
            rid = pulls[0].round
            if any(pl.round != rid for pl in pulls):
                raise RuntimeError(f"learners got different rounds: {[pl.round for pl in pulls]}")
            time.sleep(0.05)
            s.add("raw_fanout", raw.transfer(n * push_bytes))
            time.sleep(0.05)
            jobs = []
            for lr, pl in zip(learners, pulls, strict=True):
                jobs.append(PushJob(pl, pl.version, tokens=4096, steps=1, step_s=None, delta=delta))
                lr.client.submit(jobs[-1])
            frag, version = pulls[0].fragment, pulls[0].version + 1
            for lr in learners:
                lr.pump(lambda: lr.bcast_versions.get(frag) == version and bool(lr.pulls), 120,  # noqa: B023
                        f"learner {lr.client.learner_id}'s BCAST of round {rid}")
            for job in jobs:
                if not job.done.wait(10) or job.error:
                    raise RuntimeError(f"push failed: {job.error}")
            commit = syncer.tape_record(lambda r: r.get("event") == "commit" and r.get("round") == rid,  # noqa: B023
                                        10)
            if sorted(commit["learners"]) != list(range(n)):
                raise RuntimeError(f"round {rid} committed with learners {commit['learners']}, expected all {n}")
            got = [stamps[(lr.client.learner_id, frag, version)] for lr in learners]
            s.add("fanout", max(got) - commit["t"])
            s.add("fanout_first", min(got) - commit["t"])
            if args.verbose:
                print(f"  fan-out round {rid}: raw {s.t['raw_fanout'][-1] * 1e3:.1f} ms, yeto "
                      f"{s.t['fanout'][-1] * 1e3:.1f} ms (first learner {s.t['fanout_first'][-1] * 1e3:.1f})",
                      flush=True)
    finally:
        for lr in learners:
            try:
                lr.client.close("benchmark done")
            except Exception as exc:  # keep closing the others and the syncer
                print(f"  (closing learner {lr.client.learner_id}: {exc})", file=sys.stderr)
        syncer.close()


def _fsync_ms(directory: Path) -> list[float]:
    """What appending one tape-sized line with flush + fsync costs here (the tape does this per commit)."""
    out = []
    with open(directory / "fsync-probe", "ab") as f:
        for _ in range(5):
            t0 = time.perf_counter()
            f.write(b'{"event": "commit", "round": 0, "pad": "' + b"x" * 400 + b'"}\n')
            f.flush()
            os.fsync(f.fileno())
            out.append((time.perf_counter() - t0) * 1e3)
    return out


# ---------------------------------------------------------------------------------------------
# 3. Bytes on the wire
# ---------------------------------------------------------------------------------------------
def _wire_bytes(payload: int, head: int) -> int:
    """The frame holding the message, then one CHUNK frame (header + chunk header) per 4 MiB."""
    from yeto_core.wire.messages import CHUNK_HEADER, HEADER

    return head + payload + math.ceil(payload / CHUNK) * (HEADER.size + CHUNK_HEADER.size)


def _bytes_section(numel: int, block: int, full_every: int) -> list[str]:
    from yeto_core.codecs import F32, codec_by_name
    from yeto_core.downlink import DOWNLINK_DTYPES, downlink_codec
    from yeto_core.wire.messages import Bcast, Push, encode_frame

    lines = [f"BYTES ON THE WIRE, one fragment of {numel:,} values ({numel * 4 / MIB:.1f} MiB f32), push block {block}",
             f"  {'codec':<15} {'payload bytes':>15} {'wire bytes':>15} {'payload/f32':>12} {'wire/f32':>9} "
             f"{'bits/param':>10}"]
    f32_payload = F32.encoded_nbytes(numel)

    def row(name: str, payload: float, wire: float, wire_ref: float, note: str = "") -> str:
        return (f"  {name:<15} {payload:>15,.0f} {wire:>15,.0f} {payload / f32_payload:>12.4f} {wire / wire_ref:>9.4f} "
                f"{8 * payload / numel:>10.3f}{note}")

    push_head = len(encode_frame(Push(0, 0, 0, 0, 0, 0, 0, 0, f32_payload, F32.wire_id)))
    f32_wire = _wire_bytes(f32_payload, push_head)
    for name in CODEC_NAMES:
        payload = codec_by_name(name, block=block).encoded_nbytes(numel)
        lines.append(row("PUSH " + name, payload, _wire_bytes(payload, push_head), f32_wire))
    bcast_head = len(encode_frame(Bcast(0, 0, 0, 0, 0, f32_payload, F32.wire_id, b"\0" * 32)))
    full_wire = _wire_bytes(f32_payload, bcast_head)
    lines.append(row("BCAST f32", f32_payload, full_wire, full_wire, "   (exact: every version FULL)"))
    for name in DOWNLINK_DTYPES[1:]:
        codec = downlink_codec(name)
        assert codec is not None
        d_payload = codec.encoded_nbytes(numel)
        d_wire = _wire_bytes(d_payload, bcast_head)
        lines.append(row("BCAST " + name, d_payload, d_wire, full_wire, "   (downlink delta vs FULL)"))
        if full_every > 1:
            avg_p = ((full_every - 1) * d_payload + f32_payload) / full_every
            avg_w = ((full_every - 1) * d_wire + full_wire) / full_every
            lines.append(row("  avg/version", avg_p, avg_w, full_wire, f"   (one FULL every {full_every} versions)"))
    return lines


# ---------------------------------------------------------------------------------------------
# 4. Codec speed next to a memory copy
# ---------------------------------------------------------------------------------------------
def _best(fn: Any, repeat: int) -> float:
    fn()  # warm up: first-touch of buffers, lazy initialisation
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _codec_section(numel: int, block: int, repeat: int) -> tuple[list[str], dict[str, tuple[float, float]]]:
    import torch

    from yeto_core.codecs import codec_by_name

    gen = torch.Generator().manual_seed(1)
    src = torch.randn(numel, generator=gen).mul_(1e-3)
    dst = torch.empty(numel)
    f32_bytes = numel * 4
    copy_gbps = f32_bytes / _best(lambda: dst.copy_(src), repeat) / 1e9
    lines = [f"CODEC SPEED, {numel:,} values ({f32_bytes / MIB:.0f} MiB f32), block {block}, best of {repeat}, "
             f"torch threads {torch.get_num_threads()}",
             f"  {'operation':<22} {'GB/s (f32 side)':>16} {'/ copy_':>8}",
             f"  {'torch copy_ (prealloc)':<22} {copy_gbps:>16.2f} {1.0:>8.2f}"]
    speeds: dict[str, tuple[float, float]] = {}
    for name in CODEC_NAMES:
        codec = codec_by_name(name, block=block)
        buf = memoryview(bytearray(codec.encoded_nbytes(numel)))
        enc = f32_bytes / _best(lambda codec=codec, buf=buf: codec.encode(src, buf), repeat) / 1e9
        dec = f32_bytes / _best(lambda codec=codec, buf=buf: codec.decode(buf, dst), repeat) / 1e9
        speeds[name] = (enc, dec)
        lines.append(f"  {name + ' encode':<22} {enc:>16.2f} {enc / copy_gbps:>8.2f}")
        lines.append(f"  {name + ' decode':<22} {dec:>16.2f} {dec / copy_gbps:>8.2f}")
        del buf
    from yeto_core import quant_kernels

    slowest = min(min(pair) for pair in speeds.values()) / copy_gbps
    path = "compiled loops, yeto[fast]" if quant_kernels.AVAILABLE else "torch ops: numba is not installed"
    lines.append(f"  slowest codec / copy_ = {slowest:.2f} (quantized codecs: {path}; goal >= 0.5)")
    return lines, speeds


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.wire", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="model size in MiB of float32 (default 256)")
    ap.add_argument("--fragments", type=int, default=4, help="P; a PUSH or BCAST carries one fragment (default 4)")
    ap.add_argument("--streams", type=int, default=2, help="data streams per learner, and raw streams (default 2)")
    ap.add_argument("--pushes", type=int, default=12, help="f32 PUSH rounds with one learner (default 12)")
    ap.add_argument("--learners", type=int, default=3, help="N, learners receiving each BCAST (default 3)")
    ap.add_argument("--rounds", type=int, default=8, help="fan-out rounds with N learners (default 8)")
    ap.add_argument("--elements", type=parse_count, default=64 << 20, help="values for codec speed (default 64M)")
    ap.add_argument("--block", type=int, default=128, help="block size of the quantized codecs (default 128)")
    ap.add_argument("--repeat", type=int, default=3, help="codec speed: best of this many (default 3)")
    ap.add_argument("--full-every", type=int, default=None,
                    help="downlink: one FULL every N versions (default: the syncer's default)")
    ap.add_argument("--device", default="cpu", help="syncer merge device (default cpu)")
    ap.add_argument("--keep", metavar="DIR", help="keep each syncer's tape and log under DIR")
    ap.add_argument("--verbose", action="store_true", help="print every sample as it is taken")
    args = ap.parse_args()
    if min(args.mib, args.fragments, args.streams, args.pushes, args.learners, args.rounds, args.elements,
           args.block, args.repeat) < 1:
        ap.error("every count must be >= 1")

    from yeto_core.settings import SyncerSettings
    from yeto_core.wire.messages import CHUNK_BYTES

    if CHUNK_BYTES != CHUNK:
        raise SystemExit(f"the product's chunk is {CHUNK_BYTES} bytes; this benchmark assumes {CHUNK}")
    full_every = args.full_every or int(SyncerSettings.model_fields["bcast_delta_full_every"].default)
    import tqdm  # noqa: F401 - the client imports it lazily during INIT; pay that here

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run the finally blocks
    t_begin = time.monotonic()
    layout, init, delta = _synthetic_model(args.mib, args.fragments)
    push_bytes = delta.numel() * 4
    if any(f.numel != delta.numel() for f in layout.fragments):
        raise SystemExit("the synthetic layout did not come out in equal fragments")
    s = Samples()
    raw_push = RawLoopback(push_bytes, args.streams)
    raw_fan = None
    try:
        raw_fan = RawLoopback(args.learners * push_bytes, args.learners * args.streams)
        with tempfile.TemporaryDirectory(prefix="yeto-wire-") as tmp_dir:
            tmp = Path(args.keep or tmp_dir)
            tmp.mkdir(parents=True, exist_ok=True)
            key = os.urandom(16).hex().encode()
            key_file = tmp / "key"
            key_file.write_bytes(key)
            _push_section(args, tmp, key, key_file, layout, init, delta, raw_push, s)
            t_push = time.monotonic()
            _fanout_section(args, tmp, key, key_file, layout, init, delta, raw_fan, s)
            t_fan = time.monotonic()
            fsync_ms = _fsync_ms(tmp)
    finally:
        raw_push.close()
        if raw_fan is not None:
            raw_fan.close()
    del init
    t_codec0 = time.monotonic()
    codec_lines, _speeds = _codec_section(args.elements, args.block, args.repeat)
    t_codec = time.monotonic() - t_codec0

    t = s.t
    n = args.learners
    ms = {k: [x * 1e3 for x in v] for k, v in t.items()}
    push_gbps, raw_push_gbps = _gbps(push_bytes, t["push"]), _gbps(push_bytes, t["raw_push"])
    fan_gbps, raw_fan_gbps = _gbps(n * push_bytes, t["fanout"]), _gbps(n * push_bytes, t["raw_fanout"])
    push_ratio = statistics.median(push_gbps) / statistics.median(raw_push_gbps)
    fan_ratio = statistics.median(fan_gbps) / statistics.median(raw_fan_gbps)
    print(f"yeto wire benchmark: model {args.mib} MiB f32 in {args.fragments} fragments (fragment = "
          f"{push_bytes / MIB:.0f} MiB), {args.streams} data streams per learner, {time.monotonic() - t_begin:.0f} s "
          f"(push {t_push - t_begin:.0f} s, fan-out {t_fan - t_push:.0f} s, codecs {t_codec:.0f} s)")
    print(f"  {'':<46} {'median':>8}       [min .. max, n]")
    print(f"PUSH INGEST, f32, {push_bytes / MIB:.0f} MiB per push, 1 learner")
    print(_row("raw loopback (same bytes, same streams)", raw_push_gbps))
    print(_row("push_ingest_f32: submit -> delta stored", push_gbps))
    print(_row("push_to_commit (tape t, includes the merge)", _gbps(push_bytes, t["push_commit"])))
    print(_row("raw loopback, time", ms["raw_push"], "ms"))
    print(_row("push_ingest_f32, time", ms["push"], "ms"))
    print(_row("  of which on the coordinator thread", ms["push_coordinator"], "ms"))
    print(f"  ratio push_ingest_f32/raw_loopback = {push_ratio:.2f} (the product's goal: >= 0.8)")
    print(f"BCAST FAN-OUT, f32 FULL, {push_bytes / MIB:.0f} MiB to each of {n} learners "
          f"({n * push_bytes / MIB:.0f} MiB in all)")
    print(_row(f"raw loopback ({n} x bytes over {n} x {args.streams} streams)", raw_fan_gbps))
    print(_row("bcast_fanout: commit (tape t) -> last learner", fan_gbps))
    print(_row("raw loopback, time", ms["raw_fanout"], "ms"))
    print(_row("bcast_fanout, time to the last learner", ms["fanout"], "ms"))
    print(_row("bcast_fanout, time to the first learner", ms["fanout_first"], "ms"))
    print(_row("reference: tape line write + fsync here", fsync_ms, "ms"))
    print(f"  ratio bcast_fanout/raw_loopback = {fan_ratio:.2f}")
    for line in _bytes_section(delta.numel(), args.block, full_every):
        print(line)
    for line in codec_lines:
        print(line)
    print(f"ratio bcast_fanout/raw_loopback = {fan_ratio:.2f}")
    print(f"ratio push_ingest_f32/raw_loopback = {push_ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
