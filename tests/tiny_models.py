"""Tiny transformers configs shared by the OP-DAG tests (built from configs, no downloads)."""

import transformers


def tiny_llama_config() -> transformers.LlamaConfig:
    """2 layers, width 64, grouped-query attention (4 heads, 2 KV heads)."""
    return transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=172,
        vocab_size=300,
        max_position_embeddings=128,
    )
