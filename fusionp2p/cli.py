"""The thin CLI: parse -> config -> object -> run; signals handled, shutdown in ``finally``.

fusionp2p peer   [--initial-peers MADDR ...] [--identity PATH] [--device cpu|cuda:N] ...
fusionp2p status --initial-peers MADDR ... [--json]                 (cli_swarm.py)
fusionp2p plan   --swarm-file status.json ...                       (cli_swarm.py)
fusionp2p train  --config job.toml --initial-peers MADDR ...        (cli_jobs.py)
fusionp2p local  [--peers N] [--duration S]      a local swarm on this machine (cli_swarm.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path

from fusionp2p.cli_jobs import add_export_parser, add_train_parser, cmd_export, cmd_train
from fusionp2p.cli_swarm import cmd_local, cmd_plan, cmd_status
from fusionp2p.config import DEFAULT_SWARM, ExecLimits, PeerConfig, ProbeConfig, TraceBudget, parse_bytes
from fusionp2p.errors import ConfigError, FusionP2PError
from fusionp2p.opdag.families import BUILTIN_FAMILIES
from fusionp2p.version import __version__

__all__ = ["main"]

logger = logging.getLogger("fusionp2p.cli")
_PEER = PeerConfig()  # the defaults every flag of `fusionp2p peer` shows


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
        default=list(_PEER.host_maddrs),
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
        "--checkpoint-dir",
        metavar="DIR",
        help="where this peer keeps its stages' checkpoint shards and replicas of others' "
        "(default: ~/.cache/fusionp2p/shards/<PeerID>)",
    )
    peer.add_argument(
        "--weights-dir",
        metavar="DIR",
        help="pretrained models (save_pretrained directories) this peer has: a stage loads its "
        "tensors from here, checked against the data owner's digests, instead of receiving them",
    )
    peer.add_argument(
        "--device",
        default=_PEER.device,
        help="cpu, cuda[:N], or auto (a GPU when there is one) (default: %(default)s)",
    )
    peer.add_argument("--flops", type=float, help="declared fp32 FLOP/s instead of measuring")
    peer.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the device again instead of using its cached profile (re-measured anyway "
        "after 7 days, or when a quick check runs 4x as fast as the cache says)",
    )
    peer.add_argument(
        "--emulated-speed",
        type=float,
        default=_PEER.emulated_speed,
        metavar="F",
        help="testbeds: profile and compute as a device F times as fast as this one, F in (0, 1] "
        "(each piece of work is followed by a sleep; default: %(default)s)",
    )
    peer.add_argument(
        "--upload-limit-mbps", type=float, help="cap this peer's outgoing stream traffic (Mbit/s)"
    )
    peer.add_argument("--heartbeat", type=float, default=_PEER.heartbeat, help="seconds between refreshes")
    peer.add_argument(
        "--record-ttl",
        type=float,
        default=_PEER.record_ttl,
        help="seconds a record lives without a heartbeat",
    )
    peer.add_argument(
        "--probe-period", type=float, default=_PEER.probe.period, help="seconds between link probe rounds"
    )
    peer.add_argument("--probe-fanout", type=int, default=_PEER.probe.fanout, help="peers probed per round")
    peer.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="leave the swarm when the process that started this peer dies",
    )
    peer.add_argument(
        "--ready-file", metavar="PATH", help="write {peer_id, multiaddrs, pid} as JSON here once joined"
    )
    jobs = peer.add_argument_group("what this peer runs for others (docs/security.md)")
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
    jobs.add_argument(
        "--max-jobs", type=int, default=_PEER.max_jobs, help="jobs served at once (default: %(default)s)"
    )
    jobs.add_argument(
        "--accept-jobs-from",
        action="append",
        default=[],
        metavar="PEER_ID",
        help="take jobs only from these peers (repeatable): a private swarm",
    )
    jobs.add_argument(
        "--accept-unplanned-from",
        action="append",
        default=[],
        metavar="PEER_ID",
        help="take jobs no coordinator planned from these peers too (repeatable); while the swarm "
        "has a coordinator, others' unplanned jobs are refused",
    )
    jobs.add_argument(
        "--max-inbound-memory",
        type=_size,
        default=_PEER.exec_limits.inbound_bytes,
        metavar="SIZE",
        help="message bodies held from all peers at once (default: 1GiB)",
    )
    jobs.add_argument(
        "--no-coordinator",
        action="store_true",
        help="never stand for coordinator election (the coordinator plans everyone's jobs)",
    )
    jobs.add_argument(
        "--coordinators",
        action="append",
        default=[],
        metavar="PEER_ID",
        help="accept the coordinator lease only from these peers (repeatable): a private swarm; "
        "a peer not in the list does not stand for election",
    )
    jobs.add_argument(
        "--lease-seconds",
        type=float,
        default=_PEER.lease_seconds,
        metavar="S",
        help="coordinator lease period; a dead coordinator is replaced within 3 (default: %(default)s)",
    )
    jobs.add_argument(
        "--coordinator-trace-seconds",
        type=float,
        default=_PEER.trace_budget.seconds,
        metavar="S",
        help="as coordinator, refuse a job whose trace takes more CPU seconds (default: %(default)s)",
    )
    jobs.add_argument(
        "--coordinator-max-model",
        type=_size,
        default=_PEER.trace_budget.max_model_bytes,
        metavar="SIZE",
        help="as coordinator, refuse a job whose model's parameters are larger, e.g. 8GiB (default: 64GiB)",
    )
    jobs.add_argument(
        "--job-idle-timeout",
        type=float,
        default=_PEER.exec_limits.job_idle_timeout,
        metavar="S",
        help="free a job whose owner sent nothing for this long (default: %(default)s s)",
    )

    status = sub.add_parser("status", help="print a swarm's live peers and measured links")
    _add_swarm_args(status, site=False)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    add_train_parser(sub, _add_swarm_args)
    add_export_parser(sub, _add_swarm_args)

    plan = sub.add_parser("plan", help="plan a model on a swarm file and compare with the baselines")
    plan.add_argument("--swarm-file", required=True, help="`fusionp2p status --json` output (or same shape)")
    plan.add_argument(
        "--model",
        default="gpt2",
        help="a model family: gpt2, llama (analytic OP-DAGs), mistral, qwen2, gpt_neox, resnet, "
        "digits-cnn (traced without allocating), or package.module:factory (default: %(default)s)",
    )
    plan.add_argument(
        "--trace", action="store_true", help="trace gpt2/llama too, instead of their analytic OP-DAG"
    )
    plan.add_argument(
        "--model-config", default="{}", help="JSON overrides of the model config, e.g. '{\"n_layer\": 24}'"
    )
    plan.add_argument("--seq-len", type=int, default=1024)
    plan.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    plan.add_argument("--n-micro-batches", type=int, default=8, help="micro-batches per iteration (n_b)")
    plan.add_argument("--ratio", type=float, default=100.0, help="user Top-K ratio (adaptive per link)")
    plan.add_argument(
        "--granularity",
        choices=["block", "sublayer"],
        default="block",
        help="nodes of the analytic gpt2/llama OP-DAG (a traced one has one node per operator)",
    )
    plan.add_argument("--image-size", type=int, default=32, help="image families: pixels a side")
    plan.add_argument("--channels", type=int, default=3, help="image families: channels per pixel")
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


def join_hint(swarm: str, maddrs: list[str]) -> list[str]:
    """What a peer prints about joining it: the command for another machine, or, when it
    listens on loopback only, for this machine and how to open it to others."""
    command = f"  fusionp2p peer --swarm {swarm} --initial-peers {' '.join(maddrs)}"
    if any(not m.startswith(("/ip4/127.", "/ip6/::1/")) for m in maddrs):
        return ["To join this swarm from another machine, run:", command]
    return [
        "This peer listens on loopback only. To join it from this machine, run:",
        command,
        "To let other machines join, start it with --host-maddrs /ip4/0.0.0.0/tcp/PORT "
        "(and --announce-maddrs /ip4/PUBLIC_IP/tcp/PORT behind NAT).",
    ]


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
        for line in join_hint(config.swarm, maddrs):
            print(line, flush=True)
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


_FLAG_OF = {"flops_override": "--flops", "allow_models": "--allow-model", "coordinator": "--no-coordinator"}


def _as_flags(message: str) -> str:
    """A PeerConfig error in the words of the command line: ``--host-maddrs``, not
    ``PeerConfig.host_maddrs``."""
    return re.sub(r"PeerConfig\.(\w+)", lambda m: _FLAG_OF.get(m[1], "--" + m[1].replace("_", "-")), message)


def _cmd_peer(args: argparse.Namespace) -> int:
    import uvloop

    try:
        config = _peer_config(args)
        uvloop.run(_run_peer(config, args.ready_file, args.exit_with_parent))
    except ConfigError as e:  # the config's, or one found as the peer starts (a port in use)
        raise ConfigError(_as_flags(str(e))) from None
    return 0


def _peer_config(args: argparse.Namespace) -> PeerConfig:
    return PeerConfig(
        swarm=args.swarm,
        initial_peers=tuple(args.initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=args.identity,
        device=args.device,
        flops_override=args.flops,
        emulated_speed=args.emulated_speed,
        reprofile=args.reprofile,
        upload_limit_mbps=args.upload_limit_mbps,
        site=args.site,
        heartbeat=args.heartbeat,
        record_ttl=args.record_ttl,
        probe=ProbeConfig(period=args.probe_period, fanout=args.probe_fanout),
        allow_models=tuple(args.allow_model),
        max_memory_bytes=args.max_memory,
        max_jobs=args.max_jobs,
        checkpoint_dir=args.checkpoint_dir,
        weights_dir=args.weights_dir,
        accept_jobs_from=tuple(args.accept_jobs_from),
        accept_unplanned_from=tuple(args.accept_unplanned_from),
        coordinator=not args.no_coordinator,
        coordinators=tuple(args.coordinators),
        lease_seconds=args.lease_seconds,
        trace_budget=TraceBudget(
            seconds=args.coordinator_trace_seconds, max_model_bytes=args.coordinator_max_model
        ),
        exec_limits=ExecLimits(
            inbound_bytes=args.max_inbound_memory,
            inbound_bytes_per_peer=min(args.max_inbound_memory, _PEER.exec_limits.inbound_bytes_per_peer),
            job_idle_timeout=args.job_idle_timeout,
        ),
    )


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
        "status": cmd_status,
        "plan": cmd_plan,
        "local": cmd_local,
        "train": cmd_train,
        "export": cmd_export,
    }
    try:
        return handlers[args.command](args)
    except FusionP2PError as e:
        print(f"fusionp2p {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
