"""The schema of a model family: which config keys it takes, each typed and bounded.

``ModelFamily`` pairs a factory with its ``ConfigField``s and cross-field rules; a config
from the wire is validated against it before anything is built (``families.py`` holds the
registry of families a peer serves).
"""

from __future__ import annotations

import inspect
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fusionp2p.errors import ConfigError

__all__ = [
    "BOOL_FIELD",
    "TOKEN_ID_FIELD",
    "ConfigField",
    "ModelFamily",
    "UnknownModelError",
    "float_field",
    "int_field",
]

_MAX_STR = 256
_INT_LIMIT = 1 << 31


class UnknownModelError(ConfigError):
    """A spec names a model family this peer does not serve."""


@dataclass(frozen=True)
class ConfigField:
    """One key of a family's config: its type, bounds and whether ``null`` is allowed."""

    type: type  # int, float, bool or str
    low: float = -math.inf  # inclusive bounds for numbers
    high: float = math.inf
    choices: tuple[str, ...] = ()  # for str: the allowed values (empty: any string up to 256 chars)
    nullable: bool = False
    required: bool = False

    def check(self, family: str, key: str, value: Any) -> Any:
        """The value, normalized (an int where a float is wanted becomes a float).

        Raises:
            ConfigError: wrong type, out of bounds or not one of the choices.
        """
        where = f"model {family!r} config {key!r}"
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(f"{where} must not be null")
        if self.type is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false, got {value!r:.40}")
            return value
        if self.type is str:
            if not isinstance(value, str) or len(value) > _MAX_STR:
                raise ConfigError(f"{where} must be a string of <= {_MAX_STR} chars, got {value!r:.40}")
            if self.choices and value not in self.choices:
                raise ConfigError(f"{where} must be one of {list(self.choices)}, got {value!r:.40}")
            return value
        if self.type is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{where} must be an integer, got {value!r:.40}")
        if self.type is float:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"{where} must be a finite number, got {value!r:.40}")
            value = float(value)
        if not self.low <= value <= self.high:
            raise ConfigError(f"{where} must be in [{self.low:g}, {self.high:g}], got {value!r:.40}")
        return value


def int_field(low: int = 1, high: int = _INT_LIMIT, **kw: Any) -> ConfigField:
    return ConfigField(int, low, high, **kw)


def float_field(low: float = 0.0, high: float = 1.0, **kw: Any) -> ConfigField:
    return ConfigField(float, low, high, **kw)


BOOL_FIELD = ConfigField(bool)
TOKEN_ID_FIELD = int_field(0, 1 << 20, nullable=True)


@dataclass(frozen=True)
class ModelFamily:
    """A buildable model: a factory, the schema of its config, cross-field rules."""

    name: str
    factory: Callable[..., torch.nn.Module]  # called with the validated config as keyword arguments
    fields: Mapping[str, ConfigField]
    rules: tuple[Callable[[dict[str, Any]], str | None], ...] = ()  # each returns a complaint or None
    strip_prefix: str = ""  # a wrapper attribute dropped from module paths ("model." for causal LMs)
    doc: str = ""

    def validate(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The config checked against the schema: known keys only, each typed and bounded.

        Raises:
            ConfigError: an unknown key (the message lists the known ones), a missing
                required key, a value of the wrong type or out of bounds, a broken rule.
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"model {self.name!r} config must be a JSON object")
        unknown = sorted(set(config) - set(self.fields))
        if unknown:
            raise ConfigError(
                f"model {self.name!r} has no config key {unknown[0]!r:.60}; known keys: {sorted(self.fields)}"
            )
        missing = sorted(k for k, f in self.fields.items() if f.required and k not in config)
        if missing:
            raise ConfigError(f"model {self.name!r} config needs {missing}")
        checked = {key: self.fields[key].check(self.name, key, value) for key, value in config.items()}
        for rule in self.rules:
            complaint = rule(checked)
            if complaint:
                raise ConfigError(f"model {self.name!r} config: {complaint}")
        return checked

    def build(self, config: Mapping[str, Any]) -> torch.nn.Module:
        """The model for a validated config (ConfigError if the factory rejects it)."""
        try:
            return self.factory(**config)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model {self.name!r} rejects its config: {e}") from e

    @classmethod
    def from_factory(cls, name: str, factory: Callable[..., torch.nn.Module]) -> ModelFamily:
        """A family whose schema is the factory's keyword parameters of type int, float,
        bool or str (annotated, or with a default of that type); integers are bounded by
        +-2^31 and every float must be finite. Other parameters cannot be configured.

        Raises:
            ConfigError: ``factory`` is not callable.
        """
        if not callable(factory):
            raise ConfigError(f"{name!r} is not a callable model factory")
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"cannot read the parameters of model factory {name!r}: {e}") from e
        try:
            hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
        except Exception:  # unresolvable annotations: fall back to the defaults' types
            hints = {}
        fields: dict[str, ConfigField] = {}
        for param in signature.parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                continue
            kind = hints.get(param.name)
            if kind not in (int, float, bool, str) and param.default is not param.empty:
                kind = type(param.default)
            if kind not in (int, float, bool, str):
                continue
            required = param.default is param.empty
            if kind is int:
                fields[param.name] = int_field(-_INT_LIMIT, _INT_LIMIT, required=required)
            elif kind is float:
                fields[param.name] = ConfigField(float, required=required)
            else:
                fields[param.name] = ConfigField(kind, required=required)
        return cls(name, factory, fields, doc=(inspect.getdoc(factory) or "").split("\n")[0])
