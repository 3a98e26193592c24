"""The syncer's checkpoint: one safetensors file, written atomically, read without pickle (DESIGN §6.2).

Tensors are stored per model tensor in its model shape (``param/<name>``, ``momentum/<name>``),
so the file doubles as an export source; everything else (layout specs, fingerprint, merge
backend, versions, token ledger) is one JSON document under the header metadata key ``yeto``.

``save_checkpoint`` streams the safetensors format itself (8-byte little-endian header length,
JSON header padded to 8 bytes, raw little-endian data) into ``<path>.tmp``, fsyncs it, renames it
over ``path`` and fsyncs the directory: peak memory stays at one tensor and a crash leaves the
previous checkpoint whole. ``load_checkpoint`` validates the header with the safetensors library,
then reads each tensor straight into the state's buffers in chunks (no second copy), and validates
everything before it returns, so a bad file never reaches the coordinator's state.

Integrity: the metadata holds a checksum of every tensor's bytes (``checksums``), XXH3-64 (named
in ``checksum``), computed as the data streams out (the header is written with placeholders of
the same width, then rewritten before the file is synced). Loading verifies each one and screens
params, momentum and accumulators for NaN/Inf, naming the first bad tensor. XXH3 runs at ~30 GB/s
where zlib's CRC-32 ran at 4 here, which took a core from the write at gigabytes; checkpoints
written with CRC-32 checksums (no ``checksum`` key) are still verified with it. A checkpoint
written before checksums were kept has none; it is accepted with a warning that its bytes are not
verified.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from safetensors import safe_open
from tqdm import tqdm

from syncer.durability.stopping import StopRequest
from yeto_core.downlink import DOWNLINK_WIRE_IDS
from yeto_core.faults import NO_FAULTS, FaultInjector
from yeto_core.layout import Layout, TensorSpec, build_layout

log = logging.getLogger("yeto.syncer.checkpoint")

FORMAT_VERSION = 1
_META_KEY = "yeto"
CHECKSUM = "xxh3-64"  # what this yeto writes; "crc32" (the key absent) is still read
_DIGEST_HEX = {"xxh3-64": 16, "crc32": 8}  # a checksum's width in hex digits, placeholders included
_CHUNK = 16 << 20  # bytes per write; bounds the progress bar's granularity, not memory


@dataclass
class SyncerState:
    """Everything the coordinator needs to resume: global params, outer momentum, bookkeeping."""

    specs: list[TensorSpec]
    num_fragments: int
    pattern: str
    fingerprint: bytes
    backend: str
    params: list[torch.Tensor]  # one flat float32 buffer per fragment
    momentum: list[torch.Tensor]
    versions: list[int]
    next_round: int
    ledger: dict[str, int]  # committed tokens by "learner:generation" (see `ledger_key`)
    finalized: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # Delayed Nesterov's per-fragment gradient accumulator and window position (None: not used).
    outer_accum: list[torch.Tensor] | None = None
    outer_count: list[int] = field(default_factory=list)
    # Per fragment: the round of its last commit and the learners whose pushes that commit merged
    # (empty: no commit yet, or a checkpoint from before this was kept). A learner that rebases
    # (overlap) learns from it, on reconnect, whether its last push is already in the fragment.
    merged_by: list[tuple[int, list[int]]] = field(default_factory=list)
    # The downlink's chains (DESIGN §7.4), by the delta codec's wire id: every fragment's anchor
    # and the version it stands for (its fragment's version, or one behind when the checkpoint
    # was taken between a commit and that commit's encode). A resumed syncer brings those forward
    # with the same encode and serves its learners the bits an uninterrupted run would.
    downlink: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    downlink_versions: dict[int, list[int]] = field(default_factory=dict)


def ledger_key(learner_id: int, generation: int) -> str:
    """The token ledger counts each learner's committed tokens per connection generation, so a
    replayed or carried push shows under the connection that delivered it, once."""
    return f"{learner_id}:{generation}"


def parse_ledger_key(key: str) -> tuple[int, int]:
    """(learner, generation) of a ledger key; a bare learner id (older checkpoints) is generation 0."""
    learner, _, generation = key.partition(":")
    return int(learner), int(generation or 0)


def tokens_by_learner(ledger: dict[str, int]) -> dict[int, int]:
    totals: dict[int, int] = {}
    for key, tokens in ledger.items():
        learner = parse_ledger_key(key)[0]
        totals[learner] = totals.get(learner, 0) + tokens
    return totals


def last_generations(ledger: dict[str, int]) -> dict[int, int]:
    """The highest generation each learner has in the ledger: a resumed syncer numbers on from it."""
    last: dict[int, int] = {}
    for key in ledger:
        learner, generation = parse_ledger_key(key)
        last[learner] = max(last.get(learner, 0), generation)
    return last


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and what is wrong."""


def downlink_kind(wire_id: int) -> str:
    """The file's name for the anchors of the downlink codec with `wire_id` (`downlink4/<tensor>`)."""
    return f"downlink{wire_id}"


def tensor_kinds(with_accum: bool, downlink_ids: Iterable[int] = ()) -> tuple[str, ...]:
    """The kinds of tensor a checkpoint holds, in file order."""
    return ("param", "momentum", *(("accum",) if with_accum else ()), *map(downlink_kind, sorted(downlink_ids)))


def _tensor_names(
    layout: Layout, kinds: Sequence[str] = ("param", "momentum")
) -> Iterator[tuple[str, int, int, int, tuple[int, ...]]]:
    """(file name, fragment, offset, numel, shape) in file order: all params, then all momentum
    (then the delayed-Nesterov accumulators, when the run keeps them, then each downlink chain's
    anchors)."""
    for kind in kinds:
        for frag in layout.fragments:
            for slot in frag.slots:
                yield f"{kind}/{slot.name}", frag.index, slot.offset, slot.numel, slot.shape


def _check_state(state: SyncerState, layout: Layout) -> None:
    if layout.fingerprint != state.fingerprint:
        raise ValueError("SyncerState.fingerprint does not match the layout built from its specs")
    groups = [("params", state.params), ("momentum", state.momentum)]
    if state.outer_accum is not None:
        groups.append(("outer_accum", state.outer_accum))
        if len(state.outer_count) != state.num_fragments:
            raise ValueError(f"SyncerState.outer_count has {len(state.outer_count)} entries")
    for kind, bufs in groups:
        if len(bufs) != state.num_fragments:
            raise ValueError(
                f"SyncerState.{kind} has {len(bufs)} buffers for {state.num_fragments} fragments"
            )
        for frag, buf in zip(layout.fragments, bufs, strict=True):
            if buf.dtype != torch.float32 or buf.dim() != 1 or buf.numel() != frag.numel:
                raise ValueError(
                    f"SyncerState.{kind}[{frag.index}] must be flat float32 with {frag.numel} elements, "
                    f"got {buf.dtype} {tuple(buf.shape)}"
                )
    if len(state.versions) != state.num_fragments:
        raise ValueError(f"SyncerState.versions has {len(state.versions)} entries")
    for wire_id, anchors in state.downlink.items():
        versions = state.downlink_versions.get(wire_id, [])
        if len(anchors) != state.num_fragments or len(versions) != state.num_fragments:
            raise ValueError(f"SyncerState.downlink[{wire_id}] has {len(anchors)} anchors and {len(versions)} "
                             f"versions for {state.num_fragments} fragments")
        for frag, anchor in zip(layout.fragments, anchors, strict=True):
            if anchor.dtype != torch.float32 or anchor.dim() != 1 or anchor.numel() != frag.numel:
                raise ValueError(f"SyncerState.downlink[{wire_id}][{frag.index}] must be flat float32 with "
                                 f"{frag.numel} elements")


def _metadata(state: SyncerState, checksums: dict[str, str]) -> str:
    doc = {
        "checksum": CHECKSUM,
        "checksums": checksums,
        "format": FORMAT_VERSION,
        "specs": [[s.name, list(s.shape), s.dtype, s.embedding] for s in state.specs],
        "num_fragments": state.num_fragments,
        "pattern": state.pattern,
        "fingerprint": state.fingerprint.hex(),
        "backend": state.backend,
        "versions": [int(v) for v in state.versions],
        "next_round": int(state.next_round),
        "ledger": {str(k): int(v) for k, v in state.ledger.items()},
        "finalized": bool(state.finalized),
        "extra": state.extra,
        "outer_accum": state.outer_accum is not None,
        "outer_count": [int(c) for c in state.outer_count],
        "merged_by": [[int(r), sorted(int(i) for i in ids)] for r, ids in state.merged_by],
        "downlink": {str(k): [int(v) for v in state.downlink_versions[k]] for k in sorted(state.downlink)},
    }
    return json.dumps(doc, sort_keys=True)


class _Crc32:
    """zlib's CRC-32 with hashlib's shape, for checkpoints written before XXH3."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, part: memoryview) -> None:
        self._value = zlib.crc32(part, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _digest(kind: str) -> Any:
    return xxhash.xxh3_64() if kind == "xxh3-64" else _Crc32()


class _PieceChecks:
    """A tensor's checksum (and, reading, whether it is finite), computed piece by piece on a helper
    thread while the caller moves the next piece to or from the disk. Pieces are checked in the
    order given; `kind` names the checksum (`CHECKSUM`, or "crc32" reading an older file)."""

    def __init__(self, pool: ThreadPoolExecutor, *, finite: bool, kind: str = CHECKSUM) -> None:
        self._pool = pool
        self._finite = finite
        self._kind = kind
        self._job: Future[tuple[Any, bool]] | None = None

    def add(self, part: memoryview) -> None:
        before = self._job

        def check() -> tuple[Any, bool]:
            digest, finite = before.result() if before is not None else (_digest(self._kind), True)
            if self._finite and finite:  # NaN and Inf propagate into the sum; numpy's is one thread,
                # where torch's would take the core the next piece is being read on
                finite = math.isfinite(float(np.frombuffer(part, dtype=np.float32).sum(dtype=np.float32)))
            digest.update(part)
            return digest, finite

        self._job = self._pool.submit(check)

    def result(self) -> tuple[str, bool]:
        """(hex checksum, finite) of every piece added; starts over for the next tensor."""
        job, self._job = self._job, None
        digest, finite = job.result() if job is not None else (_digest(self._kind), True)
        return digest.hexdigest(), finite


def save_checkpoint(path: Path, state: SyncerState, *, progress: bool = False,
                    read: Callable[[str, int], contextlib.AbstractContextManager[torch.Tensor]] | None = None,
                    faults: FaultInjector = NO_FAULTS, stop: StopRequest | None = None) -> int:
    """Write ``state`` to ``path`` atomically; returns the number of bytes written.

    ``read(kind, fragment)``, when given, is entered around each piece the writer reads and yields
    the tensor to read it from ("param", "momentum" or "accum"; see `snapshots.SnapshotReads`).
    ``faults`` holds the ``mid-checkpoint`` point, between the synced temporary file and the rename.
    ``stop``, once set, abandons the write before its next piece (`stopping.Stopped`): the
    temporary file is removed and ``path`` stays the previous checkpoint."""
    if sys.byteorder != "little":
        raise RuntimeError("checkpoints are written on little-endian hosts only")
    path = Path(path)
    layout = build_layout(state.specs, state.num_fragments, state.pattern)
    _check_state(state, layout)

    kinds = tensor_kinds(state.outer_accum is not None, state.downlink)
    names = [name for name, *_ in _tensor_names(layout, kinds)]
    checksums = dict.fromkeys(names, "0" * _DIGEST_HEX[CHECKSUM])

    def header_bytes() -> bytes:
        header: dict[str, Any] = {"__metadata__": {_META_KEY: _metadata(state, checksums)}}
        begin = 0
        for name, _, _, numel, shape in _tensor_names(layout, kinds):
            header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [begin, begin + 4 * numel]}
            begin += 4 * numel
        head = json.dumps(header, separators=(",", ":")).encode("utf-8")
        return head + b" " * (-len(head) % 8)

    head = header_bytes()
    total = 8 + len(head) + 4 * sum(numel for _, _, _, numel, _ in _tensor_names(layout, kinds))

    tmp = path.with_name(path.name + ".tmp")
    bufs = {"param": state.params, "momentum": state.momentum, "accum": state.outer_accum or [],
            **{downlink_kind(k): v for k, v in state.downlink.items()}}
    try:
        with (
            open(tmp, "wb") as f,
            tqdm(
                total=total, unit="B", unit_scale=True, desc=f"checkpoint {path.name}", disable=not progress
            ) as bar,
            ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc") as pool,
        ):
            checks = _PieceChecks(pool, finite=False)
            f.write(struct.pack("<Q", len(head)) + head)
            bar.update(8 + len(head))
            for name, frag, offset, numel, _ in _tensor_names(layout, kinds):
                kind = name.split("/", 1)[0]
                with read(kind, frag) if read is not None else contextlib.nullcontext(bufs[kind][frag]) as source:
                    piece = source.detach()[offset : offset + numel]
                    raw = piece.cpu().contiguous().view(torch.uint8).numpy().data
                    for start in range(0, len(raw), _CHUNK):
                        if stop is not None:
                            stop.check(f"writing checkpoint {path}")
                        part = raw[start : start + _CHUNK]
                        checks.add(part)
                        f.write(part)
                        bar.update(len(part))
                    checksums[name] = checks.result()[0]  # before the lease on `source` ends
            final_head = header_bytes()  # the same length: every checksum has its fixed width
            if len(final_head) != len(head):
                raise RuntimeError("checkpoint header changed length when its checksums were filled in")
            f.seek(8)
            f.write(final_head)
            f.flush()
            os.fsync(f.fileno())
        faults.point("mid-checkpoint")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return total


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory: the rename is all we get
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parse(path: Path, doc: Any) -> tuple[list[TensorSpec], Layout, dict[str, Any]]:
    """Check the metadata document's shape and rebuild its layout."""
    if not isinstance(doc, dict):
        raise CheckpointError(f"checkpoint {path}: 'yeto' metadata is not a JSON object")
    if doc.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {doc.get('format')!r}; this yeto reads {FORMAT_VERSION}"
        )
    try:
        specs = [TensorSpec(n, tuple(shape), dtype, bool(emb)) for n, shape, dtype, emb in doc["specs"]]
        layout = build_layout(specs, doc["num_fragments"], doc["pattern"])
        stored = bytes.fromhex(doc["fingerprint"])
        checks = [
            isinstance(doc["backend"], str),
            isinstance(doc["next_round"], int),
            isinstance(doc["finalized"], bool),
            isinstance(doc["extra"], dict),
            all(isinstance(v, int) for v in doc["versions"]),
            all(isinstance(k, str) and isinstance(v, int) for k, v in doc["ledger"].items()),
            all(min(parse_ledger_key(k)) >= 0 for k in doc["ledger"]),
            all(isinstance(r, int) and all(isinstance(i, int) for i in ids) for r, ids in doc.get("merged_by", [])),
            len(doc.get("merged_by", [])) in (0, doc["num_fragments"]),
            doc.get("checksum", "crc32") in _DIGEST_HEX,
            isinstance(doc.get("downlink", {}), dict),
            all(k.isdigit() and int(k) in DOWNLINK_WIRE_IDS and len(v) == doc["num_fragments"]
                and all(isinstance(x, int) and x >= 0 for x in v) for k, v in doc.get("downlink", {}).items()),
            isinstance(doc.get("checksums", {}), dict),
            all(isinstance(v, str) and len(v) == _DIGEST_HEX.get(doc.get("checksum", "crc32"), -1)
                for v in doc.get("checksums", {}).values()),
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path} has malformed 'yeto' metadata: {exc!r}") from exc
    if not all(checks):
        raise CheckpointError(f"checkpoint {path} has malformed 'yeto' metadata (field types)")
    if stored != layout.fingerprint:
        raise CheckpointError(
            f"checkpoint {path}: stored layout fingerprint {stored.hex()[:16]} does not match the layout "
            f"rebuilt from its specs ({layout.fingerprint.hex()[:16]})"
        )
    if len(doc["versions"]) != layout.num_fragments:
        raise CheckpointError(
            f"checkpoint {path} has {len(doc['versions'])} versions for {layout.num_fragments} fragments"
        )
    return specs, layout, doc


def _data_offsets(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """Where the data section starts, and each tensor's [begin, end) within it (the header was
    already validated by safetensors against the file's length)."""
    with open(path, "rb") as f:
        (head_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(head_len))
    return 8 + head_len, {k: (v["data_offsets"][0], v["data_offsets"][1]) for k, v in header.items()
                          if k != "__metadata__"}


def _read_tensors(path: Path, layout: Layout, kinds: Sequence[str], checksums: dict[str, str] | None,
                  bufs: dict[str, list[torch.Tensor]], kind: str) -> None:
    """Read every tensor straight into its fragment buffer, a piece at a time (no second copy),
    each piece's checksum (`kind`) and finiteness checked on a helper thread while the next one is read."""
    data_start, offsets = _data_offsets(path)
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc") as pool:
        checks = _PieceChecks(pool, finite=True, kind=kind)
        for name, frag, offset, numel, _ in _tensor_names(layout, kinds):
            begin, end = offsets[name]
            if end - begin != 4 * numel:
                raise CheckpointError(f"checkpoint {path}: tensor {name} holds {end - begin} bytes, "
                                      f"expected {4 * numel}")
            dest = bufs[name.split("/", 1)[0]][frag][offset : offset + numel]
            raw = dest.view(torch.uint8).numpy().data
            f.seek(data_start + begin)
            for start in range(0, len(raw), _CHUNK):
                part = raw[start : start + _CHUNK]
                got = 0
                while got < len(part):
                    n = f.readinto(part[got:])
                    if not n:
                        raise CheckpointError(f"checkpoint {path} is truncated (in tensor {name})")
                    got += n
                checks.add(part)
            digest, finite = checks.result()
            if checksums is not None and digest != checksums[name]:
                raise CheckpointError(f"checkpoint {path}: tensor {name} does not match its checksum (the file "
                                      "was damaged after it was written)")
            if not finite and not bool(torch.isfinite(dest).all()):  # a finite tensor whose sum overflowed
                raise CheckpointError(f"checkpoint {path}: tensor {name} holds NaN or Inf")


def load_checkpoint(
    path: Path, *, expect_fingerprint: bytes | None = None, expect_backend: str | None = None
) -> SyncerState:
    """Read and fully validate a checkpoint; raises CheckpointError before returning anything."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if _META_KEY not in meta:
                raise CheckpointError(
                    f"checkpoint {path} has no 'yeto' metadata; not a yeto syncer checkpoint"
                )
            try:
                doc = json.loads(meta[_META_KEY])
            except ValueError as exc:
                raise CheckpointError(f"checkpoint {path} has corrupt 'yeto' metadata: {exc}") from exc
            specs, layout, doc = _parse(path, doc)
            if expect_fingerprint is not None and expect_fingerprint != layout.fingerprint:
                raise CheckpointError(
                    f"checkpoint {path} was written for layout {layout.fingerprint.hex()[:16]}, but this run "
                    f"uses layout {expect_fingerprint.hex()[:16]} (different model, fragments or pattern)"
                )
            if expect_backend is not None and expect_backend != doc["backend"]:
                raise CheckpointError(
                    f"checkpoint {path} was merged with backend {doc['backend']!r}, "
                    f"but this run uses {expect_backend!r}"
                )
            with_accum = bool(doc.get("outer_accum", False))
            downlink_versions = {int(k): list(v) for k, v in doc.get("downlink", {}).items()}
            kinds = tensor_kinds(with_accum, downlink_versions)
            expected = {name: shape for name, _, _, _, shape in _tensor_names(layout, kinds)}
            present = set(f.keys())
            if missing := sorted(set(expected) - present):
                raise CheckpointError(f"checkpoint {path} is missing tensors: {', '.join(missing[:5])}")
            if unexpected := sorted(present - set(expected)):
                raise CheckpointError(
                    f"checkpoint {path} has unexpected tensors: {', '.join(unexpected[:5])}"
                )
            for name, shape in expected.items():
                sl = f.get_slice(name)
                if sl.get_dtype() != "F32" or tuple(sl.get_shape()) != shape:
                    raise CheckpointError(
                        f"checkpoint {path}: tensor {name} is {sl.get_dtype()} {sl.get_shape()}, "
                        f"expected F32 {list(shape)}"
                    )
            checksums: dict[str, str] | None = doc.get("checksums")
            if checksums is None:
                log.warning("checkpoint %s carries no checksums (written by a yeto that kept none): its tensor "
                            "bytes are not verified", path)
            elif set(checksums) != set(expected):
                raise CheckpointError(f"checkpoint {path}: its checksums do not name exactly its tensors")
        bufs = {
            kind: [torch.empty(frag.numel, dtype=torch.float32) for frag in layout.fragments]
            for kind in kinds
        }
        _read_tensors(path, layout, kinds, checksums, bufs, doc.get("checksum", "crc32"))
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors reports truncation and bad headers as assorted errors
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {exc}") from exc
    return SyncerState(
        specs=specs,
        num_fragments=layout.num_fragments,
        pattern=layout.pattern,
        fingerprint=layout.fingerprint,
        backend=doc["backend"],
        params=bufs["param"],
        momentum=bufs["momentum"],
        versions=list(doc["versions"]),
        next_round=doc["next_round"],
        ledger=dict(doc["ledger"]),
        finalized=doc["finalized"],
        extra=doc["extra"],
        outer_accum=bufs["accum"] if with_accum else None,
        downlink={k: bufs[downlink_kind(k)] for k in downlink_versions},
        downlink_versions=downlink_versions,
        outer_count=[int(c) for c in doc.get("outer_count", [])],
        merged_by=[(r, list(ids)) for r, ids in doc.get("merged_by", [])],
    )
