"""The thin CLI: parse -> config -> object -> run; signals handled, shutdown in ``finally``.

fusionp2p peer   [--initial-peers MADDR ...] [--identity PATH] [--device cpu|cuda:N] ...
fusionp2p status --initial-peers MADDR ... [--json]
fusionp2p train  --config job.toml --initial-peers MADDR ...   (or --local N; --example-config)
fusionp2p local  [--peers N] [--duration S]      a local swarm on this machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from fusionp2p import __version__
from fusionp2p.cli_jobs import add_train_parser, cmd_train, format_jobs, format_runs
from fusionp2p.config import DEFAULT_SWARM, ExecLimits, PeerConfig, ProbeConfig, parse_bytes
from fusionp2p.errors import ConfigError, FusionP2PError
from fusionp2p.opdag.families import BUILTIN_FAMILIES
from fusionp2p.records import LinkRecord, PeerRecord

if TYPE_CHECKING:
    from fusionp2p.launch import LocalSwarm

__all__ = ["main"]

logger = logging.getLogger("fusionp2p.cli")


def _add_swarm_args(parser: argparse.ArgumentParser, *, site: bool = True) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddrs of live peers (printed by `fusionp2p peer`)",
    )
    parser.add_argument("--swarm", default=DEFAULT_SWARM, help="swarm name (default: %(default)s)")
    if site:  # for the processes that publish themselves: a peer, a data owner
        parser.add_argument(
            "--site",
            default="",
            help="the data centre this machine is in: machines of one site share its links to other "
            "sites, and the planner counts those transfers together (default: none, every link its own)",
        )


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except FusionP2PError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DESCRIPTION = (
    "fusionp2p: train one model on many peers' GPUs and CPUs over a libp2p swarm "
    "(run a peer, observe a swarm, plan, or train a job as its data owner)"
)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The CLI's parser and, by name, each subcommand's own parser."""
    parser = argparse.ArgumentParser(prog="fusionp2p", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"fusionp2p {__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    peer = sub.add_parser("peer", help="join (or start) a swarm and serve until SIGINT/SIGTERM")
    _add_swarm_args(peer)
    peer.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/127.0.0.1/tcp/0"],
        metavar="MADDR",
        help="where to listen; use /ip4/0.0.0.0/tcp/PORT to accept other machines (default: loopback only)",
    )
    peer.add_argument(
        "--announce-maddrs",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="addresses other peers should dial (public IP behind NAT)",
    )
    peer.add_argument(
        "--identity", metavar="PATH", help="identity key file (created if missing) for a stable PeerID"
    )
    peer.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda[:N], or auto (a GPU when there is one) (default: %(default)s)",
    )
    peer.add_argument("--flops", type=float, help="declared fp32 FLOP/s instead of measuring")
    peer.add_argument(
        "--emulated-speed",
        type=float,
        default=1.0,
        metavar="F",
        help="testbeds: profile and compute as a device F times as fast as this one, F in (0, 1] "
        "(each piece of work is followed by a sleep; default: %(default)s)",
    )
    peer.add_argument(
        "--upload-limit-mbps", type=float, help="cap this peer's outgoing stream traffic (Mbit/s)"
    )
    peer.add_argument("--heartbeat", type=float, default=5.0, help="seconds between refreshes")
    peer.add_argument(
        "--record-ttl", type=float, default=20.0, help="seconds a record lives without a heartbeat"
    )
    peer.add_argument("--probe-period", type=float, default=10.0, help="seconds between link probe rounds")
    peer.add_argument("--probe-fanout", type=int, default=3, help="peers probed per round")
    peer.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="leave the swarm when the process that started this peer dies",
    )
    peer.add_argument(
        "--ready-file", metavar="PATH", help="write {peer_id, multiaddrs, pid} as JSON here once joined"
    )
    jobs = peer.add_argument_group("what this peer runs for others (docs/SECURITY.md)")
    jobs.add_argument(
        "--allow-model",
        action="append",
        default=[],
        metavar="MODULE:FACTORY",
        help="also serve this model factory, importable here (repeatable); built in: "
        + ", ".join(f.name for f in BUILTIN_FAMILIES),
    )
    jobs.add_argument(
        "--max-memory",
        type=_size,
        metavar="SIZE",
        help="the most memory one stage may need, e.g. 8GiB (default: 80%% of free memory at setup)",
    )
    jobs.add_argument("--max-jobs", type=int, default=1, help="jobs served at once (default: %(default)s)")
    jobs.add_argument(
        "--accept-jobs-from",
        action="append",
        default=[],
        metavar="PEER_ID",
        help="take jobs only from these peers (repeatable): a private swarm",
    )
    jobs.add_argument(
        "--max-inbound-memory",
        type=_size,
        default=ExecLimits().inbound_bytes,
        metavar="SIZE",
        help="message bodies held from all peers at once (default: 1GiB)",
    )
    jobs.add_argument(
        "--no-coordinator",
        action="store_true",
        help="never stand for coordinator election (the coordinator plans everyone's jobs)",
    )
    jobs.add_argument(
        "--lease-seconds",
        type=float,
        default=15.0,
        metavar="S",
        help="coordinator lease period; a dead coordinator is replaced within 3 (default: %(default)s)",
    )
    jobs.add_argument(
        "--job-idle-timeout",
        type=float,
        default=ExecLimits().job_idle_timeout,
        metavar="S",
        help="free a job whose owner sent nothing for this long (default: %(default)s s)",
    )

    status = sub.add_parser("status", help="print a swarm's live peers and measured links")
    _add_swarm_args(status, site=False)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    add_train_parser(sub, _add_swarm_args)

    plan = sub.add_parser("plan", help="plan a model on a swarm file and compare with the baselines")
    plan.add_argument("--swarm-file", required=True, help="`fusionp2p status --json` output (or same shape)")
    plan.add_argument("--model", default="gpt2", help="model family: gpt2 or llama (default: %(default)s)")
    plan.add_argument(
        "--model-config", default="{}", help="JSON overrides of the model config, e.g. '{\"n_layer\": 24}'"
    )
    plan.add_argument("--seq-len", type=int, default=1024)
    plan.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    plan.add_argument("--n-micro-batches", type=int, default=8, help="micro-batches per iteration (n_b)")
    plan.add_argument("--ratio", type=float, default=100.0, help="user Top-K ratio (adaptive per link)")
    plan.add_argument("--granularity", choices=["block", "sublayer"], default="block")
    plan.add_argument("--clustering", choices=["leiden", "louvain"], default="leiden")
    plan.add_argument("--png", help="draw the clustered bandwidth graph with each peer's stage here")
    plan.add_argument("--json", action="store_true", help="print the plan's stage records as JSON")

    local = sub.add_parser("local", help="run a local swarm of peer processes and show it")
    local.add_argument("--peers", type=int, default=3, help="number of peers (default: 3)")
    local.add_argument(
        "--duration",
        type=float,
        default=0.0,
        help="keep the swarm this many seconds after it formed (default: 0)",
    )
    local.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="give up if the swarm has not formed within this many seconds",
    )
    return parser, dict(sub.choices)


# -- peer ---------------------------------------------------------------------------------


async def _watch_parent(stop: asyncio.Event) -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.5)
    logger.warning("the process that started this peer is gone; leaving")
    stop.set()


async def _run_peer(config: PeerConfig, ready_file: str | None, exit_with_parent: bool) -> None:
    from fusionp2p.peer import Peer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(_watch_parent(stop)) if exit_with_parent else None
    peer = await Peer.create(config)
    try:
        maddrs = peer.multiaddrs
        flops = peer.profile.flops["float32"] / 1e9
        print(
            f"fusionp2p peer {peer.peer_id} joined swarm {config.swarm!r} "
            f"({peer.profile.device}, {flops:.1f} GFLOP/s fp32)",
            flush=True,
        )
        print("To join this swarm from another machine, run:", flush=True)
        print(f"  fusionp2p peer --swarm {config.swarm} --initial-peers {' '.join(maddrs)}", flush=True)
        if ready_file:
            tmp = Path(ready_file + ".tmp")
            tmp.write_text(json.dumps({"peer_id": peer.peer_id, "multiaddrs": maddrs, "pid": os.getpid()}))
            tmp.replace(ready_file)
        await stop.wait()
        logger.info("leaving swarm %r", config.swarm)
    finally:
        if watcher is not None:
            watcher.cancel()
        await peer.aclose()


def _cmd_peer(args: argparse.Namespace) -> int:
    config = PeerConfig(
        swarm=args.swarm,
        initial_peers=tuple(args.initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=args.identity,
        device=args.device,
        flops_override=args.flops,
        emulated_speed=args.emulated_speed,
        upload_limit_mbps=args.upload_limit_mbps,
        site=args.site,
        heartbeat=args.heartbeat,
        record_ttl=args.record_ttl,
        probe=ProbeConfig(period=args.probe_period, fanout=args.probe_fanout),
        allow_models=tuple(args.allow_model),
        max_memory_bytes=args.max_memory,
        max_jobs=args.max_jobs,
        accept_jobs_from=tuple(args.accept_jobs_from),
        coordinator=not args.no_coordinator,
        lease_seconds=args.lease_seconds,
        exec_limits=ExecLimits(
            inbound_bytes=args.max_inbound_memory,
            inbound_bytes_per_peer=min(args.max_inbound_memory, ExecLimits().inbound_bytes_per_peer),
            job_idle_timeout=args.job_idle_timeout,
        ),
    )
    import uvloop

    uvloop.run(_run_peer(config, args.ready_file, args.exit_with_parent))
    return 0


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


def _cmd_status(args: argparse.Namespace) -> int:
    from hivemind.utils import get_dht_time

    from fusionp2p.swarm import Swarm

    with Swarm(args.initial_peers, swarm=args.swarm) as swarm:
        peers, links = swarm.peers(), swarm.links()
        lease, plans, runs = swarm.coordinator(), swarm.jobs(), swarm.runs()
    now = get_dht_time()
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
    return 0


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


def _cmd_plan(args: argparse.Namespace) -> int:
    from fusionp2p.opdag import TransformerShape, transformer_dag
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
    import transformers

    try:
        known = set(transformers.AutoConfig.for_model(args.model).to_dict())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--model: unknown model type {args.model!r}") from e
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(
            f"--model-config: {args.model} has no config key {unknown[0]!r}; "
            f"known keys: {', '.join(sorted(known))}"
        )
    try:
        hf_config = transformers.AutoConfig.for_model(args.model, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--model-config: a bad value for {args.model}: {e}") from e
    shape = TransformerShape.from_hf_config(hf_config)
    dag = transformer_dag(
        shape, seq_len=args.seq_len, micro_batch=args.micro_batch, granularity=args.granularity
    )
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
            f"per user), {dag.total_fwd_flops / 1e12:.2f} TFLOP forward per micro-batch"
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


def _cmd_local(args: argparse.Namespace) -> int:
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fusionp2p`` console script."""
    parser, subcommands = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand whose options these are not, with its own usage
        subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handlers = {
        "peer": _cmd_peer,
        "status": _cmd_status,
        "plan": _cmd_plan,
        "local": _cmd_local,
        "train": cmd_train,
    }
    try:
        return handlers[args.command](args)
    except FusionP2PError as e:
        print(f"fusionp2p {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
