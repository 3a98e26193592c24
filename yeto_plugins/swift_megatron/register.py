"""Put yeto into ms-swift's Megatron callback registry; swift itself is never patched (DESIGN §1.5).

swift builds each name in `args.callbacks` as `megatron_callbacks_map[name](trainer)`, and
appends `print` and `default_flow` after the user's `--callbacks`. `register()` adds
`yeto_diloco` to that dict. For `YETO_DILOCO_AUTO_ATTACH=1` it also wraps the entries of those
two appended names: the first of them in `args.callbacks` then builds a composite that runs
yeto's event first and the wrapped callback's second, so yeto still acts before
`default_flow` decides to save. A run that names `yeto_diloco` gets it once, from its own entry.

Other plugins' entries stay as they are; an anchor another plugin replaced is wrapped as it is
found. Registering twice changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, MutableMapping
from typing import Any

from pydantic import create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from yeto_core.setting_names import flat_fields
from yeto_core.settings import LearnerSettings, load_settings
from yeto_plugins.swift_megatron.callback import YetoMegatronCallback

log = logging.getLogger("yeto.swift_megatron")

NAME = "yeto_diloco"
ANCHORS = ("print", "default_flow")  # appended by MegatronArguments.__post_init__, in this order

Factory = Callable[[Any], Any]
_attached: weakref.WeakSet[Any] = weakref.WeakSet()  # trainers already given a yeto callback


class _Prefix(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="YETO_DILOCO_", extra="ignore", frozen=True)


# `LearnerSettings.auto_attach` alone is checked when swift builds its callbacks; the other
# learner settings are checked at `on_train_begin`. They are listed here unchecked so that
# load_settings still knows every YETO_DILOCO_* name and reports a misspelt one.
_unchecked: dict[str, Any] = {name: (str | None, None) for name in flat_fields(LearnerSettings)}
AutoAttachSetting = create_model("AutoAttachSetting", __base__=_Prefix, **{**_unchecked, "auto_attach": (bool, False)})


def _fan_out(event: str) -> Callable[..., None]:
    def call(self: AutoAttached, *args: Any, **kwargs: Any) -> None:
        for part in self.parts:
            getattr(part, event)(*args, **kwargs)

    call.__name__ = event
    return call


class AutoAttached:
    """yeto's callback and a wrapped swift callback, as one registry product; yeto goes first."""

    def __init__(self, trainer: Any, parts: list[Any]) -> None:
        self.trainer, self.args, self.state = trainer, trainer.args, trainer.state
        self.parts = parts

    def __getattr__(self, name: str) -> Any:
        # Anything else is asked of the wrapped callback (e.g. PrintCallback's progress bar).
        if name == "parts":
            raise AttributeError(name)
        return getattr(self.parts[-1], name)

    on_train_begin = _fan_out("on_train_begin")
    on_train_end = _fan_out("on_train_end")
    on_step_begin = _fan_out("on_step_begin")
    on_step_end = _fan_out("on_step_end")
    on_log = _fan_out("on_log")
    on_eval_begin = _fan_out("on_eval_begin")
    on_eval_end = _fan_out("on_eval_end")
    on_eval_step = _fan_out("on_eval_step")
    on_save = _fan_out("on_save")


@functools.cache
def callback_classes(base: type) -> tuple[type, type]:
    """yeto's callback and the composite as subclasses of swift's `MegatronCallback`, so a type
    check in swift passes; built once per base so a second `register()` finds the same class."""
    if base is object:
        return YetoMegatronCallback, AutoAttached
    return (type("YetoDiLoCoCallback", (YetoMegatronCallback, base), {"__module__": __name__}),
            type("YetoAutoAttached", (AutoAttached, base), {"__module__": __name__}))


class AnchorEntry:
    """Stands in for swift's `name` entry: builds it, with yeto in front when auto-attach is on."""

    def __init__(self, name: str, wrapped: Factory, yeto: Factory, composite: Callable[[Any, list[Any]], Any]) -> None:
        self.name, self.wrapped, self.yeto, self.composite = name, wrapped, yeto, composite

    def __call__(self, trainer: Any) -> Any:
        inner = self.wrapped(trainer)
        if not self._attach_here(trainer):
            return inner
        with contextlib.suppress(TypeError):  # not weakly referable: the first-anchor rule alone holds
            _attached.add(trainer)
        return self.composite(trainer, [self.yeto(trainer), inner])

    def _attach_here(self, trainer: Any) -> bool:
        names = list(trainer.args.callbacks)
        if NAME in names or self.name != next((n for n in names if n in ANCHORS), None):
            return False
        try:
            if trainer in _attached:
                return False
        except TypeError:
            pass
        return bool(load_settings(AutoAttachSetting).auto_attach)  # type: ignore[attr-defined]


def register(registry: MutableMapping[str, Any] | None = None, base: type | None = None) -> None:
    """Add `yeto_diloco` to swift's Megatron callback registry (or `registry`) and make the anchors
    honour `YETO_DILOCO_AUTO_ATTACH`. swift is imported only when no registry is given."""
    if registry is None:
        from swift.megatron.callbacks import MegatronCallback, megatron_callbacks_map

        registry, base = megatron_callbacks_map, MegatronCallback
    yeto, composite = callback_classes(object if base is None else base)
    current = registry.get(NAME)
    if current is not None and current is not yeto:
        log.warning("replacing the %r callback registered by %r", NAME, current)
    registry[NAME] = yeto
    anchors = [name for name in ANCHORS if name in registry]
    if not anchors:
        log.warning("no %s callback in swift's registry: YETO_DILOCO_AUTO_ATTACH cannot work; "
                    "name the callback with --callbacks %s", " or ".join(ANCHORS), NAME)
    for name in anchors:
        if not isinstance(registry[name], AnchorEntry):
            registry[name] = AnchorEntry(name, registry[name], yeto, composite)
