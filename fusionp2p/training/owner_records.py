"""What only a data owner can measure: itself as a peer, and its links to the swarm.

A data owner is not a published peer. To plan a job it measures its own device (cached,
like a peer's profile) and probes its links to the candidate peers over the same streams
tensors use; the coordinator plans with these records next to the swarm's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hivemind.utils import get_dht_time

from fusionp2p.config import DEFAULT_TIMEOUTS, ProbeConfig
from fusionp2p.errors import FusionP2PError
from fusionp2p.net.probe import HIGH_RTT_S, probe_bytes, probe_link
from fusionp2p.net.transport import Transport
from fusionp2p.records import LinkRecord, PeerRecord
from fusionp2p.runtime.device_profile import free_memory, profile_device
from fusionp2p.runtime.engines import memory_allowance
from fusionp2p.version import __version__

__all__ = ["probe_from", "self_record"]

logger = logging.getLogger(__name__)

PROBE_BYTES = 1 << 20  # one probe's payload
PROBE_PINGS = 3  # round trips per probe
PROBE_CONFIG = ProbeConfig()  # how a second probe of a long-haul link is sized (net.probe.probe_bytes)


def self_record(
    peer_id: str, device: str = "cpu", site: str = "", max_memory: int | None = None
) -> PeerRecord:
    """This process as a peer would publish itself (measured once per device, then cached),
    in the declared ``site`` (``PeerRecord.site``), offering its stage at most
    ``max_memory`` bytes (default: what a stage may use, 80% of free memory)."""
    profile = profile_device(device)
    free, total = free_memory(device)
    free = min(free, memory_allowance(max_memory, device))
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
    transport: Transport,
    peers: Sequence[PeerRecord],
    *,
    nbytes: int = PROBE_BYTES,
    timeout: float = DEFAULT_TIMEOUTS.probe,
) -> list[LinkRecord]:
    """This process's measured links to ``peers`` (one probe each, one at a time so they do
    not share the uplink); a peer that does not answer is left out, with a log line."""
    out = []
    for peer in peers:
        try:
            if peer.maddrs:
                await transport.connect(peer.peer_id, peer.maddrs, timeout=timeout)
            sample = await probe_link(
                transport, peer.peer_id, nbytes=nbytes, ping_count=PROBE_PINGS, timeout=timeout
            )
            sized = probe_bytes(sample.bandwidth_bytes_per_s, sample.rtt_s, PROBE_CONFIG)
            if sample.rtt_s >= HIGH_RTT_S and sized > nbytes:  # long haul: a probe of its size too
                again = await probe_link(
                    transport, peer.peer_id, nbytes=sized, ping_count=PROBE_PINGS, timeout=timeout
                )
                sample = max(sample, again, key=lambda s: s.bandwidth_bytes_per_s)
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
                probe_bytes=sample.nbytes,
            )
        )
    return out
