"""yeto's FSDP2 store on verl's real engine (`store_worker.py`, two gloo ranks): reads are the module's full
parameters, writes land bit for bit in every rank's shards, AdamW's moments are untouched, and the engine
trains on from what was written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from processes import HERE, stopped_at_exit, torchrun

WORKER = HERE / "store_worker.py"


@pytest.mark.timeout(150)
def test_reads_and_writes_on_the_real_fsdp2_engine_are_exact_and_keep_the_moments(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    out = tmp_path / "store"
    run = torchrun(WORKER, 2, ["--model", str(tiny_model_dir), "--out", str(out)], tmp_path / "store.log",
                   {"VERL_USE_EXTERNAL_PLUGINS": "none"})
    with stopped_at_exit(run):
        assert run.wait(120) == 0, run.tail()
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert report["problems"] == [], report
        assert report["tensors"] >= 10  # every trainable tensor of the model
