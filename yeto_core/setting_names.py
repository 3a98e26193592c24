"""One flat name a setting, over settings made of sections.

The settings are nested (`LearnerSettings.link.heartbeat_s`), but users set each one by a single
name: the variable `YETO_DILOCO_HEARTBEAT_S`, the flag `--heartbeat-s`, the keyword argument
`heartbeat_s=`. A section's field goes by its own name, or by its `validation_alias` where the
component calls it otherwise (`link.stall_timeout_s` is `wan_stall_timeout_s`). `FlatSettings`
reads the environment by those names, folds flat keyword arguments into their sections, and
`flat_of` turns an error's location back into the name the user wrote.
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

from pydantic import AliasChoices, BaseModel, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from yeto_core.sections import Section


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

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # `__call__` reads every setting at once

    def __call__(self) -> dict[str, Any]:
        prefix = str(self.config.get("env_prefix", ""))
        environ = {var.upper(): value for var, value in os.environ.items()}
        found: dict[str, Any] = {}
        for flat, field in flat_fields(self.settings_cls).items():
            for var in variables_of(prefix, flat, field.info):
                if var.upper() in environ:
                    aliased = isinstance(field.info.validation_alias, AliasChoices)
                    found[var if aliased else flat] = environ[var.upper()]
                    break
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
