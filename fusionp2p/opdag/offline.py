"""The OP-DAG of a registered model family for offline planning (``fusionp2p plan``).

``gpt2`` and ``llama`` have an analytic OP-DAG (``opdag.analytic``) at block or sublayer
granularity, checked against any config key transformers knows. Every other family of the
registry (the other causal LMs, ``resnet``, ``digits-cnn``, ``--allow-model`` factories) is
traced under a ``FakeTensorMode``, as a coordinator does for a job, so nothing is
allocated and the DAG is the one a job of that model would be planned on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.analytic import TransformerShape, transformer_dag
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.ir import OpDag
from fusionp2p.opdag.lm_families import LM_FAMILIES
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.records import ModelSpec

__all__ = ["ANALYTIC_FAMILIES", "OfflineModel", "offline_dag"]

ANALYTIC_FAMILIES = ("gpt2", "llama")
_LM_NAMES = frozenset(f.name for f in LM_FAMILIES)


@dataclass(frozen=True)
class OfflineModel:
    """What ``fusionp2p plan`` plans: a family, its config overrides and one micro-batch's shape."""

    family: str
    config: dict[str, Any]
    seq_len: int = 1024
    micro_batch: int = 4
    granularity: Literal["block", "sublayer"] = "block"
    image_size: int = 32
    channels: int = 3
    trace: bool = False  # trace gpt2/llama too, instead of their analytic DAG


def _analytic(model: OfflineModel) -> OpDag:
    import transformers

    known = set(transformers.AutoConfig.for_model(model.family).to_dict())
    unknown = sorted(set(model.config) - known)
    if unknown:
        raise ConfigError(
            f"--model-config: {model.family} has no config key {unknown[0]!r}; "
            f"known keys: {', '.join(sorted(known))}"
        )
    try:
        hf_config = transformers.AutoConfig.for_model(model.family, **model.config)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--model-config: a bad value for {model.family}: {e}") from e
    shape = TransformerShape.from_hf_config(hf_config)
    return transformer_dag(
        shape, seq_len=model.seq_len, micro_batch=model.micro_batch, granularity=model.granularity
    )


def offline_dag(model: OfflineModel, registry: ModelRegistry | None = None) -> OpDag:
    """The OP-DAG of ``model``: analytic for gpt2/llama, traced (fake) for the rest.

    Raises:
        ConfigError: a family not in ``registry`` (default: the built-ins, installed
            entry points, and ``model.family`` itself if it is a ``module:factory``), a
            config key the family does not have, a bad value, or an input shape the model
            cannot take.
    """
    registry = registry or ModelRegistry.for_data_owner(model.family)
    if model.family not in registry.families:
        raise ConfigError(
            f"--model: no model family {model.family[:80]!r}; known: {', '.join(registry.names())} "
            "(or a factory of your own as package.module:factory)"
        )
    if model.family in ANALYTIC_FAMILIES and not model.trace:
        return _analytic(model)
    if model.family in _LM_NAMES:
        shape: tuple[int, ...] = (model.micro_batch, model.seq_len)
        dtype = "int64"
    else:
        shape = (model.micro_batch, model.channels, model.image_size, model.image_size)
        dtype = "float32"
    spec = ModelSpec(model.family, dict(model.config), input_shape=shape, input_dtype=dtype)
    try:
        return trace_spec(spec, registry, fake=True).dag
    except ConfigError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        what = f"{shape[1]}-token sequences" if dtype == "int64" else f"{shape[1:]} images"
        raise ConfigError(f"{model.family} cannot take {what}: {str(e).splitlines()[0][:300]}") from e
