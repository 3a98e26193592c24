"""`YETO_DILOCO_AUTO_ATTACH`: the start-up line's gate, the import finder, and one YetoDiLoCo per Trainer."""

from __future__ import annotations

import os
import site
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import TypeAdapter

from yeto_core.island import IslandStats
from yeto_core.settings import SettingsError
from yeto_plugins import autoattach

pytestmark = pytest.mark.unit

ON = ["1", "true", "True", "YES", "on", "t", "y"]
OFF = ["0", "false", "FALSE", "No", "off", "f", "n"]


def run_pth_line(monkeypatch: pytest.MonkeyPatch, value: str | None, syncer: str | None = None) -> bool:
    """Run the start-up line as site.py does; True when it called `install()`."""
    calls: list[None] = []
    monkeypatch.setattr(autoattach, "install", lambda: calls.append(None))
    if syncer is None:
        monkeypatch.delenv("YETO_DILOCO_SYNCER", raising=False)
    else:
        monkeypatch.setenv("YETO_DILOCO_SYNCER", syncer)
    if value is None:
        monkeypatch.delenv(autoattach.ENV, raising=False)
    else:
        monkeypatch.setenv(autoattach.ENV, value)
    exec(autoattach.PTH_LINE, {})
    return bool(calls)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [None, "", *OFF])
def test_unset_empty_or_false_runs_nothing(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    assert not run_pth_line(monkeypatch, value)
    assert not autoattach.requested(os.environ)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [*ON, "maybe"])
def test_true_or_unparsable_installs_the_hook(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    # An unparsable value installs it too, so that building a Trainer reports the bad value.
    assert run_pth_line(monkeypatch, value)
    assert autoattach.requested(os.environ)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [None, "0"])
def test_the_other_settings_alone_install_nothing(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    # Every process that inherits them runs the line: only the variable may import yeto there.
    assert not run_pth_line(monkeypatch, value, syncer="10.0.0.5:7070")
    assert not autoattach.requested(os.environ)


@pytest.mark.timeout(30)
def test_the_gate_agrees_with_the_setting_it_stands_for() -> None:
    as_bool = TypeAdapter(bool).validate_python
    assert all(as_bool(v) is True for v in ON)
    assert all(as_bool(v) is False for v in OFF + [v.upper() for v in autoattach.OFF if v])


@pytest.mark.timeout(30)
def test_the_installed_pth_file_is_the_start_up_line() -> None:
    found = [Path(d, autoattach.PTH_NAME) for d in site.getsitepackages() if Path(d, autoattach.PTH_NAME).exists()]
    assert found, f"{autoattach.PTH_NAME} is not in site-packages; reinstall yeto (pip install -e .)"
    assert found[0].read_text() == autoattach.PTH_LINE


FAKE_TRAINER_MODULE = """
class Handler:
    def __init__(self, callbacks):
        self.callbacks = list(callbacks)

class Trainer:
    def __init__(self, callbacks=()):
        self.callback_handler = Handler(["flow", *callbacks])

    def add_callback(self, callback):
        self.callback_handler.callbacks.append(callback)
"""


def fake_trainer_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> list[Any]:
    """Make `name` an importable, not yet imported fake of `transformers.trainer` that the hook
    watches for; returns the list the (stubbed) `attach` appends each attached trainer to."""
    (tmp_path / f"{name}.py").write_text(FAKE_TRAINER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(autoattach, "TARGET", name)
    attached: list[Any] = []
    monkeypatch.setattr(autoattach, "attach", attached.append)
    return attached


@pytest.mark.timeout(60)
def test_the_finder_waits_for_the_module_then_patches_it_and_steps_aside(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    name = "yeto_fake_hf_trainer"
    attached = fake_trainer_module(monkeypatch, tmp_path, name)
    monkeypatch.setenv(autoattach.ENV, "1")

    autoattach.install()
    autoattach.install()
    finders = [f for f in sys.meta_path if isinstance(f, autoattach.TrainerFinder)]
    assert len(finders) == 1 and sys.meta_path[0] is finders[0]
    assert name not in sys.modules

    module = __import__(name)
    monkeypatch.setitem(sys.modules, name, module)  # removed again when the test ends
    assert not any(isinstance(f, autoattach.TrainerFinder) for f in sys.meta_path)
    assert type(module.__loader__).__name__ == "SourceFileLoader"
    trainer = module.Trainer()
    assert attached == [trainer]
    autoattach.install()  # already imported: patches in place, and only once
    module.Trainer()
    assert len(attached) == 2


# -- the real HF Trainer -----------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


@pytest.fixture
def hooked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """`transformers.Trainer` with the hook on (undone after the test), and learner settings set."""
    import transformers.trainer as trainer_module

    for var in list(os.environ):
        if var.startswith("YETO_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:9")
    monkeypatch.setenv("YETO_DILOCO_KEY", "k" * 32)
    monkeypatch.setenv(autoattach.ENV, "1")
    cls = trainer_module.Trainer
    monkeypatch.setattr(cls, "__init__", cls.__init__)
    monkeypatch.setattr(cls, "add_callback", cls.add_callback)
    autoattach.install()
    import torch

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    return lambda **kw: cls(model=torch.nn.Linear(2, 2), args=args, **kw)


def yeto_callbacks(trainer: Any) -> list[Any]:
    from yeto_plugins.hf import YetoDiLoCo

    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, YetoDiLoCo)]


@pytest.mark.timeout(120)
def test_a_trainer_gets_one_yeto_callback_first(hooked: Any) -> None:
    trainer = hooked()
    found = yeto_callbacks(trainer)
    assert len(found) == 1 and trainer.callback_handler.callbacks[0] is found[0]
    assert found[0].settings.syncer == "127.0.0.1:9"
    trainer.add_callback(transformers.PrinterCallback)  # other callbacks leave it alone
    assert yeto_callbacks(trainer) == found


@pytest.mark.timeout(120)
def test_the_scripts_own_yeto_callback_is_never_doubled(hooked: Any) -> None:
    from yeto_plugins.hf import YetoDiLoCo

    given = YetoDiLoCo(learner_id=3)
    assert yeto_callbacks(hooked(callbacks=[given])) == [given]

    trainer = hooked()
    added = YetoDiLoCo(learner_id=5)
    trainer.add_callback(added)  # the README's way: after the Trainer is built
    assert yeto_callbacks(trainer) == [added]

    trainer = hooked()
    trainer.add_callback(YetoDiLoCo)
    assert len(yeto_callbacks(trainer)) == 1


@pytest.mark.timeout(120)
def test_a_bad_setting_fails_building_the_trainer(hooked: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_DILOCO_MERGE_ALPHA", "2")
    with pytest.raises(SettingsError, match="YETO_DILOCO_MERGE_ALPHA='2'"):
        hooked()
    monkeypatch.delenv("YETO_DILOCO_MERGE_ALPHA")
    monkeypatch.setenv(autoattach.ENV, "maybe")
    with pytest.raises(SettingsError, match="YETO_DILOCO_AUTO_ATTACH='maybe'"):
        hooked()


@pytest.mark.timeout(120)
def test_attach_puts_yeto_before_the_loggers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What `on_log` adds must be in the logs dict before a reporting callback reads it."""
    import torch

    from yeto_plugins.hf import YetoDiLoCo, attach

    for var in list(os.environ):
        if var.startswith("YETO_"):
            monkeypatch.delenv(var)
    seen: list[dict[str, Any]] = []

    class Logger(transformers.TrainerCallback):  # stands for a reporting integration
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            seen.append(dict(logs or {}))

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=torch.nn.Linear(2, 2), args=args, callbacks=[Logger()])
    callback = attach(trainer, syncer="127.0.0.1:9", key="k" * 32)
    assert isinstance(callback, YetoDiLoCo) and trainer.callback_handler.callbacks[0] is callback
    # As on a follower rank of a running island after a few rounds: counters, no learner stats.
    callback.island = SimpleNamespace(stats=IslandStats(steps=8, pushes=3, installs=5), final=False)  # type: ignore[assignment]
    trainer.callback_handler.on_log(args, trainer.state, trainer.control, {"loss": 1.0})
    assert seen and seen[-1]["yeto_pushes"] == 3 and seen[-1]["yeto_installs"] == 5
