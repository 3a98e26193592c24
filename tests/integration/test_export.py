"""`yeto-export` (DESIGN §6.5): a loadable HF model from the syncer checkpoint alone, no learner alive."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import (
    EXAMPLE,
    ROOT,
    TINY_MODEL,
    Procs,
    base_env,
    checkpoint_params,
    eval_loss,
    model_dir,
    start_learner,
    start_syncer,
    syncer_exit_code,
    wait_all,
)

from syncer.durability.checkpoint import load_checkpoint

pytestmark = pytest.mark.integration

FRAGMENTS = 4
ROUNDS = 8


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_tiny_llama_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_args(**overrides: object) -> argparse.Namespace:
    """The example's model arguments for TINY_MODEL (flags parsed the way the example parses them)."""
    flags = dict(zip(TINY_MODEL[::2], TINY_MODEL[1::2], strict=True))
    args = argparse.Namespace(hidden=int(flags["--hidden"]), layers=int(flags["--layers"]),
                              seq_len=int(flags["--seq-len"]), seed=0)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def write_config(example: ModuleType, directory: Path, **overrides: object) -> Path:
    example.build_model(tiny_args(**overrides)).config.save_pretrained(directory)
    return directory


def run_export(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "syncer.tools.export", *map(str, args)], cwd=ROOT, env=base_env(),
                          capture_output=True, text=True, timeout=120, check=False)


def held_out_loss(model: torch.nn.Module, example: ModuleType) -> float:
    """Mean causal-LM loss over the example's held-out split, as the Trainer computes it (every
    block has the same length, so the mean of per-block losses is the mean over all tokens)."""
    _, held_out = example.splits(tiny_args().seq_len, 0, 2)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(held_out), 32):
            ids = held_out.blocks[start : start + 32]
            out = model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
            total += float(out.loss) * ids.shape[0]
            count += ids.shape[0]
    return total / count


@pytest.mark.timeout(180)
def test_export_loads_and_matches_the_learners(procs: Procs, key_file: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=FRAGMENTS, total_rounds=ROUNDS)
    learners = [start_learner(procs, syncer, key_file, i, max_steps=3000) for i in range(2)]
    assert wait_all(learners, timeout=150) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    finals = [eval_loss(lp, "final") for lp in learners]
    assert all(f["final_cut"] for f in finals), procs.tails()
    assert all(lp.poll() is not None for lp in learners) and syncer.proc.poll() is not None

    example = load_example()
    config_dir = write_config(example, tmp_path / "tiny-config")
    out = tmp_path / "exported"
    assert syncer.checkpoint is not None
    done = run_export("--checkpoint", syncer.checkpoint, "--model", config_dir, "--output-dir", out)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", "log lines belong on stderr"
    assert "yeto-export" in done.stderr

    info = json.loads((out / "yeto_export.json").read_text())
    state = load_checkpoint(syncer.checkpoint)
    assert info["checkpoint"] == syncer.checkpoint.name
    assert info["finalized"] is True and info["next_round"] == ROUNDS == state.next_round
    assert info["versions"] == state.versions and info["fingerprint"] == state.fingerprint.hex()

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    ckpt = checkpoint_params(syncer.checkpoint)
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(ckpt)
    for name, p in params.items():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), ckpt[name]), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tie lost"

    loss = held_out_loss(model, example)
    for f in finals:
        assert abs(loss - f["loss"]) <= 1e-4, (loss, f)

    # bfloat16 export: same names, values rounded from the checkpoint
    out16 = tmp_path / "exported-bf16"
    done = run_export("--checkpoint", syncer.checkpoint, "--model", config_dir, "--output-dir", out16,
                      "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    m16 = AutoModelForCausalLM.from_pretrained(out16, local_files_only=True)
    for name, p in m16.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), ckpt[name].bfloat16()), name

    # an existing export is never overwritten silently; --overwrite says so
    before = (out / "model.safetensors").read_bytes()
    again = run_export("--checkpoint", syncer.checkpoint, "--model", config_dir, "--output-dir", out, "--dtype",
                       "bfloat16")
    assert again.returncode == 2 and "exists and is not empty" in again.stderr and "--overwrite" in again.stderr
    assert (out / "model.safetensors").read_bytes() == before
    again = run_export("--checkpoint", syncer.checkpoint, "--model", config_dir, "--output-dir", out, "--overwrite")
    assert again.returncode == 0, again.stderr

    # a config for another model: refused, naming the shape mismatch
    wrong = write_config(example, tmp_path / "wrong-config", hidden=48)
    done = run_export("--checkpoint", syncer.checkpoint, "--model", wrong, "--output-dir", tmp_path / "wrong")
    assert done.returncode == 2, done.stderr
    assert "shape mismatch" in done.stderr and "model.embed_tokens.weight" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "wrong" / "model.safetensors").exists()


@pytest.mark.timeout(180)
def test_export_refuses_bad_inputs(tmp_path: Path) -> None:
    example = load_example()
    config_dir = write_config(example, tmp_path / "tiny-config")

    done = run_export("--checkpoint", tmp_path / "nope.safetensors", "--model", config_dir,
                      "--output-dir", tmp_path / "out")
    assert done.returncode == 2
    assert "nope.safetensors" in done.stderr and "does not exist" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    done = run_export("--checkpoint", corrupt, "--model", config_dir, "--output-dir", tmp_path / "out")
    assert done.returncode == 2 and "corrupt.safetensors" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

    done = run_export("--checkpoint", corrupt, "--model", tmp_path / "no-such-config", "--output-dir",
                      tmp_path / "out")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(240)
def test_a_lora_run_syncs_only_adapters_and_exports_merged_model_and_adapter(procs: Procs, key_file: Path,
                                                                             tmp_path: Path) -> None:
    """Two HF learners train LoRA adapters (rank 4 on q_proj/v_proj) of the same base model: only
    adapter tensors cross the wire, and `yeto-export` turns the syncer checkpoint plus the base
    model into a merged model whose held-out loss is the learners' final one, and the adapter."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=FRAGMENTS, total_rounds=ROUNDS)
    lora = (*TINY_MODEL, "--lora-r", "4")
    learners = [start_learner(procs, syncer, key_file, i, max_steps=3000, model_args=lora) for i in range(2)]
    assert wait_all(learners, timeout=180) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    finals = [eval_loss(lp, "final") for lp in learners]
    assert all(f["final_cut"] for f in finals), procs.tails()
    assert syncer.checkpoint is not None
    ckpt = checkpoint_params(syncer.checkpoint)
    assert ckpt and all("lora_" in name for name in ckpt), sorted(ckpt)[:5]  # nothing but adapters was synced

    example = load_example()
    base_dir = tmp_path / "base"
    example.build_model(tiny_args()).save_pretrained(base_dir)  # the base the learners started from (seed 0)
    base = example.build_model(tiny_args())
    full_numel = sum(p.numel() for p in base.parameters())
    lora_numel = sum(t.numel() for t in ckpt.values())
    assert lora_numel * 20 < full_numel, (lora_numel, full_numel)
    # Bytes counted on the wire: a push carries one fragment of adapter tensors (f32): at least
    # the smallest adapter tensor, at most all of them, never a base-model tensor.
    smallest = min(t.numel() for t in ckpt.values()) * 4
    for f in finals:
        assert f["pushes"] > 0, f
        assert f["pushes"] * smallest <= f["bytes_pushed"] <= f["pushes"] * lora_numel * 4, (f, lora_numel)

    out = tmp_path / "exported-lora"
    adapter_src = model_dir(learners[0])  # the learner's PEFT save_pretrained: adapter_config.json
    done = run_export("--checkpoint", syncer.checkpoint, "--model", base_dir, "--adapter-config", adapter_src,
                      "--output-dir", out)
    assert done.returncode == 0, done.stderr
    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    loss = held_out_loss(merged, example)
    for f in finals:
        assert abs(loss - f["loss"]) <= 1e-3, (loss, f)

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True),
                                        out / "adapter")
    got = {n: p for n, p in adapted.named_parameters() if "lora_" in n}
    assert sorted(got) == sorted(ckpt)
    for name, p in got.items():
        assert torch.equal(p.detach(), ckpt[name]), name
    info = json.loads((out / "yeto_export.json").read_text())
    assert info["lora"]["tensors"] == len(ckpt)

    # without the adapter config the export says what it needs
    done = run_export("--checkpoint", syncer.checkpoint, "--model", base_dir, "--output-dir", tmp_path / "x")
    assert done.returncode == 2 and "--adapter-config" in done.stderr, done.stderr
