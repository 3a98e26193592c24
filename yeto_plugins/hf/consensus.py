"""The HF island's part of the consensus signal (DESIGN §8.1): the fields it adds to the Trainer's
logs. The probe itself is `yeto_plugins.torch_dist.modules.logit_probe`."""

from __future__ import annotations

from typing import Any

from yeto_core.learner import LearnerStats


def consensus_logs(stats: LearnerStats) -> dict[str, Any]:
    """`yeto_consensus_js`, `yeto_fragment_l2_mean` and `yeto_fragment_l2/<i>`, where known."""
    logs: dict[str, Any] = {}
    if stats.consensus_js is not None:
        logs["yeto_consensus_js"] = stats.consensus_js
    known = [(i, v) for i, v in enumerate(stats.fragment_l2) if v is not None]
    if known:
        logs["yeto_fragment_l2_mean"] = sum(v for _, v in known) / len(known)
        logs.update({f"yeto_fragment_l2/{i}": v for i, v in known})
    return logs
