"""A lying coordinator, as a real peer process: its plan is refused by the data owner, and the
job is planned honestly by the next lease holder and trains.

The liar (``tests/lying_peer.py``) starts the swarm, so it holds the lease; two honest, faster
peers join. Its plan is the equal-number baseline passed off as OP-Fence's. The data owner
re-plans the records the reply cites, refuses the plan, never asks that peer again or gives it
a stage, and waits for another lease holder; once the liar is gone, an honest peer takes the
lease and the job runs on its plan.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until

from fusionp2p.launch import LocalSwarm
from fusionp2p.swarm import Swarm
from fusionp2p.training.job_spec import JobSpec

LEASE_S = 5.0
PEER_ARGS = ["--heartbeat", "1", "--record-ttl", "5", "--probe-period", "2", "--lease-seconds", str(LEASE_S)]
LIAR = [sys.executable, str(Path(__file__).with_name("lying_peer.py"))]


def test_a_lying_coordinators_plan_is_refused_and_the_next_lease_holder_plans_the_job(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="fusionp2p.training.submit")
    job = JobSpec(
        name="lied-to",
        model_config={"vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2},
        seq_len=32,
        max_bytes=200_000,
        batch_size=4,
        micro_batch_size=2,
        steps=3,
        checkpoint_every=0,
        min_peers=3,
        wait_peers_s=120.0,
        out_dir=str(tmp_path / "out"),
    )
    slow = ["--flops", "1e8"]  # the liar is slow: OP-Fence would not put a stage on it
    with (
        LocalSwarm(
            1,
            swarm="liar",
            workdir=str(tmp_path / "swarm"),
            peer_args=[[*PEER_ARGS, *slow]],
            launchers=[LIAR],
        ) as local,
        Swarm(local.initial_peers, swarm=local.swarm) as client,
    ):
        liar = local.peers[0].peer_id
        holds = lambda: (c := client.coordinator()) is not None and c.holder == liar  # noqa: E731
        wait_until(holds, 60, message="the liar holding the lease")
        for _ in range(2):
            local.add_peer([*PEER_ARGS, "--flops", "1e11"])
        done: dict[str, Any] = {}

        def train() -> None:
            try:
                done["result"] = client.train(job, progress=False, out=lambda *_: None)
            except BaseException as e:  # the test asserts on it
                done["error"] = e

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        refused = wait_until(
            lambda: [r.getMessage() for r in caplog.records if "reply is refused" in r.getMessage()],
            180,
            message="the data owner refusing the liar's plan",
        )
        assert liar[-8:] in refused[0] and "makes another plan" in refused[0], refused
        assert client.coordinator().holder == liar  # the liar still holds the lease: the job waits
        local.signal(0, signal.SIGKILL)
        thread.join(300)
        assert not thread.is_alive(), "the job did not finish after the liar was gone"
        assert "error" not in done, done.get("error")
        result = done["result"]
        assert len(result.losses) == job.steps
        submitted = result.submitted
        assert submitted.reply.coordinator != liar and liar not in submitted.plan.peer_ids
        assert submitted.plan.method == "op-fence"
