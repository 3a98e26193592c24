"""What an island of any `torch.nn.Module` syncs, and its consensus probe (DESIGN §1.3, §8.1).

Shared by the trainer adapters whose model is a plain (HF-style) module, whole or FSDP2-sharded:
the HF Trainer callback and the verl worker. Nothing here imports a trainer.

The probe batch is `consensus_tokens` token ids drawn from a generator with a fixed seed over the
model's vocabulary, so every island of a run probes exactly the same batch. The probe runs the
model in eval mode (no dropout; the train/eval mode is restored) and returns its logits [T, V];
the learner session calls it under `torch.no_grad()` after installing merged fragments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from yeto_core.consensus_report import probe_ids

log = logging.getLogger("yeto.modules")


def embedding_names(model: torch.nn.Module) -> set[str]:
    """Names of the input embedding's parameters (a tied LM head shares the same tensor)."""
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else None
    if emb is None:
        return set()
    ids = {id(p) for p in emb.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def synced_parameters(model: torch.nn.Module, tuning: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors an island syncs. Frozen tensors and buffers never cross the wire; with LoRA
    (`tuning="lora"`, or `"auto"` on a model with adapters) only the adapter tensors do, and other
    trainable tensors (e.g. PEFT's `modules_to_save`) stay local to each island."""
    trainable: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adapters = [(name, p) for name, p in trainable if "lora_" in name]
    if tuning == "lora" and not adapters:
        raise ValueError("YETO_DILOCO_TUNING=lora, but the model has no trainable LoRA adapter tensors "
                         "(names with 'lora_'); use tuning='full' or wrap the model with PEFT first")
    if tuning == "lora" or (tuning == "auto" and adapters):
        local = [name for name, _ in trainable if "lora_" not in name]
        if local:
            log.warning("LoRA tuning: %d trainable tensor(s) that are not adapters stay local to this island "
                        "(e.g. %s); use tuning='full' to sync them too", len(local), local[0])
        return adapters
    return trainable


def logit_probe(model: torch.nn.Module, tokens: int) -> Callable[[], torch.Tensor] | None:
    """A callable returning the model's logits [T, V] on the fixed probe batch; None (with a
    warning) for a model whose vocabulary size cannot be read from its config."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        log.warning("consensus probe off: the model's config has no vocab_size")
        return None
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and limit > 0:
        tokens = min(tokens, limit)
    ids = probe_ids(vocab, tokens)

    def probe() -> torch.Tensor:
        device = next(model.parameters()).device
        training = model.training
        model.eval()
        try:
            out = model(input_ids=ids.to(device))
        finally:
            model.train(training)
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits[0]

    return probe
