"""`yeto-export`: turn a syncer checkpoint into a Hugging Face model directory (DESIGN §6.5).

    yeto-export --checkpoint syncer.safetensors --model CONFIG_DIR_OR_CACHED_ID --output-dir out/
    yeto-export --checkpoint syncer.safetensors --model BASE_MODEL --adapter-config ADAPTER_DIR --output-dir out/

The checkpoint alone is the source: no learner has to be alive. The model skeleton comes from
``AutoConfig`` + ``AutoModelForCausalLM.from_config`` (local files only, nothing is downloaded);
every ``param/<name>`` tensor of the checkpoint is copied into the parameter of the same name,
and the result is written with ``save_pretrained`` (safetensors) next to a small
``yeto_export.json`` that says where the weights came from. A checkpoint that does not fit the
model (missing or unexpected tensors, other shapes) is refused with one message naming them.
Log lines go to stderr; the exit status is 0 on success and 2 on any bad input.

A LoRA run's checkpoint holds only the adapter tensors (the trainable ones). Its export needs
the base model's weights (``--model``: a directory or cached id ``from_pretrained`` loads) and the
adapter's configuration (``--adapter-config``: PEFT's ``adapter_config.json``, or the directory
holding it, as ``save_pretrained`` of the learner's PEFT model writes it). It writes both the
merged model (``output_dir``, adapters folded into the base weights) and the adapter alone
(``output_dir/adapter``, loadable with ``PeftModel.from_pretrained``). An adapter config the
checkpoint does not match is refused before any model is loaded: one given for a full-tuning
checkpoint (no LoRA tensors), or one whose ``target_modules`` or rank (``r``, ``rank_pattern``)
differ from the checkpoint's LoRA tensors, with what differs named.

Bad input is one line on stderr and exit status 2, before anything is written: the progress
lines come only once the checkpoint is known to fit the model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import stat
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from syncer.durability.checkpoint import CheckpointError, SyncerState, load_checkpoint
from syncer.tools.tool_args import ToolParser, one_line, unwritable_dir

EXPORT_INFO = "yeto_export.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SHOW = 8  # names listed per kind of problem in an error message
MAX_ADAPTER_CONFIG_BYTES = 1 << 20  # PEFT's adapter_config.json is a few KiB
# PEFT's adapter tensors: `<module>.lora_A.<adapter>.weight` [r, in] and `lora_B` [out, r] of a
# linear layer, `lora_embedding_A.<adapter>` [r, vocab] and `lora_embedding_B` [dim, r] of an embedding.
_LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?:embedding_)?(?P<half>[AB])"
                          r"(?:\.[^.]+)?(?:\.weight)?$")


class ExportError(Exception):
    """A bad input to the export; the message says what is wrong and how to fix it."""


def log(message: str) -> None:
    print(f"yeto-export: {message}", file=sys.stderr, flush=True)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOW])
    return shown + (f", ... ({len(names) - _SHOW} more)" if len(names) > _SHOW else "")


def checkpoint_tensors(state: SyncerState) -> dict[str, torch.Tensor]:
    """The checkpoint's global parameters in model shapes, keyed by model tensor name (views into
    the per-fragment flat buffers)."""
    from yeto_core.layout import build_layout

    layout = build_layout(state.specs, state.num_fragments, state.pattern)
    out: dict[str, torch.Tensor] = {}
    for frag in layout.fragments:
        buf = state.params[frag.index]
        for slot in frag.slots:
            out[slot.name] = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return out


def load_skeleton(model: str) -> Any:
    """An untrained causal-LM built from the config of `model` (a directory or a cached id)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError for assorted problems
        raise ExportError(
            f"cannot load a model config from {model!r} (a config directory or a model id already in the "
            f"local cache; nothing is downloaded): {exc}"
        ) from exc
    try:
        return AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        raise ExportError(f"cannot build a causal-LM model from the config of {model!r}: {exc}") from exc


def copy_into(net: torch.nn.Module, tensors: dict[str, torch.Tensor], *, allow_missing: bool) -> list[str]:
    """Copy every checkpoint tensor into the same-named parameter of `net`; returns the names of
    parameters left at their initial values (only with `allow_missing`).

    Tied parameters count once, under the first name ``named_parameters`` gives them (the name the
    learners sync them under); a checkpoint that stores one under another of its names is accepted.
    """
    params = dict(net.named_parameters())
    alias: dict[str, str] = {}
    first_name = {id(p): name for name, p in params.items()}
    for name, p in net.named_parameters(remove_duplicate=False):
        alias[name] = first_name[id(p)]

    unexpected = sorted(n for n in tensors if n not in alias)
    targets: dict[str, str] = {}  # canonical parameter name -> checkpoint name
    duplicated: list[str] = []
    for n in sorted(tensors):
        if n in alias:
            canonical = alias[n]
            if canonical in targets:
                duplicated.append(f"{n} (tied to {targets[canonical]})")
            targets[canonical] = n
    missing = sorted(n for n in params if n not in targets)
    mismatched = [
        f"{targets[n]}: checkpoint {list(tensors[targets[n]].shape)}, model {list(params[n].shape)}"
        for n in sorted(targets)
        if tuple(tensors[targets[n]].shape) != tuple(params[n].shape)
    ]
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {_listed(mismatched)}")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensor(s) the model does not have: {_listed(unexpected)}")
    if duplicated:
        problems.append(f"tied tensors stored twice: {_listed(duplicated)}")
    if missing and not allow_missing:
        problems.append(
            f"{len(missing)} model parameter(s) not in the checkpoint: {_listed(missing)} "
            "(frozen parameters? pass --allow-missing to keep the config's initial values for them)"
        )
    if problems:
        raise ExportError(
            "the checkpoint does not fit the model built from --model (wrong config?): " + "; ".join(problems)
        )
    with torch.no_grad():
        for canonical, n in targets.items():
            params[canonical].copy_(tensors[n])
    return missing


def adapter_config_file(adapter_config: Path) -> Path:
    return adapter_config / "adapter_config.json" if adapter_config.is_dir() else adapter_config


def read_adapter_config(adapter_config: Path) -> dict[str, Any]:
    """PEFT's adapter_config.json (or the directory holding it) as a JSON object, read without
    PEFT: a regular file of at most MAX_ADAPTER_CONFIG_BYTES."""
    path = adapter_config_file(adapter_config)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ExportError(f"--adapter-config {path} is not a regular file")
        if info.st_size > MAX_ADAPTER_CONFIG_BYTES:
            raise ExportError(f"--adapter-config {path}: {info.st_size} bytes is not a PEFT adapter config")
        raw = path.read_bytes()[: MAX_ADAPTER_CONFIG_BYTES + 1]
    except OSError as exc:
        raise ExportError(f"--adapter-config {path}: cannot read it ({exc.strerror})") from None
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise ExportError(f"--adapter-config {path} is not a JSON object (PEFT's adapter_config.json)")
    return config


def checkpoint_lora_ranks(state: SyncerState) -> dict[str, int]:
    """The rank of each module the checkpoint's LoRA tensors adapt (lora_A's rows, lora_B's columns),
    keyed by the module's name in the base model."""
    ranks: dict[str, int] = {}
    for spec in state.specs:
        m = _LORA_TENSOR.match(spec.name)
        if m is None or len(spec.shape) != 2:
            continue
        ranks.setdefault(m.group("module"), spec.shape[0] if m.group("half") == "A" else spec.shape[1])
    return ranks


def _targeted(module: str, targets: Any) -> bool:
    """PEFT's `check_target_module_exists`: a regex matches the whole name, a name its last parts."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith(f".{t}") for t in targets)


def _pattern_rank(module: str, rank_pattern: dict[str, Any], r: int) -> Any:
    """PEFT's rank_pattern: the rank of the first pattern matching the end of the module's name."""
    for pattern, rank in rank_pattern.items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            return rank
    return r


def _target_problems(targets: Any, ranks: dict[str, int], path: Path, excluded: bool) -> list[str]:
    """How PEFT's `target_modules` (a list of names or a regex) differ from the modules the
    checkpoint's LoRA tensors adapt; "all-linear" and None are resolved by PEFT from the model.
    With `exclude_modules` (`excluded`) a named target may rightly adapt nothing."""
    if targets is None or targets == "all-linear":
        return []
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        raise ExportError(f"--adapter-config {path}: its target_modules is neither a list of names nor a regex")
    try:
        stray = sorted({m.rsplit(".", 1)[-1] for m in ranks if not _targeted(m, targets)})
    except re.error as exc:
        raise ExportError(f"--adapter-config {path}: its target_modules {targets!r} is not a regex ({exc})") from None
    shown = _listed(sorted(targets)) if isinstance(targets, list) else repr(targets)
    problems = [f"the checkpoint has LoRA tensors for {_listed(stray)}, which its target_modules {shown} do not "
                "adapt"] if stray else []
    lacking = sorted(t for t in targets if not any(_targeted(m, [t]) for m in ranks)) \
        if isinstance(targets, list) and not excluded else []
    if lacking:
        problems.append(f"its target_modules name {_listed(lacking)}, which the checkpoint has no LoRA tensors for")
    return problems


def check_adapter(config: dict[str, Any], path: Path, ranks: dict[str, int]) -> None:
    """Refuse an adapter config whose target modules or ranks are not the checkpoint's: one
    ExportError naming each difference (`ranks`: `checkpoint_lora_ranks`)."""
    r, pattern = config.get("r"), config.get("rank_pattern") or {}
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ExportError(f"--adapter-config {path}: its rank r = {str(r)[:40]} is not an integer >= 1")
    if not isinstance(pattern, dict):
        raise ExportError(f"--adapter-config {path}: its rank_pattern is not a JSON object")
    problems = _target_problems(config.get("target_modules"), ranks, path, bool(config.get("exclude_modules")))
    try:
        wrong = sorted((m, rank, _pattern_rank(m, pattern, r)) for m, rank in ranks.items()
                       if rank != _pattern_rank(m, pattern, r))
    except re.error as exc:
        raise ExportError(f"--adapter-config {path}: a rank_pattern key is not a regex ({exc})") from None
    if wrong:
        module, rank, expected = wrong[0]
        found = sorted({str(w[1]) for w in wrong})
        problems.append(f"its rank is {expected} (r{' / rank_pattern' if pattern else ''}), but the checkpoint's LoRA "
                        f"tensors have rank {', '.join(found)} ({len(wrong)} module(s), e.g. {module}: {rank})")
    if problems:
        raise ExportError(f"--adapter-config {path} does not match the checkpoint: " + "; ".join(problems))


def lora_model(model: str, adapter_config: Path, tensors: dict[str, torch.Tensor]) -> tuple[Any, list[str]]:
    """The base model of `model` with the adapter of `adapter_config`, holding the checkpoint's
    adapter tensors; returns it and the base parameters it kept as loaded."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ExportError("exporting a LoRA checkpoint needs the peft package (pip install peft)") from exc
    from transformers import AutoModelForCausalLM

    path = adapter_config_file(adapter_config)
    try:
        config = LoraConfig.from_json_file(str(path))
        config.pop("peft_type", None)
        lora_config = LoraConfig(**{k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__})
    except (OSError, ValueError, TypeError) as exc:
        raise ExportError(f"cannot read a LoRA adapter config from {path}: {exc}") from exc
    try:
        base = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32)
    except Exception as exc:  # transformers raises assorted errors for a missing or partial model
        raise ExportError(f"cannot load the base model's weights from {model!r} (a LoRA export needs the base "
                          f"model the run started from, not only its config): {exc}") from exc
    net = get_peft_model(base, lora_config)
    left = copy_into(net, tensors, allow_missing=True)  # the frozen base weights stay as loaded
    if stray := [n for n in left if "lora_" in n]:
        raise ExportError(f"the adapter config of {path} makes {len(stray)} adapter tensor(s) the checkpoint "
                          f"lacks: {_listed(stray)} (another rank or other target modules?)")
    return net, left


def export(checkpoint: Path, model: str, output_dir: Path, *, dtype: str = "float32",
           allow_missing: bool = False, adapter_config: Path | None = None,
           overwrite: bool = False) -> dict[str, Any]:
    """Write the checkpoint's weights as a Hugging Face model under `output_dir`; returns the
    provenance record written to ``yeto_export.json``. A non-empty `output_dir` is refused unless
    `overwrite`: an export must never silently replace a model."""
    if output_dir.exists() and (not output_dir.is_dir() or any(output_dir.iterdir())) and not overwrite:
        raise ExportError(f"--output-dir {output_dir} exists and is not empty; choose another directory or pass "
                          "--overwrite")
    if (problem := unwritable_dir(output_dir)) is not None:
        raise ExportError(f"--output-dir {output_dir}: {problem}")
    try:
        state = load_checkpoint(checkpoint)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from exc
    names = [s.name for s in state.specs]
    lora = [n for n in names if "lora_" in n]
    if lora and adapter_config is None:
        raise ExportError(f"checkpoint {checkpoint} holds LoRA adapter weights ({_listed(lora)}): pass "
                          "--adapter-config (the adapter_config.json of the run's PEFT model, or its directory)")
    if adapter_config is not None and not lora:
        raise ExportError(f"--adapter-config {adapter_config}: checkpoint {checkpoint} holds no LoRA adapter tensors "
                          "(a full-tuning run's); export it without --adapter-config")
    if adapter_config is not None:
        check_adapter(read_adapter_config(adapter_config), adapter_config_file(adapter_config),
                      checkpoint_lora_ranks(state))

    # The model is built and filled before the first progress line, so bad input is one line.
    tensors = checkpoint_tensors(state)
    if lora:
        assert adapter_config is not None
        net, left = lora_model(model, adapter_config, tensors)
    else:
        net = load_skeleton(model)
        left = copy_into(net, tensors, allow_missing=allow_missing)
    if not state.finalized:
        log(f"warning: checkpoint {checkpoint.name} is not finalized (the run had not ended); "
            f"exporting the global model as of round {state.next_round}")
    log(f"checkpoint {checkpoint.name}: {len(names)} tensors, {state.num_fragments} fragments, "
        f"versions {state.versions}, next round {state.next_round}; "
        + (f"adapters on the base model of {model}" if lora else f"the model built from {model}"))
    if left and not lora:
        log(f"kept the config's initial values for {len(left)} parameter(s) not in the checkpoint: {_listed(left)}")
    adapter_dir = output_dir / "adapter" if lora else None
    try:
        if adapter_dir is not None:
            adapter_dir.mkdir(parents=True, exist_ok=True)
            log(f"writing the adapter to {adapter_dir}")
            net.save_pretrained(adapter_dir, safe_serialization=True)
            net = net.merge_and_unload()  # the adapters folded into the base weights
        if dtype != "float32":
            net = net.to(_DTYPES[dtype])
        net.config.dtype = _DTYPES[dtype]  # recorded in config.json, so from_pretrained keeps it
        output_dir.mkdir(parents=True, exist_ok=True)
        log(f"writing {output_dir} ({dtype})")
        net.save_pretrained(output_dir, safe_serialization=True)
    except OSError as exc:
        raise ExportError(f"--output-dir {output_dir}: cannot write the model ({exc.strerror or exc})") from exc
    info = {
        "checkpoint": checkpoint.name,
        "model": Path(model).name if Path(model).exists() else model,
        "dtype": dtype,
        "versions": [int(v) for v in state.versions],
        "next_round": int(state.next_round),
        "finalized": bool(state.finalized),
        "fingerprint": state.fingerprint.hex(),
        "backend": state.backend,
        "tensors": len(names),
        "kept_initial": [] if lora else left,
        "lora": {"tensors": len(lora), "adapter": "adapter"} if adapter_dir is not None else None,
        "yeto": _version("yeto"),
        "transformers": _version("transformers"),
        "torch": torch.__version__,
    }
    try:
        (output_dir / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise ExportError(f"--output-dir {output_dir}: cannot write {EXPORT_INFO} ({exc.strerror})") from exc
    log(f"done: {output_dir} loads with AutoModelForCausalLM.from_pretrained")
    return info


def main(argv: list[str] | None = None) -> int:
    p = ToolParser(prog="yeto-export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, required=True, help="the syncer's checkpoint (safetensors)")
    p.add_argument("--model", required=True,
                   help="a config directory or a model id already in the local cache (never downloaded)")
    p.add_argument("--output-dir", type=Path, required=True, help="where to write the Hugging Face model")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="dtype of the written weights")
    p.add_argument("--allow-missing", action="store_true",
                   help="keep the config's initial values for model parameters the checkpoint lacks "
                        "(frozen parameters that were never synced)")
    p.add_argument("--adapter-config", type=Path, default=None,
                   help="for a LoRA run: the PEFT adapter_config.json (or its directory); --model is then the "
                        "base model with its weights")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --output-dir")
    args = p.parse_args(argv)
    try:
        # Libraries imported on the way (e.g. DeepSpeed, through accelerate, when it is installed)
        # log to stdout; like ours, their lines belong on stderr.
        with contextlib.redirect_stdout(sys.stderr):
            export(args.checkpoint, args.model, args.output_dir, dtype=args.dtype,
                   allow_missing=args.allow_missing, adapter_config=args.adapter_config, overwrite=args.overwrite)
    except ExportError as exc:
        print(one_line(f"yeto-export: error: {exc}"), file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
