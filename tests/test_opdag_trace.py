"""Tracing real models into OP-DAGs: parameters, FLOPs and cut bytes agree with the model."""

import pytest
import torch
import transformers
from tiny_models import tiny_llama_config

from fusionp2p.opdag import TransformerShape, transformer_dag
from fusionp2p.opdag.lm_families import CausalLMWrapper
from fusionp2p.opdag.trace import coarsen, trace_module

B, T = 2, 16


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_gpt2_traces_with_each_parameter_once_and_the_analytic_flops() -> None:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    dag = trace_module(CausalLMWrapper(model), (torch.randint(0, 500, (B, T)),), strip_prefix="model.").dag
    assert dag.total_param_bytes == 4 * _params(model)  # the tied embedding counted once
    assert any(node.tied for node in dag.nodes)  # ... and marked at both of its users
    analytic = transformer_dag(TransformerShape.from_hf_config(config), seq_len=T, micro_batch=B)
    assert dag.total_fwd_flops == pytest.approx(analytic.total_fwd_flops, rel=0.1)

    blocks = coarsen(dag, 3)
    ids = [n.id for n in blocks.nodes]
    assert "transformer.h.0" in ids and "transformer.h.1" in ids
    assert blocks.nodes[ids.index("transformer.h.0")].output_bytes == B * T * 64 * 4
    assert blocks.total_fwd_flops == pytest.approx(dag.total_fwd_flops)
    assert blocks.total_param_bytes == dag.total_param_bytes
    assert sum(n.saved_bytes for n in blocks.nodes) == sum(n.saved_bytes for n in dag.nodes)


def test_llama_traces_with_its_parameters() -> None:
    config = tiny_llama_config()
    model = transformers.LlamaForCausalLM(config).eval()
    dag = trace_module(CausalLMWrapper(model), (torch.randint(0, 300, (B, T)),), strip_prefix="model.").dag
    assert dag.total_param_bytes >= 4 * _params(model)  # + the rotary buffers
    assert len(coarsen(dag, 3)) < len(dag)


class SkipNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x))
        h = h + torch.relu(self.conv2(h))  # a skip connection
        return self.head(h.flatten(1))


def test_a_user_model_with_a_skip_connection_traces_and_coarsens_to_a_dag() -> None:
    model = SkipNet()
    dag = trace_module(model, (torch.randn(4, 1, 8, 8),)).dag
    assert dag.total_param_bytes == 4 * _params(model)
    conv2 = next(n for n in dag.nodes if n.module_path == "conv2" and n.kind == "conv2d")
    assert conv2.fwd_flops == 2 * (4 * 8 * 8 * 8) * (8 * 3 * 3)
    skip_add = next(n for n in dag.nodes if n.kind == "add")
    assert len(skip_add.inputs) == 2
    coarse = coarsen(dag, 1)
    assert coarse.total_fwd_flops == pytest.approx(dag.total_fwd_flops)
    # the residual crosses the cut after conv2's group: conv1's output and conv2's both
    cut = coarse.cut_bytes()
    assert max(cut) >= 2 * 4 * 8 * 8 * 8 * 4
