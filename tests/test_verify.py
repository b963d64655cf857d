"""The data owner accepts a coordinator's plan only if it makes the same plan itself from
records the DHT vouches for: a lying coordinator's plan or records are refused."""

from __future__ import annotations

import dataclasses

import pytest

from fusionp2p.errors import CoordinatorError
from fusionp2p.opdag import TransformerShape, transformer_dag
from fusionp2p.planning import CostConfig, Plan, Topology, plan_job, synthetic_swarm
from fusionp2p.planning.baselines import baseline_plan
from fusionp2p.planning.replicated_plan import ReplicatedPlan, plan_replicated_job
from fusionp2p.records import JobReply, JobRequest, LinkRecord, ModelSpec, PlanStageRecord, replica_job
from fusionp2p.training.verify import check_reply_records, verified_plan, verified_replicas

DAG = transformer_dag(
    TransformerShape("gpt2", 8, 512, 8, 256, 128, 2048, 4, True),
    seq_len=128,
    micro_batch=4,
    granularity="block",
)
COST = CostConfig(n_micro_batches=4)
COORDINATOR = "QmCoordinator" + "c" * 33


def _swarm() -> tuple[JobRequest, JobReply, Topology]:
    """An honest coordinator's reply on a synthetic swarm: the data owner is its first peer."""
    peers, links, _ = synthetic_swarm(7, n_peers=8)
    owner = peers[0]
    request = JobRequest(
        "job-1",
        ModelSpec("gpt2", {}, (4, 128)),
        4,
        "planned",
        "op-fence",
        owner,
        tuple(lk for lk in links if lk.src == owner.peer_id),
        max_ratio=20.0,
    )
    topo = Topology.from_records(peers, links)
    reply = JobReply("job-1", 1, 1, COORDINATOR, tuple(peers), tuple(topo.link_records(0.0)))
    return request, reply, Topology.from_records(reply.peers, reply.links)


def _published(plan: Plan, request: JobRequest) -> list:
    return plan.to_records(
        plan_id="job-1", epoch=1, made_by=COORDINATOR, made_at=0.0, data_owner=request.owner.peer_id
    )


def _check(reply: JobReply, request: JobRequest, probed: list[str] | None = None) -> None:
    live = {p.peer_id: p for p in _swarm()[1].peers}
    signed = [lk for lk in synthetic_swarm(7, n_peers=8)[1] if lk.src != request.owner.peer_id]
    check_reply_records(reply, request, live, signed, probed or [lk.dst for lk in request.owner_links])


def test_an_honest_plan_is_accepted() -> None:
    request, reply, topo = _swarm()
    honest = plan_job(DAG, topo, request.owner.peer_id, method="op-fence", cost=COST)
    _check(reply, request)
    plan, _ = verified_plan(_published(honest, request), DAG, reply, request, COST)
    assert plan.peer_ids == honest.peer_ids and [s.nodes for s in plan.stages] == [
        s.nodes for s in honest.stages
    ]


def test_a_plan_that_is_not_op_fences_is_refused() -> None:
    request, reply, topo = _swarm()
    peers = topo.without(request.owner.peer_id)
    other = baseline_plan("equal-number", DAG, peers, COST, "none")  # e.g. every peer, in PeerID order
    with pytest.raises(CoordinatorError, match="makes another plan"):
        verified_plan(_published(other, request), DAG, reply, request, COST)


@pytest.mark.parametrize(
    ("lie", "refusal"),
    [
        ("faster peer", "profile"),
        ("more memory", "free memory"),
        ("faster link", "cited at"),
        ("hidden peer", "leaves out"),
        ("unknown peer", "no live record"),
        ("other owner links", "not the one it measured"),
        ("a peer the job does not allow", "does not allow"),
    ],
)
def test_records_the_dht_does_not_vouch_for_are_refused(lie: str, refusal: str) -> None:
    request, reply, _ = _swarm()
    peers, links = list(reply.peers), list(reply.links)
    victim = peers[3]
    probed = [lk.dst for lk in request.owner_links]
    if lie == "faster peer":
        peers[3] = dataclasses.replace(victim, flops={"float32": victim.fp32_flops * 100})
    elif lie == "more memory":
        peers[3] = dataclasses.replace(victim, memory_bytes=victim.memory_bytes * 4)
    elif lie == "faster link":
        i = next(k for k, lk in enumerate(links) if lk.src == victim.peer_id and not lk.extra)
        links[i] = dataclasses.replace(links[i], bandwidth_bytes_per_s=links[i].bandwidth_bytes_per_s * 1000)
    elif lie == "hidden peer":
        probed = [*probed, "Qm" + "h" * 44]
    elif lie == "unknown peer":
        peers.append(dataclasses.replace(victim, peer_id="Qm" + "u" * 44))
    elif lie == "other owner links":
        i = next(k for k, lk in enumerate(links) if lk.src == request.owner.peer_id)
        links[i] = dataclasses.replace(links[i], rtt_s=links[i].rtt_s / 10)
    else:  # the job allows every cited peer but the victim
        allowed = tuple(p.peer_id for p in peers if p.peer_id not in (victim.peer_id, request.owner.peer_id))
        object.__setattr__(request, "only", allowed)  # synthetic ids are no base58 PeerIDs: skip the check
    lying = dataclasses.replace(reply, peers=tuple(peers), links=tuple(links))
    with pytest.raises(CoordinatorError, match=refusal):
        _check(lying, request, probed)


def test_a_direction_the_coordinator_took_from_its_reverse_is_not_held_to_a_record_it_never_read() -> None:
    request, _, _ = _swarm()
    peers, links, _ = synthetic_swarm(7, n_peers=8)
    owner = request.owner.peer_id
    pairs = {(lk.src, lk.dst) for lk in links}
    gone = next(lk for lk in links if owner not in (lk.src, lk.dst) and (lk.dst, lk.src) in pairs)
    # the coordinator read the swarm before gone.src measured gone.dst; since then it has,
    # ten times faster than the reverse the coordinator planned on
    seen = [lk for lk in links if lk != gone]
    reply = JobReply(
        "job-1", 1, 1, COORDINATOR, tuple(peers), tuple(Topology.from_records(peers, seen).link_records(0))
    )
    cited = next(lk for lk in reply.links if (lk.src, lk.dst) == (gone.src, gone.dst))
    assert cited.extra == {"inferred": 1.0}
    now = dataclasses.replace(gone, bandwidth_bytes_per_s=cited.bandwidth_bytes_per_s * 10)
    signed = [now if lk == gone else lk for lk in links if lk.src != owner]
    live = {p.peer_id: p for p in peers}
    check_reply_records(reply, request, live, signed, [lk.dst for lk in request.owner_links])
    # a direction the coordinator did read is still held to its record
    lying = dataclasses.replace(
        reply,
        links=tuple(
            dataclasses.replace(lk, bandwidth_bytes_per_s=lk.bandwidth_bytes_per_s * 100)
            if (lk.dst, lk.src) == (gone.src, gone.dst)
            else lk
            for lk in reply.links
        ),
    )
    with pytest.raises(CoordinatorError, match="cited at"):
        check_reply_records(lying, request, live, signed, [lk.dst for lk in request.owner_links])


def test_replicas_that_average_with_other_codecs_than_op_fence_picks_are_refused() -> None:
    """The averaging codec is part of the plan: a coordinator that has the replicas send
    fp16 where the job asked for fp32 (or the reverse) is caught like any other lie."""
    request, reply, topo = _swarm()
    request = dataclasses.replace(request, replicas=2, n_micro_batches=4)
    reply = dataclasses.replace(reply, replicas=2)
    owner = request.owner.peer_id
    honest = plan_replicated_job(DAG, topo, owner, replicas=2, cost=COST)

    def published(plan: ReplicatedPlan) -> list[list[PlanStageRecord]]:
        records = plan.to_records(job="job-1", epoch=1, made_by=COORDINATOR, made_at=0.0, data_owner=owner)
        return [[r for r in records if r.plan_id == replica_job("job-1", k, 2)] for k in range(2)]

    accepted, _ = verified_replicas(published(honest), DAG, reply, request, COST)
    assert accepted.averaging_codecs == honest.averaging_codecs
    assert set(honest.averaging_codecs) == {"none"}  # the job asked for fp32 (the default)
    lied = dataclasses.replace(honest, averaging_codecs=("fp16",) * len(honest.averaging_codecs))
    with pytest.raises(CoordinatorError, match="other codecs"):
        verified_replicas(published(lied), DAG, reply, request, COST)


BIG = transformer_dag(  # spread over five peers: the links between them matter
    TransformerShape("gpt2", 24, 2048, 16, 50257, 1024, 8192, 16, True),
    seq_len=1024,
    micro_batch=4,
    granularity="block",
)


def test_links_that_moved_past_the_slack_are_judged_by_the_plan_they_make() -> None:
    """A cited link between 8x and 64x off its signed record may be a re-measurement since
    the coordinator read it (an 11x move was seen on this machine): the plan is then judged
    over the links as their records say now. An honest plan whose unused link moved is
    taken; a coordinator that bends every link between peers 60x (one peer's faster, the
    rest slower) to put that peer on the plan is refused, its plan 7x slower than the data
    owner's own over the links as they are."""
    request, reply, topo = _swarm()
    owner = request.owner.peer_id
    live = {p.peer_id: p for p in reply.peers}
    signed = [lk for lk in synthetic_swarm(7, n_peers=8)[1] if lk.src != owner]
    probed = [lk.dst for lk in request.owner_links]
    honest = plan_job(BIG, topo, owner, method="op-fence", cost=COST)
    used = {frozenset(pair) for pair in zip(honest.peer_ids, honest.peer_ids[1:], strict=False)}
    moved = next(lk for lk in signed if frozenset((lk.src, lk.dst)) not in used and not lk.extra)
    now = [
        dataclasses.replace(lk, bandwidth_bytes_per_s=lk.bandwidth_bytes_per_s / 12) if lk == moved else lk
        for lk in signed
    ]
    drifted = check_reply_records(reply, request, live, now, probed)
    assert list(drifted) == [(moved.src, moved.dst)]
    taken, _ = verified_plan(_published(honest, request), BIG, reply, request, COST, drifted)
    assert taken.peer_ids == honest.peer_ids
    favoured = next(p.peer_id for p in reply.peers if p.peer_id.endswith("0003"))

    def bend(link: LinkRecord) -> LinkRecord:
        if owner in (link.src, link.dst) or link.extra:
            return link
        factor = 60.0 if favoured in (link.src, link.dst) else 1 / 60
        return dataclasses.replace(link, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s * factor)

    lying = dataclasses.replace(reply, links=tuple(bend(lk) for lk in reply.links))
    bent = plan_job(BIG, Topology.from_records(lying.peers, lying.links), owner, method="op-fence", cost=COST)
    assert favoured in bent.peer_ids and favoured not in honest.peer_ids
    drifted = check_reply_records(lying, request, live, signed, probed)
    with pytest.raises(
        CoordinatorError, match=r"moved past 8x since it read them .* \d+\.\d\dx the plan made of"
    ):
        verified_plan(_published(bent, request), BIG, lying, request, COST, drifted)
    far = dataclasses.replace(
        lying,
        links=tuple(
            dataclasses.replace(lk, bandwidth_bytes_per_s=lk.bandwidth_bytes_per_s * 100)
            if lk.src == favoured and lk.dst != owner and not lk.extra
            else lk
            for lk in reply.links
        ),
    )
    with pytest.raises(CoordinatorError, match="its signed record says"):  # past 64x: a lie, whatever it does
        check_reply_records(far, request, live, signed, probed)
