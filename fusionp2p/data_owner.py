"""The data owner's view for planning: itself as a peer, its links to the swarm, a plan.

A data owner (a ``Swarm`` that trains) is not a published peer. To plan a job it measures
its own device (cached, like a peer's profile), probes its links to the candidate peers
over the same streams tensors use, and adds itself to the swarm's records. It always runs
the job's inputs and its loss (stage 0 of the runtime); the plan places the model over the
other peers, and the runtime estimate (``estimate_segments``) counts both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from hivemind.utils import get_dht_time

from fusionp2p import __version__
from fusionp2p.errors import ConfigError, FusionP2PError
from fusionp2p.net.probe import probe_link
from fusionp2p.net.transport import Transport
from fusionp2p.opdag.ir import OpDag
from fusionp2p.planning import BASELINES, CostConfig, Plan, PlanningError, Topology, baseline_plan, op_fence
from fusionp2p.records import LinkRecord, PeerRecord
from fusionp2p.runtime.device_profile import free_memory, profile_device

__all__ = ["PLAN_METHODS", "plan_job", "probe_from", "self_record"]

logger = logging.getLogger(__name__)

# a bare baseline runs with the job's compression; a suffixed one with its own
PLAN_METHODS = (
    "op-fence",
    *BASELINES,
    *(f"{b}/{c}" for b in BASELINES for c in ("none", "uniform", "adaptive")),
)


def self_record(peer_id: str, device: str = "cpu", site: str = "") -> PeerRecord:
    """This process as a peer would publish itself (measured once per device, then cached),
    in the declared ``site`` (``PeerRecord.site``)."""
    profile = profile_device(device)
    free, total = free_memory(device)
    now = get_dht_time()
    return PeerRecord(
        peer_id=peer_id,
        maddrs=(),
        device=profile.device,
        device_name=profile.device_name[:64],
        flops=dict(profile.flops),
        topk_codec_s=dict(profile.topk_codec_s),
        site=site,
        memory_bytes=free,
        total_memory_bytes=total,
        state="training",
        started_at=now,
        updated_at=now,
        torch_version=profile.torch_version,
        fusionp2p_version=__version__,
    )


async def probe_from(
    transport: Transport, peers: Sequence[PeerRecord], *, nbytes: int = 1 << 20, timeout: float = 20.0
) -> list[LinkRecord]:
    """This process's measured links to ``peers`` (one probe each, one at a time so they do
    not share the uplink); a peer that does not answer is left out, with a log line."""
    out = []
    for peer in peers:
        try:
            if peer.maddrs:
                await transport.connect(peer.peer_id, peer.maddrs, timeout=timeout)
            sample = await probe_link(transport, peer.peer_id, nbytes=nbytes, ping_count=3, timeout=timeout)
        except (FusionP2PError, TimeoutError, OSError) as e:
            logger.info("probe of %s failed, planning without it: %s", peer.peer_id[:12], e)
            continue
        out.append(
            LinkRecord(
                src=transport.peer_id,
                dst=peer.peer_id,
                bandwidth_bytes_per_s=sample.bandwidth_bytes_per_s,
                rtt_s=sample.rtt_s,
                measured_at=get_dht_time(),
            )
        )
    return out


def plan_job(dag: OpDag, topo: Topology, data_owner: str, *, method: str, cost: CostConfig) -> Plan:
    """A plan of ``dag`` over the peers of ``topo`` other than ``data_owner``: OP-Fence, or a
    baseline with ``cost``'s compression (``"equal-number"``) or its own
    (``"equal-computation/adaptive"``, ...).

    Raises:
        ConfigError: an unknown method.
        PlanningError: no peer besides the data owner, or the model fits nowhere.
    """
    if method not in PLAN_METHODS:
        raise ConfigError(f"plan method must be one of {list(PLAN_METHODS)}, got {method!r}")
    peers = topo.without(data_owner)
    if not len(peers):
        raise PlanningError("the swarm has no live peer besides this data owner to run the model on")
    start = time.perf_counter()
    if method == "op-fence":
        plan = op_fence(dag, peers, cost)
    else:
        name, _, kind = method.partition("/")
        plan = baseline_plan(name, dag, peers, cost, kind or cost.compression.kind)  # type: ignore[arg-type]
    logger.info(
        "planned %s with %s on %d peer(s) in %.2f s: %d stage(s), %.3f s per iteration (estimate)",
        dag.name,
        method,
        len(peers),
        time.perf_counter() - start,
        len(plan.stages),
        plan.expected_s,
    )
    return plan
