"""Training survives a lost stage owner, a stopped one, the coordinator and the data owner.

Real peer processes (``LocalSwarm``), a real DHT and libp2p streams, real signals. With
compression off, a run that rolls back to a checkpoint (tensors and optimizer state) and
redoes the steps since sees the same batches and computes the same losses as one process
training without interruption; that is what "nothing is lost" means here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from job_helpers import reference_losses, wait_idle
from process_helpers import run_grouped, wait_group_gone

from fusionp2p.cli_jobs import format_runs
from fusionp2p.launch import LocalSwarm
from fusionp2p.swarm import Swarm
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.supervision import EventLog

LEASE_S = 5.0
IDLE_S = 12.0  # a stage frees a job whose data owner went silent this long
PEER_ARGS = [
    *("--heartbeat", "1", "--record-ttl", "5", "--probe-period", "2"),
    *("--lease-seconds", str(LEASE_S), "--job-idle-timeout", str(IDLE_S)),
]
GPT = {"vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}
K = 5  # checkpoint period of these jobs


def _job(tmp: Path, **changes: Any) -> JobSpec:
    base = JobSpec(
        name="ft-gpt",
        model_config=dict(GPT),
        seq_len=32,
        max_bytes=200_000,
        batch_size=4,
        micro_batch_size=2,
        lr=3e-3,
        steps=30,
        checkpoint_every=K,
        min_peers=2,
        wait_peers_s=60.0,
        deadline_s=6.0,
        out_dir=str(tmp),
    )
    return base.with_(**changes)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    workdir = str(tmp_path_factory.mktemp("fault"))
    with LocalSwarm(6, swarm="fault", workdir=workdir, peer_args=[PEER_ARGS] * 6) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def client(local: LocalSwarm) -> Iterator[Swarm]:
    with Swarm(local.initial_peers, swarm=local.swarm) as swarm:
        wait_idle(swarm, len(local.peers))
        yield swarm


def _index(local: LocalSwarm, peer_id: str) -> int:
    return next(i for i, p in enumerate(local.peers) if p.peer_id == peer_id)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    return EventLog.read(run_dir / "events.jsonl")


def _victim(row: dict[str, Any], client: Swarm) -> str:
    """A stage owner of the running plan, other than the coordinator if there is a choice."""
    lease = client.coordinator()
    others = [p for p in row["peers"] if lease is None or p != lease.holder]
    return (others or row["peers"])[-1]


def _assert_same_training(losses: list[float], job: JobSpec) -> None:
    # rolled back to a checkpoint and redone: still one process's uninterrupted trajectory
    assert losses == pytest.approx(reference_losses(job), rel=1e-3, abs=1e-3)


def test_a_killed_stage_owner_is_planned_around_from_the_last_checkpoint(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    job = _job(tmp_path, steps=20)  # killed at 12, redone from the checkpoint of step 10
    killed: dict[str, Any] = {}

    def on_step(row: dict[str, Any]) -> None:
        if row["step"] == 12 and not killed:
            killed["peer"] = _victim(row, client)
            local.signal(_index(local, killed["peer"]), signal.SIGKILL)

    result = client.train(job, progress=False, out=lambda *_: None, on_step=on_step)
    assert len(result.losses) == job.steps and result.replans >= 1
    events = _events(result.run_dir)
    lost = next(e for e in events if e["event"] == "peer_lost")
    assert lost["lost"] == [killed["peer"]] and lost["step"] == 13
    restored = next(e for e in events if e["event"] == "restored")
    assert restored["step"] == 10 and 0 < restored["redone"] <= K
    final = [e for e in events if e["event"] == "planned"][-1]
    assert killed["peer"] not in final["peers"] and final["plan_version"] >= 2
    # the new stages read the checkpoint's shards from their holders; the lost one's from
    # its replica: on another stage peer (the data owner sent setups and grants, no
    # tensors) or, if the lost peer was the plan's only stage peer, on the data owner
    first_plan = next(e for e in events if e["event"] == "planned")
    if len(first_plan["peers"]) >= 2:
        assert final["setup_bytes"] < 64 << 10
    else:
        assert final["setup_bytes"] > 128 << 10
    # a checkpoint brings the data owner only the stages' reports, not their state (~0.5 MiB
    # with AdamW's), unless the plan has one stage peer: its replica is the data owner's
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    taken = [(len(r["peers"]), r["checkpoint_bytes"]) for r in rows if "checkpoint_bytes" in r]
    assert taken and all(nbytes < 128 << 10 for n, nbytes in taken if n >= 2)
    assert all(nbytes > 128 << 10 for n, nbytes in taken if n == 1)
    # after its warm-up steps, the first plan was re-estimated from its stages' compute
    calibrated = next(e for e in events if e["event"] == "calibrated")
    assert calibrated["plan_version"] == 1 and calibrated["step"] == 5 and calibrated["estimate_s"] > 0
    first = next(e for e in events if e["event"] == "planned")
    assert {p[-8:] for p in first["peers"]} <= set(calibrated["speed_factors"])
    _assert_same_training(result.losses, job)
    # what `fusionp2p status` shows: the run as its data owner reported it, with its last events
    (report,) = [r for r in client.runs() if r.run_id == result.run_id]
    assert (report.step, report.replans, report.plan_version) == (
        job.steps,
        result.replans,
        final["plan_version"],
    )
    assert any(e.startswith("restored: ") for e in report.events)
    assert f"run {result.run_id}: step {job.steps}/{job.steps}" in format_runs(client.runs(), time.time())


def test_a_stage_owner_that_leaves_tells_the_data_owner_at_once(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    """Ctrl-C on a stage peer: it says it leaves, and the job re-plans long before its deadline."""
    wait_idle(client, 3, timeout=90)
    job = _job(tmp_path, name="ft-leave", steps=16, deadline_s=90.0)
    left: dict[str, Any] = {}

    def on_step(row: dict[str, Any]) -> None:
        if row["step"] == 7 and not left:
            left["peer"] = _victim(row, client)
            left["index"] = _index(local, left["peer"])
            left["at"] = time.time()
            local.signal(left["index"], signal.SIGINT)

    result = client.train(job, progress=False, out=lambda *_: None, on_step=on_step)
    assert len(result.losses) == job.steps
    lost = next(e for e in _events(result.run_dir) if e["event"] == "peer_lost")
    assert lost["lost"] == [left["peer"]] and "leaving the swarm" in lost["error"]
    assert lost["time"] - left["at"] < 20  # told, not found out at the 90 s step deadline
    assert local.peers[left["index"]].popen.wait(60) == 0  # it left in order
    _assert_same_training(result.losses, job)


def test_a_stopped_stage_owner_is_planned_around_and_waking_up_corrupts_nothing(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    wait_idle(client, 2)
    job = _job(tmp_path, name="ft-stop", steps=20)  # stopped at 8
    stopped: dict[str, Any] = {}

    def on_step(row: dict[str, Any]) -> None:
        if row["step"] == 8 and not stopped:
            stopped["peer"] = _victim(row, client)
            stopped["index"] = _index(local, stopped["peer"])
            stopped["at"] = time.time()  # events carry wall-clock time
            local.signal(stopped["index"], signal.SIGSTOP)
        elif row["plan_version"] >= 2 and "woke" not in stopped:  # it wakes up into the new plan's run
            stopped["woke"] = row["step"]
            local.signal(stopped["index"], signal.SIGCONT)

    try:
        result = client.train(job, progress=False, out=lambda *_: None, on_step=on_step)
    finally:
        if "index" in stopped:
            local.signal(stopped["index"], signal.SIGCONT)
    assert len(result.losses) == job.steps and "woke" in stopped
    events = _events(result.run_dir)
    lost = next(e for e in events if e["event"] == "peer_lost")
    assert lost["lost"] == [stopped["peer"]] and lost["step"] == 9  # the first step it held up
    assert lost["time"] - stopped["at"] < 3 * job.deadline_s + 10  # its deadline, the pings
    final = [e for e in events if e["event"] == "planned"][-1]
    assert stopped["peer"] not in final["peers"]
    _assert_same_training(result.losses, job)
    assert local.peers[stopped["index"]].popen.poll() is None  # alive after waking, serving again


def test_training_goes_on_without_the_coordinator_and_a_later_loss_is_still_handled(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    wait_idle(client, 3, timeout=90)
    job = _job(tmp_path, name="ft-coord")
    lease = client.coordinator()
    assert lease is not None
    seen: dict[str, Any] = {}

    def on_step(row: dict[str, Any]) -> None:
        if row["step"] == 6 and "coordinator" not in seen:
            seen["coordinator"] = lease.holder
            seen["held_stage"] = lease.holder in row["peers"]
            local.signal(_index(local, lease.holder), signal.SIGKILL)
        elif row["step"] == 24 and "victim" not in seen:
            seen["victim"] = next(p for p in row["peers"] if p != lease.holder)
            local.signal(_index(local, seen["victim"]), signal.SIGKILL)

    result = client.train(job, progress=False, out=lambda *_: None, on_step=on_step)
    assert len(result.losses) == job.steps
    events = _events(result.run_dir)
    plans = [e for e in events if e["event"] == "planned"]
    lost = [e for e in events if e["event"] == "peer_lost"]
    if not seen["held_stage"]:  # nothing to re-plan: the plan in force needed no coordinator
        assert [e["step"] for e in lost] == [25] and len(plans) == 2
    assert lost[-1]["lost"] == [seen["victim"]]
    # the later loss was re-planned by a newly elected coordinator, in a later epoch
    assert plans[-1]["coordinator"] != seen["coordinator"] and plans[-1]["epoch"] > plans[0]["epoch"]
    _assert_same_training(result.losses, job)


def _metrics_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_a_killed_data_owner_resumes_from_its_checkpoint(
    client: Swarm, local: LocalSwarm, tmp_path: Path
) -> None:
    wait_idle(client, 1, timeout=90)
    job = _job(tmp_path, name="ft-owner", min_peers=1, steps=30)
    config = tmp_path / "job.toml"
    config.write_text(
        f'name = "{job.name}"\n[model.config]\n'
        + "".join(f"{k} = {v}\n" for k, v in GPT.items())
        + f"[data]\nseq_len = 32\nmax_bytes = 200000\n"
        f"[train]\nsteps = {job.steps}\nbatch_size = 4\nmicro_batch_size = 2\nlr = 0.003\n"
        f"checkpoint_every = {K}\nmin_peers = 1\nwait_peers_s = 60\n[fault]\ndeadline_s = 6\n"
        f'[output]\ndir = "{tmp_path}"\n'
    )
    assert JobSpec.load(config) == job
    command = [sys.executable, "-m", "fusionp2p", "--log-level", "error", "train", "--config", str(config)]
    command += ["--swarm", local.swarm, "--initial-peers", *client.multiaddrs[:2], "--no-progress"]
    log = (tmp_path / "owner.log").open("w")
    owner = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        runs: list[Path] = []
        while time.monotonic() < deadline:
            runs = [d for d in job.run_dir.iterdir()] if job.run_dir.exists() else []
            if runs and max(_metrics_steps(runs[0]), default=0) >= 12:
                break
            assert owner.poll() is None, (tmp_path / "owner.log").read_text()[-3000:]
            time.sleep(0.2)
        else:
            pytest.fail("the data owner did not reach step 12")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)  # the data owner and its DHT daemon, at once
        owner.wait()
        log.close()
    left = wait_group_gone(owner.pid)  # nothing of the killed data owner is left (once the kernel reaped it)
    assert not left, f"left over from the data owner: {left}"
    (run_dir,) = runs
    # its stage owners free the job on their own, and say so
    deadline = time.monotonic() + IDLE_S + 30
    while not any("nothing from its owner" in p.log() for p in local.peers if p.popen.poll() is None):
        assert time.monotonic() < deadline, "no stage freed the dead data owner's job"
        time.sleep(1.0)
    done, left = run_grouped([*command, "--resume"], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    events = _events(run_dir)
    resumed = next(e for e in events if e["event"] == "resumed")
    assert resumed["step"] in (10, 15)  # the last checkpoint before the kill
    steps = _metrics_steps(run_dir)
    assert steps[-1] == job.steps and set(range(1, job.steps + 1)) <= set(steps)
    losses: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        losses[row["step"]] = row["loss"]
    _assert_same_training([losses[s] for s in range(1, job.steps + 1)], job)
    assert (run_dir / "checkpoints" / "step-000030.json").is_file()  # the final weights, kept by the stages
    assert not left  # the resumed data owner's daemon is gone too
    rows = (run_dir / "metrics.jsonl").read_text()
    again, left = run_grouped([*command, "--resume"], timeout=240)  # a finished run: nothing to redo
    assert again.returncode == 1 and "is complete (30 steps" in again.stderr, again.stderr[-2000:]
    assert (run_dir / "metrics.jsonl").read_text() == rows and not left
