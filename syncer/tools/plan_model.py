"""What `yeto-plan` knows of a model: its tensors, from a preset, an HF `config.json` or the
safetensors headers of a checkpoint, read within bounds (a config of 10^9 layers, a header of
gigabytes or a shape of absurd rank is refused by name before anything is sized by it).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from syncer.tools.plan import MAX_TENSORS, Model, PlanError, Tensor

# Llama-2-7B and Llama-2-70B (their HF config.json), written out so nothing is downloaded.
PRESETS: dict[str, dict[str, Any]] = {
    "7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False},
    "70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False},
}
PRESET_NAMES = {"7b": "Llama-2-7B", "70b": "Llama-2-70B"}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
DEFAULT_LORA_TARGETS = ATTENTION
# Input embeddings as HF, GPT-2, BLOOM and Megatron name them (yeto_plugins/torch_dist/modules.embedding_names
# finds them from the live model; a checkpoint header only has names).
EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight")
# What a model input may hold; past these it is not a model this planner sizes, and it is refused
# before anything is built from it (a header's JSON takes ~15x its bytes in memory).
MAX_HEADER_BYTES = 16 << 20  # safetensors headers of --model, all files together (a 70B model's: ~0.3 MiB)
MAX_CONFIG_BYTES = 1 << 20  # an HF config.json is a few KiB
MAX_FILES = 1024  # .safetensors files in a --model dir
MAX_DIMS = 8  # of a tensor's shape
MAX_NUMEL = 1 << 48  # elements of one tensor
MAX_LORA_RANK = 1 << 16
# A Llama-like config's fields: required or not, and the largest value planned for.
CONFIG_FIELDS: dict[str, tuple[bool, int]] = {
    "hidden_size": (True, 1 << 20), "intermediate_size": (True, 1 << 22), "num_hidden_layers": (True, 1024),
    "num_attention_heads": (True, 1 << 16), "num_key_value_heads": (False, 1 << 16), "head_dim": (False, 1 << 16),
    "vocab_size": (True, 1 << 24),
}


# ---- models ---------------------------------------------------------------------------------------


def decoder_shape(cfg: Mapping[str, Any], where: str = "--model") -> dict[str, Any]:
    """`cfg` with its size fields checked (integers in the bounds of CONFIG_FIELDS) and the
    optional ones filled in as transformers does; a PlanError names the first bad field."""
    out = dict(cfg)
    for name, (required, most) in CONFIG_FIELDS.items():
        value = cfg.get(name)
        if value is None:
            if required:
                raise PlanError(f"{where}: the config lacks the decoder field {name}; a Llama-like config needs "
                                "hidden_size, intermediate_size, num_hidden_layers, num_attention_heads and vocab_size")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise PlanError(f"{where}: config field {name} = {shown}: must be an integer between 1 and {most}")
    out["num_key_value_heads"] = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    out["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if out["head_dim"] < 1:
        raise PlanError(f"{where}: config field num_attention_heads = {cfg['num_attention_heads']} is more than "
                        f"hidden_size = {cfg['hidden_size']} (no head_dim given)")
    return out


def _linear_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, int, bool]]:
    """(in, out, bias) of each projection of one decoder layer of a Llama / Mistral / Qwen2 / Qwen3
    config that `decoder_shape` has checked."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv, hd = cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    kind = str(cfg.get("model_type", "llama"))
    qkv_bias = kind == "qwen2" or bool(cfg.get("attention_bias", False))
    o_bias = kind != "qwen2" and bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False))
    return {"q_proj": (h, heads * hd, qkv_bias), "k_proj": (h, kv * hd, qkv_bias), "v_proj": (h, kv * hd, qkv_bias),
            "o_proj": (heads * hd, h, o_bias), "gate_proj": (h, inter, mlp_bias), "up_proj": (h, inter, mlp_bias),
            "down_proj": (inter, h, mlp_bias)}


def decoder_tensors(cfg: Mapping[str, Any], where: str = "--model") -> list[Tensor]:
    """`LlamaForCausalLM(cfg).named_parameters()` (and Mistral, Qwen2, Qwen3) as the planner needs
    them: names in order, element counts, the input embedding flagged; a tied head is the
    embedding's own tensor, so it is not listed twice."""
    cfg = decoder_shape(cfg, where)
    h, layers, vocab, hd = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"], cfg["head_dim"]
    shapes = _linear_shapes(cfg)
    out = [Tensor("model.embed_tokens.weight", vocab * h, embedding=True)]
    for i in range(layers):
        pre = f"model.layers.{i}."
        for name in (*ATTENTION, *MLP):
            fan_in, fan_out, bias = shapes[name]
            part = "self_attn" if name in ATTENTION else "mlp"
            out.append(Tensor(f"{pre}{part}.{name}.weight", fan_in * fan_out))
            if bias:
                out.append(Tensor(f"{pre}{part}.{name}.bias", fan_out))
            if name == "o_proj" and cfg.get("model_type") == "qwen3":
                out += [Tensor(f"{pre}self_attn.q_norm.weight", hd), Tensor(f"{pre}self_attn.k_norm.weight", hd)]
        out += [Tensor(f"{pre}input_layernorm.weight", h), Tensor(f"{pre}post_attention_layernorm.weight", h)]
    out.append(Tensor("model.norm.weight", h))
    if not cfg.get("tie_word_embeddings", True):  # transformers' default ties them
        out.append(Tensor("lm_head.weight", vocab * h))
    return out


def lora_tensors(cfg: Mapping[str, Any], rank: int, targets: Sequence[str], where: str = "--model") -> list[Tensor]:
    """The adapters PEFT adds (`lora_A` [r, in], `lora_B` [out, r] per targeted projection), the only
    tensors a LoRA island syncs (yeto_plugins/torch_dist/modules.synced_parameters)."""
    if not 1 <= rank <= MAX_LORA_RANK:
        raise PlanError(f"--lora-r {rank}: the rank must be between 1 and {MAX_LORA_RANK}")
    cfg = decoder_shape(cfg, where)
    shapes = _linear_shapes(cfg)
    unknown = [t for t in targets if t not in shapes]
    if unknown or not targets:
        raise PlanError(f"--lora-targets {','.join(targets)}: accepted: {', '.join(shapes)}")
    out = []
    for i in range(cfg["num_hidden_layers"]):
        for name in (*ATTENTION, *MLP):
            if name in targets:
                part = "self_attn" if name in ATTENTION else "mlp"
                pre = f"base_model.model.model.layers.{i}.{part}.{name}"
                fan_in, fan_out, _ = shapes[name]
                out += [Tensor(f"{pre}.lora_A.default.weight", rank * fan_in),
                        Tensor(f"{pre}.lora_B.default.weight", fan_out * rank)]
    return out


def _regular_file(path: Path, what: str) -> os.stat_result:
    """`path`'s stat when it is a regular file (a FIFO or a device would block or never end)."""
    try:
        info = path.stat()
    except OSError as exc:
        raise PlanError(f"--model {path}: cannot read {what} ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise PlanError(f"--model {path}: {what} is not a regular file")
    return info


def _json(raw: bytes) -> Any:
    """`raw` as JSON, or None when it is not (bad UTF-8, bad syntax, nested past the recursion limit)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def safetensors_header(path: Path, limit: int = MAX_HEADER_BYTES) -> tuple[dict[str, Any], int]:
    """The JSON header of a .safetensors file (8-byte little-endian length, then JSON) and its
    length: no tensor data is read, and no header longer than `limit` bytes."""
    _regular_file(path, "the safetensors file")
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PlanError(f"--model {path}: not a safetensors file (shorter than its 8-byte header length)")
            (size,) = struct.unpack("<Q", head)
            if size > limit:
                raise PlanError(f"--model {path}: a {size}-byte header is not a safetensors header this planner "
                                f"reads (at most {MAX_HEADER_BYTES} bytes, all files together)")
            raw = f.read(size)
    except OSError as exc:
        raise PlanError(f"--model {path}: cannot read it ({exc.strerror})") from None
    header = _json(raw)
    if not isinstance(header, dict) or len(raw) < size:
        raise PlanError(f"--model {path}: the safetensors header is not a JSON object")
    return header, size


def _numel(name: str, info: Any) -> int:
    shape = info.get("shape") if isinstance(info, dict) else None
    if not isinstance(shape, list):
        raise PlanError(f"--model: tensor {name!r} has no shape in the safetensors header")
    if len(shape) > MAX_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise PlanError(f"--model: tensor {name!r} has the shape {str(shape)[:40]}: at most {MAX_DIMS} dimensions, "
                        "each an integer >= 0")
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        raise PlanError(f"--model: tensor {name!r} of shape {shape} has more than {MAX_NUMEL} elements")
    return numel


def checkpoint_tensors(headers: Sequence[dict[str, Any]]) -> tuple[list[Tensor], int]:
    """The tensors a checkpoint's islands would sync, and all its parameters. A yeto syncer
    checkpoint (`param/<name>`, `momentum/<name>`) counts its params once; LoRA adapter tensors
    (names with `lora_`) are all that sync when present, as with `tuning auto`."""
    count = sum(len(h) for h in headers)
    # a syncer checkpoint lists each tensor two to four times (and a downlink chain's), plus metadata
    if count > 4 * MAX_TENSORS + len(headers):
        raise PlanError(f"--model: {count} tensors in the safetensors headers; at most {MAX_TENSORS} synced tensors "
                        "are planned for")
    entries = [(name, _numel(name, info)) for header in headers for name, info in header.items()
               if name != "__metadata__"]
    if entries and all(n.startswith(("param/", "momentum/", "accum/", "downlink")) for n, _ in entries):
        entries = [(n.removeprefix("param/"), k) for n, k in entries if n.startswith("param/")]
    total = sum(k for _, k in entries)
    adapters = [(n, k) for n, k in entries if "lora_" in n]
    synced = adapters or entries
    if len(synced) > MAX_TENSORS:
        raise PlanError(f"--model: {len(synced)} synced tensors; at most {MAX_TENSORS} are planned for")
    return [Tensor(n, k, embedding=not adapters and n.endswith(EMBEDDING_SUFFIXES)) for n, k in synced], total


def read_config(path: Path) -> dict[str, Any]:
    """The decoder's config of an HF config dir: its config.json (or that file's `text_config`)."""
    info = _regular_file(path / "config.json", "config.json")
    if info.st_size > MAX_CONFIG_BYTES:
        raise PlanError(f"--model {path}: config.json is {info.st_size} bytes; an HF config is at most "
                        f"{MAX_CONFIG_BYTES}")
    try:
        raw = (path / "config.json").read_bytes()[:MAX_CONFIG_BYTES + 1]
    except OSError as exc:
        raise PlanError(f"--model {path}: cannot read config.json ({exc.strerror})") from None
    cfg = _json(raw) if len(raw) <= MAX_CONFIG_BYTES else None
    if cfg is None:
        raise PlanError(f"--model {path}: config.json is not readable JSON")
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict):
        raise PlanError(f"--model {path}: config.json is not a JSON object")
    return cfg


def load_model(model: str | None, preset: str | None, lora_r: int, lora_targets: Sequence[str]) -> Model:
    if (model is None) == (preset is None):
        raise PlanError("give exactly one of --model DIR_OR_FILE and --preset 7b|70b")
    if preset is not None:
        cfg, name = PRESETS[preset], PRESET_NAMES[preset]
        return _from_config(cfg, name, lora_r, lora_targets, "--preset")
    assert model is not None
    path = Path(model)
    if path.is_dir() and (path / "config.json").exists():
        return _from_config(read_config(path), str(path.name or path), lora_r, lora_targets, f"--model {path}")
    files = sorted(itertools.islice(path.glob("*.safetensors"), MAX_FILES + 1)) if path.is_dir() else [path]
    if not files or not files[0].exists():
        raise PlanError(f"--model {path}: neither a config dir (config.json) nor a .safetensors file or dir")
    if len(files) > MAX_FILES:
        raise PlanError(f"--model {path}: more than {MAX_FILES} .safetensors files")
    if lora_r:
        raise PlanError("--lora-r: a checkpoint's LoRA tensors are read from it; give --lora-r with a config only")
    headers, budget = [], MAX_HEADER_BYTES
    for f in files:
        header, size = safetensors_header(f, budget)
        headers.append(header)
        budget -= size
    tensors, total = checkpoint_tensors(headers)
    tuning = "lora" if any("lora_" in t.name for t in tensors) else "full"
    return Model(path.name, tuple(tensors), total, tuning)


def _from_config(cfg: Mapping[str, Any], name: str, lora_r: int, targets: Sequence[str], where: str) -> Model:
    full = decoder_tensors(cfg, where)
    total = sum(t.numel for t in full)
    if not lora_r:
        return Model(name, tuple(full), total)
    adapters = lora_tensors(cfg, lora_r, targets, where)
    return Model(f"{name} + LoRA r={lora_r} on {','.join(targets)}", tuple(adapters),
                 total + sum(t.numel for t in adapters), "lora")


# ---- islands and the host ---------------------------------------------------------------------------
