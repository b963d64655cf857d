"""The WAN benchmark's job and matrix: one job file per (planner, compression) cell, of a
byte-level GPT-2 on stdlib text or a ResNet-18 on the scaled digits, and the cost model's
estimate of every cell on a topology's nominal rates (a dry run)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from benchmarks.testbed.topology import TestbedTopology
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import CostConfig, Topology, compression_policy, plan_job
from fusionp2p.records import LinkRecord, PeerRecord
from fusionp2p.training.job_spec import JobSpec

__all__ = [
    "MODELS",
    "PLANNERS",
    "POLICIES",
    "EmulatedDevice",
    "WanJob",
    "nominal_records",
    "order_spread",
    "plan_cells",
]

MODELS = ("gpt2", "resnet18")

PLANNERS = ("equal-number", "equal-computation", "op-fence")
POLICIES = ("none", "uniform", "adaptive", "planned")
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


@dataclass(frozen=True)
class WanJob:
    """The model and training geometry every cell runs: a byte-level GPT-2 on stdlib text
    (``model`` "gpt2") or a ResNet-18 on scikit-learn's digits scaled to ``image_size``
    pixels ("resnet18"; ``n_*`` and ``seq_len`` are the GPT-2's)."""

    model: str = "gpt2"
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
    image_size: int = 128  # resnet18: a 224-pixel ImageNet ResNet's cost at a third of the FLOPs
    replicas: int | str = 1  # [train] replicas of every cell (op-fence only): a number, or "auto"

    @property
    def n_micro_batches(self) -> int:
        return self.batch // self.micro_batch

    def toml(self, planner: str, policy: str, *, n_peers: int, out_dir: str) -> str:
        """The job file of one cell: no ratio warm-up, no checkpoints, no fault handling
        that could re-plan a slow cell (the matrix measures plans, not recovery)."""
        return f"""\
name = "wan-{planner}-{policy}"

{self._model_and_data()}
[train]
steps = {self.steps}
batch_size = {self.batch}
micro_batch_size = {self.micro_batch}
lr = {self.lr}
compression = "{policy}"
ratio_warmup_steps = 0
max_ratio = {self.max_ratio}
plan_method = "{planner}"
{self._replicas_line()}checkpoint_every = 1000000
min_peers = {n_peers}
wait_peers_s = 300

[fault]
deadline_s = 3600
straggler_steps = 10000
max_replans = 0

[output]
dir = "{out_dir}"
"""

    def _replicas_line(self) -> str:
        if self.replicas == 1:
            return ""
        value = f'"{self.replicas}"' if isinstance(self.replicas, str) else str(self.replicas)
        return f"replicas = {value}\n"

    def _model_and_data(self) -> str:
        if self.model == "resnet18":
            return f"""[model]
family = "resnet"
seed = 0

[model.config]
depth = 18
num_classes = 10

[data]
kind = "digits"
image_size = {self.image_size}
channels = 3
"""
        return f"""[model]
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
"""

    def describe(self) -> str:
        """The model and its input, for the report."""
        if self.model == "resnet18":
            return (
                f"ResNet-18 (torchvision's layout), scikit-learn's digits scaled to {self.image_size}x"
                f"{self.image_size}x3"
            )
        return f"GPT-2, n_embd {self.n_embd}, {self.n_layer} layers, {self.seq_len} tokens"

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


@dataclass(frozen=True)
class EmulatedDevice:
    """What a peer at one emulated speed measures of itself (``runtime.device_profile``)."""

    flops: dict[str, float]
    topk_codec_s: dict[str, float]


def nominal_records(
    topo: TestbedTopology,
    devices: dict[float, EmulatedDevice],
    *,
    memory_bytes: int = 2 << 30,
    salt: str = "",
) -> tuple[list[PeerRecord], list[LinkRecord], dict[str, str]]:
    """Records of the testbed's hosts as the peers would publish them if every probe read
    its link's setting (0.2 ms RTT): what a plan should look like before anything runs.
    Returns (peers, links, cluster of each peer); the first host is the data owner. Another
    ``salt`` gives the hosts other PeerIDs, so another order for the baselines."""
    peers, cluster_of = [], {}
    hosts = [(c, i) for c in topo.clusters for i in range(c.hosts)]
    for cluster, i in hosts:
        pid = _peer_id(f"{salt}{cluster.name}{i}")
        cluster_of[pid] = cluster.name
        peers.append(
            PeerRecord(
                peer_id=pid,
                maddrs=(),
                device="cpu",
                device_name="cpu",
                flops=dict(devices[cluster.slowdown].flops),
                topk_codec_s=dict(devices[cluster.slowdown].topk_codec_s),
                site=cluster.name,
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
                    "estimate_s": plan.expected_s,
                }
            )
    return rows


def order_spread(
    job: WanJob, topo: TestbedTopology, devices: dict[float, EmulatedDevice], orders: int = 40
) -> dict[str, Any]:
    """The estimate of equal-number/none and of OP-Fence/planned on nominal rates over
    ``orders`` random PeerID assignments: the baselines take peers in PeerID order, so
    their cost is a draw; OP-Fence's is not."""
    traced = trace_spec(job.spec().model_spec(), fake=True)
    out: dict[str, list[float]] = {"equal-number/none": [], "op-fence/planned": []}
    for k in range(orders):
        peers, links, _ = nominal_records(topo, devices, salt=f"order{k}-")
        topology = Topology.from_records(peers, links)
        for cell, values in out.items():
            planner, _, policy = cell.partition("/")
            cost = CostConfig(
                n_micro_batches=job.n_micro_batches, compression=compression_policy(policy, job.max_ratio)
            )
            values.append(
                plan_job(traced.dag, topology, peers[0].peer_id, method=planner, cost=cost).expected_s
            )
    return {"orders": orders, **{cell: sorted(values) for cell, values in out.items()}}
