from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from yeto_core.layout import (
    PATTERNS,
    Layout,
    TensorSpec,
    build_layout,
    layout_fingerprint,
    specs_from_named_tensors,
    transformer_layer_index,
)

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]


def llama_specs(
    layers: int = 32, hidden: int = 4096, ffn: int = 11008, vocab: int = 32000
) -> list[TensorSpec]:
    """A Llama-7B-shaped parameter list in parameter order, untied head."""
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "bfloat16", embedding=True)]
    for i in range(layers):
        p = f"model.layers.{i}"
        specs += [
            TensorSpec(f"{p}.self_attn.q_proj.weight", (hidden, hidden), "bfloat16"),
            TensorSpec(f"{p}.self_attn.k_proj.weight", (hidden, hidden), "bfloat16"),
            TensorSpec(f"{p}.self_attn.v_proj.weight", (hidden, hidden), "bfloat16"),
            TensorSpec(f"{p}.self_attn.o_proj.weight", (hidden, hidden), "bfloat16"),
            TensorSpec(f"{p}.mlp.gate_proj.weight", (ffn, hidden), "bfloat16"),
            TensorSpec(f"{p}.mlp.up_proj.weight", (ffn, hidden), "bfloat16"),
            TensorSpec(f"{p}.mlp.down_proj.weight", (hidden, ffn), "bfloat16"),
            TensorSpec(f"{p}.input_layernorm.weight", (hidden,), "bfloat16"),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), "bfloat16"),
        ]
    specs.append(TensorSpec("model.norm.weight", (hidden,), "bfloat16"))
    specs.append(TensorSpec("lm_head.weight", (vocab, hidden), "bfloat16"))
    return specs


def moe_specs(layers: int = 40, experts: int = 344) -> list[TensorSpec]:
    """A big-MoE-shaped list: per layer attention, norms, a router and 3 weights per expert."""
    hidden, kv, moe_ffn = 4096, 512, 1536
    specs = [TensorSpec("model.embed_tokens.weight", (151936, hidden), "bfloat16", embedding=True)]
    for i in range(layers):
        p = f"model.layers.{i}"
        specs += [
            TensorSpec(f"{p}.self_attn.q_proj.weight", (8192, hidden), "bfloat16"),
            TensorSpec(f"{p}.self_attn.k_proj.weight", (kv, hidden), "bfloat16"),
            TensorSpec(f"{p}.self_attn.v_proj.weight", (kv, hidden), "bfloat16"),
            TensorSpec(f"{p}.self_attn.o_proj.weight", (hidden, 8192), "bfloat16"),
            TensorSpec(f"{p}.self_attn.q_norm.weight", (128,), "bfloat16"),
            TensorSpec(f"{p}.self_attn.k_norm.weight", (128,), "bfloat16"),
            TensorSpec(f"{p}.input_layernorm.weight", (hidden,), "bfloat16"),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), "bfloat16"),
            TensorSpec(f"{p}.mlp.gate.weight", (experts, hidden), "bfloat16"),
        ]
        for e in range(experts):
            specs += [
                TensorSpec(f"{p}.mlp.experts.{e}.gate_proj.weight", (moe_ffn, hidden), "bfloat16"),
                TensorSpec(f"{p}.mlp.experts.{e}.up_proj.weight", (moe_ffn, hidden), "bfloat16"),
                TensorSpec(f"{p}.mlp.experts.{e}.down_proj.weight", (hidden, moe_ffn), "bfloat16"),
            ]
    specs.append(TensorSpec("model.norm.weight", (hidden,), "bfloat16"))
    specs.append(TensorSpec("lm_head.weight", (151936, hidden), "bfloat16"))
    return specs


def small_specs() -> list[TensorSpec]:
    return [
        TensorSpec("embed.weight", (100, 8), "float32", embedding=True),
        TensorSpec("layers.0.w", (8, 8), "float32"),
        TensorSpec("layers.0.b", (8,), "float32"),
        TensorSpec("layers.1.w", (8, 16), "float32"),
        TensorSpec("layers.1.b", (16,), "float32"),
        TensorSpec("layers.2.w", (16, 8), "float32"),
        TensorSpec("norm.weight", (8,), "float32"),
    ]


def assert_well_formed(layout: Layout) -> None:
    order = {s.name: i for i, s in enumerate(layout.specs)}
    seen: list[str] = []
    for k, frag in enumerate(layout.fragments):
        assert frag.index == k
        offset = 0
        for slot in frag.slots:
            assert slot.offset == offset
            spec = layout.specs[order[slot.name]]
            assert (slot.shape, slot.numel, slot.embedding) == (spec.shape, spec.numel, spec.embedding)
            offset += slot.numel
            assert layout.fragment_of(slot.name) == k
        assert frag.numel == offset > 0
        positions = [order[s.name] for s in frag.slots]
        assert positions == sorted(positions), "slots must keep canonical order"
        seen += [s.name for s in frag.slots]
    assert sorted(seen) == sorted(order), "every tensor exactly once"
    assert layout.total_numel == sum(s.numel for s in layout.specs)
    assert len(layout.fingerprint) == 32


# --- determinism -------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
def test_same_input_same_layout(pattern: str) -> None:
    a = build_layout(llama_specs(), 8, pattern)
    b = build_layout(llama_specs(), 8, pattern)
    assert a == b
    assert a.fingerprint == b.fingerprint
    assert a.assignment == b.assignment
    assert_well_formed(a)


_CHILD = """
import sys
from tests.unit.test_layout import llama_specs
from yeto_core.layout import build_layout
layout = build_layout(llama_specs(), int(sys.argv[1]), sys.argv[2])
print(layout.fingerprint.hex())
print(",".join(map(str, layout.assignment)))
"""


@pytest.mark.parametrize("pattern", PATTERNS)
def test_same_layout_in_another_process(pattern: str) -> None:
    local = build_layout(llama_specs(), 6, pattern)
    # A different hash seed proves nothing rides on hash() or set order.
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, "6", pattern],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    assert out[0] == local.fingerprint.hex()
    assert out[1] == ",".join(map(str, local.assignment))


# --- binpack -----------------------------------------------------------------------------------


def test_binpack_is_balanced_on_a_realistic_model() -> None:
    layout = build_layout(llama_specs(), 8)
    assert_well_formed(layout)
    sizes = [f.numel for f in layout.fragments[1:]]
    assert max(sizes) / min(sizes) < 1.05, sizes


def test_binpack_largest_first_into_lightest_smallest_index_wins_ties() -> None:
    sizes = [1, 10, 3, 8]
    specs = [TensorSpec(f"t{i}", (n,), "float32") for i, n in enumerate(sizes)]
    # 10 → bin 0, 8 → bin 1, 3 → bin 1 (8 < 10), 1 → bin 0 (10 < 11).
    assert build_layout(specs, 2).assignment == (0, 0, 1, 1)
    equal = [TensorSpec(f"e{i}", (4,), "float32") for i in range(5)]
    # Equal sizes go in canonical order, each to the lightest bin, lowest index on ties.
    assert build_layout(equal, 2).assignment == (0, 1, 0, 1, 0)


def test_many_moe_tensors_into_32_fragments_fast() -> None:
    specs = moe_specs()
    assert len(specs) == 41_643
    t0 = time.perf_counter()
    layout = build_layout(specs, 32)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"build_layout took {elapsed:.2f}s"
    assert_well_formed(layout)
    sizes = [f.numel for f in layout.fragments[1:]]
    assert max(sizes) / min(sizes) < 1.01


# --- embedding and strided ---------------------------------------------------------------------


@pytest.mark.parametrize("pattern", PATTERNS)
def test_embedding_fragment_isolated(pattern: str) -> None:
    specs = llama_specs()
    specs[-1] = TensorSpec("lm_head.weight", specs[-1].shape, "bfloat16", embedding=True)
    layout = build_layout(specs, 5, pattern)
    assert_well_formed(layout)
    emb = layout.fragments[0]
    assert emb.embedding
    assert [s.name for s in emb.slots] == ["model.embed_tokens.weight", "lm_head.weight"]
    for frag in layout.fragments[1:]:
        assert not frag.embedding
        assert not any(s.embedding for s in frag.slots)


def test_single_fragment_holds_everything() -> None:
    specs = small_specs()
    layout = build_layout(specs, 1)
    assert_well_formed(layout)
    (frag,) = layout.fragments
    assert not frag.embedding
    assert [s.name for s in frag.slots] == [s.name for s in specs]
    assert [s.embedding for s in frag.slots] == [s.embedding for s in specs]


def test_without_embedding_all_fragments_are_filled() -> None:
    specs = [s for s in llama_specs() if not s.embedding]
    layout = build_layout(specs, 4)
    assert_well_formed(layout)
    assert not any(f.embedding for f in layout.fragments)


def test_strided_maps_layer_i_to_i_mod_b() -> None:
    specs = llama_specs(layers=12)
    layout = build_layout(specs, 5, "strided")  # fragment 0 = embedding, B = 4
    assert_well_formed(layout)
    for s in specs:
        layer = transformer_layer_index(s.name)
        if layer is not None:
            assert layout.fragment_of(s.name) == 1 + layer % 4, s.name
    # Tensors outside any layer land in the lightest fragment; all layers weigh the same here,
    # so the tie goes to the lowest index, and the big head then tips the norm elsewhere.
    assert layout.fragment_of("lm_head.weight") == 1
    assert layout.fragment_of("model.norm.weight") == 2


def test_strided_without_embedding() -> None:
    specs = [s for s in llama_specs(layers=6) if not s.embedding]
    layout = build_layout(specs, 3, "strided")
    for s in specs:
        layer = transformer_layer_index(s.name)
        if layer is not None:
            assert layout.fragment_of(s.name) == layer % 3


# --- fingerprint -------------------------------------------------------------------------------


def test_fingerprint_changes_with_every_input() -> None:
    base = small_specs()
    layout = build_layout(base, 3)
    assignment = layout.assignment

    def fp(
        specs: list[TensorSpec], assign: tuple[int, ...] = assignment, p: int = 3, pattern: str = "binpack"
    ) -> bytes:
        return layout_fingerprint(specs, assign, p, pattern)

    assert fp(base) == layout.fingerprint

    def replaced(i: int, **kw: object) -> list[TensorSpec]:
        s = base[i]
        fields = {"name": s.name, "shape": s.shape, "dtype": s.dtype, "embedding": s.embedding, **kw}
        return [*base[:i], TensorSpec(**fields), *base[i + 1 :]]  # type: ignore[arg-type]

    moved = list(assignment)
    moved[-1] = 1 if moved[-1] != 1 else 2
    variants = {
        "name": fp(replaced(2, name="layers.0.bias")),
        "shape": fp(replaced(2, shape=(2, 4))),
        "shape-rank": fp(replaced(2, shape=(8, 1))),
        "dtype": fp(replaced(2, dtype="bfloat16")),
        "embedding": fp(replaced(2, embedding=True)),
        "assignment": fp(base, tuple(moved)),
        "pattern": fp(base, pattern="strided"),
        "num_fragments": fp(base, p=4),
        "order": fp([base[1], base[0], *base[2:]], (assignment[1], assignment[0], *assignment[2:])),
    }
    values = [layout.fingerprint, *variants.values()]
    assert len(set(values)) == len(values), variants


def test_fingerprint_encoding_is_unambiguous() -> None:
    a = [TensorSpec("ab", (1,), "float32"), TensorSpec("c", (1,), "float32")]
    b = [TensorSpec("a", (1,), "float32"), TensorSpec("bc", (1,), "float32")]
    assert layout_fingerprint(a, (0, 0), 1, "binpack") != layout_fingerprint(b, (0, 0), 1, "binpack")
    c = [TensorSpec("x", (12, 1), "float32")]
    d = [TensorSpec("x", (1, 21), "float32")]
    assert layout_fingerprint(c, (0,), 1, "binpack") != layout_fingerprint(d, (0,), 1, "binpack")


def test_fingerprint_assignment_length_checked() -> None:
    with pytest.raises(ValueError, match="2 entries for 1 tensors"):
        layout_fingerprint([TensorSpec("x", (1,), "float32")], (0, 0), 1, "binpack")


# --- errors ------------------------------------------------------------------------------------


def test_empty_fragment_is_an_error() -> None:
    specs = [TensorSpec(f"t{i}", (4,), "float32") for i in range(3)]
    with pytest.raises(ValueError, match=r"3 tensors into 4 fragments"):
        build_layout(specs, 4)
    with_embedding = [TensorSpec("emb", (4,), "float32", embedding=True), *specs]
    with pytest.raises(ValueError, match=r"4 tensors into 5 fragments.*embedding"):
        build_layout(with_embedding, 5)
    # Strided: two layers cannot feed three fragments when nothing else is left to spread.
    layered = [TensorSpec(f"layers.{i}.w", (4,), "float32") for i in range(2)]
    layered.append(TensorSpec("layers.0.b", (4,), "float32"))
    with pytest.raises(ValueError, match=r"3 tensors into 3 fragments"):
        build_layout(layered, 3, "strided")
    zero = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (0, 4), "float32")]
    with pytest.raises(ValueError, match="empty"):
        build_layout(zero, 2)


def test_duplicate_name_is_an_error() -> None:
    specs = [*small_specs(), TensorSpec("layers.1.w", (2,), "float32")]
    with pytest.raises(ValueError, match=r"duplicate tensor name 'layers\.1\.w'"):
        build_layout(specs, 2)


def test_bad_pattern_and_count() -> None:
    with pytest.raises(ValueError, match="accepted: binpack, strided"):
        build_layout(small_specs(), 2, "roundrobin")
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="num_fragments"):
            build_layout(small_specs(), bad)


def test_bad_specs() -> None:
    with pytest.raises(ValueError, match=r"without 'torch\.'"):
        TensorSpec("x", (1,), "torch.float32")
    with pytest.raises(ValueError, match="negative"):
        TensorSpec("x", (-1,), "float32")
    with pytest.raises(ValueError, match="non-empty"):
        TensorSpec("", (1,), "float32")
    assert TensorSpec("x", torch.Size([2, 3]), "float32").shape == (2, 3)


def test_fragment_of_unknown_name() -> None:
    with pytest.raises(KeyError, match="nope"):
        build_layout(small_specs(), 2).fragment_of("nope")


# --- helpers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.7.mlp.up_proj.weight", 7),
        ("transformer.h.3.attn.c_attn.weight", 3),
        ("model.blocks.2.ln.weight", 2),
        ("decoder.layers.5.self_attention.linear_qkv.weight", 5),
        ("module.decoder.layers.11.mlp.experts.local_experts.3.linear_fc1.weight", 11),
        ("model.layers.12.mlp.experts.3.gate_proj.weight", 12),
        ("bert.encoder.layer.4.attention.self.query.weight", 4),
        ("layers.0.w", 0),
        ("base_model.model.model.layers.30.self_attn.q_proj.lora_A.default.weight", 30),
        ("model.embed_tokens.weight", None),
        ("lm_head.weight", None),
        ("model.norm.weight", None),
        ("transformer.wte.weight", None),
        ("model.layers_extra.3.weight", None),
        ("model.h.weight", None),
    ],
)
def test_transformer_layer_index(name: str, expected: int | None) -> None:
    assert transformer_layer_index(name) == expected


def test_specs_from_named_tensors() -> None:
    named = [
        ("embed.weight", torch.zeros(10, 4, dtype=torch.bfloat16)),
        ("layers.0.w", torch.zeros(4, 4)),
        ("scale", torch.zeros(())),
    ]
    specs = specs_from_named_tensors(named, embedding_names={"embed.weight", "lm_head.weight"})
    assert specs == [
        TensorSpec("embed.weight", (10, 4), "bfloat16", embedding=True),
        TensorSpec("layers.0.w", (4, 4), "float32"),
        TensorSpec("scale", (), "float32"),
    ]
    assert specs[2].numel == 1
