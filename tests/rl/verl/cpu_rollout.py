"""A CPU stand-in for verl's rollout engine that only records the weights it is sent; registered on import.

Why: ``ActorRolloutRefWorker.init_model`` builds its rollout through ``get_rollout_class(name, mode)``
(verl/workers/engine_workers.py:667-670), which looks the pair up in ``_ROLLOUT_REGISTRY``
(verl/workers/rollout/base.py:89-93). That registry only knows vllm, sglang and trtllm, all GPU servers.
Adding one entry for ``("cpu_test", "async")`` lets the real worker run its real weight sync
(``update_weights(mode="naive")``, engine_workers.py:728-827) into something a test can inspect.

The registry stores a dotted path that ``get_rollout_class`` imports (base.py:106-110); the path is built from
this module's ``__name__``, so it resolves to the already imported module whatever it was imported as.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout

ROLLOUT_NAME = "cpu_test"
ROLLOUT_MODE = "async"


class CpuTestRollout(BaseRollout):
    """Keeps a CPU copy of every tensor each weight sync delivers, checked against the HF model's names.

    ``weights`` maps parameter name to the last tensor received; ``update_count`` counts completed syncs and
    ``last_update_names`` lists the names the last one carried, in order.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        # The model verl's rollout engines would serve, built on the meta device: only names and shapes
        # are needed to check that every synced tensor lands on a real parameter.
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.model_config.hf_config)
        self.expected_shapes: dict[str, torch.Size] = {name: p.shape for name, p in model.state_dict().items()}
        self.weights: dict[str, torch.Tensor] = {}
        self.update_count = 0
        self.last_update_names: list[str] = []

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def update_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"{type(self).__name__} only takes full named tensors, not {wire_format!r}")
        received: list[str] = []
        for name, tensor in weights:
            expected = self.expected_shapes.get(name)
            if expected is None:
                raise KeyError(f"the rollout model has no parameter named {name!r}")
            if tensor.shape != expected:
                raise ValueError(f"{name}: received shape {tuple(tensor.shape)}, the model has {tuple(expected)}")
            # Clone: the sender may hand out views of live training storage that the next step overwrites.
            self.weights[name] = tensor.detach().to("cpu", copy=True)
            received.append(name)
        self.last_update_names = received
        self.update_count += 1


rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, ROLLOUT_MODE)] = f"{__name__}.{CpuTestRollout.__qualname__}"
