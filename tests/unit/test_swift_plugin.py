"""ms-swift Megatron plugin: registration, auto-attach, and the callback's per-step accounting.

The real `swift.megatron.callbacks` cannot be imported without TransformerEngine (so not on a
CPU machine): these tests drive the plugin through stand-ins that copy swift's contracts —
`megatron_callbacks_map[name](trainer)` for each name in `args.callbacks`, user names before the
appended `print`, `default_flow`; `state.iteration += 1` then `on_step_end`, then the save
decision; the LR scheduler advanced by `global_batch_size` only on a successful update.
The plugin against swift's own callback files (they load without TransformerEngine once
`swift/megatron/utils/__init__.py` is kept from running) is tests/ms_swift/test_megatron_callbacks.py, in .venv-swift.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from yeto_core.settings import SettingsError
from yeto_plugins.swift_megatron import callback as callback_mod
from yeto_plugins.swift_megatron.callback import EVENTS, YetoMegatronCallback
from yeto_plugins.swift_megatron.register import NAME, AutoAttached, register

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "yeto_plugins" / "swift_megatron" / "plugin" / "swift_plugin.py"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("YETO_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7070")
    monkeypatch.setenv("YETO_DILOCO_KEY", "k" * 32)


# -- stand-ins ----------------------------------------------------------------------------------

class RecordingSync:
    """Takes the sync core's place, with `IslandSession`'s end of run (a `last` step waits for the final cut;
    `finish` is idempotent; once final, `step` returns True at once); the real one is tested end to end
    with Megatron ranks."""

    def __init__(self, log: list[Any], final_at: int | None = None, finish_result: bool = True) -> None:
        self.log, self.final_at, self.finish_result = log, final_at, finish_result
        self.stats = SimpleNamespace(pushes=0, installs=0, steps=0, in_yeto_s=0.25)
        self.final = self.finished = False

    def start(self) -> None:
        self.log.append("start")

    def step(self, tokens: int, *, last: bool = False) -> bool:
        if self.final:
            return True
        self.stats.steps += 1
        self.stats.pushes += 1
        self.log.append(("step", tokens))
        self.final = self.stats.steps == self.final_at
        return self.final or (last and self.finish())

    def finish(self) -> bool:
        if self.final or self.finished:
            return self.final
        self.finished = True
        self.log.append("finish")
        self.final = self.finish_result
        return self.final

    def close(self) -> None:
        self.log.append("close")


def factory_for(sync: RecordingSync) -> Any:
    def make(model: Any, optimizer: Any, settings: Any) -> RecordingSync:
        sync.log.append(("built", model, optimizer, settings.syncer))
        return sync
    return make


class Trainer:
    """The attributes swift's BaseMegatronTrainer gives callbacks (a plain class: weakly referable)."""

    def __init__(self, callbacks: list[str], *, train_iters: int = 10, gbs: int = 8, seq_length: int = 512,
                 iteration: int = 0, scheduler: bool = True) -> None:
        self.args = SimpleNamespace(callbacks=callbacks, train_iters=train_iters, global_batch_size=gbs,
                                    seq_length=seq_length, max_length=seq_length)
        self.state = SimpleNamespace(iteration=iteration, consumed_train_samples=iteration * gbs,
                                     should_save=False)
        self.wrapped_models = ["chunk0"]
        self.optimizer = "optimizer"
        if scheduler:
            self.opt_param_scheduler = SimpleNamespace(num_steps=iteration * gbs)
        self.callbacks: list[Any] = []


def run(trainer: Trainer, log: list[Any], skipped: frozenset[int] = frozenset()) -> None:
    """swift's train(): on_train_begin, steps while iteration < train_iters, save marks, on_train_end."""
    call(trainer, "on_train_begin")
    while trainer.state.iteration < trainer.args.train_iters:
        if trainer.state.iteration + 1 not in skipped and hasattr(trainer, "opt_param_scheduler"):
            trainer.opt_param_scheduler.num_steps += trainer.args.global_batch_size
        trainer.state.iteration += 1
        call(trainer, "on_step_end")
        if trainer.state.should_save:
            trainer.state.should_save = False
            log.append(("save", trainer.state.iteration))
    call(trainer, "on_train_end")


def call(trainer: Trainer, event: str, **kwargs: Any) -> None:
    for cb in trainer.callbacks:
        getattr(cb, event)(**kwargs)


class Base:
    """Mirrors swift's MegatronCallback: `(trainer)`, nine events, only on_log/on_save take an argument."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.args, self.state = trainer, trainer.args, trainer.state

    def on_train_begin(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_step_begin(self) -> None: ...
    def on_step_end(self) -> None: ...
    def on_log(self, logs: dict[str, Any]) -> None: ...
    def on_eval_begin(self) -> None: ...
    def on_eval_end(self) -> None: ...
    def on_eval_step(self) -> None: ...
    def on_save(self, output_dir: str) -> None: ...


def swift_registry(log: list[Any]) -> dict[str, Any]:
    class Print(Base):
        def on_step_end(self) -> None:
            log.append("print.on_step_end")

        def on_log(self, logs: dict[str, Any]) -> None:
            log.append(("print.on_log", dict(logs)))

    class DefaultFlow(Base):
        def on_step_end(self) -> None:  # the save decision, as swift's default_flow makes it
            log.append("default_flow.on_step_end")
            if self.state.iteration >= self.args.train_iters:
                self.state.should_save = True

    return {"print": Print, "default_flow": DefaultFlow, "tensorboard": Base}


def build(registry: dict[str, Any], trainer: Trainer) -> list[Any]:
    trainer.callbacks = [registry[name](trainer) for name in trainer.args.callbacks]
    return trainer.callbacks


def yeto_parts(callbacks: list[Any]) -> list[YetoMegatronCallback]:
    flat = [p for cb in callbacks for p in (cb.parts if isinstance(cb, AutoAttached) else [cb])]
    return [p for p in flat if isinstance(p, YetoMegatronCallback)]


# -- importing the plugin file by path --------------------------------------------------------

# swift.megatron.callbacks needs TransformerEngine, so the subprocess imports a stand-in module
# tree at the real module paths, with the real MegatronCallback signature (base.py) and registry
# (mapping.py), and imports the plugin exactly as swift.utils.import_external_file does.
STANDIN = {
    "swift/__init__.py": "",
    "swift/megatron/__init__.py": "",
    "swift/megatron/callbacks/__init__.py": """
        from .base import MegatronCallback
        from .mapping import megatron_callbacks_map
        """,
    "swift/megatron/callbacks/base.py": """
        class MegatronCallback:
            def __init__(self, trainer):
                self.trainer = trainer
                self.args = trainer.args
                self.state = trainer.state
            def on_train_begin(self): pass
            def on_train_end(self): pass
            def on_step_begin(self): pass
            def on_step_end(self): pass
            def on_log(self, logs): pass
            def on_eval_begin(self): pass
            def on_eval_end(self): pass
            def on_eval_step(self): pass
            def on_save(self, output_dir): pass
        """,
    "swift/megatron/callbacks/mapping.py": """
        from .base import MegatronCallback
        class PrintCallback(MegatronCallback): pass
        class DefaultFlowCallback(MegatronCallback): pass
        megatron_callbacks_map = {'print': PrintCallback, 'default_flow': DefaultFlowCallback}
        """,
}

PROBE = """
import importlib, importlib.util, json, os, sys
standin, plugin, hide_install = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if hide_install:  # as if yeto were a checkout, not pip-installed
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    assert importlib.util.find_spec("yeto_plugins") is None
sys.path.insert(0, standin)
py_dir, py_file = os.path.split(os.path.abspath(plugin))   # swift.utils.import_external_file
sys.path.insert(0, py_dir)
importlib.import_module(py_file.split(".", 1)[0])
from swift.megatron.callbacks import MegatronCallback, megatron_callbacks_map as reg
first = dict(reg)
spec = importlib.util.spec_from_file_location("swift_plugin_again", plugin)   # a second import
spec.loader.exec_module(importlib.util.module_from_spec(spec))
import yeto_plugins
print(json.dumps({
    "subclass": issubclass(reg["yeto_diloco"], MegatronCallback),
    "same_after_reimport": all(reg[k] is v for k, v in first.items()) and reg.keys() == first.keys(),
    "anchors_wrap": [type(reg[k]).__name__ + ":" + reg[k].wrapped.__name__ for k in ("print", "default_flow")],
    "yeto_from": os.path.dirname(os.path.dirname(yeto_plugins.__file__)),
    "plugin_dir_on_path": py_dir in sys.path,
    "swift_modules": sorted(m for m in sys.modules if m.startswith("swift.")),
}))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("installed", [False, True], ids=["checkout", "installed"])
def test_plugin_file_registers_from_any_cwd(tmp_path: Path, installed: bool) -> None:
    standin = tmp_path / "standin"
    for rel, text in STANDIN.items():
        (standin / rel).parent.mkdir(parents=True, exist_ok=True)
        (standin / rel).write_text(textwrap.dedent(text))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # -I: no PYTHONPATH, no cwd, no user site on sys.path; env: nothing but PATH.
    out = subprocess.run([sys.executable, "-I", "-c", PROBE, str(standin), str(PLUGIN), "0" if installed else "1"],
                         cwd=elsewhere, env={"PATH": os.environ.get("PATH", "")},
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["subclass"] and got["same_after_reimport"]
    assert got["anchors_wrap"] == ["AnchorEntry:PrintCallback", "AnchorEntry:DefaultFlowCallback"]
    assert Path(got["yeto_from"]) == ROOT
    assert not got["plugin_dir_on_path"]  # its siblings (callback, register, ...) must not shadow top-level names
    assert got["swift_modules"] == ["swift.megatron", "swift.megatron.callbacks", "swift.megatron.callbacks.base",
                                    "swift.megatron.callbacks.mapping"]


# -- auto-attach --------------------------------------------------------------------------------

@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[Any]]:
    """A registered stand-in registry whose yeto callbacks get a RecordingSync by default."""
    log: list[Any] = []
    monkeypatch.setattr(callback_mod, "megatron_sync", factory_for(RecordingSync(log)))
    registry = swift_registry(log)
    register(registry, base=Base)
    return registry, log


@pytest.mark.timeout(10)
def test_auto_attach_off_builds_swift_callbacks_unchanged(recorded: tuple[dict[str, Any], list[Any]]) -> None:
    registry, _ = recorded
    built = build(registry, Trainer(["print", "default_flow", "tensorboard"]))
    assert [type(cb).__name__ for cb in built] == ["Print", "DefaultFlow", "Base"]
    assert issubclass(registry[NAME], Base) and issubclass(registry[NAME], YetoMegatronCallback)


@pytest.mark.timeout(10)
def test_auto_attach_runs_yeto_first(recorded: tuple[dict[str, Any], list[Any]],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    registry, log = recorded
    monkeypatch.setenv("YETO_DILOCO_AUTO_ATTACH", "1")
    trainer = Trainer(["print", "default_flow", "tensorboard"], train_iters=2)
    built = build(registry, trainer)
    assert len(yeto_parts(built)) == 1 and isinstance(built[0], AutoAttached) and isinstance(built[0], Base)
    assert not isinstance(built[1], AutoAttached)  # only the first anchor carries yeto
    run(trainer, log)
    call(trainer, "on_log", logs={"loss": 1.0})
    steps = [e for e in log if e == "print.on_step_end" or e == "default_flow.on_step_end"
             or (isinstance(e, tuple) and e[0] in ("step", "save")) or e == "finish"]
    assert steps == [("step", 4096), "print.on_step_end", "default_flow.on_step_end",
                     ("step", 4096), "finish", "print.on_step_end", "default_flow.on_step_end", ("save", 2)]
    assert log[-1] == ("print.on_log", {"loss": 1.0, "yeto_pushes": 2, "yeto_installs": 0,
                                              "yeto_seconds": 0.25})


@pytest.mark.timeout(10)
def test_auto_attach_uses_default_flow_when_print_is_absent(recorded: tuple[dict[str, Any], list[Any]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    registry, _ = recorded
    monkeypatch.setenv("YETO_DILOCO_AUTO_ATTACH", "true")
    built = build(registry, Trainer(["tensorboard", "default_flow"]))
    assert isinstance(built[1], AutoAttached) and len(yeto_parts(built)) == 1


@pytest.mark.timeout(10)
def test_named_callback_is_never_attached_twice(recorded: tuple[dict[str, Any], list[Any]],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    registry, _ = recorded
    monkeypatch.setenv("YETO_DILOCO_AUTO_ATTACH", "1")
    built = build(registry, Trainer([NAME, "print", "default_flow"]))
    assert len(yeto_parts(built)) == 1 and built[0] is yeto_parts(built)[0]
    assert not any(isinstance(cb, AutoAttached) for cb in built)


@pytest.mark.timeout(10)
def test_bad_auto_attach_value_names_the_variable(recorded: tuple[dict[str, Any], list[Any]],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    registry, _ = recorded
    monkeypatch.setenv("YETO_DILOCO_AUTO_ATTACH", "maybe")
    with pytest.raises(SettingsError, match="YETO_DILOCO_AUTO_ATTACH='maybe'"):
        build(registry, Trainer(["print", "default_flow"]))


@pytest.mark.timeout(10)
def test_composes_with_other_plugins_and_registers_once(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[Any] = []
    monkeypatch.setattr(callback_mod, "megatron_sync", factory_for(RecordingSync(log)))
    monkeypatch.setenv("YETO_DILOCO_AUTO_ATTACH", "1")
    registry = swift_registry(log)

    # another plugin replaced 'print' with its own subclass, and added an entry of its own
    OtherPrint = type("OtherPrint", (registry["print"],), {"on_step_end": lambda self: log.append("other.on_step_end")})

    other = type("Other", (Base,), {})
    registry["print"], registry["other"] = OtherPrint, other
    register(registry, base=Base)
    snapshot = dict(registry)
    register(registry, base=Base)  # a second import of the plugin file changes nothing
    assert registry == snapshot and registry["other"] is other and registry["print"].wrapped is OtherPrint

    inner = registry["print"]  # a later plugin wraps 'print' again, on top of yeto's entry
    registry["print"] = lambda trainer: inner(trainer)
    register(registry, base=Base)  # and yeto registers once more, above it
    trainer = Trainer(["other", "print", "default_flow"])
    built = build(registry, trainer)
    assert len(yeto_parts(built)) == 1 and type(built[0]) is other
    call(trainer, "on_train_begin")
    trainer.opt_param_scheduler.num_steps += 8
    trainer.state.iteration += 1
    call(trainer, "on_step_end")
    assert log[-3:] == [("step", 4096), "other.on_step_end", "default_flow.on_step_end"]


# -- the callback's accounting ------------------------------------------------------------------

def direct(trainer: Trainer, sync: RecordingSync) -> YetoMegatronCallback:
    cb = YetoMegatronCallback(trainer, sync_factory=factory_for(sync))
    trainer.callbacks = [cb, swift_registry(sync.log)["default_flow"](trainer)]  # as swift orders them
    return cb


@pytest.mark.timeout(10)
def test_one_step_per_optimizer_step_and_zero_tokens_when_skipped() -> None:
    log: list[Any] = []
    trainer = Trainer([NAME], train_iters=4, gbs=8, seq_length=512)
    cb = direct(trainer, RecordingSync(log))
    run(trainer, log, skipped=frozenset({2}))
    assert log[0] == ("built", ["chunk0"], "optimizer", "127.0.0.1:7070") and log[1] == "start"
    assert [e[1] for e in log if e[0] == "step"] == [4096, 0, 4096, 4096]
    # the final cut arrives at the last step, before swift saves it; on_train_end only closes
    assert [e for e in log if isinstance(e, str) or e[0] == "save"][-4:] == [
        "finish", "default_flow.on_step_end", ("save", 4), "close"]
    assert log.count("finish") == 1 and cb.final_installed


@pytest.mark.timeout(10)
def test_without_a_scheduler_every_step_counts_the_batch() -> None:
    log: list[Any] = []
    trainer = Trainer([NAME], train_iters=2, gbs=4, seq_length=100, scheduler=False)
    direct(trainer, RecordingSync(log))
    run(trainer, log, skipped=frozenset({1}))
    assert [e[1] for e in log if e[0] == "step"] == [400, 400]


@pytest.mark.timeout(10)
def test_final_cut_stops_training_at_that_step() -> None:
    log: list[Any] = []
    trainer = Trainer([NAME], train_iters=10)
    cb = direct(trainer, RecordingSync(log, final_at=3))
    run(trainer, log)
    assert trainer.state.iteration == 3 and trainer.args.train_iters == 3
    assert sum(1 for e in log if e[0] == "step") == 3 and ("save", 3) in log
    assert "finish" not in log and log[-1] == "close" and cb.final_installed


@pytest.mark.timeout(10)
def test_train_end_finishes_then_closes_when_no_step_reached_the_end() -> None:
    log: list[Any] = []
    trainer = Trainer([NAME], train_iters=5, iteration=5)  # resumed at its last step: no step runs
    cb = YetoMegatronCallback(trainer, sync_factory=factory_for(RecordingSync(log, finish_result=False)))
    trainer.callbacks = [cb]
    run(trainer, log)
    assert log[1:] == ["start", "finish", "close"] and not cb.final_installed


@pytest.mark.timeout(10)
def test_on_log_adds_counters_and_events_are_complete() -> None:
    trainer = Trainer([NAME])
    cb = YetoMegatronCallback(trainer, sync_factory=factory_for(RecordingSync([])))
    logs: dict[str, Any] = {}
    cb.on_log(logs=logs)
    assert logs == {}  # nothing before training began
    cb.on_train_begin()
    trainer.state.iteration = 1
    trainer.opt_param_scheduler.num_steps += 8
    cb.on_step_end()
    cb.on_log(logs=logs)
    assert logs == {"yeto_pushes": 1, "yeto_installs": 0, "yeto_seconds": 0.25}
    for event in EVENTS:
        assert callable(getattr(cb, event))
    cb.on_save(output_dir="out")


@pytest.mark.timeout(10)
def test_bad_setting_fails_at_train_begin_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_DILOCO_MERGE_ALPHA", "2")
    cb = YetoMegatronCallback(Trainer([NAME]), sync_factory=factory_for(RecordingSync([])))  # building is fine
    with pytest.raises(SettingsError, match="YETO_DILOCO_MERGE_ALPHA='2'"):
        cb.on_train_begin()


@pytest.mark.timeout(10)
def test_the_default_sync_core_is_megatron_dilocosync(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []

    class MegatronDiLoCoSync(RecordingSync):
        def __init__(self, model: Any, optimizer: Any, settings: Any) -> None:
            super().__init__([])
            made.append((model, optimizer, settings.learner_id))

    # the real module needs Megatron ranks; only the wiring is checked here
    fake = SimpleNamespace(MegatronDiLoCoSync=MegatronDiLoCoSync)
    monkeypatch.setitem(sys.modules, "yeto_plugins.megatron.sync", fake)
    monkeypatch.setenv("YETO_DILOCO_LEARNER_ID", "1")
    cb = YetoMegatronCallback(Trainer([NAME]))
    cb.on_train_begin()
    assert made == [(["chunk0"], "optimizer", 1)]
    assert isinstance(cb.sync, MegatronDiLoCoSync) and cb.sync.log == ["start"]
