"""The WAN benchmark's job and matrix: one GPT-2 job file per (planner, compression) cell,
and the cost model's estimate of every cell on a topology's nominal rates (a dry run)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from benchmarks.testbed.topology import TestbedTopology
from fusionp2p.data_owner import plan_job
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import CostConfig, Topology
from fusionp2p.records import LinkRecord, PeerRecord
from fusionp2p.training.job_spec import JobSpec, compression_policy

__all__ = ["PLANNERS", "POLICIES", "WanJob", "nominal_records", "plan_cells"]

PLANNERS = ("equal-number", "equal-computation", "op-fence")
POLICIES = ("none", "uniform", "adaptive", "planned")
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


@dataclass(frozen=True)
class WanJob:
    """The model and training geometry every cell runs (a byte-level GPT-2 on stdlib text)."""

    n_embd: int = 384
    n_layer: int = 8
    n_head: int = 6
    seq_len: int = 128
    micro_batch: int = 4
    batch: int = 16
    steps: int = 10
    warmup_steps: int = 5  # not timed: setup, first allocations, then the 3 steps the re-estimate reads
    max_ratio: float = 20.0  # "planned": the hardest ratio; "uniform": every link's
    lr: float = 1e-3

    @property
    def n_micro_batches(self) -> int:
        return self.batch // self.micro_batch

    def toml(self, planner: str, policy: str, *, n_peers: int, out_dir: str) -> str:
        """The job file of one cell: no ratio warm-up, no checkpoints, no fault handling
        that could re-plan a slow cell (the matrix measures plans, not recovery)."""
        return f"""\
name = "wan-{planner}-{policy}"

[model]
family = "gpt2"
seed = 0

[model.config]
vocab_size = 256
n_positions = {self.seq_len}
n_embd = {self.n_embd}
n_layer = {self.n_layer}
n_head = {self.n_head}

[data]
path = ""
seq_len = {self.seq_len}
max_bytes = 2000000

[train]
steps = {self.steps}
batch_size = {self.batch}
micro_batch_size = {self.micro_batch}
lr = {self.lr}
compression = "{policy}"
ratio_warmup_steps = 0
max_ratio = {self.max_ratio}
plan_method = "{planner}"
checkpoint_every = 1000000
min_peers = {n_peers}
wait_peers_s = 300

[fault]
deadline_s = 3600
straggler_steps = 10000
max_replans = 0

[output]
dir = "{out_dir}"
"""

    def spec(self, planner: str = "op-fence", policy: str = "none") -> JobSpec:
        return JobSpec.from_toml(self.toml(planner, policy, n_peers=1, out_dir="unused"))


def _peer_id(name: str) -> str:
    """A stable fake PeerID; hashed, so that PeerID order (the baselines' order) mixes
    clusters as real PeerIDs do."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest(), "big")
    chars = []
    for _ in range(44):
        digest, rem = divmod(digest, 58)
        chars.append(_B58[rem])
    return "Qm" + "".join(chars)


def nominal_records(
    topo: TestbedTopology, flops_by_speed: dict[float, dict[str, float]], *, memory_bytes: int = 2 << 30
) -> tuple[list[PeerRecord], list[LinkRecord], dict[str, str]]:
    """Records of the testbed's hosts as the peers would publish them if every probe read
    its link's setting (0.2 ms RTT): what a plan should look like before anything runs.
    Returns (peers, links, cluster of each peer); the first host is the data owner."""
    peers, cluster_of = [], {}
    hosts = [(c, i) for c in topo.clusters for i in range(c.hosts)]
    for cluster, i in hosts:
        pid = _peer_id(f"{cluster.name}{i}")
        cluster_of[pid] = cluster.name
        peers.append(
            PeerRecord(
                peer_id=pid,
                maddrs=(),
                device="cpu",
                device_name="cpu",
                flops=dict(flops_by_speed[cluster.slowdown]),
                memory_bytes=memory_bytes,
                total_memory_bytes=2 * memory_bytes,
                state="idle",
                started_at=0.0,
                updated_at=0.0,
            )
        )
    links = []
    for a in peers:
        for b in peers:
            if a.peer_id == b.peer_id:
                continue
            ca, cb = cluster_of[a.peer_id], cluster_of[b.peer_id]
            mbps = topo.cluster(ca).host_mbps if ca == cb else topo.rate(ca, cb)
            mbps = min(mbps, topo.cluster(ca).host_mbps, topo.cluster(cb).host_mbps)
            links.append(LinkRecord(a.peer_id, b.peer_id, mbps * 1e6 / 8, 2e-4, 0.0))
    return peers, links, cluster_of


def plan_cells(
    job: WanJob, peers: list[PeerRecord], links: list[LinkRecord], owner: str
) -> list[dict[str, Any]]:
    """Every cell's plan on these records: method, stages, ratios, estimate (s/iteration)."""
    traced = trace_spec(job.spec().model_spec(), fake=True)
    topo = Topology.from_records(peers, links)
    rows = []
    for planner in PLANNERS:
        for policy in POLICIES:
            cost = CostConfig(
                n_micro_batches=job.n_micro_batches, compression=compression_policy(policy, job.max_ratio)
            )
            plan = plan_job(traced.dag, topo, owner, method=planner, cost=cost)
            rows.append(
                {
                    "planner": planner,
                    "compression": policy,
                    "stages": len(plan.stages),
                    "peers": list(plan.peer_ids),
                    "ratios": sorted({round(r, 2) for r in plan.ratios.values()}),
                    "estimate_s": plan.iteration_s,
                }
            )
    return rows
