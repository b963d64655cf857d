"""The swarm trains by itself: an elected coordinator plans jobs, stages follow only its plan.

Real peer processes (``LocalSwarm``), a real DHT and libp2p streams. A data owner submits a
``JobSpec``; the coordinator's published plan is OP-Fence on the records it planned from;
with compression off the job's losses are those of one process training the same model on
the same batches. A killed coordinator is replaced within three lease periods; a plan of an
older epoch, or signed by a peer without the lease, is refused by the stages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from job_helpers import reference_losses
from process_helpers import run_grouped

from fusionp2p.config import OptimizerConfig
from fusionp2p.errors import ProtocolError, SwarmError
from fusionp2p.launch import LocalSwarm
from fusionp2p.net.dht_node import start_dht
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.net.identity import ensure_identity, load_signing_key
from fusionp2p.planning import CompressionPolicy, CostConfig, Topology, plan_job
from fusionp2p.records import LeaseRecord, ModelSpec
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.swarm import Swarm
from fusionp2p.training.corpus import TextCorpus
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.submit import SubmittedJob

LEASE_S = 5.0
PEER_ARGS = ["--heartbeat", "1", "--record-ttl", "5", "--probe-period", "2", "--lease-seconds", str(LEASE_S)]
GPT = {"vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}


def _job(tmp: Path, **changes: object) -> JobSpec:
    base = JobSpec(
        name="tiny-gpt",
        model_config=dict(GPT),
        seq_len=32,
        max_bytes=200_000,
        batch_size=4,
        micro_batch_size=2,
        lr=3e-3,
        steps=3,
        checkpoint_every=0,
        min_peers=3,
        wait_peers_s=30.0,
        out_dir=str(tmp),
    )
    return base.with_(**changes)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    workdir = str(tmp_path_factory.mktemp("coord"))
    with LocalSwarm(4, swarm="coord", workdir=workdir, peer_args=[PEER_ARGS] * 4) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def client(local: LocalSwarm) -> Iterator[Swarm]:
    with Swarm(local.initial_peers, swarm=local.swarm) as swarm:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            idle = [p for p in swarm.peers() if p.state == "idle"]
            if len(idle) == len(local.peers) and swarm.coordinator() is not None:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the peers did not join or elect a coordinator")
        yield swarm


def test_a_job_is_planned_by_the_coordinator_and_trains_like_one_process(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    job = _job(tmp_path, steps=50, min_peers=4, checkpoint_every=25, weights="gather")
    result = client.train(job, progress=False, out=lambda *_: None)
    losses = result.losses
    assert len(losses) == 50
    assert statistics.mean(losses[-10:]) < statistics.mean(losses[:10]) - 0.5, losses

    submitted = result.submitted
    lease = client.coordinator()
    assert lease is not None and (lease.holder, lease.epoch) == (submitted.reply.coordinator, submitted.epoch)
    records = client.jobs()[(submitted.run_id, submitted.epoch, lease.holder)]
    assert all(r.data_owner == submitted.data_owner and r.made_by == lease.holder for r in records)
    # the published plan is OP-Fence's on the records the coordinator planned from
    topo = Topology.from_records(submitted.reply.peers, submitted.reply.links)
    cost = CostConfig(n_micro_batches=job.n_micro_batches, compression=CompressionPolicy(kind="none"))
    expected = plan_job(submitted.traced.dag, topo, submitted.data_owner, method="op-fence", cost=cost)
    assert submitted.plan.peer_ids == expected.peer_ids
    assert [s.nodes for s in submitted.plan.stages] == [s.nodes for s in expected.stages]
    assert {p.peer_id for p in submitted.reply.peers} == {p.peer_id for p in local.peers} | {
        submitted.data_owner
    }
    # no compression: exactly the single-process trajectory, up to float rounding, which
    # 50 optimizer steps amplify (a split's sums run in another order: ~1e-3 by step 50)
    reference = reference_losses(job)
    assert losses[:10] == pytest.approx(reference[:10], rel=2e-4, abs=2e-4)
    assert losses == pytest.approx(reference, rel=1e-3, abs=1e-3)
    # what a user gets on disk
    rows = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 50 and '"loss"' in rows[0]
    manifests = sorted(p.name for p in (result.run_dir / "checkpoints").iterdir())
    assert manifests == ["step-000025.json", "step-000050.json"]  # the final state is a checkpoint too
    assert result.weights is not None and result.weights.is_file()
    assert result.pretrained is not None and (result.pretrained / "config.json").is_file()
    # the stages keep the final weights: exported peer to peer, they load with from_pretrained
    exported = client.export(result.run_dir, tmp_path / "exported", out=lambda *_: None)
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
    gathered = load_file(str(result.weights))
    got = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in gathered.items():
        assert torch.equal(got[name.removeprefix("model.")], tensor), name
    assert len(result.stage_seconds) == len(set(submitted.plan.peer_ids))  # the data owner is one of them


def test_a_resnet_trains_on_the_digits_through_the_coordinator_like_one_process(
    client: Swarm, tmp_path: Path
) -> None:
    job = _job(
        tmp_path,
        name="digits-resnet",
        family="resnet",
        model_config={"depth": 18, "num_classes": 10, "width": 8},
        data_kind="digits",
        image_size=32,
        batch_size=8,
        micro_batch_size=4,
        steps=4,
    )
    lines: list[str] = []
    result = client.train(job, progress=False, out=lines.append)
    assert any("1797 images (3x32x32, 10 classes)" in line for line in lines), lines
    ids, owner = result.submitted.plan.peer_ids, result.submitted.data_owner
    assert ids[0] == ids[-1] == owner and owner not in ids[1:-1]  # it reads the images and takes the loss
    # images and labels stay here; the stages' gradients are exact: one process's losses
    assert result.losses == pytest.approx(reference_losses(job), rel=2e-4, abs=2e-4)
    row = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["images"] == 4 * 8 and row["images_per_s"] > 0


def _options(submitted: SubmittedJob, epoch: int, job: str) -> JobOptions:
    """How the data owner sets ``submitted``'s plan up, claiming ``epoch`` for job ``job``."""
    return JobOptions(job=job, n_micro_batches=submitted.plan.n_micro_batches, epoch=epoch)


def _forger_does(local: LocalSwarm, act: Callable[[SwarmDirectory, str], Awaitable[None]], tmp: Path) -> str:
    """A DHT participant that is no peer runs ``act`` with its own signed directory; its PeerID."""
    identity = str(tmp / "forger.key")
    forger = ensure_identity(identity).to_base58()
    key = load_signing_key(identity)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    dht = start_dht(initial_peers=local.initial_peers, identity_path=identity, signing_key=key)
    try:
        directory = SwarmDirectory(dht, local.swarm, owner_marker=RSASignatureValidator(key).local_public_key)
        loop.run_until_complete(act(directory, forger))
    finally:
        dht.shutdown()
        loop.close()
        asyncio.set_event_loop(None)
    return forger


def _forger_publishes(local: LocalSwarm, records_of: Callable[[str], list], tmp: Path) -> str:
    """A peer that does not hold the lease signs and publishes a plan; returns its PeerID."""

    async def publish(directory: SwarmDirectory, forger: str) -> None:
        records = records_of(forger)
        assert await directory.publish_plan(records, get_dht_time() + 60) == len(records)

    return _forger_does(local, publish, tmp)


def test_a_lease_of_a_huge_epoch_or_far_ahead_is_ignored_and_coordination_goes_on(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    honest = client.coordinator()
    assert honest is not None

    async def claim(directory: SwarmDirectory, forger: str) -> None:
        now = get_dht_time()
        huge = LeaseRecord(forger, 1 << 40, now, now + 1e9, maddrs=(), period_s=LEASE_S)
        assert await directory.publish_lease(huge, now + 60)  # stored: it is well-formed and signed
        overflow = dataclasses.replace(huge, epoch=2**64 - 1)  # does not fit the wire's epoch
        assert not await directory.publish_lease(overflow, now + 61)

    forger = _forger_does(local, claim, tmp_path)
    assert any(lease.holder == forger for lease in client.call(client.directory.fetch_leases()))
    time.sleep(2 * LEASE_S)  # keepers read the claim several times
    now = client.coordinator()
    assert now is not None and (now.holder, now.epoch) == (honest.holder, honest.epoch)
    submitted = client.data_owner().submit(_job(tmp_path, min_peers=1))
    assert submitted.epoch == honest.epoch and submitted.reply.coordinator == honest.holder


def test_a_job_is_planned_only_on_its_stage_peers(client: Swarm, local: LocalSwarm, tmp_path: Path) -> None:
    allowed = local.peers[-1].peer_id
    submitted = client.data_owner().submit(_job(tmp_path, min_peers=1, stage_peers=(allowed,)))
    assert set(submitted.plan.peer_ids) - {submitted.data_owner} == {allowed}
    assert {p.peer_id for p in submitted.reply.peers} == {allowed, submitted.data_owner}


def test_an_unplanned_job_is_refused_while_the_swarm_has_a_coordinator(client: Swarm) -> None:
    """A data owner's own split (epoch 0) goes around the coordinator: a peer of a swarm
    with one refuses it, so no identity can occupy peers outside the plans."""
    spec = ModelSpec("gpt2", GPT, input_shape=(2, 32))
    with pytest.raises(ProtocolError, match="this swarm has a coordinator"):
        client.data_owner().pipeline(spec, n_stages=2, options=JobOptions(n_micro_batches=2))


def test_a_plan_not_signed_by_the_lease_holder_is_refused(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    job = _job(tmp_path)
    owner = client.data_owner()
    submitted = owner.submit(job)
    lease = client.coordinator()
    assert lease is not None
    forged_job = f"{submitted.run_id}-forged"

    def records_of(forger: str) -> list:
        return submitted.plan.to_records(
            plan_id=forged_job,
            epoch=lease.epoch,
            made_by=forger,
            made_at=get_dht_time(),
            data_owner=submitted.data_owner,
        )

    forger = _forger_publishes(local, records_of, tmp_path)
    assert (forged_job, lease.epoch, forger) in client.jobs()  # it is in the DHT, properly signed
    with pytest.raises(ProtocolError, match="published no complete plan"):
        owner.pipeline(
            job.model_spec(), plan=submitted.plan, options=_options(submitted, lease.epoch, forged_job)
        )
    # the coordinator's own plan of the same job is taken
    with owner.pipeline(
        job.model_spec(), plan=submitted.plan, options=_options(submitted, submitted.epoch, submitted.run_id)
    ) as p:
        assert len(p.run_iteration(next(_batches(job)))) == job.n_micro_batches
        # its peers are busy now: marked so in their records, and left out of another job's plan
        busy = {peer.peer_id for peer in p.peers}
        deadline = time.monotonic() + 15
        while {peer.peer_id for peer in client.peers() if peer.state == "training"} != busy:
            assert time.monotonic() < deadline, "the busy peers never said so"
            time.sleep(0.3)
        second = job.with_(name="second", min_peers=1, wait_peers_s=3.0)
        if len(busy) < len(local.peers):
            other = owner.submit(second)
            assert other.plan.peer_ids and not busy & set(other.plan.peer_ids)
        else:  # the plan took every peer: none is left for another job
            with pytest.raises(SwarmError, match="too few peers"):
                owner.submit(second)


def _batches(job: JobSpec) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    corpus = TextCorpus.load(job.data_path, seq_len=job.seq_len, max_bytes=job.max_bytes)
    return corpus.batches(job.micro_batch_size, job.n_micro_batches, seed=0)


def _wait_new_lease(client: Swarm, old: LeaseRecord, timeout: float) -> tuple[LeaseRecord, float]:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        lease = client.coordinator()
        if lease is not None and lease.holder != old.holder and lease.epoch > old.epoch:
            return lease, time.monotonic() - start
        time.sleep(0.2)
    pytest.fail(f"no new coordinator within {timeout:.0f} s of killing {old.holder[-8:]}")


def test_a_killed_coordinator_is_replaced_and_its_epoch_is_over(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    job = _job(tmp_path)
    owner = client.data_owner()
    old_plan = owner.submit(job)
    old = client.coordinator()
    assert old is not None and old.epoch == old_plan.epoch
    index = next(i for i, p in enumerate(local.peers) if p.peer_id == old.holder)
    killed_at = time.monotonic()
    local.signal(index, signal.SIGKILL)
    new, _ = _wait_new_lease(client, old, timeout=30)
    took = time.monotonic() - killed_at
    assert took <= 3 * LEASE_S + 2.0, f"re-elected after {took:.1f} s"  # 3 lease periods + DHT reads
    assert new.epoch == old.epoch + 1
    # every stage ignores a plan of the old epoch, though its signer held the lease then
    submitted = owner.submit(job.with_(min_peers=2))
    assert submitted.epoch == new.epoch and submitted.reply.coordinator == new.holder
    with pytest.raises(ProtocolError, match=f"epoch {old.epoch}, the coordinator's is {new.epoch}"):
        owner.pipeline(
            job.model_spec(), plan=submitted.plan, options=_options(submitted, old.epoch, submitted.run_id)
        )
    # and a job submitted now runs
    result = client.train(job.with_(min_peers=2, name="after-failover"), progress=False, out=lambda *_: None)
    assert len(result.losses) == job.steps and result.submitted.epoch == new.epoch


TRAIN = [sys.executable, "-m", "fusionp2p", "--log-level", "error", "train"]


def _train_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TRAIN, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ('name = "x"\n[train]\nmicro_batch_size = 3\nbatch_size = 8\n', "[train] micro_batch_size"),
        ('name = "x"\n[trian]\nsteps = 3\n', "[trian] steps: unknown key"),
        ('name = "x"\n[model]\nfamily = "gpt9"\n', "model family 'gpt9' is not served"),
        ('name = "x"\n[model.config]\nn_layer = 100000\n', "n_layer"),
        (
            'name = "x"\n[train]\nmin_peers = 9\nwait_peers_s = 2\n',
            "too few peers: the job needs 9 idle peer(s)",
        ),
        ("name = [1,\n", "not valid TOML"),
        ('name = "x"\n[data]\nkind = "digits"\n', "[data] kind: 'digits' feeds images"),
        ('name = "x"\n[data]\nkind = "pictures"\n', "[data] kind: must be one of"),
        ('name = "x"\n[model]\nfamily = "resnet"\n', "[data] kind: 'text' feeds token ids"),
    ],
)
def test_train_cli_refuses_a_bad_job_in_one_line(client: Swarm, tmp_path: Path, toml: str, says: str) -> None:
    config = tmp_path / "job.toml"
    config.write_text(f'{toml}\n[output]\ndir = "{tmp_path}"\n')
    args = ["--config", str(config), "--initial-peers", *client.multiaddrs[:2], "--no-progress"]
    done, left = run_grouped([*TRAIN, *args], timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fusionp2p train: error: "), done.stderr
    assert says in lines[0]
    assert not left  # nothing left running: not its DHT daemon either


def test_a_mistyped_swarm_name_is_named_as_the_likely_cause(client: Swarm, tmp_path: Path) -> None:
    typo = [*("--initial-peers", *client.multiaddrs[:2]), "--swarm", "coordd"]
    config = tmp_path / "job.toml"
    config.write_text(f'name = "x"\n[train]\nwait_peers_s = 2\n[output]\ndir = "{tmp_path}"\n')
    done, left = run_grouped([*TRAIN, "--config", str(config), "--no-progress", *typo], timeout=120)
    assert done.returncode != 0 and "no peer of swarm 'coordd' is live" in done.stderr, done.stderr
    assert "check the swarm name (--swarm)" in done.stderr and not left
    status = [sys.executable, "-m", "fusionp2p", "--log-level", "error", "status"]
    done, left = run_grouped([*status, *typo], timeout=120)
    assert done.returncode == 1 and "no live peer in swarm 'coordd'" in done.stderr, done.stderr
    done, left = run_grouped([*status, *typo[:-2], "--swarm", "coord"], timeout=120)  # the right name
    assert done.returncode == 0 and not left, done.stderr


def test_a_job_file_naming_an_import_path_runs_nothing_unless_train_allows_it(tmp_path: Path) -> None:
    (tmp_path / "pwn_module.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').close()\nbuild = None\n")
    config = tmp_path / "job.toml"
    config.write_text('name = "x"\n[model]\nfamily = "pwn_module:build"\n')
    done = subprocess.run(
        [sys.executable, "-m", "fusionp2p", "train", "--config", str(config), "--local", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # the module is importable from here
    )
    assert done.returncode != 0 and "--allow-model pwn_module:build" in done.stderr
    assert not (tmp_path / "pwned").exists()  # the family named in the file was never imported


def test_train_cli_example_config_is_a_valid_job() -> None:
    done = _train_cli(["--example-config"])
    assert done.returncode == 0
    job = JobSpec.from_toml(done.stdout)
    assert job.family == "gpt2" and job.n_micro_batches == 4 and job.data_path == ""
    assert OptimizerConfig(lr=job.lr) and job.compression == "none"
