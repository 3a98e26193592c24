"""`YETO_DILOCO_AUTO_ATTACH=1`: every HF Trainer in the process gets `YetoDiLoCo()`, with no change
to the training script (DESIGN §1.4).

The package installs `yeto-autoattach.pth` into site-packages, and Python runs its one line
(`PTH_LINE`) at start-up. The line reads the variable and stops there when it is unset, empty or
false, so a process without it imports nothing. Otherwise it calls `install()`, which puts a
finder on `sys.meta_path` that waits for `transformers.trainer` to be imported (transformers is
never imported early) and then wraps two `Trainer` methods:

- `__init__`: a Trainer built afterwards gets `YetoDiLoCo()` as its first callback, so its log
  fields reach every logger and it installs the final cut before other callbacks see the end of
  training. The callback reads `YETO_DILOCO_*` then, so a bad value makes building the Trainer fail
  with the usual `SettingsError`. A Trainer given a `YetoDiLoCo` in `callbacks=` keeps only that one.
- `add_callback`: a `YetoDiLoCo` the script adds itself replaces the automatic one, as explicit
  arguments win over the environment.

Nothing else arms the line: the other `YETO_DILOCO_*` variables (the syncer's address, say) import
nothing, so a Trainer without a `YetoDiLoCo` then trains alone, unwarned (the README says so). A
warning would cost every process that inherits those settings an import of yeto at start-up.

At start-up this module imports only `weakref` (the hook runs in every process that has the
variable, dataloader workers included); yeto's callback, and with it torch, is imported when the
first Trainer is built.
"""

from __future__ import annotations

import os
import sys
import weakref

TYPE_CHECKING = False  # not typing's: that import alone would add milliseconds to every start-up
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

ENV = "YETO_DILOCO_AUTO_ATTACH"
TARGET = "transformers.trainer"
# pydantic's false strings (any case); empty counts as unset. Any other value turns the hook on,
# and one that pydantic refuses then fails the Trainer's construction with a message naming ENV.
OFF = ("", "0", "f", "false", "n", "no", "off")
PTH_NAME = "yeto-autoattach.pth"
PTH_LINE = (f"import os; os.environ.get({ENV!r}, '').lower() not in {OFF!r} "
            f"and __import__('yeto_plugins.autoattach', fromlist=['install']).install()\n")

_automatic: weakref.WeakSet[Any] = weakref.WeakSet()  # callbacks this module attached
_MARK = "__yeto_auto_attach__"


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the start-up line calls `install()` (the same test, for use outside it)."""
    return environ.get(ENV, "").lower() not in OFF


def install() -> None:
    """Attach to every HF Trainer built from now on; calling it again changes nothing."""
    module = sys.modules.get(TARGET)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, TrainerFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TrainerFinder())


class TrainerFinder:
    """A `sys.meta_path` finder that imports nothing itself: it asks the finders after it for
    `transformers.trainer`, lets that module's loader run, patches the module and steps aside."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != TARGET:
            return None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = getattr(spec.loader, "exec_module", None)
        if exec_module is None:
            import logging

            logging.getLogger("yeto.hf").warning("%s: cannot watch %s (its loader has no exec_module); "
                                                 "nothing is attached", ENV, TARGET)
            return None

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)

        # An attribute of this one loader object (a file's loader is made for its spec), so other
        # modules load as before and `module.__loader__` stays the real loader.
        spec.loader.exec_module = exec_and_patch  # type: ignore[union-attr, method-assign]
        return spec


def patch(module: Any) -> None:
    """Wrap `module.Trainer.__init__` and `.add_callback` (once)."""
    import functools

    trainer_cls = module.Trainer
    init, add = trainer_cls.__init__, trainer_cls.add_callback
    if getattr(init, _MARK, False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if requested():
            attach(self)

    @functools.wraps(add)
    def add_callback(self: Any, callback: Any) -> None:
        replace_automatic(self, callback)
        add(self, callback)

    setattr(__init__, _MARK, True)
    trainer_cls.__init__ = __init__
    trainer_cls.add_callback = add_callback


def attach(trainer: Any) -> None:
    """Put `YetoDiLoCo()` first among the trainer's callbacks unless it already has one."""
    import logging

    from yeto_plugins.hf.callback import YetoDiLoCo

    callbacks = trainer.callback_handler.callbacks
    if any(isinstance(cb, YetoDiLoCo) for cb in callbacks):
        return
    callback = YetoDiLoCo()
    _automatic.add(callback)
    callbacks.insert(0, callback)
    logging.getLogger("yeto.hf").info("%s: attached YetoDiLoCo to %s (syncer %s, learner %d)", ENV,
                                      type(trainer).__name__, callback.settings.syncer, callback.settings.learner_id)


def replace_automatic(trainer: Any, callback: Any) -> None:
    """Drop the automatic `YetoDiLoCo` when the script adds one (an instance or the class)."""
    handler = getattr(trainer, "callback_handler", None)
    # By identity: a script's callback need not be hashable (a dataclass, say).
    automatic = [cb for cb in getattr(handler, "callbacks", ()) if any(cb is a for a in _automatic)]
    if not automatic:
        return
    from yeto_plugins.hf.callback import YetoDiLoCo

    cls = callback if isinstance(callback, type) else type(callback)
    if issubclass(cls, YetoDiLoCo):
        for cb in automatic:
            handler.callbacks.remove(cb)  # type: ignore[union-attr]
