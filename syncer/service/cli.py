"""Command line of the syncer: flags mirror `YETO_SYNCER_*` (flags win), then run until final."""

from __future__ import annotations

import argparse
import errno
import functools
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType, UnionType
from typing import Literal, Union, get_args, get_origin

import torch
from pydantic.fields import FieldInfo

from syncer.core.links import backend_id, sweep_problem
from syncer.core.payload import payload_screen
from syncer.durability.checkpoint import CheckpointError, SyncerState, last_generations, load_checkpoint
from syncer.durability.run_lock import RunLock, RunLockError
from syncer.durability.tape import EventTape
from syncer.merge.iso_pool import ISO_EXIT_CODE, IsoPool, IsoPoolError
from syncer.service.coordinator import Coordinator
from syncer.service.gate import default_cap
from syncer.service.metrics import SyncerMetrics
from syncer.service.server import SyncerServer
from syncer.service.traffic import FanOut
from syncer.web.status import StatusBoard
from syncer.web.web import serve
from yeto_core.setting_names import flat_fields
from yeto_core.settings import IsoWorkerSettings, SettingsError, SyncerSettings, load_settings
from yeto_core.web_server import read_token

log = logging.getLogger("yeto.syncer")


# Settings with no flag: a key on the command line is visible to every user of the machine (`ps`);
# a fault is a test hook, armed through the environment so that a whole process tree inherits it.
NOT_FLAGS = frozenset({"key", "fault"})
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# A flag's text as its setting's type; pydantic then checks the value and its bounds.
FLAG_TYPES: dict[object, Callable[[str], object]] = {int: int, float: float, str: str, Path: Path}


def flag_of(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def shown_default(setting: str, value: object) -> str:
    """A setting's default as `--help` shows it: 120.0 → "120 s" for a duration, None → "none"."""
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g} s" if setting.endswith("_s") else f"{value:g}"
    return str(value)


def add_setting_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, setting: str, field: FieldInfo) -> None:
    """The flag of one setting, typed by its annotation and explained by its description and default.
    It defaults to None, "not given", so that the environment fills what the command line leaves out."""
    kind = field.annotation
    if get_origin(kind) in (Union, UnionType):  # `Path | None`: None is "not given" anyway
        kind = next(arg for arg in get_args(kind) if arg is not type(None))
    text = f"{field.description} (default {shown_default(setting, field.default)})".replace("%", "%%")
    if kind is bool and field.default is False:
        parser.add_argument(flag_of(setting), action="store_true", default=None, help=text)
    elif get_origin(kind) is Literal:
        parser.add_argument(flag_of(setting), choices=get_args(kind), help=text)
    elif kind in FLAG_TYPES:
        parser.add_argument(flag_of(setting), type=FLAG_TYPES[kind], help=text)
    else:
        raise TypeError(f"SyncerSettings.{setting} ({field.annotation}) has no flag form; add it to NOT_FLAGS")


def build_parser() -> argparse.ArgumentParser:
    """One flag per syncer setting, derived from its field, so the help cannot drift from the defaults.
    A section's flags are listed under its heading."""
    p = argparse.ArgumentParser(prog="python -m syncer", description="yeto syncer: merges the islands' "
                                "fragment updates with quorum rounds, RDA and a Nesterov outer step.")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for setting, field in flat_fields(SyncerSettings).items():
        if setting in NOT_FLAGS:
            continue
        where: argparse.ArgumentParser | argparse._ArgumentGroup = p
        if len(field.path) == 2:
            section = field.path[0]
            if section not in groups:
                heading = getattr(SyncerSettings.model_fields[section].annotation, "heading", section)
                groups[section] = p.add_argument_group(heading)
            where = groups[section]
        add_setting_flag(where, setting, field.info)
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                   help="logging level (default INFO)")
    former = p.add_argument_group("deprecated flags (each read as its new setting, with a warning)")
    for old, renamed in SyncerSettings.renamed.items():
        unit = ", in milliseconds" if renamed.unit == "ms" else ""
        former.add_argument(flag_of(old), type=float, help=f"former name of {flag_of(renamed.new)}{unit}")
    return p


def check_output_path(path: Path | None, setting: str) -> None:
    """A file the syncer will write (checkpoint, tape) must be creatable: its folder is made if
    missing and must be writable, and the path itself is no folder. Found out at start, not at the
    first commit."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise SettingsError(f"{setting}={path}: is a directory; name a file in it")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "is not a directory" if exc.errno in (errno.EEXIST, errno.ENOTDIR) else f"cannot be made ({exc.strerror})"
        raise SettingsError(f"{setting}={path}: its folder {folder} {why}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SettingsError(f"{setting}={path}: its folder {folder} is not writable")
    if path.exists() and not path.is_file():
        raise SettingsError(f"{setting}={path}: not a regular file")


def check_listen(what: str, host: str, port: int, host_setting: str, port_setting: str) -> None:
    """Bind host:port once and let go, so that a busy port or a foreign address is one line before
    anything starts (the iso workers, a resume's load); the real bind comes later and still reports
    a port taken in between. `what`: the line's opening ("cannot listen on")."""
    try:
        socket.create_server((host, port)).close()
    except OSError as exc:
        blame = host_setting if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL else port_setting
        why = os.strerror(exc.errno) if exc.errno and not isinstance(exc, socket.gaierror) else exc.strerror
        raise SettingsError(f"{what} {host}:{port} ({blame}): {why}") from None


def given_as(args: argparse.Namespace, setting: str) -> str:
    """How an error names a setting: its flag when the command line gave it, else its variable."""
    return flag_of(setting) if getattr(args, setting, None) is not None else f"YETO_SYNCER_{setting.upper()}"


def resolve_device(name: str, setting: str) -> torch.device:
    """The device `name` names, checked against this machine before anything starts on it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingsError(f"{setting}={name}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SettingsError(f"{setting}={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
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
    state = load_checkpoint(path, expect_backend=backend_id(settings.merging))
    if state.num_fragments != settings.fragments or state.pattern != settings.pattern:
        raise SettingsError(f"checkpoint {path} has {state.num_fragments} {state.pattern} fragments; the syncer "
                            f"was started with --fragments {settings.fragments} --pattern {settings.pattern}")
    state.params = [t.to(device) for t in state.params]
    state.momentum = [t.to(device) for t in state.momentum]
    if state.outer_accum is not None:
        state.outer_accum = [t.to(device) for t in state.outer_accum]
    log.info("resumed from %s: round %d, versions %s", path, state.next_round, state.versions)
    return state


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_shape(settings: SyncerSettings, device: torch.device) -> dict[str, object]:
    """The run's shape, as the status page heads it."""
    return {"learners": settings.learners, "quorum": settings.effective_quorum, "fragments": settings.fragments,
            "pattern": settings.pattern, "pipeline": settings.pipeline, "total_rounds": settings.total_rounds,
            "merge": settings.merging.merge, "device": str(device)}


def main(argv: list[str] | None = None) -> int:
    """Run the syncer; its checkpoint and tape stay locked until it returns (`run_lock.py`)."""
    with RunLock() as run_lock:
        return run_syncer(argv, run_lock)


def run_syncer(argv: list[str] | None, run_lock: RunLock) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    explicit = {k: v for k, v in vars(args).items() if k != "log_level"}
    try:
        settings = load_settings(SyncerSettings, flags=True, **explicit)
        key = settings.read_key(key_file_flag=args.key_file is not None)
        check_output_path(settings.checkpoint, given_as(args, "checkpoint"))
        check_output_path(settings.tape, given_as(args, "tape"))
        web_token = None
        if settings.metrics_token_file is not None:
            web_token = read_token(settings.metrics_token_file, given_as(args, "metrics_token_file"))
        device = resolve_device(settings.device, given_as(args, "device"))
        for worker_device in settings.merging.iso_devices:
            resolve_device(worker_device, given_as(args, "iso_worker_devices"))
        check_listen("cannot listen on", settings.host, settings.port, given_as(args, "host"), given_as(args, "port"))
        if settings.metrics_port is not None:
            check_listen("cannot serve metrics on", settings.metrics_host, settings.metrics_port,
                         given_as(args, "metrics_host"), given_as(args, "metrics_port"))
        for setting, path in (("checkpoint", settings.checkpoint), ("tape", settings.tape)):
            if path is not None:  # before anything reads or writes it: one syncer per path
                run_lock.acquire(given_as(args, setting), path)
        state = load_state(settings, device)
        iso_settings = load_settings(IsoWorkerSettings) if settings.merging.iso_devices else None
    except (SettingsError, CheckpointError, RunLockError) as exc:
        print(f"yeto syncer: {exc}", file=sys.stderr)
        return 2
    pool = None
    if iso_settings is not None:
        try:
            pool = IsoPool(settings.merging.iso_devices, iso_settings, fault=settings.fault)
        except IsoPoolError as exc:
            print(f"yeto syncer: {exc}", file=sys.stderr)
            return ISO_EXIT_CODE
    try:
        return serve_run(settings, key, device, state, pool, web_token)
    finally:
        if pool is not None:
            pool.close()


def serve_run(settings: SyncerSettings, key: bytes, device: torch.device, state: SyncerState | None,
              pool: IsoPool | None, web_token: bytes | None = None) -> int:
    """Listen, run the coordinator until the run ends, and say how it ended. `web_token`: what the
    web port (`--metrics-port`) requires, if anything."""
    tape = EventTape(settings.tape)
    metrics = SyncerMetrics(settings.fragments)
    board = StatusBoard(run_shape(settings, device), settings.fragments)
    tape.listeners += [metrics.observe, board.observe]
    faults = settings.fault_injector()  # one for the process: occurrences count across all its points
    coordinator = Coordinator(settings, device=device, tape=tape, state=state, faults=faults,
                              observer=FanOut([metrics, board]), iso=pool)
    try:
        server = SyncerServer(
            host=settings.host, port=settings.port, key=key, announced=settings.schedule, post=coordinator.post,
            pinned_fingerprint=coordinator.pinned_fingerprint,
            max_payload=coordinator.max_payload, initial_cut_ready=coordinator.initial_cut_ready,
            id_conflict=coordinator.id_conflict,
            schedule_problem=functools.partial(sweep_problem, fragments=settings.fragments, pipeline=settings.pipeline,
                                               sync_interval_steps=settings.sync_interval_steps),
            handshake_timeout_s=settings.handshake_timeout_s,
            max_handshakes=settings.max_handshakes or default_cap(), streams=settings.streams,
            generations=last_generations(state.ledger) if state is not None else None,
            screen=payload_screen, faults=faults, on_refused=metrics.handshake_refused,
        )
    except OSError as exc:
        print(f"yeto syncer: cannot listen on {settings.host}:{settings.port}: {exc.strerror}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.warning("signal %d: stopping (the last checkpoint stays valid)", signum)
        stop.set()
        coordinator.request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    exposition = None
    if settings.metrics_port is not None:
        try:
            exposition = serve(metrics.registry, board, settings.metrics_host, settings.metrics_port, token=web_token,
                               max_connections=settings.metrics_max_connections,
                               request_timeout_s=settings.metrics_request_timeout_s)
        except OSError as exc:
            server.close()
            blame = "--metrics-host" if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL \
                else "--metrics-port"
            print(f"yeto syncer: cannot serve metrics on {settings.metrics_host}:{settings.metrics_port} ({blame}): "
                  f"{exc.strerror}", file=sys.stderr)
            return 2
        if web_token is None and not is_loopback(exposition.host):
            log.warning("the web port on %s has no token: anyone who reaches it reads the run's status "
                        "(--metrics-token-file)", exposition.host)
    server.start()
    host, port = server.address
    if exposition is not None:
        web = f"[{exposition.host}]" if ":" in exposition.host else exposition.host  # an IPv6 address
        print(f"yeto syncer metrics on http://{web}:{exposition.port}/metrics", flush=True)
        print(f"yeto syncer status page on http://{web}:{exposition.port}/", flush=True)
    print(f"yeto syncer listening on {host}:{port}", flush=True)
    log.info("M=%d learners, quorum %d, %d %s fragments, %s rounds, merge on %s, outer lr %.4g", settings.learners,
             settings.effective_quorum, settings.fragments, settings.pattern, settings.total_rounds or "unlimited",
             device, settings.merging.outer_lr)
    try:
        code = coordinator.run()
    finally:
        server.close()
        tape.close()
        if exposition is not None:
            exposition.close()
    if stop.is_set() and code == 0:
        code = 130
    log.info("syncer exits with code %d", code)
    return code
