"""`yeto-export` on inputs that do not fit: one line naming the input, exit 2, nothing written. An
adapter config is checked against the checkpoint's LoRA tensors before any model is loaded; a
matching one (PEFT's own file) still exports. Checkpoints are written here, from tiny models, so no
run is needed (tests/integration/test_export.py exports real runs' checkpoints)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from syncer.durability.checkpoint import SyncerState, save_checkpoint
from syncer.tools.export import main
from yeto_core.layout import TensorSpec, build_layout

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "vocab_size": 64}


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], fragments: int = 2) -> Path:
    """A finalized syncer checkpoint holding `tensors` as its global params."""
    specs = [TensorSpec(name, tuple(t.shape), "float32", embedding="embed_tokens" in name)
             for name, t in tensors.items()]
    layout = build_layout(specs, fragments, "binpack")
    params = []
    for frag in layout.fragments:
        flat = torch.zeros(frag.numel)
        for slot in frag.slots:
            flat[slot.offset : slot.offset + slot.numel] = tensors[slot.name].reshape(-1)
        params.append(flat)
    save_checkpoint(path, SyncerState(
        specs=specs, num_fragments=fragments, pattern="binpack", fingerprint=layout.fingerprint,
        backend="rda-none-nesterov-v1", params=params, momentum=[torch.zeros_like(p) for p in params],
        versions=[1] * fragments, next_round=fragments, ledger={}, finalized=True))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (config and weights), its full checkpoint, and a LoRA checkpoint (rank 4 on
    q_proj and v_proj) with PEFT's adapter_config.json for it."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    model.save_pretrained(root / "base")
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(model, lora_config)
    adapters = {n: torch.randn(p.shape) * 0.01 for n, p in peft_model.named_parameters() if "lora_" in n}
    peft_model.peft_config["default"].save_pretrained(root / "adapter")
    return {"base": root / "base", "adapter": root / "adapter",
            "full": write_checkpoint(root / "full.safetensors", full),
            "lora": write_checkpoint(root / "lora.safetensors", adapters)}


def export(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def adapter_config(tmp_path: Path, source: Path, **changes: object) -> Path:
    """PEFT's adapter_config.json of `source` with `changes`, in a directory of its own."""
    config = json.loads((source / "adapter_config.json").read_text())
    config.update(changes)
    out = tmp_path / "changed-adapter"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def refused(code: int, err: list[str], *says: str) -> None:
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("yeto-export: error: ") and all(s in err[0] for s in says), err


def test_an_adapter_config_on_a_full_tuning_checkpoint_is_refused(tiny: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "syncer.tools.export", "--checkpoint", str(tiny["full"]), "--model",
                           str(tiny["base"]), "--adapter-config", str(tiny["adapter"]), "--output-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    err = done.stderr.strip().splitlines()
    refused(done.returncode, err, "--adapter-config", str(tiny["adapter"]), "holds no LoRA adapter tensors")
    assert "Traceback" not in done.stderr and not out.exists()


@pytest.mark.parametrize(("changes", "says"), [
    ({"r": 8}, ["its rank is 8 (r)", "LoRA tensors have rank 4", "4 module(s)"]),
    ({"rank_pattern": {"v_proj": 2}}, ["its rank is 2 (r / rank_pattern)", "2 module(s)", "v_proj: 4"]),
    ({"target_modules": ["q_proj", "k_proj"]},
     ["LoRA tensors for v_proj, which its target_modules k_proj, q_proj do not adapt",
      "its target_modules name k_proj, which the checkpoint has no LoRA tensors for"]),
    ({"target_modules": r".*\.q_proj"}, ["LoRA tensors for v_proj, which its target_modules"]),
    ({"target_modules": ["q_proj", "v_proj", "down_proj"], "r": 16},
     ["name down_proj, which the checkpoint has no LoRA", "its rank is 16"]),
], ids=["rank", "rank-pattern", "targets", "regex-targets", "targets-and-rank"])
def test_an_adapter_config_the_checkpoint_does_not_match_names_what_differs(
        tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], changes: dict[str, object],
        says: list[str]) -> None:
    config = adapter_config(tmp_path, tiny["adapter"], **changes)
    out = tmp_path / "out"
    code, err = export(capsys, "--checkpoint", tiny["lora"], "--model", tiny["base"], "--adapter-config", config,
                       "--output-dir", out)
    refused(code, err, "--adapter-config", "does not match the checkpoint", *says)
    assert not out.exists()


@pytest.mark.parametrize(("content", "says"), [
    ("{not json", "is not a JSON object"),
    ("[1, 2]", "is not a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "is not a JSON object"),
    ('{"r": "four", "target_modules": ["q_proj"]}', "its rank r = four is not an integer"),
    ('{"r": 4, "target_modules": 7}', "target_modules is neither a list of names nor a regex"),
    ('{"r": 4, "target_modules": "(q_proj"}', "is not a regex"),
], ids=["not-json", "list", "deep", "rank-type", "targets-type", "bad-regex"])
def test_a_bad_adapter_config_file_is_one_line(tiny: dict[str, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str], content: str, says: str) -> None:
    config = tmp_path / "adapter_config.json"
    config.write_text(content)
    code, err = export(capsys, "--checkpoint", tiny["lora"], "--model", tiny["base"], "--adapter-config", config,
                       "--output-dir", tmp_path / "out")
    refused(code, err, str(config), says)


def test_missing_or_unusable_inputs_are_one_line(tiny: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base, lora = tiny["base"], tiny["lora"]
    code, err = export(capsys, "--checkpoint", lora, "--model", base, "--adapter-config", tmp_path / "nope",
                       "--output-dir", tmp_path / "out")
    refused(code, err, "--adapter-config", "nope", "cannot read it")
    code, err = export(capsys, "--checkpoint", lora, "--model", base, "--adapter-config", tmp_path,
                       "--output-dir", tmp_path / "out")  # a directory without adapter_config.json
    refused(code, err, "adapter_config.json", "cannot read it")
    code, err = export(capsys, "--checkpoint", lora, "--model", base, "--output-dir", tmp_path / "out")
    refused(code, err, "holds LoRA adapter weights", "--adapter-config")
    code, err = export(capsys, "--checkpoint", tmp_path / "nope.safetensors", "--model", base,
                       "--output-dir", tmp_path / "out")
    refused(code, err, "nope.safetensors", "does not exist")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = export(capsys, "--checkpoint", tiny["full"], "--model", base, "--output-dir", blocker / "out")
    refused(code, err, "--output-dir", "a-file is not a directory")
    code, err = export(capsys, "--checkpoint", tiny["full"], "--model", tmp_path / "no-config",
                       "--output-dir", tmp_path / "out")
    refused(code, err, "no-config")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(lora), "--model", str(base), "--dtype", "float64", "--output-dir", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "--dtype" in err[0], err


def test_a_checkpoint_of_another_model_is_one_line_before_any_progress_line(
        tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig

    LlamaConfig(**{**TINY, "hidden_size": 32}).save_pretrained(tmp_path / "other")
    code, err = export(capsys, "--checkpoint", tiny["full"], "--model", tmp_path / "other",
                       "--output-dir", tmp_path / "out")
    refused(code, err, "shape mismatch", "model.embed_tokens.weight")
    assert not (tmp_path / "out").exists()


def test_matching_inputs_still_export(tiny: dict[str, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The refusals above refuse only what does not fit: PEFT's own config of the run exports."""
    from safetensors.torch import load_file

    code, err = export(capsys, "--checkpoint", tiny["lora"], "--model", tiny["base"], "--adapter-config",
                       tiny["adapter"], "--output-dir", tmp_path / "lora")
    assert code == 0, err
    assert (tmp_path / "lora" / "model.safetensors").exists()
    adapter = load_file(str(tmp_path / "lora" / "adapter" / "adapter_model.safetensors"))
    assert len(adapter) == 8 and all("lora_" in n for n in adapter)
    code, err = export(capsys, "--checkpoint", tiny["full"], "--model", tiny["base"], "--output-dir",
                       tmp_path / "full")
    assert code == 0, err
    info = json.loads((tmp_path / "full" / "yeto_export.json").read_text())
    assert info["finalized"] is True and info["lora"] is None
