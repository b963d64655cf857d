"""Model families: only what the registry holds is built, and every config is checked first."""

from __future__ import annotations

import importlib.metadata
import math

import pytest
import torch

from fusionp2p.errors import ConfigError
from fusionp2p.opdag import families
from fusionp2p.opdag.families import BUILTIN_FAMILIES, ModelFamily, ModelRegistry, UnknownModelError
from fusionp2p.opdag.spec import build_model, resolve_spec
from fusionp2p.opdag.split import op_node_names, partition
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.records import ModelSpec

GPT2 = ModelSpec("gpt2", {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 31}, input_shape=(2, 5))


def test_the_builtin_families_are_served_and_nothing_else() -> None:
    registry = ModelRegistry(entry_points=False)
    assert (
        registry.names()
        == sorted(f.name for f in BUILTIN_FAMILIES)
        == [
            "digits-cnn",
            "gpt2",
            "gpt_neox",
            "llama",
            "mistral",
            "qwen2",
            "resnet",
        ]
    )
    for name in ("os:system", "subprocess:run", "builtins:eval", "os.system", "../../etc"):
        with pytest.raises(UnknownModelError, match="--allow-model") as info:
            registry.resolve(name)
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"command": "touch /tmp/x"}, "no config key 'command'; known keys"),
        ({"n_embd": "16"}, "must be an integer"),
        ({"n_embd": True}, "must be an integer"),
        ({"n_embd": 1 << 20}, r"must be in \[1, 65536\]"),
        ({"n_layer": 0}, r"must be in \[1, 128\]"),
        ({"n_embd": 30, "n_head": 4}, "multiple of n_head"),
        ({"resid_pdrop": math.nan}, "finite number"),
        ({"activation_function": "rm -rf"}, "must be one of"),
        ({"n_inner": None, "bos_token_id": -1}, r"must be in \[0"),
        ({"n_embd": None}, "must not be null"),
    ],
)
def test_a_config_outside_its_schema_is_refused(config: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_spec(ModelSpec("gpt2", config))


def test_llama_grouped_query_attention_rule() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        resolve_spec(ModelSpec("llama", {"num_attention_heads": 4, "num_key_value_heads": 3}))
    _, config = resolve_spec(
        ModelSpec("llama", {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32})
    )
    assert config["num_key_value_heads"] == 2


def test_an_allowed_factory_gets_a_schema_from_its_signature() -> None:
    registry = ModelRegistry(allow=["user_models:SkipNet"], entry_points=False)
    family = registry.resolve("user_models:SkipNet")
    assert sorted(family.fields) == ["classes", "features", "hidden"]
    assert family.validate({"hidden": 7}) == {"hidden": 7}
    with pytest.raises(ConfigError, match="known keys"):
        family.validate({"hidden": 7, "evil": "x"})
    with pytest.raises(ConfigError, match="integer"):
        family.validate({"hidden": 7.5})
    spec = ModelSpec("user_models:SkipNet", {"hidden": 7}, input_shape=(2, 12), input_dtype="float32")
    model = build_model(spec, registry)
    assert model.block1[0].out_features == 7


def test_an_allowed_family_object_keeps_its_own_name_and_bounds() -> None:
    registry = ModelRegistry(allow=["user_models:TINY_MLP"], entry_points=False)
    assert "tiny-mlp" in registry.names() and "user_models:TINY_MLP" not in registry.names()
    with pytest.raises(ConfigError, match=r"\[1, 64\]"):
        registry.resolve("tiny-mlp").validate({"width": 65})


def test_installed_entry_points_are_served(monkeypatch: pytest.MonkeyPatch) -> None:
    point = importlib.metadata.EntryPoint("skip", "user_models:SkipNet", families.ENTRY_POINT_GROUP)
    monkeypatch.setattr(
        families.importlib.metadata,
        "entry_points",
        lambda group: [point] if group == families.ENTRY_POINT_GROUP else [],
    )
    assert "skip" in ModelRegistry().names()
    assert "skip" not in ModelRegistry(entry_points=False).names()


def test_a_data_owner_trusts_only_the_import_path_it_names() -> None:
    assert "user_models:SkipNet" in ModelRegistry.for_data_owner("user_models:SkipNet").names()
    assert ModelRegistry.for_data_owner("gpt2").names() == ModelRegistry().names()


@pytest.mark.parametrize(
    "spec",
    [
        GPT2,
        ModelSpec(
            "llama",
            {
                "num_hidden_layers": 1,
                "hidden_size": 16,
                "num_attention_heads": 2,
                "intermediate_size": 24,
                "vocab_size": 29,
            },
            input_shape=(1, 4),
        ),
        ModelSpec("digits-cnn", {"channels": 3}, input_shape=(2, 1, 8, 8), input_dtype="float32"),
    ],
    ids=lambda s: s.family,
)
def test_a_fake_trace_is_the_real_graph_without_the_memory(spec: ModelSpec) -> None:
    fake, real = trace_spec(spec, fake=True), trace_spec(spec)
    ops = op_node_names(real.program.graph)
    assignment = [i * 2 // len(ops) for i in range(len(ops))]
    a, b = partition(fake.program, assignment, 2), partition(real.program, assignment, 2)
    assert a.fingerprint == b.fingerprint and a.params == b.params and a.values == b.values
    assert [n.saved_bytes for n in fake.dag.nodes] == [n.saved_bytes for n in real.dag.nodes]
    assert all(
        isinstance(t, torch._subclasses.fake_tensor.FakeTensor) for t in fake.program.state_dict.values()
    )


def test_a_huge_config_is_traced_fake_in_little_memory() -> None:
    import resource

    spec = ModelSpec(
        "gpt2", {"n_layer": 2, "n_embd": 8192, "n_head": 8, "vocab_size": 50257}, input_shape=(1, 8)
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    traced = trace_spec(spec, fake=True)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    params = sum(t.numel() for t in traced.program.state_dict.values())
    assert params > 2e9  # 8 GB of float32 that never existed
    assert grown_mb < 500


def test_family_build_errors_are_config_errors() -> None:
    def broken(width: int = 1) -> torch.nn.Module:
        raise ValueError("no such width")

    family = ModelFamily.from_factory("broken", broken)
    with pytest.raises(ConfigError, match="rejects its config"):
        family.build({"width": 2})
