"""How settings are named: one flat name each, former names, misspellings.

The settings are nested (`LearnerSettings.link.heartbeat_s`), but users set each one by a single
name: the variable `YETO_DILOCO_HEARTBEAT_S`, the flag `--heartbeat-s`, the keyword argument
`heartbeat_s=`. A section's field goes by its own name, or by its `validation_alias` where the
component calls it otherwise (`link.stall_timeout_s` is `wan_stall_timeout_s`). `FlatSettings`
reads the environment by those names, folds flat keyword arguments into their sections, and
`flat_of` turns an error's location back into the name the user wrote. A variable under a yeto
prefix that names no setting is reported with the one it resembles (`unknown_variables`), and a
former name is still read, converted and warned about (`take_renamed`).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
from typing import Any, Literal, NamedTuple

from pydantic import AliasChoices, BaseModel, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from yeto_core.sections import Section

log = logging.getLogger("yeto.settings")


class SettingsError(ValueError):
    """A setting has a value yeto cannot use; the message names the setting."""


class Renamed(NamedTuple):
    """A setting's former name (a settings class's `renamed` maps it to this): its value, in
    `unit`, goes to the setting `new`, which is in seconds."""

    new: str
    unit: Literal["s", "ms"]

    @property
    def to_seconds(self) -> float:
        return 0.001 if self.unit == "ms" else 1.0


def renamed_settings(cls: type[BaseSettings]) -> dict[str, Renamed]:
    """Former name → its replacement, for the settings classes that renamed any."""
    return dict(getattr(cls, "renamed", {}))


class FlatField(NamedTuple):
    """Where a flat name lands: `path` is (field,) at the top or (section, field), and `info` the
    field it sets."""

    path: tuple[str, ...]
    info: FieldInfo


def section_of(info: FieldInfo) -> type[Section] | None:
    kind = info.annotation
    return kind if isinstance(kind, type) and issubclass(kind, Section) else None


def flat_name(name: str, info: FieldInfo) -> str:
    return info.validation_alias if isinstance(info.validation_alias, str) else name


@functools.cache
def flat_fields(cls: type[BaseModel]) -> dict[str, FlatField]:
    """Every setting of `cls` by its flat name, sections opened, in declaration order."""
    fields: dict[str, FlatField] = {}
    for name, info in cls.model_fields.items():
        section = section_of(info)
        inner = section.model_fields.items() if section else [(name, info)]
        for field, field_info in inner:
            flat = flat_name(field, field_info) if section else field
            if flat in fields or (section and flat in cls.model_fields):
                raise TypeError(f"{cls.__name__}: two settings are named {flat!r}")
            fields[flat] = FlatField((name, field) if section else (name,), field_info)
    return fields


def flat_of(cls: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """The flat name of the setting an error's location points at (the location, dotted, when it
    points at none)."""
    for flat, field in flat_fields(cls).items():
        if len(field.path) == 2 and loc[:2] in (field.path, (field.path[0], flat)):
            return flat
        if len(field.path) == 1 and loc[:1] == field.path:
            return flat
    return ".".join(str(part) for part in loc)


def flat_value(settings: BaseModel, flat: str) -> Any:
    """The value of the setting named `flat`, found in its section."""
    value: Any = settings
    for part in flat_fields(type(settings))[flat].path:
        value = getattr(value, part)
    return value


def nest(cls: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """Flat values → the nested shape of `cls`. A flat value goes into its section over what the
    section holds already (a section given whole, or read from the environment); names of no
    setting stay where they are, for validation to refuse."""
    fields = flat_fields(cls)
    nested: dict[str, Any] = {}
    into: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        field = fields.get(key)
        if field is not None and len(field.path) == 2:
            into.setdefault(field.path[0], {})[field.path[1]] = value
        else:
            nested[key] = value
    for section, flat in into.items():
        held = nested.get(section)
        base = held.model_dump() if isinstance(held, BaseModel) else dict(held or {})
        nested[section] = {**base, **flat}
    return nested


def variables_of(prefix: str, flat: str, info: FieldInfo) -> list[str]:
    """The environment variables that set a setting: PREFIX + its flat name, or the whole names
    its `AliasChoices` lists (the fault point's `YETO_FAULT`)."""
    if isinstance(info.validation_alias, AliasChoices):
        return [str(choice) for choice in info.validation_alias.choices]
    return [f"{prefix}{flat}".upper()]


class FlatEnvironment(PydanticBaseSettingsSource):
    """The environment, read by the flat names: each variable set goes to its section's field. A
    value read through an alias keeps the alias as its key, so an error names that variable."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        self._environ: dict[str, str] = {}  # this read's variables, names upper-cased

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """The value of the setting whose flat name is `field_name`, under the key validation takes
        (the variable's whole name when it came through an alias), or None; never complex."""
        prefix = str(self.config.get("env_prefix", ""))
        for var in variables_of(prefix, field_name, field):
            value = self._environ.get(var.upper())
            if value is not None:
                return value, var if isinstance(field.validation_alias, AliasChoices) else field_name, False
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        self._environ = {var.upper(): value for var, value in os.environ.items()}
        found: dict[str, Any] = {}
        for flat, field in flat_fields(self.settings_cls).items():
            value, key, _ = self.get_field_value(field.info, flat)
            if value is not None:
                found[key] = value
        return nest(self.settings_cls, found)


class FlatSettings(BaseSettings):
    """Settings made of sections and read by flat names, from the environment and from keyword
    arguments (which win)."""

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, FlatEnvironment(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, values: Any) -> Any:
        # The environment arrives nested already; keyword arguments arrive flat and win over it.
        return nest(cls, values) if isinstance(values, dict) else values


def unknown_variables(cls: type[BaseSettings]) -> list[str]:
    """A line for each environment variable under the settings' prefix that names no setting:
    a typo must not silently leave a setting at its default."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    if not prefix:
        return []
    known = [f"{prefix}{name.upper()}" for name in flat_fields(cls)]
    former = [f"{prefix}{name.upper()}" for name in renamed_settings(cls)]  # read, with a warning
    lines = []
    for var in sorted(os.environ):
        if var.upper().startswith(prefix) and var.upper() not in known + former:
            close = difflib.get_close_matches(var.upper(), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; the settings are {', '.join(known)}"
            lines.append(f"{var} is not a yeto setting{hint}")
        elif (meant := misspelt_prefix(var.upper(), prefix)) is not None:
            close = difflib.get_close_matches(meant, known, n=1)
            lines.append(f"{var} is not a yeto setting; did you mean {close[0] if close else meant}?")
    return lines


def misspelt_prefix(var: str, prefix: str) -> str | None:
    """`var` with `prefix` put in place of a misspelling of it (`YETO_SYNCR_QUORUM` →
    `YETO_SYNCER_QUORUM`), or None when `var` does not start with something close to `prefix`:
    such a variable would otherwise leave its setting at the default without a word."""
    if var.startswith(prefix) or not var.startswith("YETO"):
        return None
    best, meant = 0.0, None
    for cut in range(max(5, len(prefix) - 2), min(len(var), len(prefix) + 2) + 1):  # a letter or two off
        ratio = difflib.SequenceMatcher(None, var[:cut], prefix).ratio()
        if ratio > best:
            best, meant = ratio, prefix + var[cut:].lstrip("_")
    return meant if best >= 0.85 else None


def configured(cls: type[BaseSettings]) -> bool:
    """Whether the environment sets any of `cls`'s variables: a plugin that attaches itself (verl's
    entry point) stays inert without one, and is configured, rightly or wrongly, with any."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    return bool(prefix) and any(var.upper().startswith(prefix) for var in os.environ)


def environment_of(cls: type[BaseSettings]) -> dict[str, str]:
    """This process's variables of `cls`'s prefix, as set: for processes that do not inherit this
    environment (the workers of a Ray cluster started before the job, `yeto_plugins.verl.entry`)."""
    prefix = str(cls.model_config.get("env_prefix", "")).upper()
    return {k: v for k, v in os.environ.items() if prefix and k.upper().startswith(prefix)}


def setting_name(field: str, *, flags: bool) -> str:
    """How errors call a value given explicitly: its command-line flag or keyword argument."""
    return f"--{field.replace('_', '-')}" if flags else f"argument {field}"


def take_renamed(cls: type[BaseSettings], given: dict[str, Any], *, flags: bool) -> dict[str, tuple[str, Any]]:
    """Move a value set under a former name (explicitly, or in the environment) into `given` under
    the current name, converted to seconds, with one warning each; explicit values still win over
    the environment. Returns, for each setting filled so, the name and value its errors quote:
    the ones the user wrote."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    environ = {var.upper(): value for var, value in os.environ.items()}
    quoted: dict[str, tuple[str, Any]] = {}
    for old, renamed in renamed_settings(cls).items():
        new = renamed.new
        if old in given:
            raw, name, new_name = given.pop(old), setting_name(old, flags=flags), setting_name(new, flags=flags)
            if new in given:
                raise SettingsError(f"{name} and {new_name} are both given; drop the deprecated {name}")
        elif f"{prefix}{old.upper()}" in environ and new not in given:
            name, new_name = f"{prefix}{old.upper()}", f"{prefix}{new.upper()}"
            raw = environ[name]
            if new_name in environ:
                raise SettingsError(f"{name} and {new_name} are both set; drop the deprecated {name}")
        else:
            continue
        try:
            seconds = float(raw) * renamed.to_seconds
        except (TypeError, ValueError):
            raise SettingsError(f"{name}={raw!r}: expected a number ({renamed.unit})") from None
        log.warning("%s is deprecated; use %s (in seconds): read as %s=%g", name, new_name, new_name, seconds)
        given[new] = seconds
        quoted[new] = (name, raw)
    return quoted
