"""The job side of the CLI: ``fusionp2p train`` and the coordinator part of ``status``.

fusionp2p train --config job.toml --initial-peers MADDR ...   train as this job's data owner
fusionp2p train --example-config                              a commented job file to start from
fusionp2p train --local 4 [--config job.toml]                 ... on a local swarm of 4 peers
fusionp2p train --config job.toml --resume ...                 go on from the job's latest checkpoint
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING, Any

from fusionp2p.errors import ConfigError
from fusionp2p.records import LeaseRecord, PeerRecord, PlanStageRecord, RunStatusRecord

if TYPE_CHECKING:
    from fusionp2p.opdag.families import ModelRegistry
    from fusionp2p.training.job_spec import JobSpec

__all__ = ["add_export_parser", "add_train_parser", "cmd_export", "cmd_train", "format_jobs", "format_runs"]


def add_train_parser(sub: Any, add_swarm_args: Any) -> None:
    """Registers ``train`` on the CLI's subparsers."""
    train = sub.add_parser(
        "train",
        help="train a model on the swarm as its data owner (the data never leaves this machine)",
    )
    add_swarm_args(train)
    train.add_argument("--config", metavar="TOML", help="the job file (see --example-config)")
    train.add_argument("--example-config", action="store_true", help="print a commented job file and exit")
    train.add_argument(
        "--local",
        type=int,
        default=0,
        metavar="N",
        help="start a local swarm of N peer processes on this machine for the job (a demo)",
    )
    train.add_argument(
        "--allow-model",
        action="append",
        default=[],
        metavar="MODULE:FACTORY",
        help="let the job's [model] family name this factory, importable here (repeatable); "
        "a job file may name only the built-in families otherwise",
    )
    train.add_argument("--steps", type=int, help="override the job's [train] steps")
    train.add_argument("--out-dir", help="override the job's [output] dir")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (metrics still written)")
    train.add_argument(
        "--resume",
        action="store_true",
        help="go on from the latest checkpoint of the job's newest run under its [output] dir "
        "(after this data owner was lost)",
    )


def add_export_parser(sub: Any, add_swarm_args: Any) -> None:
    """Registers ``export`` on the CLI's subparsers."""
    export = sub.add_parser(
        "export",
        help="write a run's weights from the shards its stages keep (a save_pretrained directory)",
    )
    add_swarm_args(export)
    export.add_argument(
        "run_dir", metavar="RUN_DIR", help="the run's directory (<[output] dir>/<name>/<run id>)"
    )
    export.add_argument("--out", required=True, metavar="DIR", help="where to write the weights")
    export.add_argument(
        "--allow-model", action="append", default=[], metavar="MODULE:FACTORY", help="as for train"
    )


def cmd_export(args: argparse.Namespace) -> int:
    """``fusionp2p export``: returns the exit code (errors propagate as FusionP2PError)."""
    from fusionp2p.opdag.families import ModelRegistry
    from fusionp2p.swarm import Swarm

    if not args.initial_peers:
        raise ConfigError("export reads the shards from the swarm: it needs --initial-peers MADDR")
    with Swarm(args.initial_peers, swarm=args.swarm) as swarm:
        swarm.export(args.run_dir, args.out, registry=ModelRegistry(allow=args.allow_model))
    return 0


def _load_job(args: argparse.Namespace) -> Any:
    from fusionp2p.training.job_spec import JobSpec

    job = JobSpec.load(args.config) if args.config else JobSpec(name="stdlib-gpt", min_peers=args.local or 1)
    changes: dict[str, Any] = {}
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.out_dir:
        changes["out_dir"] = args.out_dir
    try:
        return job.with_(**changes) if changes else job
    except ConfigError as e:
        raise ConfigError(f"command line: {e}") from e


def cmd_train(args: argparse.Namespace) -> int:
    """``fusionp2p train``: returns the exit code (errors propagate as FusionP2PError)."""
    from fusionp2p.training.job_spec import EXAMPLE_CONFIG

    if args.example_config:
        print(EXAMPLE_CONFIG, end="")
        return 0
    job = _load_job(args)
    from fusionp2p.opdag.families import ModelRegistry
    from fusionp2p.training.trainer import preflight

    registry = ModelRegistry(allow=args.allow_model)  # what the file names is data: nothing imported
    preflight(job, registry)
    if args.local < 0 or args.local > 16:
        raise ConfigError(f"--local takes 1-16 peers, got {args.local}")
    if not args.local and not args.initial_peers:
        raise ConfigError("train needs --initial-peers MADDR (printed by `fusionp2p peer`), or --local N")
    try:
        _train(args, job, registry)
    except KeyboardInterrupt:  # Ctrl-C: the peers left in order; say what is kept and how to go on
        print(f"\nfusionp2p train: interrupted. {_resume_hint(job)}", file=sys.stderr, flush=True)
        return 130
    return 0


def _resume_hint(job: JobSpec) -> str:
    """How to go on from the last checkpoint: the same command with ``--resume``."""
    argv = sys.argv[sys.argv.index("train") :] if "train" in sys.argv else ["train", "--config", "JOB.toml"]
    again = shlex.join(["fusionp2p", *(a for a in argv if a != "--resume"), "--resume"])
    every = f"every {job.checkpoint_every} steps" if job.checkpoint_every else "at the automatic period"
    return (
        f"The run keeps its last checkpoint (taken {every}) under {job.out_dir}; "
        f"go on from it with:\n  {again}"
    )


def _train(args: argparse.Namespace, job: JobSpec, registry: ModelRegistry) -> None:
    from fusionp2p.swarm import Swarm

    if args.local:
        from fusionp2p.launch import LocalSwarm

        print(f"starting a local swarm of {args.local} peers on loopback...", flush=True)
        job = job.with_(weights="gather")  # the local peers, and the shards they keep, end with the command
        fast = ["--heartbeat", "2", "--record-ttl", "10", "--probe-period", "3", "--lease-seconds", "6"]
        with (
            LocalSwarm(args.local, peer_args=[fast] * args.local, log_level="warning") as local,
            Swarm(local.initial_peers, swarm=local.swarm) as swarm,
        ):
            swarm.train(job, progress=not args.no_progress, resume=args.resume, registry=registry)
        print("the local swarm stopped; no peer process is left.")
        return
    with Swarm(args.initial_peers, swarm=args.swarm, site=args.site) as swarm:
        swarm.train(job, progress=not args.no_progress, resume=args.resume, registry=registry)


def format_jobs(
    lease: LeaseRecord | None,
    plans: dict[tuple[str, int, str], list[PlanStageRecord]],
    peers: list[PeerRecord],
    now: float,
) -> str:
    """The coordinator and its epoch, then each job's plan with each stage's state and last
    measured compute time."""
    if lease is None:
        rows = ["coordinator: none (no peer holds the lease)"]
    else:
        rows = [
            f"coordinator: {lease.holder[-8:]} (epoch {lease.epoch}, since {now - lease.granted_at:.0f} s, "
            f"lease valid {lease.valid_until - now:.0f} s more)"
        ]
    by_id = {p.peer_id: p for p in peers}
    current = {
        (job, e, by) for job, e, by in plans if lease is not None and (e, by) == (lease.epoch, lease.holder)
    }
    shown = sorted(plans, key=lambda k: (k not in current, k[0], -k[1]))
    rows.append(f"{len(plans)} planned job(s)" + (":" if plans else ""))
    for key in shown[:20]:
        job, epoch, by = key
        stages = plans[key]
        flag = "" if key in current else "  (older epoch or coordinator: not in force)"
        owner = stages[0].data_owner[-8:] if stages[0].data_owner else "?"
        replica = f", replica {stages[0].replica} of {stages[0].replicas}" if stages[0].replicas > 1 else ""
        rows.append(
            f"  job {job}: epoch {epoch} by {by[-8:]}, data owner {owner}, "
            f"{len(stages)} stage(s){replica}{flag}"
        )
        for r in stages:
            peer = by_id.get(r.peer_id)
            state = peer.state if peer is not None else "gone"
            took = (
                f"{peer.stage_s:.2f} s/step" if peer is not None and peer.job == job and peer.stage_s else "-"
            )
            n_nodes = sum(e - s for s, e in zip(r.node_ranges[::2], r.node_ranges[1::2], strict=True))
            ratios = ", ".join(
                f"->{b} " + ("dense" if v <= 1 else f"Top-K 1/{v:.0f}") for b, v in sorted(r.links_to.items())
            )
            averaging = f"  averaging ~{r.averaging_s * 1e3:.0f} ms" if r.averaging_s else ""
            averaging += f" in {r.averaging_codec}" if r.averaging_s and r.averaging_codec != "none" else ""
            rows.append(
                f"    stage {r.stage} {r.peer_id[-8:]} {state:<8} {n_nodes:>4} nodes  {took:>12}  "
                f"{ratios}{averaging}"
            )
    return "\n".join(rows)


def format_runs(runs: list[RunStatusRecord], now: float) -> str:
    """Each training run as its data owner last reported it: progress, plan, newest events."""
    rows = [f"{len(runs)} training run(s)" + (":" if runs else "")]
    for r in runs[:20]:
        rows.append(
            f"  run {r.run_id}: step {r.step}/{r.steps}, loss {r.loss:.3f}, plan v{r.plan_version} "
            f"(job {r.job}, epoch {r.epoch}), {r.replans} re-plan(s), data owner {r.data_owner[-8:]}, "
            + (f"{r.samples_per_s:.1f} samples/s, " if r.samples_per_s else "")
            + (f"{r.replicas} replicas (averaging {r.averaging_s:.2f} s), " if r.replicas > 1 else "")
            + f"reported {max(0.0, now - r.updated_at):.0f} s ago"
        )
        rows += [f"    {event}" for event in r.events]
    return "\n".join(rows)
