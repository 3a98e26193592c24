"""HF Trainer plugin: `from yeto_plugins.hf import YetoDiLoCo, attach` (needs the `hf` extra)."""

from typing import Any

from yeto_plugins.hf.callback import YetoDiLoCo
from yeto_plugins.torch_dist.modules import embedding_names

__all__ = ["YetoDiLoCo", "attach", "embedding_names"]


def attach(trainer: Any, **settings: Any) -> YetoDiLoCo:
    """Make `YetoDiLoCo(**settings)` the trainer's first callback and return it.

    `trainer.add_callback` appends after the Trainer's own reporting callbacks (W&B, TensorBoard),
    which then log before yeto adds its `yeto_*` values to the log; first in line, those values
    reach every logger the run already uses. Auto-attach places it first too.
    """
    callback = YetoDiLoCo(**settings)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
