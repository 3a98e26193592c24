"""Test-only shim that lets megatron-core 0.16.1 run on a CPU-only torch build.

megatron-core assumes CUDA in a few hundred places; no setting turns that off. On CPU the calls
that break fall into four kinds, and this shim answers each with the CPU equivalent:

* ``torch.cuda.current_device()`` (device of new buffers, rotary embeddings, DDP grad buffers)
  returns ``torch.device("cpu")`` instead of raising;
* ``torch.cuda.synchronize()`` (pipeline p2p communication) does nothing;
* tensor factories called with ``device="cuda"`` (or a CUDA index, or ``torch.device("cuda")``):
  the pipeline schedules, ``GlobalMemoryBuffer`` and the causal-mask helper allocate on the CPU;
  ``Tensor.cuda()`` returns the tensor itself;
* ``Tensor.type()`` with no argument reports ``torch.cuda.<X>Tensor`` for a CPU tensor, because
  the mixed-precision and distributed optimizers accept a parameter only if its type string is
  ``torch.cuda.FloatTensor`` / ``torch.cuda.BFloat16Tensor`` / ``torch.cuda.HalfTensor``.
  ``Tensor.type(dtype)`` (a conversion) is untouched.

One fix is a megatron-core 0.16.1 bug rather than CUDA: without TransformerEngine,
``moe_utils.te_general_gemm`` is never defined, yet the MoE router's gating GEMM tests it
(``NameError``). The shim defines it as None, which selects the plain ``torch.mm`` path.

It changes process-wide torch attributes, so it belongs in test worker processes only, installed
before megatron is imported; product code never imports it. ``install()`` is idempotent and
``uninstall()`` restores every attribute it replaced.

Not covered (they fail on CPU even with the shim): ``model_parallel_cuda_manual_seed`` (CUDA RNG
state; see ``islands.init_island`` for the workaround) and the ``alltoall`` MoE token dispatcher
(``torch.cuda.Stream``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# Factories megatron-core calls with an explicit CUDA device.
_FACTORIES = (
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
)  # fmt: skip

_MISSING = object()  # an attribute the shim added rather than replaced

# (owner, attribute name) -> original value, filled while installed.
_saved: dict[tuple[Any, str], Any] = {}


def installed() -> bool:
    """Whether the shim is in place."""
    return bool(_saved)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare index means a CUDA ordinal
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _on_cpu(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapper


def _cuda_type_name(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if args or kwargs or not isinstance(result, str):
            return result  # a conversion, not a query
        if result.startswith("torch.") and not result.startswith("torch.cuda."):
            return "torch.cuda." + result[len("torch.") :]
        return result

    return type_


def _replace(owner: Any, name: str, value: Any) -> None:
    _saved[(owner, name)] = getattr(owner, name, _MISSING)
    setattr(owner, name, value)


def install() -> None:
    """Patch torch so megatron-core's CUDA-assuming code runs on the CPU. Safe to call twice."""
    if _saved:
        return
    _replace(torch.cuda, "current_device", lambda: torch.device("cpu"))
    _replace(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    for name in _FACTORIES:
        _replace(torch, name, _on_cpu(getattr(torch, name)))
    _replace(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    _replace(torch.Tensor, "type", _cuda_type_name(torch.Tensor.type))
    # Imported only now, so that megatron sees the patched torch from its first import.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        _replace(moe_utils, "te_general_gemm", None)


def uninstall() -> None:
    """Restore every attribute `install` replaced. Safe to call when not installed."""
    for (owner, name), original in reversed(list(_saved.items())):
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _saved.clear()
