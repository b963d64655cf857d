"""Pretrained weights from a local ``save_pretrained`` directory: found under the model's
names, checked from the files' headers, and refused in one line naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fusionp2p.errors import ConfigError
from fusionp2p.opdag.spec import build_model
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.pretrained import INDEX_FILE, PretrainedWeights, SavedTensor, saved_tensors

SPEC = ModelSpec(
    "gpt2", {"vocab_size": 64, "n_positions": 16, "n_embd": 16, "n_layer": 2, "n_head": 2}, seed=9
)


@pytest.fixture(scope="module")
def expected() -> dict[str, SavedTensor]:
    return saved_tensors(trace_spec(SPEC, fake=True).program)


def _saved(tmp: Path, shard_size: str = "5GB") -> tuple[Path, torch.nn.Module]:
    model = build_model(SPEC)
    model.model.save_pretrained(tmp, max_shard_size=shard_size)  # transformers' own names, no lm_head
    return tmp, model


def test_a_sharded_save_pretrained_directory_reads_every_tensor_under_the_models_names(tmp_path, expected):
    path, model = _saved(tmp_path, shard_size="20KB")
    assert (path / INDEX_FILE).is_file() and len(list(path.glob("*.safetensors"))) > 1
    weights = PretrainedWeights(path)
    weights.check(expected)
    got = dict(weights.read(list(expected), expected))
    want = model.state_dict()  # the tied LM head is read from the embedding it is saved as
    assert set(got) == set(expected) and "model.lm_head.weight" in got
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


def test_a_renamed_tensor_a_wrong_shape_or_a_corrupted_file_is_refused_in_one_line(tmp_path, expected):
    path, _ = _saved(tmp_path / "ok")
    (file,) = path.glob("*.safetensors")
    tensors = load_file(str(file))
    renamed = tmp_path / "renamed.safetensors"
    save_file(
        {
            ("transformer.h.0.attn.c_attn.weightX" if k.endswith("h.0.attn.c_attn.weight") else k): v
            for k, v in tensors.items()
        },
        str(renamed),
    )
    with pytest.raises(ConfigError, match=r"no tensor model\.transformer\.h\.0\.attn\.c_attn\.weight") as e:
        PretrainedWeights(renamed).check(expected)
    assert "\n" not in str(e.value)
    shaped = tmp_path / "shaped.safetensors"
    save_file(
        {k: (v[:, :-1].contiguous() if k == "transformer.wpe.weight" else v) for k, v in tensors.items()},
        str(shaped),
    )
    with pytest.raises(ConfigError, match=r"tensor transformer\.wpe\.weight has shape \[16, 15\]") as e:
        PretrainedWeights(shaped).check(expected)
    assert "\n" not in str(e.value)
    corrupted = tmp_path / "corrupted"
    corrupted.mkdir()
    (corrupted / "model.safetensors").write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ConfigError, match="not a readable safetensors file") as e:
        PretrainedWeights(corrupted)
    assert "\n" not in str(e.value)
    (corrupted / INDEX_FILE).write_text(json.dumps({"weight_map": "nope"}))
    with pytest.raises(ConfigError, match="not a safetensors index"):
        PretrainedWeights(corrupted)
    with pytest.raises(ConfigError, match="no such file or directory"):
        PretrainedWeights(tmp_path / "absent")
