"""Worker of the fixture smoke test: build the island given as JSON in argv[1], train, report.

Reports the rank's coordinates, the optimizer classes, the dtypes of model params and of the
optimizer's master params, the loss of each step (None off the last pipeline stage) and a digest
of the rank's parameters after training (DP replicas must agree bit for bit).

Usage: ``fixture_worker.py SPEC_JSON [STEPS]`` under `launch.run_ranks`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import warnings

from islands import IslandSpec, init_island, rank_info, teardown
from launch import report


def param_digest(chunks: list) -> str:
    """sha256 over this rank's parameters, by name."""
    digest = hashlib.sha256()
    for chunk in chunks:
        for name, param in sorted(chunk.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().float().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    warnings.filterwarnings("ignore")  # megatron warns about missing TransformerEngine/Apex
    spec = IslandSpec(**json.loads(sys.argv[1]))
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    began = time.monotonic()
    island = init_island(spec)
    built = time.monotonic()
    losses = [island.train_step() for _ in range(steps)]
    optimizers = getattr(island.optimizer, "chained_optimizers", [island.optimizer])
    masters = {str(p.dtype) for opt in optimizers for group in opt.optimizer.param_groups for p in group["params"]}
    report({
        **rank_info(),
        "losses": losses,
        "update_successful": island.last_step_info["update_successful"],
        "optimizers": [type(opt).__name__ for opt in optimizers],
        "param_dtypes": sorted({str(p.dtype) for c in island.model_chunks for p in c.parameters()}),
        "master_dtypes": sorted(masters),
        "tokens_per_step": island.tokens_per_step,
        "param_digest": param_digest(island.model_chunks),
        "build_s": round(built - began, 2),
        "train_s": round(time.monotonic() - built, 2),
    })
    teardown()


if __name__ == "__main__":
    main()
