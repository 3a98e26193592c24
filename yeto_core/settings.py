"""Settings, read once at the edge (plugin constructor, syncer `main()`) and passed down typed.

Learner settings come from `YETO_DILOCO_*`, syncer settings from `YETO_SYNCER_*`. Explicit
arguments (keyword arguments, command-line flags) always win over the environment. Both are made
of the sections their components take (yeto_core/sections.py), yet every setting keeps one flat
name (yeto_core/setting_names.py). A bad value fails at start-up with one message that names the
variable, flag or argument and what it accepts.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import (
    AliasChoices,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from yeto_core import faults
from yeto_core.sections import (
    DAY_S,
    DEFAULT_SYNC_INTERVAL,
    HOUR_S,
    MAX_STEPS,
    WEEK_S,
    ConsensusSettings,
    Endpoint,
    IslandSettings,
    LinkSettings,
    MergeSettings,
    Schedule,
    StreamSettings,
)
from yeto_core.setting_names import (
    FlatSettings,
    Renamed,
    SettingsError,
    flat_fields,
    flat_of,
    setting_name,
    take_renamed,
    unknown_variables,
)

log = logging.getLogger("yeto.settings")

MIN_KEY_BYTES = 16
MAX_SECRET_FILE_BYTES = 4096  # a key or token file larger than this is a mistake (or /dev/zero)
# More upper bounds, beside the durations' and MAX_STEPS (yeto_core/sections.py).
MAX_FRAGMENTS = 4096
MAX_LEARNERS = 4096
MAX_ROUNDS = 2**31 - 1
MAX_MBPS = 1e9  # 1 Pb/s: a probe floor above any link there is
# The end of a run, one rule for both sides (DESIGN §4.7): a learner waits for the final cut longer
# than the syncer may take to serve it once every learner is done, so it never gives up on a syncer
# still within its deadlines. From the last DONE the syncer may wait up to REJOIN_WAIT_S for a
# learner that left while training, write its final checkpoint (FINAL_CHECKPOINT_S allowed), then
# hold the cut open FINAL_HOLD_S. A learner's DONE may come half its own wait late (it settles its
# last pushes first, DESIGN §3.7), so it waits twice that sum: 2 × (60 + 30 + 60) = 300 s.
FINAL_HOLD_S = 60.0  # the syncer's --final-timeout-s
REJOIN_WAIT_S = 60.0  # the syncer's --rejoin-wait-s
FINAL_CHECKPOINT_S = 30.0
FINAL_WAIT_S = 2 * (REJOIN_WAIT_S + FINAL_CHECKPOINT_S + FINAL_HOLD_S)  # the learners' YETO_DILOCO_FINAL_TIMEOUT_S


def parse_address(value: str) -> tuple[str, int]:
    """`HOST:PORT` → (host, port); IPv6 hosts may be bracketed (`[::1]:7000`)."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a port in 1..65535, got {value!r}")
    return host.strip("[]"), int(port)


def read_secret_file(path: Path, name: str, *, what: str = "secret", min_bytes: int = 1,
                     max_bytes: int = MAX_SECRET_FILE_BYTES) -> bytes:
    """A secret (the HMAC key, a bearer token) from a regular file of at most `max_bytes`, surrounding
    whitespace stripped. `name` is how errors call the file's setting. A device, a FIFO or a directory
    is refused before it is read (`/dev/zero` would be read until memory runs out), and a file is read
    at most one byte past the cap, so an absurd file costs nothing. Warns once when others can read it."""
    where = f"{name}={path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SettingsError(f"{where}: cannot read the {what} file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SettingsError(f"{where}: not a regular file; put the {what} in a file of its own")
        if info.st_size > max_bytes:
            raise SettingsError(f"{where}: {info.st_size} bytes is not a {what}; at most {max_bytes} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise SettingsError(f"{where}: cannot read the {what} file ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:  # it grew since fstat
        raise SettingsError(f"{where}: more than {max_bytes} bytes is not a {what}")
    raw = raw.strip()
    if len(raw) < min_bytes:  # before the warning below: an unusable secret is the one thing to say
        raise SettingsError(f"{where}: the {what} must be at least {min_bytes} bytes, got {len(raw)}"
                            if raw else f"{where}: the {what} file is empty")
    if info.st_mode & 0o077:  # a usable secret others can read: say so, once per read
        log.warning("%s: the file is readable by other users (mode %03o); `chmod 600 %s`", where,
                    info.st_mode & 0o777, path)
    return raw


def read_key(key: SecretStr | None, key_file: Path | None, *, prefix: str, key_file_name: str | None = None) -> bytes:
    """The shared HMAC key from KEY or KEY_FILE (exactly one), at least 16 bytes. `key_file_name`
    is what errors call the file's setting (e.g. the `--key-file` flag it came from)."""
    if (key is None) == (key_file is None):
        raise SettingsError(f"set exactly one of {prefix}KEY or {prefix}KEY_FILE (the shared HMAC key)")
    if key_file is not None:
        name = key_file_name or prefix + "KEY_FILE"
        where = f"{name}={key_file}"
        raw = read_secret_file(key_file, name, what="key", min_bytes=MIN_KEY_BYTES)
    else:
        assert key is not None
        raw = key.get_secret_value().encode()
        where = f"{prefix}KEY"
        if len(raw) > MAX_SECRET_FILE_BYTES:
            raise SettingsError(f"{where}: at most {MAX_SECRET_FILE_BYTES} bytes, got {len(raw)}")
    if len(raw) < MIN_KEY_BYTES:
        raise SettingsError(f"{where}: the key must be at least {MIN_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def fault_field(prefix: str) -> Any:
    """The fault-injection setting: `YETO_FAULT`, as the tests arm a process, or the prefixed name."""
    return Field(default="", validation_alias=AliasChoices(faults.ENV, f"{prefix}FAULT"),
                 description="arm a fault point for tests: POINT[@N][:kill|stop|exit] (see yeto_core.faults)")


def check_fault(value: str) -> str:
    try:
        faults.FaultInjector(value)
    except faults.FaultSpecError as exc:
        raise ValueError(exc.reason) from None  # load_settings names the variable and the value
    return value


class LearnerSettings(FlatSettings):
    """One island's DiLoCo learner (`YETO_DILOCO_*`): its own settings, and the sections its parts
    take (`link`, `consensus`, `island`), each set by flat names (`YETO_DILOCO_HEARTBEAT_S`)."""

    model_config = SettingsConfigDict(env_prefix="YETO_DILOCO_", extra="forbid", frozen=True, allow_inf_nan=False,
                                      validate_by_name=True)  # `fault=` beside its variables' names

    syncer: str = Field(description="syncer address, HOST:PORT")
    key: SecretStr | None = Field(default=None, description="shared HMAC key (or use key_file)")
    key_file: Path | None = Field(default=None, description="file holding the shared HMAC key")
    learner_id: int = Field(default=0, ge=0, lt=2**32, description="this island's id; learner 0 sends INIT")
    sync_interval: int | None = Field(default=None, ge=1, le=MAX_STEPS, description="H: inner steps per fragment "
                                      "round trip. Unset: the syncer's --sync-interval-steps, learned at the "
                                      f"handshake ({DEFAULT_SYNC_INTERVAL} under a syncer that does not pace by "
                                      "steps); set: it must equal the syncer's, or the learner is refused")
    merge_alpha: float = Field(default=0.0, ge=0.0, le=1.0, description="without overlap, install "
                               "θ ← α·θ_local + (1−α)·Θ_global (0: overwrite)")
    wire_dtype: Literal["f32", "bf16", "int8", "int4", "e3m0", "int4-log", "int2"] = Field(
        default="f32", description="dtype of pushed deltas (the block-quantized ones use push_block)")
    push_block: int = Field(default=128, ge=1, le=1 << 20, description="values per scale of quantized pushes")
    init_timeout_s: float = Field(default=600.0, ge=0, le=WEEK_S, description="wait for the initial cut at start")
    final_timeout_s: float = Field(default=FINAL_WAIT_S, ge=0, le=WEEK_S, description="wait for the final cut at "
                                   "the end: at least 2 × (the syncer's --rejoin-wait-s + 30 s + --final-timeout-s)")
    wan_probe_min_mbps: float = Field(default=0.0, ge=0, le=MAX_MBPS,
                                      description="exit 75 below this upload rate (0: no probe)")
    wan_probe_min_down_mbps: float = Field(default=0.0, ge=0, le=MAX_MBPS,
                                           description="exit 75 below this download rate")
    metrics_port: int | None = Field(default=None, ge=0, lt=65536, description="serve this island's Prometheus "
                                     "/metrics on this port (rank 0 only; 0 picks a free one; none: off)")
    metrics_host: str = Field(default="127.0.0.1", description="address the island's /metrics listens on "
                              "(0.0.0.0 for a scraper on another host)")
    metrics_token_file: Path | None = Field(default=None, description="file holding a bearer token the island's "
                                            "/metrics requires (none: no token)")
    wan_probe_mib: int = Field(default=16, ge=1, le=1024, description="MiB moved each way by the bandwidth probe")
    fragments: int | None = Field(default=None, ge=1, le=MAX_FRAGMENTS,
                                  description="expected fragment count (None: syncer's)")
    tuning: Literal["auto", "lora", "full"] = Field(
        default="auto", description="lora: sync only LoRA adapter tensors; full: every trainable tensor; "
                                    "auto: lora when the model carries adapters")
    blocking: str = Field(default="", description="Mix2: fragments waited for at their boundary: comma-separated "
                                                  "'embedding', 'head', 'layers:N' (the first N layers) or indices")
    blocking_timeout_s: float = Field(default=120.0, gt=0, le=DAY_S, description="longest wait for a blocking fragment")
    alone_if_refused: bool = Field(default=False, description="after a permanent refusal (wrong key, layout, "
                                   "contract, an id held by another process) train on alone instead of stopping")
    final_flush: bool = Field(default=False, description="when training ends, push every fragment's last steps "
                              "and wait for their merge before asking for the final cut")
    share_momentum: bool = Field(default=False, description="send the optimizer's first moment of the pushed "
                                 "fragment's tensors (Adam's exp_avg, SGD's momentum; 4-bit blocks) with each push "
                                 "and take the fleet's average into them with the broadcast, so the islands' next "
                                 "steps start from one direction; about 4.25 bits per value of the fragment more "
                                 "each way per round")
    answer_on_arrival: bool = Field(default=False, description="under a syncer that paces rounds by steps, "
                                    "answer a PULL at the first step after it arrives rather than at this island's "
                                    "next boundary (every H/P steps): the round's quorum forms sooner and its merge "
                                    "lands fewer steps after the push (lockstep keeps its boundaries)")
    lockstep: bool = Field(default=False, description="pin the schedule to learner steps for reproducible "
                           "experiments: round k is answered at boundary k and its merge installed at the next "
                           "step, waiting for both; every island then waits for the slowest")
    lockstep_timeout_s: float = Field(default=300.0, gt=0, le=DAY_S,
                                      description="lockstep: longest wait for a pull or a merge before training on")
    lockstep_round_trip: int = Field(default=1, ge=1, le=10_000, description="lockstep: the steps from a push to "
                                     "the install of its round's merge (capped at H/P); set to the mean round trip "
                                     "an unpaced run measures, it reproduces that run's staleness step for step")
    auto_attach: bool = Field(default=False, description="attach the trainer callback without naming it")
    fault: str = fault_field("YETO_DILOCO_")
    link: LinkSettings = LinkSettings()
    consensus: ConsensusSettings = ConsensusSettings()
    island: IslandSettings = IslandSettings()

    _fault = field_validator("fault")(check_fault)
    _key: bytes | None = PrivateAttr(default=None)  # the key as first read (`read_key`)

    @field_validator("blocking")
    @classmethod
    def _blocking(cls, v: str) -> str:
        from yeto_core.blocking import parse_blocking

        parse_blocking(v)
        return v

    @field_validator("syncer")
    @classmethod
    def _address(cls, v: str) -> str:
        if "," in v:
            raise ValueError("a sharded syncer (several comma-separated addresses) is not supported; "
                             "give the one HOST:PORT of the syncer")
        parse_address(v)
        return v

    @property
    def sweeps(self) -> bool:
        """Whether boundaries come once per RL iteration, every fragment at once (`sweep()`)."""
        return self.link.sweeps

    @property
    def address(self) -> tuple[str, int]:
        return parse_address(self.syncer)

    def read_key(self) -> bytes:
        """The key, read once: the one a plugin checks at start-up is the one the session's link proves,
        even if the key file changes or goes away in between."""
        if self._key is None:
            self._key = read_key(self.key, self.key_file, prefix="YETO_DILOCO_")
        return self._key

    def endpoint(self) -> Endpoint:
        """Who this learner is and where its syncer is, with the key (read once)."""
        return Endpoint(self.address, self.read_key(), self.learner_id)

    def fault_injector(self) -> faults.FaultInjector:
        """This process's fault injector, to build once and pass to whatever holds a point."""
        return faults.FaultInjector(self.fault) if self.fault else faults.NO_FAULTS


def default_quorum(learners: int) -> int:
    """K when none is set: M − ⌊M/4⌋. Up to three learners every round waits for all; from four on,
    a quarter may miss a round, so one slow or stalled island does not pace the rest (the grace
    still waits for members near the fleet's pace, DESIGN §4.4)."""
    return learners - learners // 4


class SyncerSettings(FlatSettings):
    """The syncer service (`YETO_SYNCER_*`; command-line flags win): its own settings, and the sections
    its parts take (`streams`, `merging`), each set by flat names (`--outer-lr`)."""

    model_config = SettingsConfigDict(env_prefix="YETO_SYNCER_", extra="forbid", frozen=True, allow_inf_nan=False,
                                      validate_by_name=True)  # `fault=` beside its variables' names

    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=7070, ge=0, lt=65536, description="port to listen on (0 picks a free one)")
    learners: int = Field(default=2, ge=1, le=MAX_LEARNERS, description="M: expected number of learners")
    quorum: int = Field(default=0, ge=0, le=MAX_LEARNERS, description="K: answers that close a round (0 = "
                        "M − ⌊M/4⌋: all of up to 3 learners, 3 of 4, 6 of 8)")
    fragments: int = Field(default=4, ge=1, le=MAX_FRAGMENTS, description="P: fragments the model is split into")
    pattern: Literal["binpack", "strided"] = Field(default="binpack", description="fragment layout")
    total_rounds: int = Field(default=0, ge=0, le=MAX_ROUNDS, description="fragment rounds before finalization "
                              "(0: until the learners finish)")
    checkpoint: Path | None = Field(default=None, description="checkpoint file, safetensors + JSON metadata "
                                    "(none: no checkpoints)")
    checkpoint_every: int = Field(default=1, ge=1, le=MAX_STEPS,
                                  description="checkpoint after every N committed rounds")
    background_checkpoint: bool = Field(default=False, description="write each checkpoint from a snapshot on its "
                                        "own thread while rounds go on (one writer at a time)")
    checkpoint_retry_s: float = Field(default=120.0, gt=0, le=DAY_S, description="retry a failed checkpoint write "
                                      "this long, holding every round, then stop with exit code 4")
    resume: bool = Field(default=False, description="resume from the checkpoint file when it exists")
    tape: Path | None = Field(default=None, description="JSONL event tape of every commit (none: no tape)")
    metrics_port: int | None = Field(default=None, ge=0, lt=65536, description="serve Prometheus /metrics and the "
                                     "live status page (/) on this port of --metrics-host (0 picks a free one; "
                                     "none: off)")
    metrics_host: str = Field(default="127.0.0.1", description="address the web port listens on; 127.0.0.1 even "
                              "when --host is 0.0.0.0 — set 0.0.0.0 to publish it")
    metrics_token_file: Path | None = Field(default=None, description="file holding a bearer token the web port "
                                            "requires (none: no token)")
    metrics_max_connections: int = Field(default=32, ge=1, le=1024, description="connections the web port holds "
                                         "at once; more wait in the kernel's queue")
    metrics_request_timeout_s: float = Field(default=10.0, gt=0, le=300, description="a web connection is closed "
                                             "when a request takes longer than this to arrive")
    key: SecretStr | None = Field(default=None, description="shared HMAC key (or use key_file)")
    key_file: Path | None = Field(default=None, description="file holding the shared HMAC key (or YETO_SYNCER_KEY)")
    device: str = Field(default="auto", description="merge device: auto (cuda when present) | cpu | cuda | cuda:N")
    decode_threads: int = Field(default=2, ge=1, le=64, description="threads decoding pushes beside the coordinator")
    round_timeout_s: float = Field(default=120.0, gt=0, le=DAY_S, description="a round below quorum retries after this")
    pipeline: int = Field(default=2, ge=1, le=MAX_FRAGMENTS,
                          description="rounds in flight, on distinct fragments (1 = serial)")
    grace_s: float = Field(default=5.0, ge=0, le=HOUR_S,
                           description="cap of the adaptive straggler grace window (0 disables)")
    grace_gamma: float = Field(default=1.0, ge=0, le=100,
                               description="γ of the grace window: share of the compute slack "
                               "spent waiting")
    grace_tau: float = Field(default=2.0, ge=0, le=MAX_STEPS,
                             description="τ of the grace window: learner steps a round may take")
    sync_interval_steps: int = Field(default=DEFAULT_SYNC_INTERVAL, ge=0, le=MAX_STEPS,
                                     description="pace rounds so each fragment syncs every H "
                                     "learner steps (0: off)")
    min_round_interval_s: float = Field(default=0.0, ge=0, le=DAY_S,
                                        description="floor between round launches (0: none)")
    max_base_lag: int = Field(default=1, ge=0, le=MAX_STEPS,
                              description="carry a late push to its fragment's next round when its "
                              "base lags by at most this many versions")
    carry_answers_round: bool = Field(default=False, description="count carried pushes toward the quorum of the "
                                      "round they join")
    init_timeout_s: float = Field(default=600.0, gt=0, le=WEEK_S, description="exit when no INIT arrives by then")
    final_timeout_s: float = Field(default=FINAL_HOLD_S, gt=0, le=WEEK_S, description="wait for learners to take "
                                   "the final cut; the learners wait for it longer (YETO_DILOCO_FINAL_TIMEOUT_S)")
    rejoin_wait_s: float = Field(default=REJOIN_WAIT_S, ge=0, le=DAY_S, description="once every connected learner has "
                                 "finished, wait this long after one left while training (a crash, a cut link) "
                                 "for it to come back before finalizing without it (0: do not wait)")
    handshake_timeout_s: float = Field(default=10.0, gt=0, le=HOUR_S, description="deadline of a whole handshake, "
                                       "from accept until the key is proven")
    max_handshakes: int = Field(default=0, ge=0, le=4096, description="unauthenticated connections at once; at the "
                                "cap the oldest (open over 2 s) or the newcomer is closed (0: 64, or a quarter of "
                                "the descriptor limit when lower)")
    bcast_delta_full_every: int = Field(default=0, ge=0, le=MAX_STEPS,
                                        description="for learners taking delta broadcasts: also send the full "
                                        "fragment every N versions (0: only on joins and for a fragment's last "
                                        "version; a delta's error is carried by the next one, so nothing drifts)")
    fault: str = fault_field("YETO_SYNCER_")
    streams: StreamSettings = StreamSettings()
    merging: MergeSettings = MergeSettings()
    _key: bytes | None = PrivateAttr(default=None)  # the key as first read (`read_key`)

    # Former names, still read from the environment and from keyword arguments (flags), with
    # a warning: settings once in other units are now in seconds like every other duration.
    renamed: ClassVar[dict[str, Renamed]] = {
        "grace_ms": Renamed("grace_s", unit="ms"),
        "min_round_interval_ms": Renamed("min_round_interval_s", unit="ms"),
        "wan_stall_timeout": Renamed("wan_stall_timeout_s", unit="s"),
    }

    _fault = field_validator("fault")(check_fault)

    @field_validator("quorum")
    @classmethod
    def _quorum_fits(cls, v: int, info: ValidationInfo) -> int:
        learners = info.data.get("learners")
        if learners is not None and v > learners:
            raise ValueError(f"quorum {v} exceeds learners {learners}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v.strip()):
            raise ValueError("expected auto, cpu, cuda or cuda:N")
        return v.strip()

    @model_validator(mode="after")
    def _outer_lr_of_the_fleet(self) -> SyncerSettings:
        # The outer lr left unset (0) depends on M; resolved once here, so every part that takes the
        # merge section (the outer optimizer, the checkpoint's record of it) sees the lr it steps by.
        merging = self.merging.for_learners(self.learners)
        if merging is not self.merging:
            self.__dict__["merging"] = merging  # frozen: the validated value, set before anyone reads it
        return self

    @property
    def effective_quorum(self) -> int:
        return self.quorum or default_quorum(self.learners)

    def read_key(self, *, key_file_flag: bool = False) -> bytes:
        """The key, read once, as the learners' is. `key_file_flag`: the file came from `--key-file`,
        and errors say so."""
        if self._key is None:
            self._key = read_key(self.key, self.key_file, prefix="YETO_SYNCER_",
                                 key_file_name="--key-file" if key_file_flag else None)
        return self._key

    @property
    def schedule(self) -> Schedule:
        """What this syncer's CHALLENGE announces: P, the pattern and H."""
        return Schedule(self.fragments, self.pattern, self.sync_interval_steps)

    def fault_injector(self) -> faults.FaultInjector:
        """This process's fault injector, to build once and pass to whatever holds a point."""
        return faults.FaultInjector(self.fault) if self.fault else faults.NO_FAULTS


class IsoWorkerSettings(BaseSettings):
    """The isotropic-merge worker pool of `--iso-worker-devices` (`YETO_ISO_WORKER_*`)."""

    model_config = SettingsConfigDict(env_prefix="YETO_ISO_WORKER_", extra="forbid", frozen=True,
                                      allow_inf_nan=False)

    startup_timeout_s: float = Field(default=120.0, gt=0, le=HOUR_S, description="every worker must be ready "
                                     "(torch imported, its device set up) this long after the first starts")
    request_timeout_s: float = Field(default=600.0, gt=0, le=DAY_S, description="a worker must answer one matrix "
                                     "within this, or it is killed and the pool poisoned")
    drain_timeout_s: float = Field(default=900.0, gt=0, le=DAY_S, description="before a checkpoint or the final "
                                   "cut, the queued and running matrices must be done within this")
    threads: int = Field(default=1, ge=1, le=256, description="torch threads of each worker (the same in every "
                         "worker, so any worker gives the same bits)")
    queue: int = Field(default=0, ge=0, le=4096, description="matrices queued or running at once "
                       "(0: two per worker)")


S = TypeVar("S", bound=BaseSettings)


class MilesDriverSettings(BaseSettings):
    """What `python -m yeto_plugins.miles.train` reads of Miles' own environment (`MILES_*`; Miles has
    more of them, which are not ours to check, so unknown names are ignored here)."""

    model_config = SettingsConfigDict(env_prefix="MILES_", extra="ignore", frozen=True)

    train: Path = Field(default=Path("train.py"), description="Miles' driver script (a Miles checkout's train.py)")
    experimental_ft_trainer: bool = Field(default=False, description="Miles' fault-tolerant trainer group, which the "
                                          "yeto driver does not patch")


def load_settings(cls: type[S], *, flags: bool = False, **explicit: Any) -> S:
    """Build settings (explicit values win over the environment); one clear error on bad input.

    An error names where the bad value came from: the environment variable, or the keyword
    argument (the command-line flag when `flags` is true). None means "not given".
    """
    prefix = str(cls.model_config.get("env_prefix", ""))
    given = {k: v for k, v in explicit.items() if v is not None}
    unknown = unknown_variables(cls)
    if unknown:
        raise SettingsError("; ".join(unknown))
    quoted = take_renamed(cls, given, flags=flags)
    try:
        return cls(**given)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = flat_of(cls, err["loc"])
            value = err.get("input")
            if field in quoted:
                name, value = quoted[field]
            elif field in given:
                name = setting_name(field, flags=flags)
            elif field not in flat_fields(cls):  # an alias: already the variable's whole name
                name = field
            else:
                name = f"{prefix}{field.upper()}"
            shown = "" if isinstance(value, dict) or value is None else f"={value!r}"
            message = str(err["msg"]).removeprefix("Value error, ")
            if err["type"] == "missing":
                lines.append(f"{name} is required")
            else:
                lines.append(f"{name}{shown}: {message}")
        raise SettingsError("; ".join(lines)) from None
