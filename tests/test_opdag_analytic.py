"""The analytic transformer OP-DAG counts the same parameters as the transformers model it describes."""

import pytest
import transformers
from tiny_models import tiny_llama_config

from fusionp2p.errors import ConfigError
from fusionp2p.opdag import OpDag, OpNode, TransformerShape, transformer_dag
from fusionp2p.opdag.ir import OpDagError


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("granularity", ["block", "sublayer"])
def test_gpt2_parameters_match_the_real_model(granularity: str) -> None:
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=500, n_positions=128)
    shape = TransformerShape.from_hf_config(config)
    dag = transformer_dag(shape, seq_len=32, micro_batch=2, granularity=granularity)
    tied = config.vocab_size * config.n_embd  # counted at the embedding and at the LM head
    assert dag.total_param_bytes // 4 == _n_params(transformers.GPT2LMHeadModel(config)) + tied
    assert len(dag) == 2 + (3 if granularity == "block" else 6)
    assert dag.cut_bytes()[1] == 2 * 32 * 64 * 4  # the hidden state crossing each cut


def test_llama_parameters_match_the_real_model() -> None:
    config = tiny_llama_config()
    dag = transformer_dag(TransformerShape.from_hf_config(config), seq_len=16, micro_batch=1)
    assert dag.total_param_bytes // 4 == _n_params(transformers.LlamaForCausalLM(config))


def test_bad_shapes_and_dags_are_refused() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        TransformerShape("gpt2", 2, 65, 4, 10, 10, 10, 4, True)
    with pytest.raises(ConfigError, match="seq_len"):
        transformer_dag(TransformerShape("gpt2", 2, 64, 4, 10, 10, 10, 4, True), seq_len=11, micro_batch=1)
    with pytest.raises(OpDagError, match="cycle"):
        OpDag.from_unordered([OpNode("a", "x", ("b",)), OpNode("b", "x", ("a",))])
    with pytest.raises(OpDagError, match="not an earlier node"):
        OpDag((OpNode("a", "x", ("missing",)),))
    with pytest.raises(OpDagError, match="fwd_flops"):
        OpNode("a", "x", fwd_flops=float("nan"))
