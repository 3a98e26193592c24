"""Pure pieces of the Megatron sync core: global naming order, TP slicing, batching, coverage."""

from __future__ import annotations

import pytest
import torch

from yeto_plugins.megatron.names import _globalize, canonical_order
from yeto_plugins.megatron.store import Piece, Slot, _batches, _global_specs, join_shards, shard_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SINGLE = [
    "embedding.word_embeddings.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight",
    "decoder.layers.0.mlp.router.weight",
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight",
    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
    "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight",
    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight",
    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
    "decoder.layers.1.self_attention.linear_qkv.weight",
    "decoder.layers.1.mlp.linear_fc1.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
]


def test_canonical_order_merges_pipeline_and_expert_ranks_into_the_single_rank_order():
    # PP2 × EP2: stage 0 holds the embedding and layer 0 (experts split over two EP ranks),
    # stage 1 holds layer 1 and the head. Each rank lists its own names in module order.
    stage0_ep0 = [n for n in SINGLE[:11] if "experts.local_experts.2" not in n and "experts.local_experts.3" not in n]
    stage0_ep1 = [n for n in SINGLE[:11] if "experts.local_experts.0" not in n and "experts.local_experts.1" not in n]
    stage1 = SINGLE[11:]
    assert canonical_order([stage0_ep0, stage0_ep1, stage1, stage1]) == SINGLE
    assert canonical_order([stage1, stage0_ep1, stage0_ep0]) == SINGLE  # rank order does not matter


def test_grouped_expert_names_order_by_global_index():
    names = [f"decoder.layers.0.mlp.experts.linear_fc{k}.weight{e}" for k in (1, 2) for e in (2, 3)]
    other = [f"decoder.layers.0.mlp.experts.linear_fc{k}.weight{e}" for k in (1, 2) for e in (0, 1)]
    order = canonical_order([names, other])
    prefix = "decoder.layers.0.mlp.experts."
    assert order == [f"{prefix}linear_fc{k}.weight{e}" for e in range(4) for k in (1, 2)]  # expert by expert


def test_globalize_maps_local_layer_and_expert_indices():
    layers = {"decoder.layers.0": "decoder.layers.2", "decoder.layers.1": "decoder.layers.3"}
    experts = {"decoder.layers.1.mlp.experts": [2, 3]}
    assert _globalize("decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight", layers, experts) == (
        "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight", True)
    assert _globalize("decoder.layers.1.mlp.experts.linear_fc1.weight0", layers, experts) == (
        "decoder.layers.3.mlp.experts.linear_fc1.weight2", True)
    assert _globalize("decoder.layers.0.self_attention.linear_proj.weight", layers, experts) == (
        "decoder.layers.2.self_attention.linear_proj.weight", False)
    with pytest.raises(ValueError, match="no global expert index"):
        _globalize("decoder.layers.1.mlp.experts.weight1", layers, experts)  # several experts packed in one tensor
    with pytest.raises(ValueError, match="no global expert index"):
        _globalize("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight", layers, {})


@pytest.mark.parametrize(("shape", "tp_dim", "stride", "n"), [
    ((8, 6), 0, 1, 2), ((8, 6), 1, 1, 2), ((8, 6), 0, 2, 2), ((12,), 0, 2, 2), ((12, 4), 0, 3, 2),
    ((8, 6), 1, 1, 3), ((4, 6), -1, 1, 1), ((8, 6), 0, 1, 1),
])
def test_tp_slices_round_trip(shape, tp_dim, stride, n):
    numel = torch.Size(shape).numel()
    slot = Slot("w", shape, 0, numel, tp_dim, stride)
    values = torch.arange(numel, dtype=torch.float32)
    shards = [shard_of(values, slot, (t, n)).clone() for t in range(n)]
    assert sum(s.numel() for s in shards) == numel
    full = values.view(shape)
    if stride == 2 and n == 2 and len(shape) == 2:  # a GLU: slice t is [gate_t; up_t] of the global [gate; up]
        gate, up = full.chunk(2)
        h = gate.shape[0] // 2
        assert torch.equal(shards[1], torch.cat([gate[h:], up[h:]]).reshape(-1))
    if tp_dim == 1 and n == 2:
        assert torch.equal(shards[0], full[:, :3].reshape(-1))
    out = torch.full((numel,), float("nan"))
    join_shards(out, slot, shards)
    assert torch.equal(out, values)


def test_batches_keep_whole_tensors_under_the_limit():
    slots = [Slot(str(i), (n,), 0, n, -1, False) for i, n in enumerate([3, 4, 10, 1, 1])]
    assert [[s.name for s in b] for b in _batches(slots, 8)] == [["0", "1"], ["2"], ["3", "4"]]


def _catalog(pieces: list[Piece], shape: tuple[int, ...], tp_dim: int = -1) -> tuple[list[Piece], list[dict]]:
    return pieces, [{"name": p.name, "shape": shape, "tp_dim": tp_dim, "stride": 1} for p in pieces]


def test_global_specs_require_exactly_one_master_per_element():
    def rank(owned: tuple[int, int] | None, shape: tuple[int, ...] = (10,)) -> tuple[list[Piece], list[dict]]:
        return _catalog([Piece("w", 10, (0, 1), owned, False)], shape)

    ok = [rank((0, 6)), rank((6, 10))]
    specs, _ = _global_specs(ok)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [("w", (10,), "float32")]
    gap = [rank((0, 6)), rank(None)]
    with pytest.raises(ValueError, match=r"\[6, 10\) have no rank"):
        _global_specs(gap)
    overlap = [rank((0, 6)), rank((5, 10))]
    with pytest.raises(ValueError, match="more than one"):
        _global_specs(overlap)
    disagree = [rank((0, 10)), rank(None, (5, 2))]
    with pytest.raises(ValueError, match="ranks disagree on w"):
        _global_specs(disagree)
