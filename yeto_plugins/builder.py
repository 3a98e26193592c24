"""`build_island`: the one place an adapter turns its settings and its model into an `IslandSession`.

    island = build_island(settings, model)                                  # one process holds every tensor
    island = build_island(settings, model, collective=True)                 # a DDP, FSDP2 or ZeRO island's ranks
    island = build_island(settings, model_chunks, optimizer=megatron_opt)   # a Megatron island's ranks

What is synced (`tuning`: every trainable tensor, or a PEFT model's adapters), which tensors are the
embedding, the consensus probe (`consensus_every`), the store across ranks and the line said when the
final cut is in are decided here for every trainer alike; the adapter only says where its model lives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from yeto_core.island import IslandSession
from yeto_core.settings import LearnerSettings
from yeto_plugins.torch_dist.modules import embedding_names, logit_probe, synced_parameters
from yeto_plugins.torch_dist.store import ProcessGroupStore


def build_island(settings: LearnerSettings, model: torch.nn.Module | Sequence[torch.nn.Module], *,
                 optimizer: Any = None, collective: bool = False, on_final: str = "training stops") -> IslandSession:
    """`optimizer` (a Megatron optimizer, with `model` its DDP-wrapped chunks): the island over every rank's fp32
    masters (`MegatronDiLoCoSync`). Otherwise `model` is one torch module, whose trainable tensors sync from this
    process alone or, `collective`, with every rank of its process group taking part."""
    if optimizer is not None:
        from yeto_plugins.megatron.sync import MegatronDiLoCoSync  # megatron-core: only for Megatron islands

        return MegatronDiLoCoSync(model, optimizer, settings, on_final=on_final).island
    assert isinstance(model, torch.nn.Module), "a torch island is one module"
    named = synced_parameters(model, settings.tuning)
    embedding = embedding_names(model)
    probe = logit_probe(model, settings.consensus.tokens) if settings.consensus.every else None
    if collective:  # rank 0 talks to the syncer; the others follow its reads and writes
        store = ProcessGroupStore(named, embedding, settings.island)
        return IslandSession(settings, store=store, probe=probe, on_final=on_final)
    return IslandSession(settings, named, embedding_names=embedding, probe=probe, on_final=on_final)
