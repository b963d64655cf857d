"""Pretrained weights from a local ``save_pretrained`` directory: found under the model's
names, checked from the files' headers, and refused in one line naming the tensor."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from exec_helpers import Identities
from safetensors.torch import load_file, save_file

from fusionp2p.errors import ConfigError
from fusionp2p.launch import LocalSwarm
from fusionp2p.opdag.spec import build_model
from fusionp2p.opdag.split import op_node_names
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.runtime.pretrained import INDEX_FILE, PretrainedWeights, SavedTensor, saved_tensors

SPEC = ModelSpec(
    "gpt2", {"vocab_size": 64, "n_positions": 16, "n_embd": 16, "n_layer": 2, "n_head": 2}, seed=9
)


@pytest.fixture(scope="module")
def expected() -> dict[str, SavedTensor]:
    return saved_tensors(trace_spec(SPEC, fake=True).program)


def _saved(tmp: Path, shard_size: str = "5GB", spec: ModelSpec = SPEC) -> tuple[Path, torch.nn.Module]:
    model = build_model(spec)
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


@pytest.mark.swarm
def test_stages_load_their_own_copy_checked_by_digest_or_receive_the_tensors(tmp_path: Path) -> None:
    """Peer A has the same save_pretrained directory: its stage loads from it. Peer B's copy
    has one tensor changed: its digest differs, so B is sent its tensors instead."""
    spec = ModelSpec("gpt2", {**SPEC.config, "n_embd": 64}, seed=SPEC.seed)  # blocks of 200 KB
    saved, model = _saved(tmp_path / "owner", shard_size="100KB", spec=spec)
    for peer in ("a", "b"):
        shutil.copytree(saved, tmp_path / peer / "models" / "tiny")
    changed = sorted((tmp_path / "b" / "models" / "tiny").glob("*.safetensors"))[-1]
    tensors = load_file(str(changed))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1.0
    save_file(tensors, str(changed), metadata={"format": "pt"})
    n = len(op_node_names(trace_spec(SPEC, fake=True).program.graph))
    ids = [
        torch.randint(0, 64, SPEC.input_shape, generator=torch.Generator().manual_seed(s)) for s in range(2)
    ]
    want = [LOSSES["lm"]([model(x)], x).item() for x in ids]
    args = [["--no-coordinator", "--weights-dir", str(tmp_path / p / "models")] for p in ("a", "b")]
    with LocalSwarm(2, swarm="tuned", workdir=str(tmp_path / "swarm"), peer_args=args) as local:
        clients = Identities(local.initial_peers, 1)
        transport = clients.transports[0]
        a, b = local.peers
        layout = RuntimeLayout((transport.peer_id, a.peer_id, b.peer_id), [i * 3 // n for i in range(n)])

        async def run() -> tuple[list[float], int, PipelineDriver]:
            sent = transport.bytes_sent
            driver = await PipelineDriver.create(
                transport,
                spec,
                layout,
                JobOptions(n_micro_batches=2, timeout=60),
                addresses={p.peer_id: p.multiaddrs for p in local.peers},
                pretrained=PretrainedWeights(saved),
            )
            setup = transport.bytes_sent - sent
            try:
                return await driver.run_iteration([(x, x) for x in ids]), setup, driver
            finally:
                await driver.aclose()

        try:
            losses, setup, driver = clients.run(run())
        finally:
            clients.close()
        log_a, log_b = a.log(), b.log()
    assert losses == pytest.approx(want, rel=1e-5)  # the saved model's losses, on every stage's copy
    assert "pretrained tensors loaded from this peer's copy" in log_a
    assert "pretrained tensors loaded" not in log_b
    bytes_of = saved_tensors(driver.traced.program)
    part_b = sum(math.prod(bytes_of[n].shape) * 4 for n in driver.partition.params[2] if n in bytes_of)
    part_a = sum(math.prod(bytes_of[n].shape) * 4 for n in driver.partition.params[1] if n in bytes_of)
    assert part_b < setup < part_b + part_a  # b's tensors were sent, a's were not
