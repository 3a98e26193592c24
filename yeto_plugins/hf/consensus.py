"""The HF island's part of the consensus signal (DESIGN §8.1): the probe, and the log fields.

The probe batch is `consensus_tokens` token ids drawn from a generator with a fixed seed over the
model's vocabulary, so every island of a run probes exactly the same batch. The probe runs the
model in eval mode (no dropout; the train/eval mode is restored) and returns its logits [T, V];
the learner session calls it under `torch.no_grad()` after installing merged fragments.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from yeto_core.consensus_report import probe_ids
from yeto_core.learner import LearnerStats

log = logging.getLogger("yeto.hf")

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


def consensus_logs(stats: LearnerStats) -> dict[str, Any]:
    """`yeto_consensus_js`, `yeto_fragment_l2_mean` and `yeto_fragment_l2/<i>`, where known."""
    logs: dict[str, Any] = {}
    if stats.consensus_js is not None:
        logs["yeto_consensus_js"] = stats.consensus_js
    known = [(i, v) for i, v in enumerate(stats.fragment_l2) if v is not None]
    if known:
        logs["yeto_fragment_l2_mean"] = sum(v for _, v in known) / len(known)
        logs.update({f"yeto_fragment_l2/{i}": v for i, v in known})
    return logs
