"""The data owner's check of the coordinator: a plan counts only if the data owner gets the
same plan itself, from records the DHT vouches for.

A coordinator is any peer that won the lease, so it is verified, not trusted. Planning is
deterministic and the coordinator plans on exactly the records its reply cites (the
candidates and every pair between them), so the data owner plans them again and accepts
only an equal plan. The cited records must be the swarm's: the data owner's own record and
links as it sent them, every other peer's profile as its signed record in the DHT says
(speeds scaled only as the request asked; only peers the request allows), its free memory
within ``MEMORY_SLACK`` of what the DHT says now, every measured link within
``LINK_SLACK`` of what its two ends' signed records vouch for (``planning.vouch``), no
inferred link (a pair never measured, or a direction taken from its reverse: the
coordinator may have read the swarm before that direction was measured) faster than
``LINK_SLACK`` times the fastest link the data owner saw measured, and every peer the data
owner probed itself among the candidates. A
coordinator can then only plan what OP-Fence (or the baseline asked for) makes of the swarm
as it is.

A link re-measured past ``LINK_SLACK`` (but within ``DRIFT_LIMIT``) since the coordinator
read it is not a lie by itself: on a busy machine a loopback probe has moved 11x between
two reads seconds apart. Such a plan is judged by what it does instead: over the links as
their records say now, it must take at most ``OUTCOME_SLACK`` times the step of the plan
this data owner makes of them itself. A coordinator that bends links that far can then
cost the job at most that much.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence

from fusionp2p.errors import CoordinatorError
from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning import CostConfig, Plan, PlanningError, Topology, plan_job, vouched_links
from fusionp2p.planning.replicated_plan import ReplicatedPlan, plan_replicated_job, replicas_request
from fusionp2p.records import JobReply, JobRequest, LinkRecord, PeerRecord, PlanStageRecord

__all__ = [
    "DRIFT_LIMIT",
    "LINK_SLACK",
    "MEMORY_SLACK",
    "OUTCOME_SLACK",
    "PlanRefused",
    "check_reply_records",
    "verified_plan",
    "verified_replicas",
]

logger = logging.getLogger(__name__)

MEMORY_SLACK = 2.0  # a cited peer's free memory may differ this much (either way) from the DHT's now
LINK_SLACK = 8.0  # a cited link may differ this much from its signed record: probes vary (2.4x seen on
# loopback within seconds) and the coordinator reads the DHT a few seconds earlier
DRIFT_LIMIT = LINK_SLACK**2  # past LINK_SLACK, up to this: the plan is judged over the links as they are now
OUTCOME_SLACK = 1.25  # ... and may take this much longer a step than the data owner's own plan of them

Drifted = Mapping[tuple[str, str], LinkRecord]  # (src, dst) -> the link's signed record now


class PlanRefused(CoordinatorError):
    """The coordinator's reply is not what the swarm's records make: the message says why."""


def _refuse(coordinator: str, why: str) -> PlanRefused:
    return PlanRefused(f"the coordinator {coordinator[-8:]}'s reply is refused: {why}")


def _check_peer(cited: PeerRecord, signed: PeerRecord | None, factor: float, coordinator: str) -> None:
    who = cited.peer_id[-8:]
    if signed is None:
        raise _refuse(coordinator, f"it cites peer {who}, which the DHT holds no live record of")
    profile = ("device", "total_memory_bytes", "topk_codec_s", "site", "started_at")
    if any(getattr(cited, f) != getattr(signed, f) for f in profile) or cited.flops != {
        k: v * factor for k, v in signed.flops.items()
    }:
        raise _refuse(coordinator, f"peer {who}'s profile is not the one it signed")
    low, high = (
        signed.memory_bytes / MEMORY_SLACK,
        min(signed.memory_bytes * MEMORY_SLACK, signed.total_memory_bytes),
    )
    if not low <= cited.memory_bytes <= high:
        raise _refuse(
            coordinator,
            f"peer {who}'s free memory is cited as {cited.memory_bytes}, not ~{signed.memory_bytes}",
        )


def check_reply_records(
    reply: JobReply,
    request: JobRequest,
    live: Mapping[str, PeerRecord],
    signed_links: Sequence[LinkRecord],
    probed: Sequence[str],
) -> dict[tuple[str, str], LinkRecord]:
    """Refuses ``reply`` unless the records it cites are the swarm's (see the module doc):
    ``live`` are the DHT's live peer records now, ``signed_links`` the DHT's links of the
    cited peers, ``probed`` the peers this data owner measured a link to. Returns the
    links re-measured past ``LINK_SLACK`` (within ``DRIFT_LIMIT``), as signed now: the plan
    must then pass ``verified_plan``'s check over them.

    Raises:
        PlanRefused: the reason, naming the record.
    """
    owner, by = request.owner.peer_id, reply.coordinator
    cited = {p.peer_id: p for p in reply.peers}
    if cited.get(owner) != request.owner:
        raise _refuse(by, "it does not cite this data owner's record as it was sent")
    outside = [p[-8:] for p in cited if p != owner and request.only and p not in request.only]
    if outside:
        raise _refuse(by, f"it cites peers this data owner's job does not allow: {outside}")
    factors = dict(request.speeds)
    for peer_id, record in cited.items():
        if peer_id != owner:
            _check_peer(record, live.get(peer_id), factors.get(peer_id, 1.0), by)
    left_out = [p[-8:] for p in probed if p not in cited and p not in request.exclude]
    if left_out:
        raise _refuse(by, f"it leaves out idle peers this data owner reached: {left_out}")
    mine = {(lk.src, lk.dst): lk for lk in request.owner_links}
    vouched = vouched_links([*signed_links, *request.owner_links], trusted={owner, by})
    signed = {(lk.src, lk.dst): lk for lk in vouched}
    fastest = max([lk.bandwidth_bytes_per_s for lk in (*signed_links, *request.owner_links)], default=0.0)
    drifted: dict[tuple[str, str], LinkRecord] = {}
    for link in reply.links:
        key, bandwidth = (link.src, link.dst), link.bandwidth_bytes_per_s
        if link.src == owner and "inferred" not in link.extra:
            sent = mine.get(key)
            if sent is None or (sent.bandwidth_bytes_per_s, sent.rtt_s) != (bandwidth, link.rtt_s):
                raise _refuse(by, f"this data owner's link to {link.dst[-8:]} is not the one it measured")
        elif key in signed and "inferred" not in link.extra:
            truth = signed[key].bandwidth_bytes_per_s
            if truth / DRIFT_LIMIT <= bandwidth <= truth * DRIFT_LIMIT and not (
                truth / LINK_SLACK <= bandwidth <= truth * LINK_SLACK
            ):
                drifted[key] = signed[key]
            elif not truth / LINK_SLACK <= bandwidth <= truth * LINK_SLACK:
                raise _refuse(
                    by,
                    f"link {link.src[-8:]} -> {link.dst[-8:]} is cited at {bandwidth:.3g} B/s, "
                    f"its signed record says {truth:.3g}",
                )
        elif bandwidth > LINK_SLACK * fastest:
            raise _refuse(
                by,
                f"link {link.src[-8:]} -> {link.dst[-8:]} is cited at {bandwidth:.3g} B/s, "
                f"faster than any link measured ({fastest:.3g})",
            )
    return drifted


def _check_outcome(
    by: str,
    reply: JobReply,
    drifted: Drifted,
    plans: Callable[[Topology], tuple[Plan, Plan] | tuple[ReplicatedPlan, ReplicatedPlan]],
) -> None:
    """Refuses the published plan unless, over the cited swarm with the drifted links as
    their records say now, it takes at most ``OUTCOME_SLACK`` times the step of this data
    owner's own plan (``plans``: both, over a topology)."""
    now = Topology.from_records(reply.peers, [drifted.get((lk.src, lk.dst), lk) for lk in reply.links])
    try:
        published_s, mine_s = (p.expected_s for p in plans(now))
    except PlanningError as e:
        raise _refuse(by, f"its plan cannot be checked over the links as they are now: {e}") from e
    src, dst = next(iter(drifted))
    if not published_s <= OUTCOME_SLACK * mine_s:
        raise _refuse(
            by,
            f"{len(drifted)} link(s) moved past {LINK_SLACK:g}x since it read them ({src[-8:]} -> "
            f"{dst[-8:]} is at {drifted[src, dst].bandwidth_bytes_per_s:.3g} B/s now), and over the "
            f"links as they are now its plan takes {published_s:.3g} s a step, "
            f"{published_s / mine_s:.2f}x the plan made of them here",
        )
    logger.info(
        "%d link(s) moved past %gx since the coordinator %s read them; over them as they are now its "
        "plan takes %.3g s a step, %.2fx the plan made of them here: taken",
        len(drifted),
        LINK_SLACK,
        by[-8:],
        published_s,
        published_s / mine_s,
    )


def _same(published: Plan, mine: Plan) -> bool:
    return (
        published.peer_ids == mine.peer_ids
        and [s.nodes for s in published.stages] == [s.nodes for s in mine.stages]
        and published.ratios.keys() == mine.ratios.keys()
        and all(math.isclose(published.ratios[k], mine.ratios[k], rel_tol=1e-9) for k in mine.ratios)
    )


def verified_plan(
    records: Sequence[PlanStageRecord],
    dag: OpDag,
    reply: JobReply,
    request: JobRequest,
    cost: CostConfig,
    drifted: Drifted | None = None,
) -> tuple[Plan, Topology]:
    """The published plan, if it is what ``request.method`` makes of the records the reply
    cites and, with ``drifted`` links (``check_reply_records``), still good over them as
    they are now; the plan and the topology it runs in.

    Raises:
        PlanRefused: the published plan is another one, or incomplete, or over the drifted
            links more than ``OUTCOME_SLACK`` slower than this data owner's own plan.
    """
    owner, by = request.owner.peer_id, reply.coordinator

    def plans(topo: Topology) -> tuple[Plan, Plan]:  # the published plan and this data owner's, over topo
        published = Plan.from_records(records, dag, topo, cost, method=request.method)
        return published, plan_job(dag, topo, owner, method=request.method, cost=cost)

    try:
        topo = Topology.from_records(reply.peers, reply.links)
        published, mine = plans(topo)
    except PlanningError as e:
        raise _refuse(by, f"its plan cannot be checked: {e}") from e
    if not _same(published, mine):
        raise _refuse(
            by,
            f"{request.method} makes another plan of the records it cites (stages on "
            f"{[p[-8:] for p in mine.peer_ids]}, it published {[p[-8:] for p in published.peer_ids]})",
        )
    if drifted:
        _check_outcome(by, reply, drifted, plans)
    return published, topo


def verified_replicas(
    replicas: Sequence[Sequence[PlanStageRecord]],
    dag: OpDag,
    reply: JobReply,
    request: JobRequest,
    cost: CostConfig,
    drifted: Drifted | None = None,
) -> tuple[ReplicatedPlan, Topology]:
    """The published replicas (replica k's records at ``replicas[k]``), if they are what
    ``plan_replicated_job`` makes of the records the reply cites for the replicas the
    request asked for (and with ``drifted`` links, still good over them: ``verified_plan``);
    the plan and the topology it runs in.

    Raises:
        PlanRefused: the published replicas are others, fewer or more, or incomplete, or
            too slow over the drifted links.
    """
    owner, by = request.owner.peer_id, reply.coordinator

    def plans(topo: Topology) -> tuple[ReplicatedPlan, ReplicatedPlan]:  # published, and this data owner's
        published = ReplicatedPlan.from_records(replicas, dag, topo, cost, owner, method="op-fence")
        return published, plan_replicated_job(
            dag, topo, owner, replicas=replicas_request(request.replicas), cost=cost
        )

    try:
        topo = Topology.from_records(reply.peers, reply.links)
        published, mine = plans(topo)
    except PlanningError as e:
        raise _refuse(by, f"its plan cannot be checked: {e}") from e
    if mine.replicas != published.replicas or not all(
        _same(a, b) for a, b in zip(published.plans, mine.plans, strict=True)
    ):
        raise _refuse(
            by,
            f"op-fence makes other replicas of the records it cites ({mine.replicas} on "
            f"{[[p[-8:] for p in plan.peer_ids] for plan in mine.plans]}, it published "
            f"{published.replicas} on {[[p[-8:] for p in plan.peer_ids] for plan in published.plans]})",
        )
    stages = range(len(published.averaging_s))
    codecs = [mine.averaging_codec(k) for k in stages]
    if [published.averaging_codec(k) for k in stages] != codecs:
        raise _refuse(by, f"its replicas average with other codecs than op-fence picks ({codecs})")
    if drifted:
        _check_outcome(by, reply, drifted, plans)
    return published, topo
