"""Command line of the syncer: flags mirror `YETO_SYNCER_*` (flags win), then run until final."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

import torch

from syncer.checkpoint import CheckpointError, SyncerState, last_generations, load_checkpoint
from syncer.commit import payload_screen
from syncer.coordinator import Coordinator
from syncer.gate import default_cap
from syncer.links import backend_id
from syncer.server import SyncerServer
from syncer.tape import EventTape
from yeto_core.settings import SettingsError, SyncerSettings, load_settings

log = logging.getLogger("yeto.syncer")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m syncer", description="yeto syncer: merges the islands' "
                                "fragment updates with quorum rounds, RDA and a Nesterov outer step.")
    add = p.add_argument
    add("--host", help="address to listen on (default 127.0.0.1)")
    add("--port", type=int, help="port to listen on; 0 picks a free one (default 7070)")
    add("--learners", type=int, help="M, the expected number of learners (default 2)")
    add("--quorum", type=int, help="K, answers that close a round (default: all M)")
    add("--fragments", type=int, help="P, fragments the model is split into (default 4)")
    add("--pattern", choices=["binpack", "strided"], help="fragment layout (default binpack)")
    add("--total-rounds", type=int, help="fragment rounds before finalization (default 0: until learners finish)")
    add("--checkpoint", type=Path, help="checkpoint file (safetensors + JSON metadata)")
    add("--checkpoint-every", type=int, help="checkpoint after every N committed rounds (default 1)")
    add("--background-checkpoint", action="store_true", default=None,
        help="write each checkpoint from a snapshot on its own thread while rounds go on (one writer at a time)")
    add("--checkpoint-retry-s", type=float, help="retry a failed checkpoint write this long, holding every round, "
        "then stop with exit code 4 (default 120)")
    add("--resume", action="store_true", default=None, help="resume from --checkpoint if it exists")
    add("--tape", type=Path, help="JSONL event tape of every commit")
    add("--key-file", type=Path, help="file holding the shared HMAC key (or YETO_SYNCER_KEY)")
    add("--device", help="merge device: auto (cuda when present) | cpu | cuda | cuda:N")
    add("--outer-lr", type=float, help="Nesterov outer learning rate (default 0.5)")
    add("--outer-momentum", type=float, help="Nesterov outer momentum (default 0.5)")
    add("--outer-optimizer", choices=["nesterov", "delayed-nesterov"], help="outer optimizer (default nesterov)")
    add("--outer-delay", type=int, help="N of delayed Nesterov: the momentum moves every N steps (default 4)")
    add("--merge", choices=["rda", "average"], help="merge of non-embedding tensors: radial-directional "
        "averaging (rda, default) or the plain weighted average (the embedding is always averaged)")
    add("--delta-correction", choices=["heloco", "none"],
        help="correct deltas that oppose the outer momentum (HeLoCo) or not (default)")
    add("--decode-threads", type=int, help="threads that decode pushes beside the coordinator (default 2)")
    add("--merge-threads", type=int, help="CPU merge threads; every count gives the same bits (default 1)")
    add("--round-timeout-s", type=float, help="a round below quorum is retried after this (default 120)")
    add("--pipeline", type=int, help="rounds in flight on distinct fragments (default 2; 1 = serial)")
    add("--grace-ms", type=float, help="cap of the adaptive straggler grace window (default 5000; 0 disables)")
    add("--grace-gamma", type=float, help="γ of the grace window (default 1.0)")
    add("--grace-tau", type=float, help="τ of the grace window, in learner steps (default 2)")
    add("--sync-interval-steps", type=int, help="pace rounds so each fragment syncs every H learner steps "
        "(default 24; 0 disables)")
    add("--min-round-interval-ms", type=float, help="floor between round launches (default 0)")
    add("--max-base-lag", type=int, help="carry a late push to its fragment's next round when its base lags "
        "by at most this many versions (default 1)")
    add("--carry-answers-round", action="store_true", default=None,
        help="count carried pushes toward the quorum of the round they join")
    add("--init-timeout-s", type=float, help="exit when no INIT arrives by then (default 600)")
    add("--final-timeout-s", type=float, help="wait this long for learners to take the final cut (default 60)")
    add("--wan-stall-timeout", type=float, help="seconds without progress on a stream that fail its connection "
        "group; also TCP_USER_TIMEOUT after the initial cut (default 0: off)")
    add("--bcast-delta-full-every", type=int, help="for learners taking bf16 delta broadcasts: send the full "
        "fragment every N versions (default 8)")
    add("--wan-stream-schedule", choices=["rr", "adaptive"], help="stripe chunks round-robin (default) or to the "
        "data stream with the earliest estimated finish")
    add("--handshake-timeout-s", type=float, help="deadline of a whole handshake, from accept until the key is "
        "proven (default 10)")
    add("--max-handshakes", type=int, help="unauthenticated connections at once; at the cap the oldest (open over "
        "2 s) or the newcomer is closed (default 0: 64, or a quarter of the descriptor limit when lower)")
    add("--log-level", default="INFO", help="logging level (default INFO)")
    return p


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SettingsError(f"YETO_SYNCER_DEVICE={name}: CUDA is not available on this machine")
    return device


def load_state(settings: SyncerSettings, device: torch.device) -> SyncerState | None:
    path = settings.checkpoint
    if not settings.resume:
        return None
    if path is None:
        raise SettingsError("--resume needs --checkpoint (YETO_SYNCER_CHECKPOINT)")
    if not path.exists():
        log.info("no checkpoint at %s yet; starting fresh", path)
        return None
    state = load_checkpoint(path, expect_backend=backend_id(settings))
    if state.num_fragments != settings.fragments or state.pattern != settings.pattern:
        raise SettingsError(f"checkpoint {path} has {state.num_fragments} {state.pattern} fragments; the syncer "
                            f"was started with --fragments {settings.fragments} --pattern {settings.pattern}")
    state.params = [t.to(device) for t in state.params]
    state.momentum = [t.to(device) for t in state.momentum]
    log.info("resumed from %s: round %d, versions %s", path, state.next_round, state.versions)
    return state


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    explicit = {k: v for k, v in vars(args).items() if k != "log_level"}
    try:
        settings = load_settings(SyncerSettings, flags=True, **explicit)
        key = settings.read_key(key_file_flag=args.key_file is not None)
        device = resolve_device(settings.device)
        state = load_state(settings, device)
    except (SettingsError, CheckpointError) as exc:
        print(f"yeto syncer: {exc}", file=sys.stderr)
        return 2
    tape = EventTape(settings.tape)
    coordinator = Coordinator(settings, device=device, tape=tape, state=state)
    try:
        server = SyncerServer(
            host=settings.host, port=settings.port, key=key, num_fragments=settings.fragments,
            pattern=settings.pattern, post=coordinator.post, pinned_fingerprint=coordinator.pinned_fingerprint,
            max_payload=coordinator.max_payload, initial_cut_ready=coordinator.initial_cut_ready,
            id_conflict=coordinator.id_conflict,
            handshake_timeout_s=settings.handshake_timeout_s,
            max_handshakes=settings.max_handshakes or default_cap(), heartbeat_s=settings.heartbeat_s,
            peer_timeout_s=settings.peer_timeout_s, stall_timeout_s=settings.wan_stall_timeout,
            schedule=settings.wan_stream_schedule,
            generations=last_generations(state.ledger) if state is not None else None,
            screen=payload_screen,
        )
    except OSError as exc:
        print(f"yeto syncer: cannot listen on {settings.host}:{settings.port}: {exc.strerror}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.warning("signal %d: stopping (the last checkpoint stays valid)", signum)
        stop.set()
        coordinator.post(None)
        coordinator.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    host, port = server.address
    print(f"yeto syncer listening on {host}:{port}", flush=True)
    log.info("M=%d learners, quorum %d, %d %s fragments, %s rounds, merge on %s", settings.learners,
             settings.effective_quorum, settings.fragments, settings.pattern, settings.total_rounds or "unlimited",
             device)
    try:
        code = coordinator.run()
    finally:
        server.close()
        tape.close()
    if stop.is_set() and code == 0:
        code = 130
    log.info("syncer exits with code %d", code)
    return code
