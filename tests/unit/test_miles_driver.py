"""`python -m yeto_plugins.miles.train` patches Miles' driver; checked against a minimal copy of the three
places it touches (radixark/miles at 31f1ca9), written to a temporary package: the actor class that
``allocate_gpus_for_actor`` imports when it runs (``miles/ray/train/actor_factory.py:63-66``), and
``RayTrainGroup.train`` / ``_broadcast`` (``miles/ray/actor_group.py:77-109``, ``:150-152``)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

MILES = {
    "miles/__init__.py": "",
    "miles/backends/__init__.py": "",
    "miles/backends/megatron_utils/__init__.py": "",
    "miles/backends/megatron_utils/actor.py": """
        class MegatronTrainRayActor:
            def train(self, rollout_id, data_ref):
                return "trained"

            def update_weights(self, info=None):
                return "updated"
    """,
    "miles/ray/__init__.py": "",
    "miles/ray/train/__init__.py": "",
    "miles/ray/train/actor_factory.py": """
        def allocate_gpus_for_actor():
            from miles.backends.megatron_utils.actor import MegatronTrainRayActor
            actor_impl = MegatronTrainRayActor
            return actor_impl
    """,
    "miles/ray/actor_group.py": """
        import asyncio

        class RayTrainGroup:
            def __init__(self, handles):
                self._actor_handles = handles
                self.calls = []

            async def train(self, rollout_id, rollout_data_pack, external_data=None):
                return await self._broadcast("train", rollout_id, rollout_data_pack["data_ref"])

            async def update_weights(self, rollout_id=None):
                await self._broadcast("update_weights", info="engines")

            async def _broadcast(self, method_name, *args, **kwargs):
                self.calls.append((method_name, args))
                return [getattr(actor, method_name)(*args, **kwargs) for actor in self._actor_handles]
    """,
}


@pytest.fixture
def miles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, text in MILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for module in [m for m in sys.modules if m == "miles" or m.startswith(("miles.", "yeto_plugins.miles.actor"))]:
        del sys.modules[module]


def test_the_driver_sweeps_every_actor_after_each_rollouts_training(
        miles: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.ray import actor_group
    from miles.ray.train import actor_factory

    from yeto_plugins.miles import hook
    from yeto_plugins.miles.train import install

    install()
    install()  # idempotent: one sweep per rollout, however often it is called
    actor_cls = actor_factory.allocate_gpus_for_actor()
    assert actor_cls.__name__ == "YetoTrainRayActor" and actor_cls.__mro__[1].__name__ == "MegatronTrainRayActor"

    swept = []

    class Island:
        def sweep(self, rollout_id: int, backuper: object) -> bool:
            swept.append((rollout_id, backuper))
            return False

    monkeypatch.setattr(hook, "_ISLAND", Island())
    actors = [actor_cls(), actor_cls()]
    for actor in actors:
        actor.weights_backuper, actor._enable_weight_backup = f"backup-{id(actor)}", True
    group = actor_group.RayTrainGroup(actors)
    asyncio.run(group.update_weights())  # before the loop (train.py:52): no sweep
    assert asyncio.run(group.train(4, {"data_ref": "ref"})) == ["trained", "trained"]  # Miles' own result
    asyncio.run(group.update_weights(rollout_id=4))
    assert group.calls == [("update_weights", ()), ("train", (4, "ref")), ("yeto_sweep", (4,)),
                           ("update_weights", ())]
    assert swept == [(4, f"backup-{id(actors[0])}"), (4, f"backup-{id(actors[1])}")]


def test_the_driver_refuses_miles_fault_tolerant_trainer_group(miles: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from yeto_plugins.miles.train import install

    monkeypatch.setenv("MILES_EXPERIMENTAL_FT_TRAINER", "1")
    with pytest.raises(SystemExit, match="unset MILES_EXPERIMENTAL_FT_TRAINER"):
        install()
