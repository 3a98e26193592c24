"""A test-only verl platform for hosts without an accelerator; importing this module registers it.

Why: verl resolves its device once, through ``verl.plugin.platform.get_platform()``. Without a GPU, and
without ``nvidia-smi``, auto-detection finds nothing and falls back to ``"nvidia"``
(verl/plugin/platform/platform_manager.py:113-117), so ``get_device_name() == "cuda"`` and every
``get_device_id()`` ends in ``torch.cuda.current_device()``, which raises on a CPU-only torch. verl ships no
CPU platform, but its registry takes new ones (``PlatformRegistry.register``, platform_manager.py:43) and
``VERL_PLATFORM`` selects one by name before any probing (platform_manager.py:92-95). So this module
registers a ``"cpu"`` platform and the harness sets ``VERL_PLATFORM=cpu``; verl itself is not patched.

Order matters: the platform is resolved on the first ``get_platform()`` call and cached for the life of
the process (platform_manager.py:140-147), and ``verl.workers.engine.fsdp.transformer_impl`` calls it at
import time (transformer_impl.py:89). Import this module in every worker process before verl's workers.

The platform alone is not enough: verl registers its FSDP engines for the devices ``cuda`` and ``npu`` only
(transformer_impl.py:1143) and looks them up by the platform's device name, unless ``VERL_ENGINE_DEVICE``
names another (verl/workers/engine/base.py:405-406). The harness sets ``VERL_ENGINE_DEVICE=cuda``: the engine
class is chosen as on a GPU, while every device it asks for comes from this platform.

The device namespace (``device_module``) is ``torch.cpu`` plus the ``torch.cuda`` calls that verl makes
unconditionally and ``torch.cpu`` lacks: ``empty_cache`` and ``synchronize`` around weight syncs
(verl/workers/engine_workers.py:769, 813-814), ``memory_allocated``/``memory_reserved`` in
``aggressive_empty_cache`` (verl/utils/memory_utils.py:47-62), ``mem_get_info`` in ``log_gpu_memory_usage``
(verl/utils/profiler/performance.py:49-54), ``max_memory_allocated``/``max_memory_reserved`` in every
training-step metric (engine_workers.py:219-220), and ``get_device_name`` in ``FlopsCounter``
(verl/utils/flops_counter.py:80).
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"
# The key of the CPU entry in verl's peak-FLOPS table (verl/utils/flops_counter.py:23), so the MFU
# metric stays finite instead of dividing by an unknown device's infinite peak.
DEVICE_MARKETING_NAME = "CPU"


def _no_memory(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` with the accelerator memory and cache calls verl makes answered as no-ops."""

    class CpuDeviceModule(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cpu, name)

    module = CpuDeviceModule("verl_test_cpu_device")
    module.__dict__.update(
        empty_cache=_nothing,
        ipc_collect=_nothing,
        reset_peak_memory_stats=_nothing,
        set_per_process_memory_fraction=_nothing,
        synchronize=_nothing,
        memory_allocated=_no_memory,
        memory_reserved=_no_memory,
        max_memory_allocated=_no_memory,
        max_memory_reserved=_no_memory,
        mem_get_info=lambda *_args: (0, 0),
        get_device_name=lambda *_args: DEVICE_MARKETING_NAME,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        get_rng_state=lambda *_args: torch.get_rng_state(),
        set_rng_state=lambda state, *_args: torch.set_rng_state(state),
    )
    return module


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPUForTests(PlatformBase):
    """verl on the host CPU: device ``"cpu"``, collectives over gloo, every accelerator knob a no-op."""

    _device_module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only an explicit VERL_PLATFORM=cpu selects this platform, so importing the
        # module cannot change what verl picks on a machine that has an accelerator.
        return False

    def current_device(self) -> str:  # type: ignore[override]  # verl passes it to .to()/torch.device()
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # No CPU equivalent; a name nothing sets keeps Worker's visible-device bookkeeping inert.
        return "VERL_TEST_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_cpus": num_gpus}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def platform_is_selected() -> bool:
    """Whether this process's environment makes verl pick the CPU platform (platform_manager.py:92)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def _one_gloo_backend(initialize: Any) -> Any:
    """verl's Ray workers open their process group with ``cpu:gloo,<device>:<backend>``
    (verl/utils/distributed.py:82-98, called at verl/workers/engine_workers.py:89), which on this platform reads
    ``cpu:gloo,cpu:gloo`` and which torch refuses (one backend per device type). The torchrun harness opens the
    group itself first; a run through ``main_ppo`` cannot, so on this platform the default becomes plain ``gloo``."""

    def initialize_with_gloo(timeout_second: Any = None, backend: str | None = None) -> Any:
        return initialize(timeout_second=timeout_second, backend=backend or "gloo")

    return initialize_with_gloo


if platform_is_selected():
    import verl.utils.distributed

    # before verl.workers.engine_workers imports the name (this module is imported when verl is, by
    # VERL_USE_EXTERNAL_MODULES in a main_ppo run, or first of all by the harness)
    verl.utils.distributed.initialize_global_process_group_ray = _one_gloo_backend(
        verl.utils.distributed.initialize_global_process_group_ray)
