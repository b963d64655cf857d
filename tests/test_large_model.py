"""A model larger than any one peer: every peer, the data owner included, allows less
memory than the model's training state, and the swarm trains it anyway, each stage making
its own part (``opdag.init``), exactly as one process trains the whole model.

Real peer processes (``LocalSwarm``) with ``--max-memory``, a real DHT and libp2p streams.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from job_helpers import reference_losses

from fusionp2p.config import OptimizerConfig, format_bytes
from fusionp2p.launch import LocalSwarm
from fusionp2p.opdag.spec import build_model
from fusionp2p.opdag.split import op_node_names, partition
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.memory import stage_memory
from fusionp2p.swarm import Swarm
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.supervision import EventLog

GPT = {"vocab_size": 256, "n_positions": 32, "n_embd": 384, "n_layer": 12, "n_head": 6}  # 21M parameters
PEER_LIMIT = 180 << 20  # each peer's --max-memory: under half of the model's training state
OWNER_LIMIT = "64MiB"  # the data owner's own stage: its embeddings and the loss
PEER_ARGS = [
    *("--heartbeat", "1", "--record-ttl", "5", "--probe-period", "2", "--lease-seconds", "5"),
    *("--max-memory", str(PEER_LIMIT)),
]
N_PEERS = 4  # three hold the model; the fourth lets it lose one


def _job(tmp: Path) -> JobSpec:
    return JobSpec(
        name="large-gpt",
        model_config=dict(GPT),
        seq_len=32,
        max_bytes=200_000,
        batch_size=2,
        micro_batch_size=1,
        lr=1e-3,
        steps=10,
        checkpoint_every=100,  # none during the run: this test is about setup and training
        min_peers=3,
        wait_peers_s=90.0,
        deadline_s=120.0,
        max_memory=OWNER_LIMIT,
        out_dir=str(tmp),
    )


def _whole_model_need(job: JobSpec) -> int:
    """Bytes one process training the whole model would need (one stage holding it all)."""
    traced = trace_spec(job.model_spec(), fake=True)
    ops = op_node_names(traced.program.graph)
    whole = partition(traced.program, [0] * len(ops), 1, data_stage=0)
    return stage_memory(traced, whole, 0, in_flight=job.n_micro_batches, optimizer=OptimizerConfig()).total


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    workdir = str(tmp_path_factory.mktemp("large"))
    with LocalSwarm(N_PEERS, swarm="large", workdir=workdir, peer_args=[PEER_ARGS] * N_PEERS) as swarm:
        yield swarm


def test_a_model_larger_than_every_peer_trains_exactly(local: LocalSwarm, tmp_path: Path) -> None:
    job = _job(tmp_path).with_(steps=4)
    need = _whole_model_need(job)
    assert need > 2 * PEER_LIMIT and need > job.max_memory_bytes, "the model must fit in no one peer"
    assert 3 * PEER_LIMIT + job.max_memory_bytes > need  # ... but in all of them together
    with Swarm(local.initial_peers, swarm=local.swarm) as swarm:
        result = swarm.train(job, progress=False, out=lambda *_: None)
    events = EventLog.read(result.run_dir / "events.jsonl")
    planned = next(e for e in events if e["event"] == "planned")
    assert len(planned["peers"]) >= 3, "no two peers can hold it"
    # no weights left the data owner at setup: only the stages' setups (a few KiB each)
    weights = 4 * 21_000_000
    assert 0 < planned["setup_bytes"] < 64 << 10, format_bytes(planned["setup_bytes"])
    assert planned["setup_bytes"] < weights / 1000
    assert result.losses == pytest.approx(reference_losses(job), rel=1e-4, abs=1e-5)


def test_a_save_pretrained_directory_is_fine_tuned_from_its_weights(
    local: LocalSwarm, tmp_path: Path
) -> None:
    small = {"vocab_size": 256, "n_positions": 32, "n_embd": 64, "n_layer": 3, "n_head": 2}
    job = _job(tmp_path).with_(name="tuned-gpt", model_config=small, steps=3, max_memory="", min_peers=2)
    saved = build_model(ModelSpec("gpt2", small, seed=77))  # not the job's seed: loading must matter
    with torch.no_grad():
        for param in saved.parameters():
            param.add_(0.01)
    saved.model.save_pretrained(tmp_path / "pretrained", max_shard_size="200KB")  # sharded, with an index
    job = job.with_(pretrained=str(tmp_path / "pretrained"))
    with Swarm(local.initial_peers, swarm=local.swarm) as swarm:
        result = swarm.train(job, progress=False, out=lambda *_: None)
    want = reference_losses(job, model=saved)
    assert result.losses[0] == pytest.approx(want[0], rel=1e-5)  # the saved model's loss on that batch
    assert result.losses == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert result.losses[0] != pytest.approx(reference_losses(job)[0], rel=1e-3)  # the seed's is another


def test_a_killed_stage_owner_is_restored_from_its_replica_peer_to_peer(
    local: LocalSwarm, tmp_path: Path
) -> None:
    job = _job(tmp_path).with_(
        name="large-kill", steps=9, checkpoint_every=3, deadline_s=30.0, min_peers=N_PEERS
    )
    killed: dict[str, str] = {}
    with Swarm(local.initial_peers, swarm=local.swarm) as swarm:

        def on_step(row: dict) -> None:
            if row["step"] == 5 and not killed:
                lease = swarm.coordinator()
                victims = [p for p in row["peers"] if lease is None or p != lease.holder]
                killed["peer"] = victims[-1]
                index = next(i for i, p in enumerate(local.peers) if p.peer_id == killed["peer"])
                local.signal(index, signal.SIGKILL)

        try:
            result = swarm.train(job, progress=False, out=lambda *_: None, on_step=on_step)
        except Exception:  # which peers were lost, and why the re-plan failed: shown with the failure
            for path in job.run_dir.glob("*/events.jsonl"):
                print(path.read_text()[-6000:])
            raise
    events = EventLog.read(result.run_dir / "events.jsonl")
    restored = next(e for e in events if e["event"] == "restored")
    assert restored["step"] == 3 and result.replans >= 1
    plans = [e for e in events if e["event"] == "planned"]
    first, final = plans[0], plans[-1]
    assert killed["peer"] in first["peers"] and killed["peer"] not in final["peers"]
    # the new stages read their tensors from the shards' holders, the lost stage's from its
    # replica on another stage peer: nothing but setups (with every tensor's digest) and
    # grants left the data owner, against 84 MB of weights
    assert final["setup_bytes"] < 1 << 20
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    taken = [r["checkpoint_bytes"] for r in rows if "checkpoint_bytes" in r]
    assert taken and max(taken) < 1 << 20  # reports of ~330 MiB of shards
    assert result.losses == pytest.approx(reference_losses(job), rel=1e-4, abs=1e-5)
