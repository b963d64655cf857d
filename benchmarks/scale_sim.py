"""The swarm's directory, probes and the coordinator's view at 100, 1,000 and 10,000 peers.

    python benchmarks/scale_sim.py [--peers 100 1000] [--plan-peers 10000] [--rounds 60]
                                   [--json benchmarks/results/scale_sim.json]

Per N: a seeded synthetic network (``planning.synthetic_network``: clusters of ~50 peers,
20% of peers behind a slow access link) and N simulated peers, each with its own RSA
identity (1024-bit, to keep generating a thousand short). Their probes run through the
real ``LinkEstimator`` for ``--rounds`` rounds on the true bandwidths (+-10% noise), with
the same hints a live peer reads. Then, on 3 real hivemind DHT nodes running fusionp2p's
validators: every peer's record and links are published through ``SwarmDirectory``, each
signed in this process with its own key (a publisher node signs for whichever identity a
subkey names; the storing nodes verify as always); a coordinator node reads the swarm with
a ``DirectoryView`` (once cold, once warm); the largest key is measured. Last, the view is
planned on: the inference error against the true graph on the pairs nobody measured,
OP-Fence's time on the inferred graph, and its plan's true cost against the plan made on
the true graph (GPT-2 small, 8 micro-batches, uniform Top-K 100x so that the partition,
not the compression policy, is what differs). ``--plan-peers``: the planner alone on a
synthetic graph of that size, measurements sampled the way the probe policy converges.

Targets (issue 17): at 1,000 peers a complete, fresh view within 10 s, a plan within 10 s
more; the plan on the inferred graph within 10% of the plan on the true one; no key above
64 KiB at any N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
import numpy as np
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from fusionp2p.config import ProbeConfig
from fusionp2p.coordination.coordinator import MAX_PLAN_PEERS
from fusionp2p.net.dht_node import start_dht
from fusionp2p.net.directory import MAX_PEER_LEVEL, SwarmDirectory
from fusionp2p.net.directory_view import DirectoryView
from fusionp2p.net.identity import peer_id_from_public_key
from fusionp2p.net.probe import HINT_SOURCES, NEAR_LINKS, LinkEstimator, LinkSample, hints_from
from fusionp2p.net.validation import SwarmRecordValidator
from fusionp2p.opdag import TransformerShape, transformer_dag
from fusionp2p.planning import CompressionPolicy, CostConfig, Topology, op_fence, vouched_links
from fusionp2p.planning.estimate import estimate
from fusionp2p.planning.synthetic import SyntheticNetwork, synthetic_network
from fusionp2p.records import MAX_LINKS_PER_PEER, LinkRecord, PeerRecord

GPT2_SMALL = TransformerShape("gpt2", 12, 768, 12, 50257, 1024, 3072, 12, True)
COST = CostConfig(n_micro_batches=8, compression=CompressionPolicy(ratio=100.0))
TTL = 600.0
PUBLISHERS = 16  # identities publishing at once (peers of a real swarm join over time)


class ManyKeySigner(RSASignatureValidator):
    """Signs each record with the key its subkey's owner marker names (a simulator only:
    a real peer holds one key). Verifies like hivemind's validator."""

    def __init__(self, keys: list[RSAPrivateKey]) -> None:
        super().__init__(keys[0])
        self._signers = {RSASignatureValidator(k).local_public_key: RSASignatureValidator(k) for k in keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        marker = re.search(self.PUBLIC_KEY_REGEX, record.subkey or b"")
        signer = self._signers.get(marker.group(0)) if marker else None
        return signer.sign_value(record) if signer else record.value


def new_key() -> RSAPrivateKey:
    der = rsa.generate_private_key(public_exponent=65537, key_size=1024).private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def peer_records(ids: list[str], net: SyntheticNetwork, now: float) -> list[PeerRecord]:
    return [
        PeerRecord(
            peer_id=pid,
            maddrs=(),
            device="cuda:0",
            device_name="simulated",
            flops={"float32": float(net.speed[i])},
            memory_bytes=int(net.memory[i]),
            total_memory_bytes=int(net.memory[i]),
            state="idle",
            started_at=now,
            updated_at=now,
        )
        for i, pid in enumerate(ids)
    ]


def simulate_probes(net: SyntheticNetwork, ids: list[str], rounds: int, seed: int) -> list[LinkRecord]:
    """What each peer would publish after ``rounds`` probe rounds of the real policy."""
    rng = np.random.default_rng(seed)
    pos = {pid: i for i, pid in enumerate(ids)}
    config = ProbeConfig(period=1.0)
    estimators = [LinkEstimator(pid, config, rng=random.Random(seed + i)) for i, pid in enumerate(ids)]
    probed_by: list[dict[str, None]] = [{} for _ in ids]  # as Peer keeps it: who probed each, newest last
    for now in range(rounds):
        published: dict[str, list[LinkRecord]] = {}  # what the directory holds this round
        for i, est in enumerate(estimators):
            around = []
            for nb in est.fastest(HINT_SOURCES):
                if nb not in published:
                    published[nb] = estimators[pos[nb]].records(float(now), max_age=float("inf"))
                around += published[nb]
            known = est.known_peers()
            asked = [p for p in reversed(probed_by[i]) if p not in known]
            for dst in est.choose_targets(ids, float(now), [*asked, *hints_from(around)]):
                j = pos[dst]
                probed_by[j].pop(ids[i], None)
                probed_by[j][ids[i]] = None
                while len(probed_by[j]) > MAX_LINKS_PER_PEER:
                    del probed_by[j][next(iter(probed_by[j]))]
                sample = LinkSample(
                    float(net.bandwidth[i, j] * rng.uniform(0.9, 1.1)), float(2 * net.latency[i, j]), 1, 1.0
                )
                est.update(dst, sample, float(now))
    return [lk for e in estimators for lk in e.records(float(rounds), max_age=float("inf"))]


def sampled_links(net: SyntheticNetwork, ids: list[str], seed: int) -> list[LinkRecord]:
    """The links the probe policy converges to, drawn directly (for swarms too large to
    simulate round by round): each peer's ``NEAR_LINKS`` fastest among a random third of
    its cluster, and a random sample of the others; each measured from both ends (a peer
    probes back who probed it)."""
    rng = np.random.default_rng(seed)
    n, links = len(ids), []
    members = {c: np.flatnonzero(net.labels == c) for c in np.unique(net.labels)}
    for i in range(n):
        own = members[net.labels[i]]
        own = own[own != i]
        seen = rng.choice(own, min(len(own), max(NEAR_LINKS, len(own) // 3)), replace=False)
        near = seen[np.argsort(-net.bandwidth[i, seen])][:NEAR_LINKS]
        rest = rng.choice(n, MAX_LINKS_PER_PEER - len(near) + 8, replace=False)
        rest = [j for j in rest if j != i and j not in set(near)][: MAX_LINKS_PER_PEER - len(near)]
        for j in [*near, *rest]:
            for a, b in ((i, int(j)), (int(j), i)):  # a peer probes back who probed it
                bw = net.bandwidth[a, b] * rng.uniform(0.9, 1.1)
                links.append(LinkRecord(ids[a], ids[b], float(bw), float(2 * net.latency[a, b]), 0.0))
    return links


@dataclass
class DhtResult:
    publish_peers_s: float
    publish_links_s: float
    stores: int
    view_s: float
    view_complete: bool
    peers_read: int
    links_read: int
    warm_view_s: float
    warm_link_reads: int
    largest_key_bytes: int
    largest_key: str
    keys: int


async def _store_all(jobs: list[Any]) -> None:
    gate = asyncio.Semaphore(PUBLISHERS)

    async def one(job: Any) -> None:
        async with gate:
            await job

    await asyncio.gather(*(one(j) for j in jobs))


async def dht_phase(
    keys: list[RSAPrivateKey], peers: list[PeerRecord], links: list[LinkRecord], storage: list[hivemind.DHT]
) -> tuple[DhtResult, dict[str, PeerRecord], list[LinkRecord]]:
    maddrs = [str(a) for a in storage[0].get_visible_maddrs()]
    swarm = f"sim{len(peers)}"  # one swarm per size on the same DHT nodes
    publisher = start_dht(
        initial_peers=maddrs, client_mode=True, validators=[ManyKeySigner(keys), SwarmRecordValidator()]
    )
    reader = start_dht(initial_peers=maddrs, client_mode=True)
    try:
        markers = {
            p.peer_id: RSASignatureValidator(k).local_public_key for p, k in zip(peers, keys, strict=True)
        }
        dirs = {
            pid: SwarmDirectory(publisher, swarm, owner_marker=m, timeout=60.0) for pid, m in markers.items()
        }
        expiration = get_dht_time() + TTL
        start = time.perf_counter()
        await _store_all([dirs[p.peer_id].publish_peer(p, expiration) for p in peers])
        publish_peers_s = time.perf_counter() - start
        by_src: dict[str, list[LinkRecord]] = {}
        for lk in links:
            by_src.setdefault(lk.src, []).append(lk)
        start = time.perf_counter()
        await _store_all([dirs[src].publish_links(mine, expiration) for src, mine in by_src.items()])
        publish_links_s = time.perf_counter() - start

        view = DirectoryView(SwarmDirectory(reader, swarm, timeout=15.0), links_max_age=TTL)
        cold = await view.refresh()
        warm = await view.refresh()
        read_peers, read_links = view.peers(), view.links()

        directory = SwarmDirectory(reader, swarm)
        key_names = {directory.links_key(p.peer_id) for p in peers}
        key_names |= {
            directory.peer_key(p.peer_id, level) for p in peers for level in range(MAX_PEER_LEVEL + 1)
        }
        sizes = await asyncio.gather(*(_key_bytes(reader, k) for k in sorted(key_names)))
        largest = max(zip(sizes, sorted(key_names), strict=True))
    finally:
        publisher.shutdown()
        reader.shutdown()
    result = DhtResult(
        publish_peers_s,
        publish_links_s,
        len(peers) + len(links),
        cold.seconds,
        cold.complete and len(read_peers) == len(peers) and len(read_links) == len(links),
        len(read_peers),
        len(read_links),
        warm.seconds,
        warm.link_reads,
        largest[0],
        largest[1],
        sum(1 for s in sizes if s),
    )
    return result, read_peers, read_links


async def _key_bytes(dht: hivemind.DHT, key: str) -> int:
    """Bytes a key holds in the DHT: its subkeys and their signed values."""
    found = await asyncio.wait_for(dht.get(key, latest=True, return_future=True), 60)
    if found is None or not isinstance(found.value, dict):
        return 0
    return sum(len(sub) + len(item.value) for sub, item in found.value.items())


def inference_error(topo: Topology, net: SyntheticNetwork, order: np.ndarray) -> dict[str, float]:
    """Relative error of the inferred bandwidth on the pairs nobody measured."""
    truth = net.bandwidth[np.ix_(order, order)]
    unmeasured = ~topo.measured & ~np.eye(len(topo), dtype=bool)
    rel = np.abs(topo.bandwidth[unmeasured] - truth[unmeasured]) / truth[unmeasured]
    return {
        "measured_fraction": float((topo.measured | topo.measured.T).sum() / (len(topo) * (len(topo) - 1))),
        "median_rel_error": float(np.median(rel)) if rel.size else 0.0,
        "p90_rel_error": float(np.percentile(rel, 90)) if rel.size else 0.0,
    }


def plan_phase(topo: Topology, net: SyntheticNetwork, order: np.ndarray) -> dict[str, float]:
    truth = Topology.from_arrays(
        topo.peer_ids,
        net.speed[order],
        net.memory[order],
        net.bandwidth[np.ix_(order, order)],
        net.latency[np.ix_(order, order)],
    )
    dag = transformer_dag(GPT2_SMALL, seq_len=1024, micro_batch=4, granularity="block")
    start = time.perf_counter()
    inferred_plan = op_fence(dag, topo, COST)
    plan_s = time.perf_counter() - start
    true_plan = op_fence(dag, truth, COST)
    really = estimate(dag, truth, inferred_plan.stages, COST).iteration_s
    # what the coordinator plans on: its MAX_PLAN_PEERS fastest peers
    fastest = sorted(np.argsort(-topo.speed, kind="stable")[:MAX_PLAN_PEERS].tolist())
    chosen = [topo.peer_ids[i] for i in fastest]
    narrow = op_fence(dag, topo.subset(chosen), COST)
    narrow_true = estimate(dag, truth.subset(chosen), narrow.stages, COST).iteration_s
    return {
        "coordinator_plan_true_s": narrow_true,
        "plan_s": plan_s,
        "inferred_plan_believed_s": inferred_plan.iteration_s,
        "inferred_plan_true_s": really,
        "true_plan_s": true_plan.iteration_s,
        "gap_vs_true_plan": really / true_plan.iteration_s - 1,
        "estimate_error": inferred_plan.iteration_s / really - 1,  # what it believed vs its true cost
        "stages": len(inferred_plan.stages),
    }


def ordered_ids(n: int, seed: int) -> tuple[list[RSAPrivateKey], list[str]]:
    keys = [new_key() for _ in range(n)]
    return keys, [peer_id_from_public_key(k.get_public_key().to_bytes()) for k in keys]


async def run_n(n: int, rounds: int, seed: int, storage: list[hivemind.DHT]) -> dict[str, Any]:
    net = synthetic_network(seed, n)
    start = time.perf_counter()
    keys, ids = ordered_ids(n, seed)
    keys_s = time.perf_counter() - start
    start = time.perf_counter()
    links = simulate_probes(net, ids, rounds, seed)
    probes_s = time.perf_counter() - start
    peers = peer_records(ids, net, get_dht_time())
    dht, read_peers, read_links = await dht_phase(keys, peers, links, storage)
    start = time.perf_counter()
    topo = Topology.from_records(list(read_peers.values()), vouched_links(read_links))
    topology_s = time.perf_counter() - start
    order = np.array([ids.index(pid) for pid in topo.peer_ids])
    row: dict[str, Any] = {"peers": n, "keys_s": keys_s, "probe_sim_s": probes_s, "links": len(links)}
    row.update(vars(dht))
    row["topology_s"] = topology_s
    row.update(inference_error(topo, net, order))
    row.update(plan_phase(topo, net, order))
    return row


def planner_only(n: int, seed: int) -> dict[str, Any]:
    net = synthetic_network(seed, n)
    ids = [f"QmSim{i:06d}" for i in range(n)]
    links = sampled_links(net, ids, seed)
    peers = peer_records(ids, net, 0.0)
    start = time.perf_counter()
    topo = Topology.from_records(peers, vouched_links(links))
    topology_s = time.perf_counter() - start
    order = np.arange(n)
    row: dict[str, Any] = {"peers": n, "links": len(links), "topology_s": topology_s}
    row.update(inference_error(topo, net, order))
    row.update(plan_phase(topo, net, order))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else "-"

    lines = [
        "| peers | links | publish peers / links (s) | view cold / warm (s) | complete | largest key | "
        "measured | inferred bw error med / p90 | topology (s) | OP-Fence (s) | plan vs true plan | "
        "its estimate vs its true cost | 16 fastest vs true plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        publish = (
            f"{r['publish_peers_s']:.1f} / {r['publish_links_s']:.1f}" if "publish_peers_s" in r else "-"
        )
        view = f"{r['view_s']:.2f} / {r['warm_view_s']:.2f}" if "view_s" in r else "-"
        largest = f"{r['largest_key_bytes'] / 1024:.1f} KiB" if "largest_key_bytes" in r else "-"
        complete = ("yes" if r["view_complete"] else "NO") if "view_complete" in r else "-"
        lines.append(
            f"| {r['peers']} | {r['links']} | {publish} | {view} | {complete} | {largest} | "
            f"{r['measured_fraction'] * 100:.1f}% | {r['median_rel_error'] * 100:.1f}% / "
            f"{r['p90_rel_error'] * 100:.1f}% | {cell(r, 'topology_s', '.2f')} | "
            f"{cell(r, 'plan_s', '.2f')} | "
            f"{r['gap_vs_true_plan'] * 100:+.1f}% | {r['estimate_error'] * 100:+.1f}% | "
            f"{(r['coordinator_plan_true_s'] / r['true_plan_s'] - 1) * 100:+.1f}% |"
        )
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    storage = [start_dht(initial_peers=[])]
    try:
        maddrs = [str(a) for a in storage[0].get_visible_maddrs()]
        storage += [start_dht(initial_peers=maddrs) for _ in range(2)]
        for n in args.peers:
            print(f"simulating {n} peers ...", flush=True)
            rows.append(await run_n(n, args.rounds, args.seed, storage))
            print(json.dumps(rows[-1], indent=None, default=float), flush=True)
    finally:
        for node in storage:
            node.shutdown()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="*", default=[100, 1000])
    parser.add_argument("--plan-peers", type=int, nargs="*", default=[10000])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = asyncio.run(main_async(args)) if args.peers else []
    for n in args.plan_peers:
        print(f"planning {n} peers from a synthetic graph ...", flush=True)
        rows.append(planner_only(n, args.seed))
        print(json.dumps(rows[-1], default=float), flush=True)
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1, default=float))
        args.json.with_suffix(".md").write_text(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
