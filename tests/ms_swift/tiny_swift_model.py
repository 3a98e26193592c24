"""A tiny Qwen2 checkpoint and chat data that `swift sft` trains offline.

swift loads the tokenizer, the config and the weights from one local directory (`--model DIR`) and renders
each sample with its `qwen2_5` template, whose turns are wrapped in `<|im_start|>` and `<|im_end|>`: the
tokenizer must have both as special tokens. It is a byte-level BPE learnt here from the help texts that ship
with Python, so every character encodes and transformers' Qwen2 tokenizer rebuilds it unchanged (it
rebuilds qwen2 tokenizers from their vocabulary and merges). Nothing is downloaded.
"""

from __future__ import annotations

import json
import pydoc_data.topics
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB_SIZE = 512
PAD, START, END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
ANSWER_CHARS = 240  # keeps every sample well inside --max_length 512


def topics() -> list[tuple[str, str]]:
    return sorted(pydoc_data.topics.topics.items())


def write_tiny_model(directory: Path) -> Path:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[PAD, START, END], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([text for _, text in topics()], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=END,
                                        additional_special_tokens=[START, END])
    tokenizer.save_pretrained(directory)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def write_shards(directory: Path, islands: int) -> list[Path]:
    """One chat dataset (swift's `messages` JSONL) per island: every island-th topic, asked and answered."""
    samples = [{"messages": [{"role": "user", "content": f"What is {name}?"},
                             {"role": "assistant", "content": text[:ANSWER_CHARS]}]} for name, text in topics()]
    shards = []
    for island in range(islands):
        path = directory / f"shard{island}.jsonl"
        path.write_text("".join(json.dumps(sample) + "\n" for sample in samples[island::islands]))
        shards.append(path)
    return shards
