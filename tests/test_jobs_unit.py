"""Units of the coordinator and job layer: the lease rules, job files, the corpus, requests."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import msgpack
import pytest
import torch
from hivemind.utils import get_dht_time
from job_helpers import peer_record

from fusionp2p.coordination.election import LeaseKeeper, lease_in_force
from fusionp2p.errors import ConfigError, RecordError
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import compression_policy
from fusionp2p.records import JobReply, JobRequest, LeaseRecord, LinkRecord, ModelSpec, PeerRecord
from fusionp2p.training.corpus import TextCorpus
from fusionp2p.training.images import DigitImages
from fusionp2p.training.job_spec import EXAMPLE_CONFIG, JobSpec

A, B, C = (
    "QmAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
    "QmBBBBBBBBBBBBBBBBBBBBBBBBBB",
    "QmCCCCCCCCCCCCCCCCCCCCCC",
)


def _lease(holder: str, epoch: int, valid_until: float) -> LeaseRecord:
    return LeaseRecord(holder=holder, epoch=epoch, granted_at=0.0, valid_until=valid_until)


def test_the_lease_in_force_is_the_valid_one_of_the_highest_epoch() -> None:
    leases = [_lease(A, 3, 100.0), _lease(B, 4, 50.0), _lease(C, 2, 200.0)]
    assert lease_in_force(leases, 10.0).holder == B  # epoch 4 wins while valid
    assert lease_in_force(leases, 60.0).holder == A  # then epoch 3: an older epoch still valid
    assert lease_in_force(leases, 300.0) is None
    tie = [_lease(B, 5, 100.0), _lease(A, 5, 100.0)]
    assert lease_in_force(tie, 0.0).holder == min(A, B)  # two claims of one epoch: one winner everywhere


class _Directory:
    """The lease part of a SwarmDirectory, in memory: each holder writes its own subkey."""

    def __init__(self) -> None:
        self.entries: dict[str, LeaseRecord] = {}

    async def publish_lease(self, record: LeaseRecord, expiration: float) -> bool:
        self.entries[record.holder] = record
        return True

    async def fetch_leases(self) -> list[LeaseRecord]:
        return list(self.entries.values())

    async def fetch_peer(self, peer_id: str) -> PeerRecord:
        return peer_record(peer_id)  # every candidate is a live peer that joined long ago


def test_keepers_elect_one_coordinator_renew_it_and_replace_a_dead_one() -> None:
    directory = _Directory()
    keepers = [
        LeaseKeeper(directory, peer, lease_s=0.4, rng=random.Random(i))  # type: ignore[arg-type]
        for i, peer in enumerate((A, B, C))
    ]

    async def rounds(alive: list[LeaseKeeper], n: int) -> None:
        for _ in range(n):
            await asyncio.gather(*(k.step() for k in alive))
            await asyncio.sleep(0.05)

    async def run() -> None:
        await rounds(keepers, 4)
        holders = [k for k in keepers if k.holds()]
        assert len(holders) == 1 and holders[0].epoch == 1
        first = holders[0]
        await rounds(keepers, 10)  # renewals keep it: still one holder, same epoch
        assert [k for k in keepers if k.holds()] == [first] and first.epoch == 1
        rest = [k for k in keepers if k is not first]  # the holder dies: it stops renewing
        await asyncio.sleep(0.45)
        await rounds(rest, 6)
        new = [k for k in rest if k.holds()]
        assert len(new) == 1 and new[0].epoch == 2
        current = lease_in_force(await directory.fetch_leases(), get_dht_time())
        assert current is not None and current.holder == new[0].peer_id
        await new[0].release()  # leaving hands the lease over at once
        assert lease_in_force(await directory.fetch_leases(), get_dht_time()) is None

    asyncio.run(run())


def test_a_job_file_names_the_bad_field_in_one_line() -> None:
    job = JobSpec.from_toml(EXAMPLE_CONFIG)
    assert job.name == "stdlib-gpt" and job.n_micro_batches == 4 and job.model_spec().input_shape == (2, 64)
    assert job.coordinators == job.stage_peers == ()
    private = JobSpec.from_toml(f"[security]\nstage_peers = ['{A}', '{B}']\n")
    assert private.stage_peers == (A, B)
    assert (job.replicas, job.replicas_wire) == (1, 1)
    assert JobSpec.from_toml("[train]\nreplicas = 'auto'\n").replicas_wire == 0  # "auto" on the wire
    assert JobSpec.from_toml("[train]\nreplicas = 4\n").replicas_wire == 4
    cases = {
        "[train]\nmicro_batch_size = 3\n": "job.toml: [train] micro_batch_size: 3 must divide batch_size 8",
        "[train]\nlr = -1.0\n": "job.toml: [train] lr: must be a number",
        "[train]\ncompression = 'zip'\n": "job.toml: [train] compression: must be one of",
        "[data]\nseq_len = 'long'\n": "job.toml: [data] seq_len: must be an integer",
        "colour = 'red'\n": "job.toml: colour: unknown key (top-level keys: name)",
        "[train]\nstep = 20\n": "job.toml: [train] step: unknown key; did you mean 'steps'? ([train] keys:",
        "[trian]\nsteps = 3\n": "job.toml: [trian] steps: unknown key; did you mean [train]? (sections:",
        "[model]\nconfig = 3\n": "job.toml: [model] config: must be a table",
        "name = 'a b'\n": "job.toml: name: must be 1-64 letters",
        "[train]\nplan_method = 'random'\n": "job.toml: [train] plan_method: must be one of",
        "[security]\ncoordinators = ['me']\n": "job.toml: [security] coordinators: must be a list of PeerIDs",
        "[train]\nreplicas = 3\n": "job.toml: [train] replicas: 3 replicas must divide the 4 micro-batches",
        "[train]\nreplicas = 'many'\n": "job.toml: [train] replicas: must be an integer",
        "[train]\nreplicas = 2\nplan_method = 'equal-number'\n": (
            'job.toml: [train] replicas: replicas are planned by "op-fence"'
        ),
        "[train]\nrefresh_s = -1\n": "job.toml: [train] refresh_s: must be a number",
        "[train]\naveraging = 'int8'\n": "job.toml: [train] averaging: one of none, fp16, auto, not 'int8'",
    }
    for text, message in cases.items():
        with pytest.raises(ConfigError) as refused:
            JobSpec.from_toml(text)
        assert str(refused.value).startswith(message) and "\n" not in str(refused.value), text
        assert len(str(refused.value)) < 300, refused.value  # a section's keys, not every key


def test_the_corpus_cuts_byte_tokens_into_seeded_batches(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("hello world " * 200)
    corpus = TextCorpus.load(str(tmp_path), seq_len=16, max_bytes=1000)
    assert len(corpus.tokens) == 1000 and corpus.n_samples == 62
    first = next(corpus.batches(2, 3, seed=1))
    again = next(corpus.batches(2, 3, seed=1))
    assert len(first) == 3 and all(x.shape == (2, 16) and x.dtype == torch.int64 for x, _ in first)
    assert all(torch.equal(x, y) and torch.equal(x, x2) for (x, y), (x2, _) in zip(first, again, strict=True))
    assert bytes(first[0][0][0].tolist()).decode() in ("hello world " * 3)
    with pytest.raises(ConfigError, match="does not exist"):
        TextCorpus.load(str(tmp_path / "nope"), seq_len=16, max_bytes=1000)
    stdlib = TextCorpus.load("", seq_len=64, max_bytes=50_000)  # the default: Python's own source
    assert "python3" in stdlib.source and len(stdlib.tokens) == 50_000


def test_the_digits_are_scaled_labelled_images_in_seeded_batches() -> None:
    job = JobSpec(family="resnet", model_config={"depth": 18}, data_kind="digits", image_size=32)
    job = job.with_(batch_size=6, micro_batch_size=3)
    assert job.loss == "classification"
    assert job.model_spec().input_shape == (3, 3, 32, 32) and job.model_spec().input_dtype == "float32"
    data = DigitImages.load(image_size=32, channels=3)
    assert data.n_samples == 1797 and data.images.shape == (1797, 3, 32, 32)
    assert float(data.images.min()) >= 0.0 and float(data.images.max()) <= 1.0
    first, again = next(data.batches(3, 2, seed=4)), next(data.batches(3, 2, seed=4))
    assert [(x.shape, y.shape) for x, y in first] == [((3, 3, 32, 32), (3,))] * 2
    assert all(
        torch.equal(x, x2) and torch.equal(y, y2) for (x, y), (x2, y2) in zip(first, again, strict=True)
    )
    # each image is its label's: the grey digit, the same in every channel
    native = DigitImages.load()
    x, y = next(native.batches(1, 1, seed=4))[0]
    assert x.shape == (1, 1, 8, 8) and 0 <= int(y) < 10
    index = int(torch.nonzero((native.images == x[0]).flatten(1).all(1))[0])
    assert int(native.labels[index]) == int(y)
    assert torch.equal(first[0][0][:, 0], first[0][0][:, 2])
    with pytest.raises(ConfigError, match=r"\[data\] image_size"):
        JobSpec(data_kind="digits", image_size=4)


def test_a_job_request_speaks_only_for_its_sender() -> None:
    spec = ModelSpec("gpt2", {"n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 256}, input_shape=(1, 8))
    link = LinkRecord(src=A, dst=B, bandwidth_bytes_per_s=1e6, rtt_s=0.01, measured_at=0.0)
    request = JobRequest("job-1", spec, 2, "none", "op-fence", peer_record(A), (link,), max_ratio=20.0)
    back = JobRequest.from_wire(request.to_wire())
    assert back == request
    back.check_sender(A)
    with pytest.raises(RecordError, match="speak for the peer that sends them"):
        back.check_sender(B)
    with pytest.raises(RecordError, match="method"):
        JobRequest.from_wire(msgpack.packb({**request.to_body(), "method": "random"}))
    planned = dataclasses.replace(request, compression="planned", max_ratio=8.0)
    assert JobRequest.from_wire(planned.to_wire()).max_ratio == 8.0
    for wrong in (0.5, 1e9, "8", True):
        with pytest.raises(RecordError, match="max_ratio"):
            JobRequest.from_wire(msgpack.packb({**planned.to_body(), "max_ratio": wrong}))
    policy = compression_policy("planned", 8.0)
    assert (policy.kind, policy.max_ratio) == ("planned", 8.0)
    reply = JobReply("job-1", 3, 2, B, (peer_record(A),), (link,))
    assert JobReply.from_wire(reply.to_wire()) == reply
    with pytest.raises(RecordError, match="replicas must divide"):
        dataclasses.replace(request, replicas=3)
    with pytest.raises(RecordError, match="only op-fence"):
        dataclasses.replace(request, replicas=2, method="equal-number")
    auto = dataclasses.replace(request, replicas=0)  # "auto": the coordinator picks
    assert JobRequest.from_wire(auto.to_wire()).replicas == 0
    fp16 = dataclasses.replace(auto, averaging="fp16")
    assert JobRequest.from_wire(fp16.to_wire()).averaging == "fp16"
    for wrong in ("int8", "", 16, None):
        with pytest.raises(RecordError, match="averaging"):
            JobRequest.from_wire(msgpack.packb({**fp16.to_body(), "averaging": wrong}))


@pytest.mark.parametrize(
    ("family", "config"),
    [
        (
            "mistral",
            {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
        ),
        (
            "qwen2",
            {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_key_value_heads": 2},
        ),
        ("gpt_neox", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "rotary_pct": 0.5}),
    ],
)
def test_more_transformers_families_build_and_trace_the_same_graph_fake(family: str, config: dict) -> None:
    config = {"vocab_size": 256, "max_position_embeddings": 64, "num_attention_heads": 4, **config}
    config["intermediate_size"] = 64
    spec = ModelSpec(family, config, input_shape=(2, 8))
    registry = ModelRegistry()
    real, fake = trace_spec(spec, registry), trace_spec(spec, registry, fake=True)
    assert real.dag.fingerprint == fake.dag.fingerprint and len(real.dag) > 20
    assert real.dag.fingerprint.startswith(f"{family}@")
    with pytest.raises(ConfigError, match="no config key"):
        registry.resolve(family).validate({**config, "trust_remote_code": True})


def test_a_bare_baseline_plans_with_the_jobs_compression() -> None:
    from fusionp2p.opdag import TransformerShape, transformer_dag
    from fusionp2p.planning import CostConfig, Topology, plan_job, synthetic_swarm

    job = JobSpec.from_toml(
        "[train]\ncompression = 'uniform'\nmax_ratio = 16\nplan_method = 'equal-number'\n"
    )
    policy = compression_policy(job.compression, job.max_ratio)
    assert (policy.kind, policy.ratio, policy.max_ratio) == ("uniform", 16.0, 16.0)
    shape = TransformerShape("gpt2", 4, 256, 4, 256, 128, 1024, 4, True)
    dag = transformer_dag(shape, seq_len=128, micro_batch=2, granularity="block")
    peers, links, _ = synthetic_swarm(3, n_peers=6)
    topo = Topology.from_records(peers, links)
    cost = CostConfig(n_micro_batches=4, compression=policy)
    owner = topo.peer_ids[0]
    plan = plan_job(dag, topo, owner, method=job.plan_method, cost=cost)
    assert plan.method == "equal-number/uniform"
    assert plan.ratios and set(plan.ratios.values()) == {16.0}
    dense = plan_job(dag, topo, owner, method="equal-number/none", cost=cost)  # its own compression
    assert dense.method == "equal-number/none" and set(dense.ratios.values()) == {1.0}
