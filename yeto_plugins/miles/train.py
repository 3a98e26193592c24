"""``python -m yeto_plugins.miles.train <Miles' train.py arguments>``: Miles' driver, a sweep after each training.

Run it where ``python train.py`` of a Miles checkout runs (its directory, or ``MILES_TRAIN=path/to/train.py``),
with the same arguments plus ``--custom-megatron-before-train-step-hook-path
yeto_plugins.miles.hook.before_train_step`` and ``YETO_DILOCO_RL_MODE=sweep`` (or ``overlap``). Two
patches, both made in the driver process before Miles builds anything (radixark/miles at 31f1ca9):

* the actor class: ``allocate_gpus_for_actor`` imports ``MegatronTrainRayActor`` from
  ``miles.backends.megatron_utils.actor`` when it runs (``miles/ray/train/actor_factory.py:63-66``)
  and wraps it with ``ray.remote`` (``:74-78``); the module attribute is pointed at
  `YetoTrainRayActor`, its subclass with ``yeto_sweep``, importable by reference in every actor;
* the group: ``RayTrainGroup.train(rollout_id, ...)`` (``miles/ray/actor_group.py:77-109``), which the
  loop awaits (``train.py:109-118``), ends with ``yeto_sweep(rollout_id)`` on every actor through the
  group's own ``_broadcast`` (``:150-152``). So the sweep (and, after the last rollout, the final
  cut) is in the weights before the loop saves them (``train.py:121-127``) and before
  ``update_weights`` hands them to the engines (``:132``).

Miles' experimental fault-tolerant trainer group (``MILES_EXPERIMENTAL_FT_TRAINER``) is not patched:
the driver refuses to start with it.
"""

from __future__ import annotations

import runpy
import sys
from typing import Any

from pydantic import ValidationError

from yeto_core.settings import MilesDriverSettings


def install(settings: MilesDriverSettings | None = None) -> None:
    """Patch Miles (call once, in the driver, before its training models are created)."""
    settings = settings if settings is not None else MilesDriverSettings()
    if settings.experimental_ft_trainer:
        raise SystemExit("yeto: the Miles driver patches RayTrainGroup of miles/ray/actor_group.py; unset "
                         "MILES_EXPERIMENTAL_FT_TRAINER")
    import miles.backends.megatron_utils.actor as actor_module
    from miles.ray import actor_group

    from yeto_plugins.miles.actor import YetoTrainRayActor  # subclasses the original class: import it first

    actor_module.MegatronTrainRayActor = YetoTrainRayActor
    group = actor_group.RayTrainGroup
    if getattr(group.train, "yeto", False):
        return
    original = group.train

    async def train(self: Any, rollout_id: int, *args: Any, **kwargs: Any) -> Any:
        outcome = await original(self, rollout_id, *args, **kwargs)
        await self._broadcast("yeto_sweep", rollout_id)
        return outcome

    train.yeto = True  # type: ignore[attr-defined]
    group.train = train


def main() -> None:
    try:
        settings = MilesDriverSettings()
    except ValidationError as exc:
        raise SystemExit(f"yeto: {exc.errors()[0]['loc'][0]!s}: {exc.errors()[0]['msg']} (MILES_*)") from None
    script = settings.train
    if not script.is_file():
        raise SystemExit(f"yeto: no Miles driver at {script}: run from a Miles checkout or set MILES_TRAIN")
    install(settings)
    sys.argv = [str(script), *sys.argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
