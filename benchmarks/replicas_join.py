"""How long a peer that joins a running job takes to start contributing a replica.

    python -m benchmarks.replicas_join [--steps 40] [--refresh 2] [--repeats 2]

A local swarm of 3 peers (real processes, declaring 2 GFLOP/s so that a replica pays,
as compute-bound peers would measure) runs one coordinated GPT-2 job (4 layers, 64 wide,
128 tokens, 2 micro-batches a step) with ``[train] replicas = "auto"`` on one allowed
stage peer: one pipeline. At step 3 a fourth peer, also allowed, starts and joins the
swarm. Reported per run, from the moment its process is started: its record in the DHT
(``swarm.peers()``), the ``grown`` event (the run chose to switch to 2 replicas: the
background plan was made and beats the one in force), and the end of the first step on 2
replicas; the switch itself (a checkpoint, the setup of both replicas from it, one step)
is the difference of the last two. Every process is ended on exit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fusionp2p.launch import LocalSwarm
from fusionp2p.net.identity import ensure_identity
from fusionp2p.swarm import Swarm
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.supervision import EventLog

PEER_ARGS = [
    *("--heartbeat", "1", "--record-ttl", "5", "--probe-period", "2", "--job-idle-timeout", "60"),
    *("--flops", "2e9"),
]
GPT = {"vocab_size": 256, "n_positions": 128, "n_embd": 64, "n_layer": 4, "n_head": 2}


def _wait_idle(swarm: Swarm, n: int, timeout: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lease = swarm.coordinator()
        idle = [p.peer_id for p in swarm.peers() if p.state == "idle"]
        if len(idle) >= n and lease is not None:
            return [p for p in idle if p != lease.holder]
        time.sleep(0.5)
    raise SystemExit(f"fewer than {n} idle peers and a coordinator after {timeout:.0f} s")


def one_run(
    local: LocalSwarm, swarm: Swarm, workdir: Path, k: int, steps: int, refresh: float
) -> dict[str, float]:
    """One run with a newcomer at step 3: seconds from its start to each milestone."""
    idle = _wait_idle(swarm, len(local.peers))
    key = workdir / f"newcomer-{k}.key"
    newcomer = str(ensure_identity(str(key)))
    job = JobSpec(
        name=f"join-{k}",
        model_config=dict(GPT),
        seq_len=128,
        max_bytes=200_000,
        batch_size=4,
        micro_batch_size=2,
        lr=1e-3,
        steps=steps,
        checkpoint_every=10,
        replicas="auto",
        refresh_s=refresh,
        min_peers=1,
        wait_peers_s=60.0,
        deadline_s=10.0,
        stage_peers=(idle[0], newcomer),
        out_dir=str(workdir / "runs"),
    )
    marks: dict[str, float] = {}
    step_ends: list[tuple[float, dict[str, Any]]] = []

    def on_step(row: dict[str, Any]) -> None:
        step_ends.append((time.time(), row))
        if row["step"] == 3 and "started" not in marks:
            marks["started"] = time.time()
            local.add_peer([*PEER_ARGS, "--identity", str(key)], timeout=120.0)
            marks["process ready"] = time.time()
            while newcomer not in {p.peer_id for p in swarm.peers()}:
                time.sleep(0.2)
            marks["in the DHT"] = time.time()

    result = swarm.train(job, progress=False, out=lambda *_: None, on_step=on_step)
    grown = [e for e in EventLog.read(result.run_dir / "events.jsonl") if e["event"] == "grown"]
    if not grown:
        raise SystemExit(f"run {k}: the newcomer was never given a replica in {steps} steps")
    first = next(t for t, row in step_ends if row.get("replicas") == 2)
    start = marks["started"]
    return {
        "process ready s": marks["process ready"] - start,
        "in the DHT s": marks["in the DHT"] - start,
        "grown s": grown[0]["time"] - start,
        "first replicated step s": first - start,
        "switch s": first - grown[0]["time"],
        "step at growth": float(grown[0]["step"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--refresh", type=float, default=2.0, help="[train] refresh_s")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fusionp2p-join-") as tmp:
        workdir = Path(tmp)
        with (
            LocalSwarm(
                3, swarm="join-bench", workdir=str(workdir / "swarm"), peer_args=[PEER_ARGS] * 3
            ) as local,
            Swarm(local.initial_peers, swarm=local.swarm) as swarm,
        ):
            for k in range(args.repeats):
                rows.append(one_run(local, swarm, workdir, k, args.steps, args.refresh))
                print(json.dumps({"run": k, **{key: round(v, 2) for key, v in rows[-1].items()}}), flush=True)
    print(
        f"\nrefresh_s {args.refresh:g}; seconds after the newcomer's process started (median of {len(rows)}):"
    )
    for key in rows[0]:
        print(f"  {key:<24} {statistics.median(r[key] for r in rows):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
