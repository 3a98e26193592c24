"""The stores of a torch.distributed island (DDP, FSDP2, DeepSpeed ZeRO), whatever the trainer.

Importing this package loads no trainer: `ProcessGroupStore` needs torch.distributed only (and
DeepSpeed when the parameters are ZeRO's). An adapter hands it to `yeto_core.island.IslandSession`.
"""

from yeto_plugins.torch_dist.store import ProcessGroupStore

__all__ = ["ProcessGroupStore"]
