"""The small regression task every framework-free test learner trains, in-process (`Island`) or
as a process (`netns_learner.py`, `fault_learner.py`): an MLP fitting a fixed linear map."""

from __future__ import annotations

from collections.abc import Callable

import torch


def default_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def small_mlp(learner_id: int, model: Callable[[], torch.nn.Module] = default_mlp,
              in_features: int = 8) -> tuple[torch.nn.Module, torch.Tensor, torch.optim.Optimizer]:
    """(model, target map, SGD optimizer), seeded by the learner id: the same on every run."""
    torch.manual_seed(learner_id)
    net = model()
    target = torch.randn(in_features, 4)
    return net, target, torch.optim.SGD(net.parameters(), lr=0.05)
