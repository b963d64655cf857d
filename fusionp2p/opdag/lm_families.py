"""The built-in causal language models: transformers families built from a config.

Each family is a ``model_type`` built with ``transformers.AutoConfig.for_model`` and
``AutoModelForCausalLM.from_config``: no hub download, no remote code. Its schema lists
the config keys a job may set, each typed and bounded; token ids default to ids inside
the vocabulary so a small byte-level vocabulary works.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fusionp2p.opdag.schema import (
    BOOL_FIELD,
    TOKEN_ID_FIELD,
    ConfigField,
    ModelFamily,
    float_field,
    int_field,
)

__all__ = ["LM_FAMILIES", "CausalLMWrapper", "causal_lm_factory"]

_ACTIVATIONS = ("gelu_new", "gelu", "gelu_pytorch_tanh", "relu", "silu", "tanh")
_DROPOUT = float_field(0.0, 0.999)
_VOCAB = int_field(1, 1 << 20)
_WIDTH = int_field(1, 1 << 16)
_FFN = int_field(1, 1 << 18)
_LAYERS = int_field(1, 128)
_HEADS = int_field(1, 1024)
_POSITIONS = int_field(1, 1 << 20)
_EPS = float_field(1e-12, 1.0)
_INIT = float_field(0.0, 10.0)
_THETA = float_field(1.0, 1e9)

# defaults of the token ids a family's config names, clamped into the vocabulary
_TOKEN_DEFAULTS: dict[str, dict[str, int | None]] = {
    "gpt2": {"bos_token_id": 50256, "eos_token_id": 50256},
    "llama": {"bos_token_id": 1, "eos_token_id": 2},
    "mistral": {"bos_token_id": 1, "eos_token_id": 2},
    "qwen2": {"bos_token_id": None, "eos_token_id": None},
    "gpt_neox": {"bos_token_id": 0, "eos_token_id": 2},
}
_GQA_TYPES = ("llama", "mistral", "qwen2")
_DEFAULT_VOCAB = {"gpt2": 50257, "llama": 32000, "mistral": 32000, "qwen2": 151936, "gpt_neox": 50432}
_NO_DROPOUT: dict[str, dict[str, float]] = {
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
}


class CausalLMWrapper(torch.nn.Module):
    """Calls a transformers causal LM with ``use_cache=False`` and returns only the logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def causal_lm_factory(model_type: str) -> Callable[..., torch.nn.Module]:
    """A factory building ``model_type``'s causal LM from keyword config (random weights)."""

    def build(**config: Any) -> torch.nn.Module:
        import transformers

        vocab = config.get("vocab_size", _DEFAULT_VOCAB.get(model_type, 32000))
        defaults: dict[str, Any] = dict(_NO_DROPOUT.get(model_type, {}))
        for key, default in _TOKEN_DEFAULTS.get(model_type, {}).items():
            if default is not None:
                defaults[key] = min(default, vocab - 1)
        if model_type in _GQA_TYPES and "num_attention_heads" in config:
            defaults["num_key_value_heads"] = config["num_attention_heads"]  # not the family's 8 or 32
        hf_config = transformers.AutoConfig.for_model(model_type, **{**defaults, **config})
        return CausalLMWrapper(transformers.AutoModelForCausalLM.from_config(hf_config))

    build.__name__ = f"build_{model_type}"
    return build


def _divides(width: str, heads: str, *, default_width: int = 4096) -> Callable[[dict[str, Any]], str | None]:
    def rule(config: dict[str, Any]) -> str | None:
        w, h = config.get(width, default_width), config.get(heads)
        if h is not None and w % h and config.get("head_dim") is None:
            return f"{width} ({w}) must be a multiple of {heads} ({h})"
        return None

    return rule


def _gqa(config: dict[str, Any]) -> str | None:
    heads, kv = config.get("num_attention_heads", 32), config.get("num_key_value_heads")
    if kv is not None and heads % kv:
        return f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})"
    return _divides("hidden_size", "num_attention_heads")(config)


def _family(
    model_type: str, fields: Mapping[str, ConfigField], rules: tuple[Callable[..., str | None], ...]
) -> ModelFamily:
    return ModelFamily(
        model_type,
        causal_lm_factory(model_type),
        fields,
        rules=rules,
        strip_prefix="model.",
        doc=f"{model_type} causal LM (transformers), built from its config; no downloads",
    )


_TOKENS = {"pad_token_id": TOKEN_ID_FIELD, "bos_token_id": TOKEN_ID_FIELD, "eos_token_id": TOKEN_ID_FIELD}

_DECODER = {  # the keys the Llama-like decoders share
    "vocab_size": _VOCAB,
    "hidden_size": _WIDTH,
    "intermediate_size": _FFN,
    "num_hidden_layers": _LAYERS,
    "num_attention_heads": _HEADS,
    "num_key_value_heads": int_field(1, 1024, nullable=True),
    "head_dim": int_field(1, 1024, nullable=True),
    "hidden_act": ConfigField(str, choices=_ACTIVATIONS),
    "max_position_embeddings": _POSITIONS,
    "initializer_range": _INIT,
    "rms_norm_eps": _EPS,
    "rope_theta": _THETA,
    "attention_dropout": _DROPOUT,
    "tie_word_embeddings": BOOL_FIELD,
    "use_cache": BOOL_FIELD,
    **_TOKENS,
}

GPT2_FAMILY = _family(
    "gpt2",
    {
        "vocab_size": _VOCAB,
        "n_positions": _POSITIONS,
        "n_embd": _WIDTH,
        "n_layer": _LAYERS,
        "n_head": _HEADS,
        "n_inner": int_field(1, 1 << 18, nullable=True),
        "activation_function": ConfigField(str, choices=_ACTIVATIONS),
        "resid_pdrop": _DROPOUT,
        "embd_pdrop": _DROPOUT,
        "attn_pdrop": _DROPOUT,
        "layer_norm_epsilon": _EPS,
        "initializer_range": _INIT,
        "scale_attn_weights": BOOL_FIELD,
        "scale_attn_by_inverse_layer_idx": BOOL_FIELD,
        "reorder_and_upcast_attn": BOOL_FIELD,
        "tie_word_embeddings": BOOL_FIELD,
        "use_cache": BOOL_FIELD,
        **_TOKENS,
    },
    (_divides("n_embd", "n_head", default_width=768),),
)

LLAMA_FAMILY = _family(
    "llama",
    {**_DECODER, "attention_bias": BOOL_FIELD, "mlp_bias": BOOL_FIELD, "pretraining_tp": int_field(1, 64)},
    (_gqa,),
)

MISTRAL_FAMILY = _family(
    "mistral", {**_DECODER, "sliding_window": int_field(1, 1 << 20, nullable=True)}, (_gqa,)
)

QWEN2_FAMILY = _family(
    "qwen2",
    {
        **_DECODER,
        "use_sliding_window": BOOL_FIELD,
        "sliding_window": int_field(1, 1 << 20, nullable=True),
        "max_window_layers": int_field(0, 128),
    },
    (_gqa,),
)

GPT_NEOX_FAMILY = _family(
    "gpt_neox",
    {
        "vocab_size": _VOCAB,
        "hidden_size": _WIDTH,
        "intermediate_size": _FFN,
        "num_hidden_layers": _LAYERS,
        "num_attention_heads": _HEADS,
        "hidden_act": ConfigField(str, choices=_ACTIVATIONS),
        "rotary_pct": float_field(0.0, 1.0),
        "rotary_emb_base": _THETA,
        "attention_dropout": _DROPOUT,
        "hidden_dropout": _DROPOUT,
        "classifier_dropout": _DROPOUT,
        "max_position_embeddings": _POSITIONS,
        "initializer_range": _INIT,
        "layer_norm_eps": _EPS,
        "use_parallel_residual": BOOL_FIELD,
        "attention_bias": BOOL_FIELD,
        "tie_word_embeddings": BOOL_FIELD,
        "use_cache": BOOL_FIELD,
        **_TOKENS,
    },
    (_divides("hidden_size", "num_attention_heads", default_width=4096),),
)

LM_FAMILIES: tuple[ModelFamily, ...] = (
    GPT2_FAMILY,
    LLAMA_FAMILY,
    MISTRAL_FAMILY,
    QWEN2_FAMILY,
    GPT_NEOX_FAMILY,
)
