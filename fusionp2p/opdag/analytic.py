"""The OP-DAG of a decoder-only transformer, computed from its config.

FLOPs: 2 per multiply-accumulate; backward = 2x forward. Saved activations follow
Korthikanti et al. (2022): per layer ``34*s*b*h + 5*a*s^2*b`` bytes at 2 bytes/element,
split into attention (``11sbh + 5as^2b``) and MLP (``19sbh``) and scaled to the dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.ir import OpDag, OpNode

__all__ = ["TransformerShape", "transformer_dag"]

Granularity = Literal["block", "sublayer"]


@dataclass(frozen=True)
class TransformerShape:
    """What the cost of a decoder-only transformer depends on."""

    family: str  # "gpt2" or "llama"
    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    max_positions: int
    d_ff: int
    n_kv_head: int
    tied: bool  # input embedding shared with the LM head

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab", "max_positions", "d_ff", "n_kv_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"TransformerShape.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")

    @classmethod
    def from_hf_config(cls, config: Any) -> TransformerShape:
        """Reads a transformers GPT2Config or LlamaConfig (or any object with those fields)."""
        family = getattr(config, "model_type", "")
        if family == "gpt2":
            d = config.n_embd
            return cls(
                "gpt2",
                config.n_layer,
                d,
                config.n_head,
                config.vocab_size,
                config.n_positions,
                config.n_inner or 4 * d,
                config.n_head,
                bool(getattr(config, "tie_word_embeddings", True)),
            )
        if family == "llama":
            return cls(
                "llama",
                config.num_hidden_layers,
                config.hidden_size,
                config.num_attention_heads,
                config.vocab_size,
                config.max_position_embeddings,
                config.intermediate_size,
                config.num_key_value_heads or config.num_attention_heads,
                bool(getattr(config, "tie_word_embeddings", False)),
            )
        raise ConfigError(f"no analytic OP-DAG for model type {family!r} (known: gpt2, llama)")


def transformer_dag(
    shape: TransformerShape,
    *,
    seq_len: int,
    micro_batch: int,
    dtype_bytes: int = 4,
    granularity: Granularity = "sublayer",
) -> OpDag:
    """The OP-DAG of ``shape`` for micro-batches of ``micro_batch`` x ``seq_len`` tokens."""
    if seq_len > shape.max_positions or seq_len < 1:
        raise ConfigError(f"seq_len {seq_len} must be in [1, {shape.max_positions}]")
    b, s, d, h, v = micro_batch, seq_len, shape.d_model, shape.n_head, shape.vocab
    tokens = b * s
    act = tokens * d * dtype_bytes
    half = dtype_bytes / 2
    d_kv = d * shape.n_kv_head // h
    gpt2 = shape.family == "gpt2"

    if gpt2:
        attn_params = 2 * d * d + 2 * d * d_kv + 4 * d + 2 * d  # qkv+o weights, biases, ln
        mlp_params = 2 * d * shape.d_ff + shape.d_ff + d + 2 * d
        mlp_flops = 2 * tokens * 2 * d * shape.d_ff
        embed_params = (v + shape.max_positions) * d
    else:
        attn_params = 2 * d * d + 2 * d * d_kv + d
        mlp_params = 3 * d * shape.d_ff + d
        mlp_flops = 2 * tokens * 3 * d * shape.d_ff
        embed_params = v * d
    attn_flops = 2 * tokens * (2 * d * d + 2 * d * d_kv) + 2 * 2 * b * s * s * d
    attn_saved = int((11 * tokens * d + 5 * h * b * s * s) * half)
    mlp_saved = int(19 * tokens * d * half) if gpt2 else int(tokens * (2 * d + 4 * shape.d_ff) * dtype_bytes)
    head_params = (2 * d if gpt2 else d) + v * d
    tied = ("wte",) if shape.tied else ()

    nodes = [
        OpNode(
            "embed",
            "embedding",
            (),
            fwd_flops=tokens * d,
            bwd_flops=tokens * d,
            param_bytes=embed_params * dtype_bytes,
            output_bytes=act,
            saved_bytes=tokens * 8,
            module_path="embed",
            output_shapes=((b, s, d),),
            tied=tied,
        )
    ]
    prev = "embed"
    for i in range(shape.n_layer):
        parts = [
            ("attn", "attention", attn_params, attn_flops, attn_saved),
            ("mlp", "mlp", mlp_params, mlp_flops, mlp_saved),
        ]
        if granularity == "block":
            parts = [
                (
                    "block",
                    "transformer_block",
                    attn_params + mlp_params,
                    attn_flops + mlp_flops,
                    attn_saved + mlp_saved,
                )
            ]
        for name, kind, params, flops, saved in parts:
            node_id = f"h.{i}" if granularity == "block" else f"h.{i}.{name}"
            nodes.append(
                OpNode(
                    node_id,
                    kind,
                    (prev,),
                    fwd_flops=flops,
                    bwd_flops=2 * flops,
                    param_bytes=params * dtype_bytes,
                    output_bytes=act,
                    saved_bytes=saved,
                    module_path=node_id,
                    output_shapes=((b, s, d),),
                )
            )
            prev = node_id
    head_flops = 2 * tokens * d * v
    nodes.append(
        OpNode(
            "head",
            "lm_head",
            (prev,),
            fwd_flops=head_flops,
            bwd_flops=2 * head_flops,
            param_bytes=head_params * dtype_bytes,
            output_bytes=4,
            saved_bytes=tokens * v * dtype_bytes,
            module_path="head",
            output_shapes=((),),
            tied=tied,
        )
    )
    return OpDag(
        tuple(nodes),
        name=f"{shape.family}-{shape.n_layer}x{d}",
        meta={"seq_len": s, "micro_batch": b, "dtype_bytes": dtype_bytes},
    )
