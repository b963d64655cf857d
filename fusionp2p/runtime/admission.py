"""Who may send what on the exec protocol, decided before a body is read.

Authorization comes from the stream's authenticated remote PeerID, never from a field a
message claims: a job belongs to the peer that set it up (which must be its data owner),
and only that owner may send its weights, step it, fetch from it or tear it down; OpData
is taken only from the peers its setup names for the neighbouring stages. A peer runs
at most ``max_jobs`` jobs and never replaces one; ``accept_jobs_from`` makes it private.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fusionp2p.config import DEFAULT_TIMEOUTS, ExecLimits
from fusionp2p.errors import LimitError, ProtocolError, RecordError
from fusionp2p.records import (
    ExecControl,
    JobSetup,
    LocalWeights,
    OpData,
    ReplicaGroup,
    ShardGrant,
    ShardOrder,
    ShardRequest,
)
from fusionp2p.records.shards import shard_stage
from fusionp2p.runtime.jobs import Job, opdata_key

__all__ = ["ServicePolicy", "admit_control", "admit_opdata", "admit_setup", "check_setup", "find_job"]


@dataclass(frozen=True, kw_only=True)
class ServicePolicy:
    """Who may use this process's exec protocol, and how much of it."""

    accept_setups: bool = True  # False in a data owner's process: it runs only its own stage
    max_jobs: int = 1  # jobs at once; a setup beyond this is refused, never replaces one
    accept_jobs_from: frozenset[str] = frozenset()  # PeerIDs that may set jobs up; empty: anyone
    max_memory_bytes: int | None = None  # what one stage may need; None: 80% of free memory
    device: str = "cpu"  # where stages compute: "cpu" or "cuda:N"
    emulated_speed: float = 1.0  # testbeds: compute as a device this much as fast (runtime.throttle)
    limits: ExecLimits = field(default_factory=ExecLimits)
    shard_dir: str | None = None  # where this peer keeps checkpoint shards; None: it keeps none
    weights_dir: str | None = None  # this peer's copies of pretrained models (load_local); None: none
    timeout: float = DEFAULT_TIMEOUTS.serve  # one remote request, or this stage finishing an iteration


def find_job(jobs: Mapping[str, Job], name: str) -> Job:
    """The job set up here under ``name``.

    Raises:
        ProtocolError: there is none.
    """
    job = jobs.get(name)
    if job is None:
        raise ProtocolError(f"job {name!r:.40} is not set up on this peer")
    return job


def admit_opdata(job: Job, remote: str, header: OpData) -> int:
    """The body size ``remote`` may send with this OpData of ``job``: only the peer of the
    stage it claims to come from, for this stage, plan version and iteration, once.

    Raises:
        ProtocolError: it may not (the reason is sent back).
    """
    setup = job.setup
    src = header.src_stage
    if src >= setup.n_stages or src == setup.stage or setup.peer_of(src) != remote:
        raise ProtocolError(f"{remote[:12]} runs no stage {src} of job {job.name} that sends here")
    if header.dst_stage != setup.stage:
        raise ProtocolError(f"OpData for stage {header.dst_stage}; this peer runs stage {setup.stage}")
    if header.plan_version != setup.plan_version:
        version = f"plan version {header.plan_version}; job {job.name} runs {setup.plan_version}"
        raise ProtocolError(f"OpData of {version}")
    if header.iteration != job.iteration:
        raise ProtocolError(f"OpData for iteration {header.iteration}; the job is at {job.iteration}")
    if job.state_missing:
        raise ProtocolError(f"stage {setup.stage} still misses {job.state_missing} of its tensors")
    job.executor.check(header)
    if opdata_key(header) in job.seen:
        what = f"{header.direction} OpData of {header.producer!r}, micro-batch {header.micro_batch}"
        raise ProtocolError(f"duplicate {what}")
    return header.body_bytes


def admit_control(
    policy: ServicePolicy,
    jobs: Mapping[str, Job],
    setting_up: Mapping[str, str],
    remote: str,
    header: ExecControl,
) -> int:
    """The body size ``remote`` may send with this control message: anyone may ping or
    (per ``admit_setup``) set a job up; a stage owner may tell the job's owner that it is
    leaving; only a job's owner may command it.

    Raises:
        ProtocolError / LimitError: it may not (the reason is sent back).
    """
    command = header.command
    if command == "ping":
        return 0
    if command == "setup":
        admit_setup(policy, jobs, setting_up, remote, header.job)
        return policy.limits.setup_bytes
    if command in ("grant", "shard_get"):  # no job: a grant proves itself, a read needs one
        return ShardRequest.MAX_BYTES if command == "shard_get" else ShardGrant.MAX_BYTES
    job = find_job(jobs, header.job)
    if command == "shard_put":  # a replica, from the stage of the job whose shard it is
        try:
            stage = shard_stage(header.what)
        except RecordError as e:
            raise ProtocolError(str(e)) from None
        if stage >= job.setup.n_stages or stage == job.setup.stage or job.setup.peer_of(stage) != remote:
            raise ProtocolError(
                f"{remote[:12]} runs no stage of job {job.name} whose shard is {header.what:.40}"
            )
        return job.shard_limit
    if command == "leaving":  # from a stage owner of the job, to its owner
        stage_owners = {peer for peer, _ in job.setup.peers} - {job.owner}
        if job.setup.stage != job.setup.data_stage or remote not in stage_owners:
            raise ProtocolError(f"{remote[:12]} runs no stage of a job {job.name} owned here")
        return 0
    if remote != job.owner:
        raise ProtocolError(f"only the peer that set job {job.name} up may {command} it")
    if command == "checkpoint":
        return ShardOrder.MAX_BYTES
    if command == "load_local":
        return LocalWeights.MAX_BYTES
    if command == "regroup":
        return ReplicaGroup.MAX_BYTES
    return job.weights_limit if command == "weights" else 0


def admit_setup(
    policy: ServicePolicy, jobs: Mapping[str, Job], setting_up: Mapping[str, str], remote: str, name: str
) -> None:
    """Whether ``remote`` may set up job ``name`` here now.

    ``setting_up`` maps the jobs being set up to their data owners: one identity sets up one
    job at a time, so it cannot hold every setup slot of a peer with ``--max-jobs`` > 1.

    Raises:
        ProtocolError: not from this peer's list, or the name is taken.
        LimitError: this peer already runs ``max_jobs``, or ``remote`` is setting one up.
    """
    if not policy.accept_setups:
        raise ProtocolError("this process runs no stages for other peers")
    if policy.accept_jobs_from and remote not in policy.accept_jobs_from:
        raise ProtocolError("this peer takes jobs only from its operator's list (--accept-jobs-from)")
    if name in jobs or name in setting_up:
        raise ProtocolError(f"job {name!r:.40} is already set up here")
    if remote in setting_up.values():
        raise LimitError("this data owner is setting another job up here: one setup at a time")
    running = len(jobs) + len(setting_up)
    if running >= policy.max_jobs:
        raise LimitError(f"this peer is busy: {running} job(s) running, its --max-jobs is {policy.max_jobs}")


def check_setup(setup: JobSetup, name: str, *, me: str, sender: str, limits: ExecLimits) -> None:
    """A setup body must be the job its header named, give this peer (``me``) the stage
    it sets up, come from the peer it names for the data stage, and have no more stages
    than this peer allows.

    Raises:
        ProtocolError: it does not.
    """
    if setup.n_stages > limits.max_stages:
        raise ProtocolError(f"setup of {setup.n_stages} stages; this peer takes at most {limits.max_stages}")
    if setup.job != name:
        raise ProtocolError(f"setup body for job {setup.job!r} under header job {name!r:.40}")
    if setup.peer_of(setup.stage) != me:
        raise ProtocolError(
            f"setup names {setup.peer_of(setup.stage)[:12]} for stage {setup.stage}, not this peer"
        )
    if setup.peer_of(setup.data_stage) != sender:
        raise ProtocolError("a job is set up by its data owner: the sender must run the data stage")
