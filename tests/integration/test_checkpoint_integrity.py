"""A damaged checkpoint never resumes a run and never exports: `python -m syncer --resume` and
`yeto-export` refuse it with one line naming the tensor (issue 14, DESIGN §6.3, §6.5)."""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, base_env, syncer_argv

from syncer.durability.checkpoint import SyncerState, save_checkpoint
from yeto_core.layout import TensorSpec, build_layout

pytestmark = pytest.mark.integration

SPECS = [TensorSpec("embed.weight", (16, 4), "float32", embedding=True), TensorSpec("layer.weight", (4, 4), "float32"),
         TensorSpec("layer.bias", (4,), "float32")]


def write_checkpoint(path: Path) -> None:
    layout = build_layout(SPECS, 2, "binpack")
    gen = torch.Generator().manual_seed(0)
    save_checkpoint(path, SyncerState(
        specs=SPECS, num_fragments=2, pattern="binpack", fingerprint=layout.fingerprint, backend="rda-none-nesterov-v1",
        params=[torch.randn(f.numel, generator=gen) for f in layout.fragments],
        momentum=[torch.zeros(f.numel) for f in layout.fragments], versions=[3, 3], next_round=6, ledger={"0:1": 60},
        finalized=True, merged_by=[(4, [0]), (5, [0])]))


def damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    (head,) = struct.unpack("<Q", raw[:8])
    start = 8 + head
    if how == "bit-flip":
        raw[start + 2] ^= 0x04
    else:  # a run of NaN over the first tensors
        size = min(4096, len(raw) - start) // 4 * 4
        raw[start : start + size] = struct.pack("<f", float("nan")) * (size // 4)
    path.write_bytes(bytes(raw))


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["bit-flip", "nan-patch"])
def test_a_damaged_checkpoint_is_refused_by_resume_and_export(tmp_path: Path, key_file: Path, how: str) -> None:
    path = tmp_path / "syncer.safetensors"
    write_checkpoint(path)
    damage(path, how)
    before = path.read_bytes()

    argv = syncer_argv(key_file=key_file, learners=1, quorum=1, fragments=2, checkpoint=path, resume=True)
    resumed = run(argv)
    assert resumed.returncode == 2, resumed.stderr
    assert re.search(r"tensor param/\S+ does not match its checksum", resumed.stderr), resumed.stderr
    assert "listening" not in resumed.stdout

    config = tmp_path / "config"
    config.mkdir()
    exported = run([sys.executable, "-m", "syncer.tools.export", "--checkpoint", str(path), "--model", str(config),
                    "--output-dir", str(tmp_path / "out")])
    assert exported.returncode == 2, exported.stderr
    assert re.search(r"tensor param/\S+ does not match its checksum", exported.stderr), exported.stderr
    assert not (tmp_path / "out").exists()
    assert path.read_bytes() == before  # refusing touches nothing
