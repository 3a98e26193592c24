"""A tiny Qwen2 causal LM and a character-level tokenizer, written offline for the verl CPU harness.

verl's ``HFModelConfig`` (verl/workers/config/model.py:148-228) loads the tokenizer, the processor, the
generation config and the HF config from one local path, so the directory must look like a real
checkpoint. Everything here is built from code: no hub access, no downloads.

Why byte-level BPE without merges rather than a WordLevel model: transformers 5 lists ``qwen2`` in
``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` (transformers/models/auto/tokenization_auto.py:350), so
``AutoTokenizer`` ignores the saved tokenizer class and rebuilds a ``Qwen2Tokenizer`` (byte-level BPE)
from the vocabulary, which silently drops every multi-character word of a WordLevel vocabulary. A vocabulary
of single byte-level characters with no merges encodes the same way under both classes.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB_SIZE = 64
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_TOKEN_ID, EOS_TOKEN_ID = 0, 1
# "Ġ" is how the byte-level pre-tokenizer spells a space; 3 specials + 1 + 26 + 26 + 8 = VOCAB_SIZE.
CHARACTERS = ("Ġ", *string.ascii_lowercase, *string.ascii_uppercase, *"01234567")
# Enough to render "user: ..." turns; the harness feeds token ids directly and never decodes.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


def _character_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    assert len(vocab) == VOCAB_SIZE
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tiny_qwen2_config() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        # Untied, so with two ranks verl loads the weights on rank 0 only, builds the others on the meta device
        # and broadcasts (verl/workers/engine/fsdp/transformer_impl.py:266-267, verl/utils/fsdp_utils.py:64-75).
        tie_word_embeddings=False,
        pad_token_id=PAD_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        bos_token_id=EOS_TOKEN_ID,
        dtype="float32",
    )


def write_tiny_qwen2(path: str | Path, seed: int = 0) -> Path:
    """Write a randomly initialised (seeded, so reproducible) tiny Qwen2 and its tokenizer into `path`."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():  # leave the caller's random stream alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(_tiny_qwen2_config())
    model.save_pretrained(directory, safe_serialization=True)
    _character_tokenizer().save_pretrained(directory)
    return directory
