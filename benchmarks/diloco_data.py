"""What `compare_diloco`'s arms train: two texts, three model families and two learning-rate schedules.

Nothing is downloaded. Tokens are bytes (vocabulary 256) of text that ships with Python:

* `help` — the English help texts of the language reference (`pydoc_data.topics`, the main job's
  data), topics in alphabetical order, about 0.47 MB;
* `code` — the standard library's own top-level modules (`Lib/*.py`), files in name order, the
  first 4 MiB: source, docstrings and comments, another distribution and another topic order.

Either is cut the same way: the last 5% is the held-out split every arm evaluates on (at most
EVAL_BLOCKS blocks of it, evenly spaced), the rest is cut into M contiguous shards, so each island
reads its own stretch of topics (or modules).

The families, each built from a config with the same width, depth and sequence length:

* `llama` — rotary positions, RMSNorm, SwiGLU, grouped-query attention, tied embeddings
  (`examples/hf_tiny_llama.py`'s model);
* `gpt2` — learned positions, LayerNorm, GELU, tied embeddings, no dropout;
* `neox` — GPT-NeoX as Pythia builds it: rotary positions on a quarter of each head, LayerNorm,
  GELU, attention and MLP side by side on one residual, separate input and output embeddings. It
  shares GPT-2's norm, activation and biases and the Llama's rotary positions, so where the two
  part ways it says which side a third family falls on.

A Llama can also take, one by one, what GPT-2 and NeoX have and it lacks (`llama+bias+ln`, …;
LLAMA_PARTS names them), so a gap between the families can be laid at one part's door or at none.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sysconfig
from functools import cache
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
CODE_BYTES = 4 << 20
EVAL_FRACTION = 0.05
FAMILIES = ("llama", "gpt2", "neox")
CORPORA = ("help", "code")
SCHEDULES = ("constant", "cosine")
COSINE_FLOOR = 0.1  # cosine decays the learning rate to this share of its peak
EVAL_BLOCKS = 512  # a longer held-out split is thinned to this many blocks, evenly spaced: evaluation stays cheap
# Each family trains at the peak learning rate where its `dp` does best on `help` (3 seeds, 288 steps, both
# schedules), so nothing yeto does can pass for a better schedule and neither family is held back by
# the other's rate. Llama: 1e-3, 2e-3 and 3e-3 cost its dp 2-8% (constant), 2e-3 and 3e-3 cost 4-6%
# (cosine). GPT-2: 1.5e-3 costs 2.3% (constant) and 3.8% (cosine); 3e-3 is 0.4% worse (constant) and
# 0.7% better (cosine) with three times the spread of seeds, and 4e-3 and 6e-3 diverge (+6%, +28%).
# NeoX: the mean over both schedules is best at 3e-3; 2e-3 is 0.7% better (constant) and 1.4% worse
# (cosine), 1.5e-3 1.7% and 4.1% worse, 4e-3 2.5% and 0.2% worse with three times the spread of seeds.
FAMILY_LR = {"llama": 1.5e-3, "gpt2": 2e-3, "neox": 3e-3}
# What GPT-2 and NeoX have that the Llama lacks, each a change to its config (or its norms):
LLAMA_PARTS = {
    "bias": "a bias on every linear layer",
    "ln": "LayerNorm (with a bias) in place of RMSNorm",
    "gelu": "GELU in place of SiLU in the gated MLP",
    "untied": "separate input and output embeddings",
    "wide": "an MLP 4x the width, as GPT-2's and NeoX's",
    "mha": "as many key/value heads as query heads",
}


@cache
def example() -> Any:
    """`examples/hf_tiny_llama.py` as a module: the main job's data and model."""
    spec = importlib.util.spec_from_file_location("hf_tiny_llama", ROOT / "examples" / "hf_tiny_llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_bytes() -> bytes:
    """The standard library's top-level modules, in name order, up to CODE_BYTES."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    out = bytearray()
    for path in files:
        out += path.read_bytes() + b"\n\n"
        if len(out) >= CODE_BYTES:
            break
    return bytes(out[:CODE_BYTES])


@cache
def corpus_bytes(corpus: str) -> bytes:
    if corpus == "help":
        return bytes(example().english_bytes())
    if corpus == "code":
        return code_bytes()
    raise ValueError(f"unknown corpus {corpus!r}; known: {', '.join(CORPORA)}")


def blocks(data: bytes, seq_len: int) -> torch.Tensor:
    usable = len(data) // seq_len * seq_len
    return torch.frombuffer(bytearray(data[:usable]), dtype=torch.uint8).long().view(-1, seq_len)


def shard(corpus: str, seq_len: int, index: int, count: int) -> torch.Tensor:
    """Training blocks of shard `index` of `count` (contiguous; count 1 is all of the training text)."""
    data = corpus_bytes(corpus)
    train = data[: int(len(data) * (1 - EVAL_FRACTION))]
    size = len(train) // count
    return blocks(train[index * size : (index + 1) * size], seq_len)


def held_out(corpus: str, seq_len: int) -> torch.Tensor:
    data = corpus_bytes(corpus)
    out = blocks(data[int(len(data) * (1 - EVAL_FRACTION)) :], seq_len)
    if len(out) <= EVAL_BLOCKS:
        return out
    return out[torch.linspace(0, len(out) - 1, EVAL_BLOCKS).long()]


def check_family(family: str) -> str:
    """`family` if it names one: a family of FAMILIES, or `llama+PART+...` with parts of LLAMA_PARTS."""
    base, *parts = family.split("+")
    if base not in FAMILIES or (parts and base != "llama"):
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}, or llama+PART+... "
                         f"with parts {', '.join(LLAMA_PARTS)}")
    if unknown := [part for part in parts if part not in LLAMA_PARTS]:
        raise ValueError(f"family {family!r}: unknown part {unknown[0]!r}; known: {', '.join(LLAMA_PARTS)}")
    if len(set(parts)) != len(parts):
        raise ValueError(f"family {family!r} names a part twice")
    return family


def family_lr(family: str) -> float:
    """The peak learning rate of `family`: its base family's (a Llama with parts takes the Llama's)."""
    return FAMILY_LR[check_family(family).split("+")[0]]


def llama_with(parts: list[str], hidden: int, layers: int, seq_len: int, seed: int) -> torch.nn.Module:
    """The bench Llama (`examples/hf_tiny_llama.py`'s) with LLAMA_PARTS `parts`."""
    overrides: dict[str, Any] = {}
    if "bias" in parts:
        overrides.update(attention_bias=True, mlp_bias=True)
    if "gelu" in parts:
        overrides.update(hidden_act="gelu")
    if "untied" in parts:
        overrides.update(tie_word_embeddings=False)
    if "wide" in parts:
        overrides.update(intermediate_size=4 * hidden)
    if "mha" in parts:
        overrides.update(num_key_value_heads=4)
    shape = argparse.Namespace(hidden=hidden, layers=layers, seq_len=seq_len, seed=seed)
    model = example().build_model(shape, **overrides)
    if "ln" in parts:  # LayerNorm's init (ones, zeros) draws nothing: the other weights stay those of `seed`
        for layer in model.model.layers:
            layer.input_layernorm = torch.nn.LayerNorm(hidden, eps=1e-5)
            layer.post_attention_layernorm = torch.nn.LayerNorm(hidden, eps=1e-5)
        model.model.norm = torch.nn.LayerNorm(hidden, eps=1e-5)
    return model


def build_model(family: str, hidden: int, layers: int, seq_len: int, seed: int) -> torch.nn.Module:
    """A causal LM of `family` from a config, its weights drawn from `seed`."""
    if family.startswith("llama+"):
        return llama_with(check_family(family).split("+")[1:], hidden, layers, seq_len, seed)
    if family == "llama":
        return example().build_model(argparse.Namespace(hidden=hidden, layers=layers, seq_len=seq_len, seed=seed))
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=hidden, n_layer=layers, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                            bos_token_id=None, eos_token_id=None)
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config)
    if family == "neox":
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        config = GPTNeoXConfig(vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                               intermediate_size=4 * hidden, rotary_pct=0.25, max_position_embeddings=seq_len,
                               use_parallel_residual=True, tie_word_embeddings=False, hidden_dropout=0.0,
                               attention_dropout=0.0, bos_token_id=None, eos_token_id=None)
        torch.manual_seed(seed)
        return GPTNeoXForCausalLM(config)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def lr_factor(schedule: str, warmup: int, steps: int, step: int) -> float:
    """The learning rate of optimizer step `step` (from 0) as a share of the peak: a linear warm-up
    of `warmup` steps, then constant (HF's `constant_with_warmup`) or a cosine down to COSINE_FLOOR
    at the last step."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(SCHEDULES)}")


__all__ = ["CORPORA", "FAMILIES", "FAMILY_LR", "LLAMA_PARTS", "SCHEDULES", "build_model", "check_family", "family_lr",
           "held_out", "lr_factor", "shard"]
