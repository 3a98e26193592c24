"""Global names for a Megatron island's trainable tensors (DESIGN §1.5).

Every island must describe the same model with the same names and shapes, whatever its own
TP/PP/EP split, or the layout fingerprints differ and the syncer refuses it. A rank's
`named_parameters()` are local: `decoder.layers.{i}` counts layers within its pipeline stage (and
virtual stage), `local_experts.{j}` counts experts within its expert-parallel rank, and a
tensor-parallel weight is a slice. Here each local parameter gets

* its **global name**: the layer index is `TransformerLayer.layer_number − 1` (1-based, already
  offset by the stage), the expert index is the MoE layer's `local_expert_indices[j]`;
* its place in the **global tensor**: the tensor-parallel dimension it is split along (or none
  when TP ranks hold copies) and Megatron's partition stride: a gated-linear-unit `linear_fc1`
  has stride 2, its TP slice holding [gate_t; up_t] rather than a contiguous block of [gate; up];
* whether it is an **alias**: the last pipeline stage's copy of a tied embedding, which Megatron
  keeps equal to the first stage's `embedding.word_embeddings.weight`.

`canonical_order` then merges every rank's names into the order a single-rank model of the same
config lists them, so islands of any split agree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

EMBEDDING = "embedding.word_embeddings.weight"

_LAYER = re.compile(r"^(.*?\blayers)\.(\d+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^(.*\.experts\.local_experts)\.(\d+)(\..+)$")
_GROUPED_EXPERT = re.compile(r"^(.*\.experts\.[A-Za-z0-9_]+\.(?:weight|bias))(\d+)$")
_GLOBAL_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_GLOBAL_EXPERT = re.compile(r"\.experts\.(?:local_experts\.(\d+)\.|[A-Za-z0-9_]+\.(?:weight|bias)(\d+)$)")


@dataclass(frozen=True)
class LocalParam:
    """One trainable parameter of this rank, placed in the global model."""

    param: torch.nn.Parameter
    local_name: str
    global_name: str
    global_shape: tuple[int, ...]
    tp_dim: int  # the dimension TP ranks split it along; -1: every TP rank holds the whole tensor
    tp_rank: int  # in the TP group of this parameter (the expert TP group for experts)
    tp_size: int
    stride: int  # Megatron's partition_stride: a TP slice is `stride` interleaved blocks (a GLU's [gate_t; up_t])
    expert: bool
    alias: bool  # a copy of `global_name` kept by Megatron (a tied embedding on the last stage)

    @property
    def shard(self) -> tuple[int, int]:
        """(which slice, of how many) of the global tensor this parameter is."""
        return (self.tp_rank, self.tp_size) if self.tp_dim >= 0 else (0, 1)

    def describe(self) -> dict[str, Any]:
        """What other ranks need to know about it (picklable)."""
        return {"name": self.global_name, "shape": self.global_shape, "local_shape": tuple(self.param.shape),
                "tp_dim": self.tp_dim, "shard": self.shard, "stride": self.stride,
                "alias": self.alias}


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The bare model under Megatron's DDP and Float16Module wrappers (they nest as `.module`)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _layer_prefixes(model: torch.nn.Module) -> dict[str, str]:
    """Local `...layers.{i}` prefixes of transformer layers → the global ones."""
    out: dict[str, str] = {}
    for path, module in model.named_modules():
        m = _LAYER.match(path)
        number = getattr(module, "layer_number", None)
        if m and isinstance(number, int):
            out[path] = f"{m.group(1)}.{number - 1}"
    return out


def _expert_indices(model: torch.nn.Module) -> dict[str, list[int]]:
    """`<moe layer path>.experts` → the global index of each local expert.

    The experts container does not always carry them; the MoE layer that owns it does."""
    out: dict[str, list[int]] = {}
    for path, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if experts is None or not isinstance(experts, torch.nn.Module):
            continue
        indices = getattr(experts, "local_expert_indices", None) or getattr(module, "local_expert_indices", None)
        if indices is not None:
            out[f"{path}.experts" if path else "experts"] = [int(i) for i in indices]
    return out


def _globalize(name: str, layers: dict[str, str], experts: dict[str, list[int]]) -> tuple[str, bool]:
    """(global name, is an expert parameter)."""
    best = max((p for p in layers if name.startswith(p + ".")), key=len, default=None)
    glob = name if best is None else layers[best] + name[len(best):]
    if ".experts." not in name:
        return glob, False
    container = max((p for p in experts if name.startswith(p + ".")), key=len, default=None)
    seq, grouped = _SEQUENTIAL_EXPERT.match(name), _GROUPED_EXPERT.match(name)
    if container is None or (seq is None and grouped is None):
        raise ValueError(f"expert parameter {name!r} has no global expert index: yeto needs one expert per "
                         "tensor (SequentialMLP or TE grouped experts with weight<j>) under a MoE layer that knows "
                         "its local_expert_indices; a layout that packs several experts into one tensor is refused")
    indices = experts[container]
    j = int(seq.group(2)) if seq else int(grouped.group(2))  # type: ignore[union-attr]
    if j >= len(indices):
        raise ValueError(f"expert parameter {name!r}: local expert {j}, but its MoE layer lists {len(indices)}")
    g = indices[j]
    gm = _SEQUENTIAL_EXPERT.match(glob) if seq else _GROUPED_EXPERT.match(glob)
    assert gm is not None
    glob = f"{gm.group(1)}.{g}{gm.group(3)}" if seq else f"{gm.group(1)}{g}"
    return glob, True


def local_params(chunks: Sequence[torch.nn.Module]) -> list[LocalParam]:
    """This rank's trainable parameters over all its model chunks, in module order."""
    from megatron.core import parallel_state as ps

    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    out: list[LocalParam] = []
    seen: set[int] = set()
    for chunk in chunks:
        model = unwrap(chunk)
        layers, experts = _layer_prefixes(model), _expert_indices(model)
        for name, p in model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            glob, is_expert = _globalize(name, layers, experts)
            alias = bool(getattr(p, "shared_embedding", False)) and name != EMBEDDING
            if alias:
                glob = EMBEDDING
            tp_rank, tp_size = etp if is_expert else tp
            split = bool(getattr(p, "tensor_model_parallel", False)) and tp_size > 1
            tp_dim = int(getattr(p, "partition_dim", 0)) if split else -1
            stride = int(getattr(p, "partition_stride", 1)) if split else 1
            shape = list(p.shape)
            if split:
                shape[tp_dim] *= tp_size
            out.append(LocalParam(p, name, glob, tuple(shape), tp_dim, tp_rank, tp_size, stride, is_expert, alias))
    return out


def _template(name: str) -> tuple[str, int | None]:
    """The name with its expert index blanked, and that index (None for a non-expert)."""
    m = _GLOBAL_EXPERT.search(name)
    if m is None:
        return name, None
    if m.group(1) is not None:
        return name[: m.start(1)] + "*" + name[m.end(1):], int(m.group(1))
    return name[: m.start(2)] + "*", int(m.group(2))


def canonical_order(per_rank: Sequence[Sequence[str]]) -> list[str]:
    """Merge each rank's global names (each list in that rank's module order) into the order of a
    single-rank model: what precedes the transformer layers, the layers by global index (inside a
    layer: module order, experts by global index as a block), then what follows them."""
    keys: dict[str, tuple[int, ...]] = {}
    template_pos: dict[tuple[int, int], dict[str, int]] = {}
    for names in per_rank:
        first_layer = next((i for i, n in enumerate(names) if _GLOBAL_LAYER.search(n)), len(names))
        for i, name in enumerate(names):
            m = _GLOBAL_LAYER.search(name)
            section = (1, int(m.group(1))) if m else ((0, 0) if i < first_layer else (2, 0))
            layer_free = name if m is None else name[: m.start(1)] + "#" + name[m.end(1):]
            template, expert = _template(layer_free)
            positions = template_pos.setdefault(section, {})
            positions.setdefault(template, len(positions))
            keys.setdefault(name, (*section, positions[template], -1 if expert is None else expert))
    # Experts of one MoE layer form one block ordered by expert index: key them by the position of
    # the block's first template, then expert index, then the template's own position.
    block_start: dict[tuple[int, int], int] = {}
    for s0, s1, pos, expert in keys.values():
        if expert >= 0:
            block_start[(s0, s1)] = min(block_start.get((s0, s1), pos), pos)

    def sort_key(name: str) -> tuple[int, ...]:
        s0, s1, pos, expert = keys[name]
        if expert < 0:
            return (s0, s1, pos, 0, 0)
        return (s0, s1, block_start[(s0, s1)], expert + 1, pos)

    return sorted(keys, key=sort_key)
