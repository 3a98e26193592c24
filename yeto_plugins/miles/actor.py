"""Miles' Megatron training actor with one more method, `yeto_sweep`, that the yeto driver calls on every rank.

Imported only where Miles is installed: in the driver (`train.py` of this package, before it patches
Miles) and, by reference through Ray, in every actor process. radixark/miles at 31f1ca9.
"""

from __future__ import annotations

from miles.backends.megatron_utils.actor import MegatronTrainRayActor

from yeto_plugins.miles import hook


class YetoTrainRayActor(MegatronTrainRayActor):
    def yeto_sweep(self, rollout_id: int) -> bool:
        """Right after ``train``, before the save and ``update_weights``: sweep, and refresh the "actor" backup that the
        colocated updater sends and the next ``train_actor`` restores (``actor.py:343-354``, ``:522``)."""
        backuper = self.weights_backuper if self._enable_weight_backup else None
        return hook.current().sweep(rollout_id, backuper)
