"""Model families: the only code a peer runs for a job is code its operator installed.

A ``ModelSpec`` names a *family* and carries a config (JSON). A peer builds it only if
the family is in its ``ModelRegistry``: the built-in families (``gpt2``, ``llama``,
``digits-cnn``), factories its operator enabled with ``fusionp2p peer --allow-model
package.module:factory``, and installed ``fusionp2p.models`` entry points. Nothing a
peer receives is ever imported: an unknown family is refused with the flag that would
enable it. Every config is validated against its family's schema: known keys only,
each with a type and bounds, so a config cannot ask for what the family never offered.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fusionp2p.errors import ConfigError

__all__ = [
    "BUILTIN_FAMILIES",
    "ENTRY_POINT_GROUP",
    "ConfigField",
    "DigitsCNN",
    "ModelFamily",
    "ModelRegistry",
    "UnknownModelError",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "fusionp2p.models"
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


def _int(low: int = 1, high: int = _INT_LIMIT, **kw: Any) -> ConfigField:
    return ConfigField(int, low, high, **kw)


def _float(low: float = 0.0, high: float = 1.0, **kw: Any) -> ConfigField:
    return ConfigField(float, low, high, **kw)


_BOOL = ConfigField(bool)
_TOKEN_ID = _int(0, 1 << 20, nullable=True)


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
                fields[param.name] = _int(-_INT_LIMIT, _INT_LIMIT, required=required)
            elif kind is float:
                fields[param.name] = ConfigField(float, required=required)
            else:
                fields[param.name] = ConfigField(kind, required=required)
        return cls(name, factory, fields, doc=(inspect.getdoc(factory) or "").split("\n")[0])


# -- built-in families --------------------------------------------------------------------


class DigitsCNN(torch.nn.Module):
    """Two convolutions and a linear head for 8x8 grey images (scikit-learn's digits)."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.head = torch.nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(images))
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def _gpt2(**config: Any) -> torch.nn.Module:
    import transformers

    from fusionp2p.opdag.trace import CausalLMWrapper

    vocab = config.get("vocab_size", 50257)
    defaults = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if vocab <= 50256:  # GPT-2's default token ids would lie outside a small vocabulary
        defaults.update(bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    return CausalLMWrapper(transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**defaults, **config})))


def _llama(**config: Any) -> torch.nn.Module:
    import transformers

    from fusionp2p.opdag.trace import CausalLMWrapper

    vocab = config.get("vocab_size", 32000)
    defaults = {"bos_token_id": min(1, vocab - 1), "eos_token_id": min(2, vocab - 1)}
    return CausalLMWrapper(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**defaults, **config})))


def _divides(width: str, heads: str) -> Callable[[dict[str, Any]], str | None]:
    def rule(config: dict[str, Any]) -> str | None:
        w, h = config.get(width), config.get(heads)
        if w is not None and h is not None and w % h:
            return f"{width} ({w}) must be a multiple of {heads} ({h})"
        return None

    return rule


def _gqa(config: dict[str, Any]) -> str | None:
    heads, kv = config.get("num_attention_heads", 32), config.get("num_key_value_heads")
    if kv is not None and heads % kv:
        return f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})"
    if config.get("head_dim") is None and config.get("hidden_size", 4096) % heads:
        return f"hidden_size must be a multiple of num_attention_heads ({heads}) unless head_dim is set"
    return None


_ACTIVATIONS = ("gelu_new", "gelu", "gelu_pytorch_tanh", "relu", "silu", "tanh")
_DROPOUT = _float(0.0, 0.999)

GPT2_FAMILY = ModelFamily(
    "gpt2",
    _gpt2,
    {
        "vocab_size": _int(1, 1 << 20),
        "n_positions": _int(1, 1 << 20),
        "n_embd": _int(1, 1 << 16),
        "n_layer": _int(1, 128),
        "n_head": _int(1, 1024),
        "n_inner": _int(1, 1 << 18, nullable=True),
        "activation_function": ConfigField(str, choices=_ACTIVATIONS),
        "resid_pdrop": _DROPOUT,
        "embd_pdrop": _DROPOUT,
        "attn_pdrop": _DROPOUT,
        "layer_norm_epsilon": _float(1e-12, 1.0),
        "initializer_range": _float(0.0, 10.0),
        "scale_attn_weights": _BOOL,
        "scale_attn_by_inverse_layer_idx": _BOOL,
        "reorder_and_upcast_attn": _BOOL,
        "tie_word_embeddings": _BOOL,
        "bos_token_id": _TOKEN_ID,
        "eos_token_id": _TOKEN_ID,
    },
    rules=(_divides("n_embd", "n_head"),),
    strip_prefix="model.",
    doc="GPT-2 causal LM (transformers), built from its config; no downloads",
)

LLAMA_FAMILY = ModelFamily(
    "llama",
    _llama,
    {
        "vocab_size": _int(1, 1 << 20),
        "hidden_size": _int(1, 1 << 16),
        "intermediate_size": _int(1, 1 << 18),
        "num_hidden_layers": _int(1, 128),
        "num_attention_heads": _int(1, 1024),
        "num_key_value_heads": _int(1, 1024, nullable=True),
        "head_dim": _int(1, 1024, nullable=True),
        "hidden_act": ConfigField(str, choices=_ACTIVATIONS),
        "max_position_embeddings": _int(1, 1 << 20),
        "initializer_range": _float(0.0, 10.0),
        "rms_norm_eps": _float(1e-12, 1.0),
        "rope_theta": _float(1.0, 1e9),
        "attention_bias": _BOOL,
        "attention_dropout": _DROPOUT,
        "mlp_bias": _BOOL,
        "tie_word_embeddings": _BOOL,
        "pad_token_id": _TOKEN_ID,
        "bos_token_id": _TOKEN_ID,
        "eos_token_id": _TOKEN_ID,
    },
    rules=(_gqa,),
    strip_prefix="model.",
    doc="Llama causal LM (transformers), built from its config; no downloads",
)

DIGITS_FAMILY = ModelFamily(
    "digits-cnn",
    DigitsCNN,
    {"channels": _int(1, 1024), "classes": _int(1, 1 << 16)},
    doc="a two-layer CNN for scikit-learn's 8x8 digits",
)

BUILTIN_FAMILIES: tuple[ModelFamily, ...] = (GPT2_FAMILY, LLAMA_FAMILY, DIGITS_FAMILY)


# -- the registry ---------------------------------------------------------------------------


def _load_target(target: str) -> ModelFamily:
    """Imports an operator-named ``module:attr``: a ModelFamily, or a factory (named by the target)."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--allow-model wants 'package.module:factory', got {target!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import model factory {target!r}: {e}") from e
    return obj if isinstance(obj, ModelFamily) else ModelFamily.from_factory(target, obj)


@dataclass
class ModelRegistry:
    """The model families this process builds.

    ``ModelRegistry()`` holds the built-in families and installed ``fusionp2p.models``
    entry points; ``allow`` adds factories by import path (``"mypkg.models:factory"``,
    which is then the family's name) or ``ModelFamily`` objects. Only the operator of a
    peer, or a data owner for its own spec, decides what goes in here.

    Raises:
        ConfigError: an ``allow`` target that cannot be imported or is not a factory.
    """

    allow: Iterable[str | ModelFamily] = ()
    entry_points: bool = True
    families: dict[str, ModelFamily] = field(init=False)

    def __post_init__(self) -> None:
        self.families = {f.name: f for f in BUILTIN_FAMILIES}
        if self.entry_points:
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                try:
                    self.add(_load_target(ep.value), name=ep.name)
                except ConfigError as e:
                    logger.warning("skipped model entry point %r: %s", ep.name, e)
        for item in self.allow:
            self.add(item if isinstance(item, ModelFamily) else _load_target(item))

    def add(self, family: ModelFamily, *, name: str | None = None) -> None:
        """Serves ``family`` (under ``name`` if given)."""
        if name is not None and name != family.name:
            family = ModelFamily(name, family.factory, family.fields, family.rules, family.strip_prefix)
        self.families[family.name] = family

    @classmethod
    def for_data_owner(cls, family: str) -> ModelRegistry:
        """The registry of a data owner building its own spec: an import path it names
        itself is its own code, so it is allowed here (never on a peer)."""
        return cls(allow=[family] if ":" in family else [])

    def resolve(self, name: str) -> ModelFamily:
        """The family called ``name``.

        Raises:
            UnknownModelError: not served here; the message names the flag that enables it.
        """
        family = self.families.get(name)
        if family is None:
            flag = f"--allow-model {name}" if ":" in name else "--allow-model package.module:factory"
            raise UnknownModelError(
                f"model family {name[:80]!r} is not served by this peer (it serves "
                f"{sorted(self.families)}); its operator can enable it with `fusionp2p peer {flag}` "
                f"or an installed {ENTRY_POINT_GROUP!r} entry point"
            )
        return family

    def names(self) -> list[str]:
        """The families served, sorted."""
        return sorted(self.families)
