from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from syncer.durability.checkpoint import (
    CheckpointError,
    SyncerState,
    _data_offsets,
    last_generations,
    ledger_key,
    load_checkpoint,
    parse_ledger_key,
    save_checkpoint,
    tokens_by_learner,
)
from yeto_core.layout import TensorSpec, build_layout

pytestmark = pytest.mark.unit

BACKEND = "rda-nesterov-v1"


def tiny_specs() -> list[TensorSpec]:
    specs = [TensorSpec("model.embed_tokens.weight", (32, 8), "bfloat16", embedding=True)]
    for i in range(3):
        p = f"model.layers.{i}"
        specs += [
            TensorSpec(f"{p}.attn.qkv.weight", (24, 8), "bfloat16"),
            TensorSpec(f"{p}.mlp.up.weight", (16, 8), "bfloat16"),
            TensorSpec(f"{p}.mlp.down.weight", (8, 16), "bfloat16"),
            TensorSpec(f"{p}.norm.weight", (8,), "float32"),
        ]
    specs.append(TensorSpec("model.norm.weight", (8,), "float32"))
    return specs


def make_state(pattern: str = "binpack", seed: int = 0) -> SyncerState:
    specs = tiny_specs()
    layout = build_layout(specs, 3, pattern)
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(f.numel, generator=gen) for f in layout.fragments]
    momentum = [torch.randn(f.numel, generator=gen) * 1e-3 for f in layout.fragments]
    params[1][0] = 1e-45  # a subnormal: bits, not values, must survive
    params[1][1] = -0.0
    return SyncerState(
        specs=specs,
        num_fragments=3,
        pattern=pattern,
        fingerprint=layout.fingerprint,
        backend=BACKEND,
        params=params,
        momentum=momentum,
        versions=[4, 3, 3],
        next_round=10,
        ledger={"0": 123_456, "7": 9_876_543_210},
        finalized=True,
        extra={"settings": {"quorum": 2, "outer_lr": 0.7}, "note": "ünïcode"},
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("pattern", ["binpack", "strided"])
def test_round_trip_is_bit_exact(tmp_path: Path, pattern: str) -> None:
    state = make_state(pattern)
    path = tmp_path / "ckpt.safetensors"
    written = save_checkpoint(path, state, progress=True)
    assert written == path.stat().st_size

    got = load_checkpoint(path, expect_fingerprint=state.fingerprint, expect_backend=BACKEND)
    assert got.specs == state.specs
    assert (got.num_fragments, got.pattern, got.fingerprint, got.backend) == (
        3,
        pattern,
        state.fingerprint,
        BACKEND,
    )
    for kind in ("params", "momentum"):
        for a, b in zip(getattr(state, kind), getattr(got, kind), strict=True):
            assert b.dtype == torch.float32 and b.is_contiguous() and b.dim() == 1
            assert torch.equal(bits(a), bits(b))
    assert got.versions == [4, 3, 3]
    assert got.next_round == 10
    assert got.ledger == state.ledger
    assert got.finalized is True
    assert got.extra == state.extra


def test_loaded_buffers_are_owned(tmp_path: Path) -> None:
    state = make_state()
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)
    got = load_checkpoint(path)
    for buf in got.params + got.momentum:
        assert buf.untyped_storage().nbytes() == 4 * buf.numel()  # its own storage, no views
    got.params[0].fill_(7.0)  # writable, and writing does not reach the file
    os.remove(path)
    assert torch.equal(got.params[0], torch.full_like(state.params[0], 7.0))
    save_checkpoint(path, state)
    assert torch.equal(load_checkpoint(path).params[0], state.params[0])


def test_file_is_plain_safetensors_with_model_shapes(tmp_path: Path) -> None:
    state = make_state()
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)
    tensors = load_file(str(path))
    assert len(tensors) == 2 * len(state.specs)
    for spec in state.specs:
        assert tuple(tensors[f"param/{spec.name}"].shape) == spec.shape
        assert tuple(tensors[f"momentum/{spec.name}"].shape) == spec.shape
        assert tensors[f"param/{spec.name}"].dtype == torch.float32
    layout = build_layout(state.specs, 3, "binpack")
    frag = layout.fragments[layout.fragment_of("model.layers.1.mlp.up.weight")]
    slot = next(s for s in frag.slots if s.name == "model.layers.1.mlp.up.weight")
    expected = state.params[frag.index][slot.offset : slot.offset + slot.numel].view(slot.shape)
    assert torch.equal(tensors["param/model.layers.1.mlp.up.weight"], expected)

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["yeto"])
    assert meta["format"] == 1
    assert meta["fingerprint"] == state.fingerprint.hex()
    assert meta["backend"] == BACKEND


def test_file_contains_no_pickle(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert raw[8:9] == b"{"  # a JSON header, not a pickle opcode (0x80) or a zip archive
    assert not raw.startswith(b"PK")
    json.loads(raw[8 : 8 + n])
    assert (8 + n) % 8 == 0
    assert b"\x80\x02" not in raw[: 8 + n]


def test_failed_save_keeps_old_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.safetensors"
    old = make_state(seed=1)
    save_checkpoint(path, old)
    before = path.read_bytes()

    def boom(src: object, dst: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", boom)
    new = make_state(seed=2)
    new.versions = [9, 9, 9]
    with pytest.raises(OSError, match="disk on fire"):
        save_checkpoint(path, new)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]
    assert load_checkpoint(path).versions == old.versions


def test_stale_tmp_file_is_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    (tmp_path / "ckpt.safetensors.tmp").write_bytes(b"garbage from a crashed writer")
    save_checkpoint(path, make_state())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors"]
    load_checkpoint(path)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    cut = tmp_path / "cut.safetensors"
    for size in (0, 4, 8, 20, 8 + n // 2, 8 + n, 8 + n + 100, len(raw) - 1):
        cut.write_bytes(raw[:size])
        with pytest.raises(CheckpointError, match=r"cut\.safetensors.*(truncated or corrupt)"):
            load_checkpoint(cut)


def test_corrupt_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    raw = bytearray(path.read_bytes())
    raw[9:14] = b"\x00\xff\x00\xff\x00"
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope\.safetensors does not exist"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_expect_fingerprint_mismatch(tmp_path: Path) -> None:
    state = make_state()
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)
    other = build_layout(state.specs, 2, "binpack").fingerprint
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, expect_fingerprint=other)
    msg = str(info.value)
    assert state.fingerprint.hex()[:16] in msg and other.hex()[:16] in msg
    assert "ckpt.safetensors" in msg


def test_expect_backend_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    with pytest.raises(CheckpointError, match=r"backend 'rda-nesterov-v1'.*'avg-sgd-v1'"):
        load_checkpoint(path, expect_backend="avg-sgd-v1")


def _rewrite_meta(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["yeto"])
    edit(meta)
    save_file(tensors, str(path), metadata={"yeto": json.dumps(meta)})


def test_stored_fingerprint_must_match_specs(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    _rewrite_meta(path, lambda m: m.update(fingerprint="00" * 32))
    with pytest.raises(CheckpointError, match="does not match the layout rebuilt"):
        load_checkpoint(path)


def test_unsupported_format_version(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    _rewrite_meta(path, lambda m: m.update(format=99))
    with pytest.raises(CheckpointError, match="format version 99"):
        load_checkpoint(path)


def test_versions_length_checked(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    _rewrite_meta(path, lambda m: m.update(versions=[1, 2]))
    with pytest.raises(CheckpointError, match="2 versions for 3 fragments"):
        load_checkpoint(path)


def test_missing_metadata_and_tensors(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(CheckpointError, match="no 'yeto' metadata"):
        load_checkpoint(path)

    path = tmp_path / "ckpt.safetensors"
    state = make_state()
    save_checkpoint(path, state)
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    del tensors["momentum/model.norm.weight"]
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CheckpointError, match=r"missing tensors: momentum/model\.norm\.weight"):
        load_checkpoint(path)

    tensors["momentum/model.norm.weight"] = torch.zeros(4)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(CheckpointError, match=r"momentum/model\.norm\.weight is F32 \[4\]"):
        load_checkpoint(path)


def test_save_rejects_inconsistent_state(tmp_path: Path) -> None:
    state = make_state()
    state.params[2] = state.params[2][:-1]
    with pytest.raises(ValueError, match=r"params\[2\]"):
        save_checkpoint(tmp_path / "ckpt.safetensors", state)
    assert list(tmp_path.iterdir()) == []


def test_delayed_nesterov_state_round_trips(tmp_path: Path) -> None:
    specs = [TensorSpec("emb.weight", (6, 4), "float32", embedding=True), TensorSpec("layers.0.w", (4, 4), "float32"),
             TensorSpec("layers.1.w", (4, 3), "float32")]
    layout = build_layout(specs, 2)
    g = torch.Generator().manual_seed(3)
    bufs = [[torch.randn(f.numel, generator=g) for f in layout.fragments] for _ in range(3)]
    state = SyncerState(specs=specs, num_fragments=2, pattern="binpack", fingerprint=layout.fingerprint,
                        backend="rda-heloco-delayed-nesterov4-v1", params=bufs[0], momentum=bufs[1], versions=[3, 2],
                        next_round=5, ledger={"0": 10}, outer_accum=bufs[2], outer_count=[1, 3])
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)
    back = load_checkpoint(path, expect_backend="rda-heloco-delayed-nesterov4-v1")
    assert back.outer_count == [1, 3] and back.outer_accum is not None
    for a, b in zip(back.outer_accum, bufs[2], strict=True):
        assert torch.equal(a, b)
    plain = SyncerState(specs=specs, num_fragments=2, pattern="binpack", fingerprint=layout.fingerprint,
                        backend="rda-none-nesterov-v1", params=bufs[0], momentum=bufs[1], versions=[3, 2],
                        next_round=5, ledger={})
    save_checkpoint(path, plain)
    assert load_checkpoint(path).outer_accum is None


def test_the_ledger_counts_per_learner_and_generation() -> None:
    ledger = {ledger_key(0, 1): 100, ledger_key(0, 3): 50, ledger_key(2, 1): 7, "5": 9}  # "5": an older checkpoint
    assert parse_ledger_key("0:3") == (0, 3) and parse_ledger_key("5") == (5, 0)
    assert tokens_by_learner(ledger) == {0: 150, 2: 7, 5: 9}
    assert last_generations(ledger) == {0: 3, 2: 1, 5: 0}


def test_a_ledger_key_that_names_no_learner_is_refused(tmp_path: Path) -> None:
    state = make_state()
    state.ledger = {"0:x": 1}
    path = tmp_path / "bad-ledger.safetensors"
    save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match="malformed 'yeto' metadata"):
        load_checkpoint(path)


def test_the_learners_each_fragment_last_merged_round_trip(tmp_path: Path) -> None:
    # What a reconnecting learner that rebases (overlap) is told of its last push.
    state = make_state()
    state.merged_by = [(9, [0, 2]), (7, [1]), (-1, [])]
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)
    assert load_checkpoint(path).merged_by == [(9, [0, 2]), (7, [1]), (-1, [])]
    state.merged_by = []  # a checkpoint from before it was kept
    save_checkpoint(path, state)
    assert load_checkpoint(path).merged_by == []
    state.merged_by = [(9, [0])]  # one entry for three fragments
    save_checkpoint(path, state)
    with pytest.raises(CheckpointError, match="malformed"):
        load_checkpoint(path)


# -- integrity --------------------------------------------------------------------------------------
def data_start(path: Path) -> int:
    (head,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + head


def test_every_tensor_has_a_checksum_of_its_bytes(tmp_path: Path) -> None:
    import xxhash

    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["yeto"])
        sums = meta["checksums"]
        assert meta["checksum"] == "xxh3-64" and set(sums) == set(f.keys())
        for name in sorted(sums):
            assert sums[name] == xxhash.xxh3_64(f.get_tensor(name).numpy().tobytes()).hexdigest(), name


def _as_crc32_era(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """The metadata a yeto that kept CRC-32 checksums wrote: no `checksum` key, 8 hex digits each."""
    import zlib

    meta.pop("checksum")
    meta["checksums"] = {name: f"{zlib.crc32(t.numpy().tobytes()):08x}" for name, t in tensors.items()}


def test_a_checkpoint_with_crc32_checksums_is_still_verified(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    state = make_state()
    save_checkpoint(path, state)
    tensors = load_file(str(path))
    _rewrite_meta(path, lambda m: _as_crc32_era(m, tensors))
    assert torch.equal(bits(load_checkpoint(path).params[0]), bits(state.params[0]))
    raw = bytearray(path.read_bytes())
    raw[data_start(path) + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        load_checkpoint(path)


def test_a_checksum_of_the_wrong_width_or_an_unknown_kind_is_malformed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    _rewrite_meta(path, lambda m: m.update(checksum="crc32"))  # 16 hex digits under the CRC-32 name
    with pytest.raises(CheckpointError, match="malformed"):
        load_checkpoint(path)
    _rewrite_meta(path, lambda m: m.update(checksum="md5"))
    with pytest.raises(CheckpointError, match="malformed"):
        load_checkpoint(path)


@pytest.mark.parametrize("damage", ["bit-flip", "nan-patch"])
def test_damaged_tensor_bytes_are_refused_naming_the_tensor(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    raw = bytearray(path.read_bytes())
    start = data_start(path)
    if damage == "bit-flip":
        raw[start + 5] ^= 0x10  # one bit of the first tensor in the file
    else:
        nan = struct.pack("<f", float("nan"))
        size = min(4096, len(raw) - start) // 4 * 4
        raw[start : start + size] = nan * (size // 4)
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"tensor param/\S+ does not match its checksum"):
        load_checkpoint(path)


def test_nan_or_inf_is_refused_even_with_a_valid_checksum(tmp_path: Path) -> None:
    state = make_state()
    state.momentum[2][3] = float("inf")
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)  # the checksums describe these bytes faithfully
    with pytest.raises(CheckpointError, match=r"tensor momentum/\S+ holds NaN or Inf"):
        load_checkpoint(path)


def test_a_checkpoint_without_checksums_loads_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ckpt.safetensors"
    state = make_state()
    save_checkpoint(path, state)
    _rewrite_meta(path, lambda m: m.pop("checksums"))  # as a yeto that kept none wrote it
    with caplog.at_level("WARNING", logger="yeto.syncer.checkpoint"):
        got = load_checkpoint(path)
    assert "carries no checksums" in caplog.text and "not verified" in caplog.text
    assert torch.equal(bits(got.params[0]), bits(state.params[0]))


def test_checksums_that_name_other_tensors_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, make_state())
    _rewrite_meta(path, lambda m: m["checksums"].pop(next(iter(m["checksums"]))))
    with pytest.raises(CheckpointError, match="do not name exactly its tensors"):
        load_checkpoint(path)


# -- streaming: every tensor crosses many write and read chunks ----------------------------------------
@pytest.fixture
def tiny_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import syncer.durability.checkpoint as ckpt

    monkeypatch.setattr(ckpt, "_CHUNK", 64)  # 16 values: the tiny model's tensors span up to 16 chunks


def test_streamed_write_and_read_are_bit_exact(tmp_path: Path, tiny_chunks: None) -> None:
    state = make_state()
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)
    reference = load_file(str(path))  # the safetensors library's own reading of the streamed file
    got = load_checkpoint(path, expect_fingerprint=state.fingerprint)
    layout = build_layout(state.specs, 3, "binpack")
    for kind, bufs in (("param", got.params), ("momentum", got.momentum)):
        for frag in layout.fragments:
            for slot in frag.slots:
                want = reference[f"{kind}/{slot.name}"].reshape(-1)
                assert torch.equal(bits(bufs[frag.index][slot.offset : slot.offset + slot.numel]), bits(want))
    for a, b in zip(state.params + state.momentum, got.params + got.momentum, strict=True):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("damage", ["bit-flip", "nan", "truncate"])
def test_damage_in_a_late_chunk_is_caught(tmp_path: Path, tiny_chunks: None, damage: str) -> None:
    state = make_state()
    state.params[0][:] = 0.5  # the first tensor's later chunks hold known values
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)
    raw = bytearray(path.read_bytes())
    at = data_start(path) + 64 * 5 + 8  # the sixth chunk of the first tensor (the embedding, 256 values)
    if damage == "bit-flip":
        raw[at] ^= 0x01
        match = r"tensor param/model.embed_tokens.weight does not match its checksum"
    elif damage == "nan":
        raw[at : at + 4] = struct.pack("<f", float("nan"))
        match = r"param/model.embed_tokens.weight does not match its checksum"  # the checksum sees it first
    else:
        raw = raw[: len(raw) - 100]
        match = r"truncated or corrupt"
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)


def test_the_downlink_chains_round_trip_with_their_versions_and_their_checksums(tmp_path: Path) -> None:
    state = make_state()
    layout = build_layout(state.specs, 3, state.pattern)
    g = torch.Generator().manual_seed(9)
    state.downlink = {4: [torch.randn(f.numel, generator=g) for f in layout.fragments],
                      7: [torch.randn(f.numel, generator=g) for f in layout.fragments]}
    state.downlink_versions = {4: [3, 3, 3], 7: [4, 3, 3]}
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, state)
    back = load_checkpoint(path)
    assert back.downlink_versions == {4: [3, 3, 3], 7: [4, 3, 3]}
    for wire_id, anchors in state.downlink.items():
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(back.downlink[wire_id], anchors, strict=True))
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
    assert "downlink4/model.norm.weight" in names and "downlink7/model.norm.weight" in names
    raw = bytearray(path.read_bytes())  # one byte of an anchor changed on disk: its checksum names it
    start, offsets = _data_offsets(path)
    begin = start + offsets["downlink7/model.norm.weight"][0]
    raw[begin] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"downlink7/model\.norm\.weight does not match its checksum"):
        load_checkpoint(path)
    state.downlink_versions = {4: [3, 3]}
    with pytest.raises(ValueError, match=r"downlink\[4\] has 3 anchors and 2 versions"):
        save_checkpoint(path, state)
