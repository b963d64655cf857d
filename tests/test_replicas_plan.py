"""Data-parallel replicas of one split: the plan, its averaging cost, the choice of R, and how a
replicated job divides its micro-batches."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fusionp2p.errors import ConfigError, RecordError
from fusionp2p.opdag import TransformerShape, transformer_dag
from fusionp2p.opdag.offline import OfflineModel, offline_dag
from fusionp2p.planning import (
    CompressionPolicy,
    CostConfig,
    PlanningError,
    RuntimeLayout,
    Topology,
    synthetic_swarm,
)
from fusionp2p.planning.owner import OwnerFrame, owner_part
from fusionp2p.planning.replicas import AUTO_AVERAGING_SHARE, averaging_seconds, plan_replicas, shared_owner
from fusionp2p.planning.replicated_plan import ReplicatedPlan, plan_replicated_job
from fusionp2p.records import PlanStageRecord, replica_job
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.replicated import replica_options, split_micro_batches

GPT = TransformerShape("gpt2", 8, 512, 8, 8192, 256, 2048, 8, True)
DENSE = CostConfig(n_micro_batches=8, compression=CompressionPolicy(kind="none"))


def _topo(seed: int, n_peers: int, n_clusters: int) -> Topology:
    peers, links, _ = synthetic_swarm(seed, n_peers=n_peers, n_clusters=n_clusters)
    return Topology.from_records(peers, links)


def _uniform(n: int, *, gbit: float = 10.0, tflops: float = 20.0, gib: int = 16) -> Topology:
    bandwidth = np.full((n, n), gbit * 1e9 / 8)
    np.fill_diagonal(bandwidth, np.inf)
    return Topology(
        tuple(f"QmUniform{i:04d}" for i in range(n)),
        np.full(n, tflops * 1e12),
        np.full(n, float(gib << 30)),
        bandwidth,
        np.full((n, n), 1e-4) * (1 - np.eye(n)),
        np.ones((n, n), dtype=bool),
    )


def test_an_all_reduce_moves_twice_the_non_owned_share_over_the_slowest_link() -> None:
    topo = _uniform(4, gbit=8.0)  # 1e9 bytes/s
    topo.bandwidth[2, 3] = 0.5e9
    assert averaging_seconds(1e9, [0, 1], topo) == pytest.approx(1.0 + 2e-4)
    assert averaging_seconds(1e9, [0, 1, 2, 3], topo) == pytest.approx(2 * 0.75 * 1e9 / 0.5e9 + 2e-4)
    assert averaging_seconds(1e9, [3], topo) == 0.0


def test_replicas_share_one_split_on_disjoint_peers_and_a_step_waits_for_the_slowest() -> None:
    dag = transformer_dag(GPT, seq_len=256, micro_batch=4, granularity="block")
    topo = _topo(3, 16, 2)
    plan = plan_replicas(dag, topo, DENSE, 2)
    first, second = plan.replicas
    assert [s.nodes for s in first] == [s.nodes for s in second]  # stage s holds the same parameters
    assert not {s.peer for s in first} & {s.peer for s in second}
    assert plan.n_micro_batches == 4  # the global batch of 8 micro-batches, split
    assert plan.step_s == pytest.approx(max(e.iteration_s for e in plan.estimates) + max(plan.averaging_s))
    for k, stage in enumerate(first):
        grad_bytes = sum(dag.nodes[i].param_bytes for i in stage.nodes)
        group = [first[k].peer, second[k].peer]
        assert plan.averaging_s[k] == pytest.approx(averaging_seconds(grad_bytes, group, topo))


def test_auto_keeps_the_replica_count_with_the_most_micro_batches_per_second() -> None:
    dag = transformer_dag(GPT, seq_len=256, micro_batch=4, granularity="block")
    topo = _uniform(8, tflops=1.0)  # one fast cluster, compute-bound, with room for several copies
    auto = plan_replicas(dag, topo, DENSE, "auto")
    rates = {}
    for r in (1, 2, 4, 8):
        try:
            rates[r] = plan_replicas(dag, topo, DENSE, r).micro_batches_per_s
        except PlanningError:
            continue
    assert len(auto.replicas) > 1  # replicas pay off inside one fast cluster
    fast = plan_replicas(dag, _uniform(8, tflops=100.0), DENSE, "auto")  # ... unless averaging dominates
    assert len(fast.replicas) == 1
    assert auto.micro_batches_per_s == pytest.approx(max(rates.values()))
    assert len(auto.replicas) == min(r for r, v in rates.items() if v == pytest.approx(max(rates.values())))


def test_the_data_owner_runs_its_part_once_per_replica_and_is_planned_as_shared() -> None:
    dag = offline_dag(
        OfflineModel(
            "gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256}, seq_len=32, trace=True
        )
    )
    topo = _uniform(9)
    part = owner_part(dag)
    assert part is not None
    frame = OwnerFrame(0, part)
    plan = plan_replicas(dag, topo, DENSE, 2, frame=frame)
    for stages in plan.replicas:
        assert stages[0].peer == 0 and stages[-1].peer == 0  # its head and tail in every replica
        assert sum(s.peer == 0 for s in stages) == 2
    assert plan.averaging_s[0] == plan.averaging_s[-1] == 0.0  # one copy of its part: nothing to average
    shared = shared_owner(topo, 0, 2)
    assert shared.speed[0] == topo.speed[0] / 2 and shared.speed[1] == topo.speed[1]
    assert shared.bandwidth[0, 1] == topo.bandwidth[0, 1] / 2 and math.isinf(shared.bandwidth[0, 0])


def test_a_replica_count_that_cannot_be_had_is_refused_with_the_reason() -> None:
    dag = transformer_dag(GPT, seq_len=256, micro_batch=4, granularity="block")
    with pytest.raises(PlanningError, match="cannot split 8 micro-batches"):
        plan_replicas(dag, _uniform(6), DENSE, 3)
    with pytest.raises(PlanningError, match="8 replicas of the plan do not fit the swarm's 4 peers"):
        plan_replicas(dag, _uniform(4), DENSE, 8)
    with pytest.raises(PlanningError, match="'auto' or a positive number"):
        plan_replicas(dag, _uniform(4), DENSE, 0)


def test_a_replicated_job_splits_its_micro_batches_and_names_its_replicas() -> None:
    assert split_micro_batches(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    with pytest.raises(ConfigError, match="divide"):
        split_micro_batches(5, 2)
    owner, a, b, c, d = ("Qm" + ch * 44 for ch in "oabcd")
    layouts = [RuntimeLayout((owner, a, b)), RuntimeLayout((owner, c, d))]
    options = replica_options(JobOptions(job="run-1", n_micro_batches=4, max_memory=1000), layouts, 1)
    assert (options.job, options.n_micro_batches, options.group) == ("run-1-r1", 2, "run-1")
    assert options.max_memory == 500  # this process holds both replicas' copies of its stage
    assert (options.replicas, options.replica) == (2, 1)
    assert options.replica_peers == ((owner, a, b), (owner, c, d))


def test_a_replicated_plan_is_published_replica_by_replica_and_read_back_as_planned() -> None:
    """Each replica's records sit under its own job id and say which replica of how many
    they are; read back over the same records, the replicas are the ones planned."""
    dag = offline_dag(
        OfflineModel(
            "gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256}, seq_len=32, trace=True
        )
    )
    topo = _uniform(9)
    owner = topo.peer_ids[0]
    planned = plan_replicated_job(dag, topo, owner, replicas=2, cost=DENSE)
    assert planned.replicas == 2 and all(p.n_micro_batches == 4 for p in planned.plans)
    assert not set(planned.plans[0].peer_ids) & set(planned.plans[1].peer_ids) - {owner}
    records = planned.to_records(
        job="run-1", epoch=3, made_by=topo.peer_ids[1], made_at=1.0, data_owner=owner
    )
    by_job: dict[str, list[PlanStageRecord]] = {}
    for record in records:
        by_job.setdefault(record.plan_id, []).append(record)
    assert (
        sorted(by_job) == [replica_job("run-1", 0, 2), replica_job("run-1", 1, 2)] == ["run-1-r0", "run-1-r1"]
    )
    assert {(r.replicas, r.replica) for r in by_job["run-1-r1"]} == {(2, 1)}
    read = ReplicatedPlan.from_records([by_job["run-1-r0"], by_job["run-1-r1"]], dag, topo, DENSE, owner)
    assert [p.peer_ids for p in read.plans] == [p.peer_ids for p in planned.plans]
    assert read.averaging_s == pytest.approx(planned.averaging_s)
    assert read.expected_s == pytest.approx(planned.expected_s)
    with pytest.raises(PlanningError, match="do not say replica 0 of 2"):
        ReplicatedPlan.from_records([by_job["run-1-r1"], by_job["run-1-r1"]], dag, topo, DENSE, owner)
    one = plan_replicated_job(dag, topo, owner, replicas=1, cost=DENSE)
    assert {
        r.plan_id for r in one.to_records(job="run-1", epoch=3, made_by="", made_at=1.0, data_owner=owner)
    } == {"run-1"}


def test_averaging_in_fp16_halves_the_bytes_and_auto_picks_it_where_fp32_would_cost_a_tenth_of_a_step() -> (
    None
):
    dag = transformer_dag(GPT, seq_len=256, micro_batch=4, granularity="block")
    gigabit = _uniform(8, gbit=1.0, tflops=1.0)
    fp32 = plan_replicas(dag, gigabit, DENSE, 2)
    fp16 = plan_replicas(dag, gigabit, dataclasses.replace(DENSE, averaging="fp16"), 2)
    assert fp16.averaging_codecs == ("fp16",) * len(fp16.replicas[0])
    for k, stage in enumerate(fp16.replicas[0]):
        grad_bytes = sum(dag.nodes[i].param_bytes for i in stage.nodes)
        group = [rep[k].peer for rep in fp16.replicas]
        assert fp16.averaging_s[k] == pytest.approx(averaging_seconds(grad_bytes / 2, group, gigabit))
        assert fp16.averaging_s[k] < fp32.averaging_s[k]
    auto = dataclasses.replace(DENSE, averaging="auto")
    for gbit, want in ((0.1, "fp16"), (1000.0, "none")):  # slow links: averaging dominates the step
        topo = _uniform(8, gbit=gbit, tflops=1.0)
        plan = plan_replicas(dag, topo, auto, 2)
        assert set(plan.averaging_codecs) == {want}
        step = max(e.expected_s for e in plan.estimates)
        for k, stage in enumerate(plan.replicas[0]):
            dense = averaging_seconds(
                sum(dag.nodes[i].param_bytes for i in stage.nodes),
                [rep[k].peer for rep in plan.replicas],
                topo,
            )
            assert (plan.averaging_codecs[k] == "fp16") == (dense > AUTO_AVERAGING_SHARE * step)
    with pytest.raises(ConfigError, match="averaging must be one of"):
        CostConfig(averaging="int4")


def test_the_averaging_codecs_travel_in_the_plan_records() -> None:
    dag = offline_dag(
        OfflineModel(
            "gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256}, seq_len=32, trace=True
        )
    )
    topo = _uniform(9)
    owner = topo.peer_ids[0]
    cost = dataclasses.replace(DENSE, averaging="fp16")
    planned = plan_replicated_job(dag, topo, owner, replicas=2, cost=cost)
    codecs = planned.averaging_codecs
    assert codecs[0] == codecs[-1] == "none" and set(codecs[1:-1]) == {"fp16"}  # the data owner's: in memory
    records = planned.to_records(
        job="run-2", epoch=1, made_by=topo.peer_ids[1], made_at=1.0, data_owner=owner
    )
    by_job: dict[str, list[PlanStageRecord]] = {}
    for record in records:
        by_job.setdefault(record.plan_id, []).append(record)
    read = ReplicatedPlan.from_records([by_job["run-2-r0"], by_job["run-2-r1"]], dag, topo, cost, owner)
    assert read.averaging_codecs == codecs
    with pytest.raises(RecordError, match="averaging codec 'int4'"):
        dataclasses.replace(records[0], averaging_codec="int4")
