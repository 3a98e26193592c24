"""HF Trainer plugin: `from yeto_plugins.hf import YetoDiLoCo` (needs the `hf` extra)."""

from yeto_plugins.hf.callback import YetoDiLoCo, embedding_names

__all__ = ["YetoDiLoCo", "embedding_names"]
