"""One yeto island: a small Llama trained with the HF Trainer and the YetoDiLoCo callback.

Nothing is downloaded. The model is built from a config; tokens are bytes (vocabulary 256) of
real English text that ships with Python (`pydoc_data.topics`, the help texts of the language
reference). Each learner trains on its own shard; every learner evaluates on the same held-out
split. At the end the final model (the syncer's final cut, when it arrived) is saved with
`save_pretrained`.

    YETO_DILOCO_SYNCER=127.0.0.1:7070 YETO_DILOCO_KEY_FILE=key YETO_DILOCO_LEARNER_ID=0 \\
        python examples/hf_tiny_llama.py --output-dir out/learner0 --max-steps 300

Progress goes to stdout as JSON lines (`{"event": "train", ...}`), so a driver can follow it.
`--no-sync` trains the same island alone (the synchronous-free local baseline).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset


def english_bytes() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class ByteBlocks(Dataset):
    """Non-overlapping blocks of `seq_len` byte tokens; labels are the inputs (the model shifts)."""

    def __init__(self, data: bytes, seq_len: int) -> None:
        usable = len(data) // seq_len * seq_len
        self.blocks = torch.frombuffer(bytearray(data[:usable]), dtype=torch.uint8).long().view(-1, seq_len)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.blocks[i]
        return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def splits(seq_len: int, shard: int, num_shards: int, eval_fraction: float = 0.05) -> tuple[ByteBlocks, ByteBlocks]:
    data = english_bytes()
    cut = int(len(data) * (1 - eval_fraction))
    train, held_out = data[:cut], data[cut:]
    size = len(train) // num_shards
    return ByteBlocks(train[shard * size : (shard + 1) * size], seq_len), ByteBlocks(held_out, seq_len)


def family_config(model_type: str, args: argparse.Namespace) -> Any:
    """A small config of any causal-LM family transformers builds from a config alone
    (`AutoConfig.for_model`), at the sizes `args` asks for, with byte tokens and no special ids."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(
            model_type, vocab_size=256, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
            intermediate_size=args.hidden * 2, max_position_embeddings=args.seq_len, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
    except ValueError:  # transformers' own message lists every model type it knows, hundreds of them
        print(f"hf_tiny_llama: --model-type {model_type}: not a model type this transformers knows "
              "(AutoConfig.for_model)", file=sys.stderr)
        raise SystemExit(2) from None
    # transformers maps most families' own names (GPT-2's n_embd, n_layer, n_head) to the ones
    # above; these are set only where the family has them: positions, grouped-query heads, experts.
    where_present = {"n_positions": args.seq_len, "n_ctx": args.seq_len, "num_key_value_heads": 2,
                     "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
                     "moe_intermediate_size": args.hidden, "shared_expert_intermediate_size": args.hidden}
    for name, value in where_present.items():
        if hasattr(config, name):
            setattr(config, name, value)
    return config


def build_model(args: argparse.Namespace, **config: Any) -> torch.nn.Module:
    """The tiny Llama, its weights drawn from `args.seed`; `config` overrides LlamaConfig fields.
    With `args.model_type` other than llama, that family's small model (`family_config`) instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_type = getattr(args, "model_type", "llama")
    if model_type != "llama":
        from transformers import AutoModelForCausalLM

        family = family_config(model_type, args)
        for name, value in config.items():
            setattr(family, name, value)
        torch.manual_seed(args.seed)
        return AutoModelForCausalLM.from_config(family)

    fields: dict[str, Any] = dict(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq_len, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    config = LlamaConfig(**{**fields, **config})
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config)


def emit(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", type=Path, required=True)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--model-type", default="llama",
                   help="the model family: llama (the default), or any causal-LM model type transformers can "
                        "build from a config alone (gpt2, gpt_neox, qwen2, mixtral, qwen3_moe, gemma, opt, mamba, ...)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=2, help="how many learners share the training text")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (several processes share the CPU)")
    p.add_argument("--no-sync", action="store_true", help="train alone, without a syncer")
    p.add_argument("--lora-r", type=int, default=0,
                   help="train LoRA adapters of this rank on q_proj/v_proj (needs peft); 0: full fine-tuning")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    if not args.no_sync:  # a bad YETO_DILOCO_* value fails now, not after transformers loads
        from yeto_core.settings import LearnerSettings, SettingsError, load_settings

        try:
            load_settings(LearnerSettings).read_key()
        except SettingsError as exc:
            print(f"hf_tiny_llama: {exc}", file=sys.stderr)
            return 2
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    learner_id = int(os.environ.get("YETO_DILOCO_LEARNER_ID", "0"))
    train_set, eval_set = splits(args.seq_len, learner_id % args.num_shards, args.num_shards)
    model = build_model(args)
    if args.lora_r:  # only the adapters train, so only they cross the wire
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                                 target_modules=["q_proj", "v_proj"]))

    class JsonProgress(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            if logs and "loss" in logs:
                emit("train", learner=learner_id, step=state.global_step, loss=round(float(logs["loss"]), 4),
                     pushes=logs.get("yeto_pushes"), installs=logs.get("yeto_installs"),
                     consensus_js=logs.get("yeto_consensus_js"), fragment_l2=logs.get("yeto_fragment_l2_mean"),
                     moments_shared=logs.get("yeto_moments_shared"))

    callbacks: list[TrainerCallback] = [JsonProgress()]
    yeto = None
    if not args.no_sync:
        from yeto_plugins.hf import YetoDiLoCo

        yeto = YetoDiLoCo()
        callbacks.insert(0, yeto)
    targs = TrainingArguments(
        output_dir=str(args.output_dir), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=32, learning_rate=args.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=min(20, args.max_steps // 10), weight_decay=0.0, logging_steps=10, save_strategy="no",
        report_to=[], use_cpu=True, dataloader_num_workers=0, seed=args.seed, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=train_set, eval_dataset=eval_set, callbacks=callbacks)
    first = trainer.evaluate()["eval_loss"]
    emit("eval", learner=learner_id, phase="initial", loss=round(first, 4))
    refusal: tuple[type[Exception], ...] = ()
    if yeto is not None:
        from yeto_core.refusal import IslandRefused

        refusal = (IslandRefused,)
    try:
        result = trainer.train()
    except refusal as exc:  # the syncer refused this island for good: one line, not a traceback
        print(f"hf_tiny_llama: IslandRefused: {exc}", file=sys.stderr)
        return 3
    final = trainer.evaluate()["eval_loss"]
    final_installed = bool(yeto and yeto.final_installed)
    emit("eval", learner=learner_id, phase="final", loss=round(final, 4), final_cut=final_installed,
         steps=result.global_step, bytes_pushed=yeto.session.stats.bytes_pushed if yeto and yeto.session else 0,
         pushes=yeto.session.stats.pushes if yeto and yeto.session else 0)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: what every rank holds, to compare
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode() + tensor.detach().float().contiguous().numpy().tobytes())
        emit("weights", learner=learner_id, rank=int(os.environ["RANK"]), sha256=digest.hexdigest(),
             final_cut=final_installed, steps=result.global_step)
    if trainer.is_world_process_zero():
        model.save_pretrained(args.output_dir)
        emit("saved", learner=learner_id, dir=str(args.output_dir), final_cut=final_installed)
    return 0


def exit_rank(code: int) -> None:
    """End a torchrun rank without the interpreter's teardown, once atexit has run.

    At finalization a gloo worker thread that drops the last reference to a collective's tensor
    must take the GIL; Python ends such a thread with pthread_exit, whose unwinding through
    torch's noexcept code aborts the rank ("terminate called without an active exception") after
    its work is done and saved (pytorch/pytorch PR 179291 describes it). Skipping finalization
    skips that race; the output is flushed first."""
    import atexit
    import logging
    import threading

    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads end as at a normal exit
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_rank(status)
    sys.exit(status)
