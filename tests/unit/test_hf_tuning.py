"""Which tensors an HF island syncs: frozen tensors never; with LoRA only the adapters."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.unit

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from yeto_plugins.torch_dist.modules import synced_parameters  # noqa: E402


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def lora(model: torch.nn.Module, **extra: object) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], **extra)
    return peft.get_peft_model(model, config)


def test_a_full_model_syncs_every_trainable_tensor_and_no_frozen_one() -> None:
    model = tiny_llama()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    names = [n for n, _ in synced_parameters(model, "auto")]
    assert names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert "model.layers.0.mlp.up_proj.weight" not in names
    assert not any("rotary" in n for n in names)  # buffers are not parameters: never synced


def test_lora_syncs_only_adapter_tensors_by_default() -> None:
    model = lora(tiny_llama())
    names = [n for n, _ in synced_parameters(model, "auto")]
    assert names and all("lora_A" in n or "lora_B" in n for n in names)
    assert len(names) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    # per layer: q_proj A [4, 32] + B [32, 4], v_proj A [4, 32] + B [16, 4] (2 KV heads of 8)
    assert sum(p.numel() for _, p in synced_parameters(model, "auto")) == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)


def test_full_tuning_of_a_peft_model_also_syncs_modules_to_save(caplog: pytest.LogCaptureFixture) -> None:
    model = lora(tiny_llama(), modules_to_save=["lm_head"])
    with caplog.at_level(logging.WARNING, logger="yeto.hf"):
        adapters = [n for n, _ in synced_parameters(model, "lora")]
    assert all("lora_" in n for n in adapters)
    assert "stay local to this island" in caplog.text
    full = [n for n, _ in synced_parameters(model, "full")]
    assert set(adapters) < set(full) and any("lm_head" in n and "lora_" not in n for n in full)


def test_lora_tuning_without_adapters_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="YETO_DILOCO_TUNING=lora"):
        synced_parameters(tiny_llama(), "lora")
