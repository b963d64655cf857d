"""The swarm side of the CLI: ``status``, ``plan`` and ``local``.

fusionp2p status --initial-peers MADDR ... [--json]     peers, links, the coordinator, runs
fusionp2p plan   --swarm-file status.json [--model ...] an offline OP-Fence plan of a swarm
fusionp2p local  [--peers N] [--duration S]             a local swarm on this machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import unicodedata
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from fusionp2p.cli_jobs import format_jobs, format_runs
from fusionp2p.errors import ConfigError, FusionP2PError
from fusionp2p.records import LinkRecord, PeerRecord

if TYPE_CHECKING:
    from fusionp2p.launch import LocalSwarm

__all__ = [
    "cmd_local",
    "cmd_plan",
    "cmd_status",
    "format_status",
    "load_swarm_file",
    "printable",
    "status_json",
]


# -- status -------------------------------------------------------------------------------


def _short(peer_id: str) -> str:
    return peer_id[-8:]


def format_status(peers: list[PeerRecord], links: list[LinkRecord], now: float) -> str:
    """Human-readable tables of peers and of the bandwidth/RTT matrix."""
    rows = [
        f"{len(peers)} live peer(s)",
        f"{'PEER':<10} {'DEVICE':<8} {'NAME':<16} {'GFLOP/s':>9} {'FREE MEM':>10} {'AGE':>6} "
        f"{'STATE':<8} SITE",
    ]
    for p in peers:
        rows.append(
            f"{_short(p.peer_id):<10} {p.device:<8} {p.device_name[:16]:<16} "
            f"{p.fp32_flops / 1e9:>9.1f} {p.memory_bytes / 2**30:>7.1f} GiB "
            f"{now - p.started_at:>5.0f}s {p.state:<8} {p.site[:16] or '-'}"
        )
    ids = [p.peer_id for p in peers]
    table = {(lk.src, lk.dst): lk for lk in links}
    rows += [
        "",
        f"{len(links)} measured link(s): MB/s / RTT ms, row = sender, column = receiver",
        f"{'':<10} " + " ".join(f"{_short(i):>16}" for i in ids),
    ]
    for src in ids:
        cells = []
        for dst in ids:
            lk = table.get((src, dst))
            cells.append(
                f"{'-' if src == dst else '?':>16}"
                if lk is None
                else f"{f'{lk.bandwidth_bytes_per_s / 1e6:.1f} / {lk.rtt_s * 1e3:.2f}':>16}"
            )
        rows.append(f"{_short(src):<10} " + " ".join(cells))
    return "\n".join(rows)


def status_json(swarm: str, peers: list[PeerRecord], links: list[LinkRecord], now: float) -> dict:
    """The ``status --json`` document (also accepted later as a swarm file by the planner)."""
    return {
        "swarm": swarm,
        "at": now,
        "peers": [asdict(p) for p in peers],
        "links": [asdict(lk) for lk in links],
    }


_R = TypeVar("_R")


def _printable_text(text: str) -> str:
    """``text`` without control or format characters (escape sequences, newlines, bidi
    overrides): what a peer wrote cannot redraw or forge a line of this terminal."""
    return "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf"))


def printable(record: _R) -> _R:
    """``record`` with every string field (and every string of a tuple field) printable."""
    changes: dict[str, object] = {}
    for f in dataclasses.fields(record):  # type: ignore[arg-type]
        value = getattr(record, f.name)
        if isinstance(value, str):
            changes[f.name] = _printable_text(value)
        elif isinstance(value, tuple) and all(isinstance(v, str) for v in value):
            changes[f.name] = tuple(_printable_text(v) for v in value)
    return dataclasses.replace(record, **changes)  # type: ignore[type-var]


def cmd_status(args: argparse.Namespace) -> int:
    from hivemind.utils import get_dht_time

    from fusionp2p.swarm import Swarm

    with Swarm(args.initial_peers, swarm=args.swarm) as swarm:
        peers, links = swarm.peers(), swarm.links()
        lease, plans, runs = swarm.coordinator(), swarm.jobs(), swarm.runs()
    now = get_dht_time()
    if not args.json:  # JSON escapes what a peer wrote; a terminal must not run it
        peers, runs = [printable(p) for p in peers], [printable(r) for r in runs]
        plans = {key: [printable(r) for r in records] for key, records in plans.items()}
        lease = printable(lease) if lease is not None else None
    if args.json:
        doc = status_json(args.swarm, peers, links, now)
        doc["coordinator"] = asdict(lease) if lease is not None else None
        doc["jobs"] = [
            {"job": job, "epoch": epoch, "coordinator": by, "stages": [asdict(r) for r in stages]}
            for (job, epoch, by), stages in sorted(plans.items())
        ]
        doc["runs"] = [asdict(r) for r in runs]
        print(json.dumps(doc, indent=2))
    else:
        print(format_status(peers, links, now))
        print()
        print(format_jobs(lease, plans, peers, now))
        print()
        print(format_runs(runs, now))
    if not peers:
        print(_no_peers_hint(args.swarm), file=sys.stderr)
        return 1
    return 0


def _no_peers_hint(swarm: str) -> str:
    return (
        f"no live peer in swarm {swarm!r}: peers of other swarms are invisible, so check --swarm "
        "(every peer and client of one swarm must give the same name) and --initial-peers"
    )


# -- plan ---------------------------------------------------------------------------------


def load_swarm_file(path: str) -> tuple[list[PeerRecord], list[LinkRecord]]:
    """Peers and links from a ``status --json`` document.

    Raises:
        FusionP2PError: unreadable file or invalid records (the message names which).
    """
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise FusionP2PError(f"cannot read swarm file {path}: {e}") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("peers"), list):
        raise FusionP2PError(
            f"swarm file {path}: needs a 'peers' list (the output of `fusionp2p status --json`)"
        )
    if not isinstance(doc.get("links", []), list):
        raise FusionP2PError(f"swarm file {path}: 'links' must be a list of link records")
    records: list[tuple[str, int, dict]] = [("peers", i, p) for i, p in enumerate(doc["peers"])]
    records += [("links", i, lk) for i, lk in enumerate(doc.get("links", []))]
    peers, links = [], []
    for field_name, i, body in records:
        try:
            if not isinstance(body, dict):
                raise TypeError("not an object")
            if field_name == "peers":
                peers.append(PeerRecord.from_dict(body))
            else:
                links.append(LinkRecord.from_dict(body))
        except (ValueError, KeyError, TypeError) as e:
            raise FusionP2PError(f"swarm file {path}: {field_name}[{i}] is not a valid record: {e}") from e
    return peers, links


def cmd_plan(args: argparse.Namespace) -> int:
    from fusionp2p.opdag.offline import OfflineModel, offline_dag
    from fusionp2p.planning import (
        BASELINES,
        CompressionPolicy,
        CostConfig,
        Topology,
        baseline_plan,
        op_fence,
    )

    if args.png:
        folder = Path(args.png).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"--png: cannot write into {folder} (no such writable directory)")
    peers, links = load_swarm_file(args.swarm_file)
    try:
        overrides = json.loads(args.model_config)
    except ValueError as e:
        raise ConfigError(f"--model-config is not JSON: {e}") from e
    if not isinstance(overrides, dict):
        raise ConfigError("--model-config must be a JSON object of config keys")
    model = OfflineModel(
        args.model,
        overrides,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        granularity=args.granularity,
        image_size=args.image_size,
        channels=args.channels,
        trace=args.trace,
    )
    dag = offline_dag(model)
    cost = CostConfig(n_micro_batches=args.n_micro_batches, compression=CompressionPolicy(ratio=args.ratio))
    topo = Topology.from_records(peers, links)
    start = time.perf_counter()
    plan = op_fence(dag, topo, cost, clustering=args.clustering)
    took = time.perf_counter() - start
    if args.json:
        records = plan.to_records(plan_id="offline", epoch=0, made_by="offline", made_at=0.0)
        print(json.dumps([asdict(r) for r in records], indent=2))
    else:
        print(
            f"{dag.name}: {len(dag)} nodes, {dag.total_param_bytes / 4 / 1e6:.0f}M parameters (tied counted "
            f"per user), {dag.total_fwd_flops / 1e9:.1f} GFLOP forward per micro-batch"
        )
        print(f"{len(topo)} peers in {len(plan.clusters)} bandwidth cluster(s); planned in {took:.2f} s\n")
        print(plan.describe(dag))
        print(f"\n{'PLAN':<28} {'ITERATION s':>12} {'vs OP-Fence':>12}")
        print(f"{'op-fence':<28} {plan.iteration_s:>12.3f} {'1.00x':>12}")
        for name in BASELINES:
            for kind in ("none", "uniform", "adaptive"):
                other = baseline_plan(name, dag, topo, cost, kind)
                t = other.iteration_s
                rel = f"{t / plan.iteration_s:.2f}x" if math.isfinite(t) else "no fit"
                print(f"{other.method:<28} {t:>12.3f} {rel:>12}")
    if args.png:
        from fusionp2p.viz import draw_plan

        draw_plan(plan, topo, args.png)
        print(f"\nwrote {args.png}", file=sys.stderr)
    return 0


# -- local --------------------------------------------------------------------------------


def cmd_local(args: argparse.Namespace) -> int:
    from fusionp2p.launch import LocalSwarm

    n = args.peers
    print(f"starting a local swarm of {n} peers on loopback...", flush=True)
    fast = ["--heartbeat", "2", "--record-ttl", "10", "--probe-period", "3"]
    interrupted = False
    with LocalSwarm(n, peer_args=[fast] * n, log_level="warning") as local:
        try:
            _watch_local(local, n, args)
        except KeyboardInterrupt:  # Ctrl-C: the peers still leave in order, and we say so
            interrupted = True
            print("\ninterrupted (Ctrl-C)", flush=True)
        print("\nstopping the local swarm...", flush=True)
    print("done: every peer left and no process is left behind.", flush=True)
    return 130 if interrupted else 0


def _watch_local(local: LocalSwarm, n: int, args: argparse.Namespace) -> None:
    """Waits until the local swarm's peers and links are all visible, shows them, and keeps
    it up for ``--duration`` seconds."""
    from hivemind.utils import get_dht_time

    from fusionp2p.swarm import Swarm

    print(f"all {n} peers joined; swarm address: {' '.join(local.initial_peers)}", flush=True)
    with Swarm(local.initial_peers, swarm=local.swarm) as swarm:
        deadline = time.monotonic() + args.timeout
        while True:
            peers, links = swarm.peers(), swarm.links()
            print(
                f"\r  {len(peers)}/{n} peers visible, {len(links)}/{n * (n - 1)} links measured",
                end="",
                flush=True,
            )
            if len(peers) == n and len(links) == n * (n - 1):
                break
            if time.monotonic() > deadline:
                print()
                raise FusionP2PError(
                    f"the local swarm did not form within {args.timeout} s; peer logs are in {local.workdir}"
                )
            time.sleep(1.0)
        print("\n")
        print(format_status(peers, links, get_dht_time()), flush=True)
        if args.duration > 0:
            print(f"\nkeeping the swarm up for {args.duration:.0f} s (Ctrl-C to stop)...", flush=True)
            time.sleep(args.duration)
