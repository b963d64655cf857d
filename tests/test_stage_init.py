"""Stage-local initialization (``opdag.init``): any peer makes any tensor of a model from
(the spec's seed, the tensor's name), by the family's own init rules, without the rest of
the model; the one-process reference ``build_model`` makes the very same tensors."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from fusionp2p.opdag.families import ModelFamily, ModelRegistry
from fusionp2p.opdag.init import InitReplayError, seed_for
from fusionp2p.opdag.schema import int_field
from fusionp2p.opdag.spec import build_model, model_init
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.engines import stage_initial

_DECODER = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
FAMILIES = [
    ModelSpec("gpt2", {"vocab_size": 97, "n_positions": 16, "n_embd": 32, "n_layer": 3, "n_head": 2}, seed=3),
    ModelSpec(
        "llama",
        {**_DECODER, "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": 5},
        seed=4,
    ),
    *(ModelSpec(f, {**_DECODER, "num_attention_heads": 2}) for f in ("mistral", "qwen2", "gpt_neox")),
    ModelSpec(
        "resnet",
        {"depth": 18, "width": 8, "num_classes": 10},
        input_shape=(2, 3, 32, 32),
        input_dtype="float32",
    ),
    ModelSpec("digits-cnn", {"channels": 4}, input_shape=(2, 1, 8, 8), input_dtype="float32"),
]


def _reference(spec: ModelSpec) -> dict[str, torch.Tensor]:
    model = build_model(spec)
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


@pytest.mark.parametrize("spec", FAMILIES, ids=lambda s: s.family)
def test_any_split_makes_the_reference_models_tensors(spec: ModelSpec) -> None:
    want = _reference(spec)
    names = sorted(want)
    shuffled = random.Random(spec.seed).sample(names, len(names))
    thirds = [shuffled[i::3] for i in range(3)]  # three stages, each its own plan and order
    got: dict[str, torch.Tensor] = {}
    for part in thirds:
        got.update(stage_initial(spec, ModelRegistry(), part))
    assert set(got) == set(want)
    for name in names:
        assert torch.equal(got[name], want[name].detach()), name
    # the caller's RNG is untouched: making tensors is not drawing from it
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    stage_initial(spec, ModelRegistry(), names[:2])
    assert torch.equal(torch.rand(3), before)


def test_a_tensor_depends_only_on_the_seed_and_its_name() -> None:
    spec = FAMILIES[0]
    name = "model.transformer.h.1.attn.c_attn.weight"
    here = stage_initial(spec, ModelRegistry(), [name])[name]
    other_seed = stage_initial(
        ModelSpec(spec.family, spec.config, seed=spec.seed + 1), ModelRegistry(), [name]
    )
    assert not torch.equal(here, other_seed[name])
    bigger = ModelSpec(spec.family, {**spec.config, "n_layer": 5}, seed=spec.seed)  # more layers after it
    assert torch.equal(stage_initial(bigger, ModelRegistry(), [name])[name], here)
    code = (
        "import hashlib, sys\n"
        "from fusionp2p.opdag.spec import model_init\n"
        "from fusionp2p.records import ModelSpec\n"
        f"spec = ModelSpec.from_wire({spec.to_wire()!r})\n"
        f"t = model_init(spec).tensors([{name!r}])[{name!r}]\n"
        "sys.stdout.write(hashlib.sha256(t.numpy().tobytes()).hexdigest())\n"
    )
    digest = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    import hashlib

    assert digest.stdout == hashlib.sha256(here.numpy().tobytes()).hexdigest()  # another process, same tensor
    assert seed_for(0, "a") != seed_for(0, "b") and seed_for(0, "a") != seed_for(1, "a")


def test_the_family_init_rules_are_kept() -> None:
    gpt2 = FAMILIES[0]
    made = model_init(gpt2).tensors(
        [
            "model.transformer.h.0.attn.c_attn.weight",
            "model.transformer.h.0.attn.c_proj.weight",
            "model.transformer.h.0.ln_1.weight",
            "model.transformer.h.0.attn.c_attn.bias",
        ]
    )
    std = 0.02  # GPT-2's initializer_range; residual projections scaled by 1/sqrt(2 n_layer)
    assert made["model.transformer.h.0.attn.c_attn.weight"].std().item() == pytest.approx(std, rel=0.15)
    scaled = std / math.sqrt(2 * gpt2.config["n_layer"])
    assert made["model.transformer.h.0.attn.c_proj.weight"].std().item() == pytest.approx(scaled, rel=0.15)
    assert torch.equal(made["model.transformer.h.0.ln_1.weight"], torch.ones(32))
    assert torch.equal(made["model.transformer.h.0.attn.c_attn.bias"], torch.zeros(96))
    llama = FAMILIES[1]  # the padding token's embedding row is zeroed through a view of the weight
    embedding = model_init(llama).tensors(["model.model.embed_tokens.weight"])[
        "model.model.embed_tokens.weight"
    ]
    assert torch.equal(embedding[5], torch.zeros(32)) and embedding[4].abs().sum() > 0


class _CopiedInit(torch.nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)  # one parameter's init read from another's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_an_init_that_copies_one_parameter_into_another_is_refused_by_name() -> None:
    registry = ModelRegistry(allow=[ModelFamily("copied", _CopiedInit, {"width": int_field(1, 64)})])
    spec = ModelSpec("copied", {"width": 4}, input_shape=(2, 4), input_dtype="float32")
    with pytest.raises(
        InitReplayError, match="_CopiedInit: its init copy_ writes one parameter from another"
    ):
        model_init(spec, registry)
