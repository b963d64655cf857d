"""How fast a swarm elects a coordinator, replaces a killed one, and plans a job.

    python -m benchmarks.election_bench [--peers 5] [--lease 5] [--kills 3]

Starts a local swarm (real peer processes), times the first election, then SIGKILLs the
coordinator ``--kills`` times and times each re-election (the target: within 3 lease
periods), and finally times one job submission (trace, OP-Fence, the plan published and
read back). Prints a table; every process is ended on exit.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time

from fusionp2p.launch import LocalSwarm
from fusionp2p.swarm import Swarm
from fusionp2p.training.job_spec import JobSpec


def _wait_lease(client: Swarm, not_holder: str | None, timeout: float) -> tuple[str, int, float]:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        lease = client.coordinator()
        if lease is not None and lease.holder != not_holder:
            return lease.holder, lease.epoch, time.monotonic() - start
        time.sleep(0.1)
    raise SystemExit(f"no coordinator within {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=5)
    parser.add_argument("--lease", type=float, default=5.0)
    parser.add_argument("--kills", type=int, default=3)
    args = parser.parse_args()
    peer_args = [
        "--heartbeat",
        "1",
        "--record-ttl",
        "5",
        "--probe-period",
        "2",
        "--lease-seconds",
        str(args.lease),
    ]
    rows = []
    with (
        tempfile.TemporaryDirectory() as workdir,
        LocalSwarm(
            args.peers, swarm="election", workdir=workdir, peer_args=[peer_args] * args.peers
        ) as local,
        Swarm(local.initial_peers, swarm=local.swarm) as client,
    ):
        holder, epoch, took = _wait_lease(client, None, 10 * args.lease)
        rows.append(("elected (swarm up)", "-", holder[-8:], epoch, took))
        for _ in range(args.kills):
            index = next(i for i, p in enumerate(local.peers) if p.peer_id == holder)
            killed = time.monotonic()
            local.signal(index, signal.SIGKILL)
            new, epoch, _ = _wait_lease(client, holder, 10 * args.lease)
            rows.append(("SIGKILL coordinator", holder[-8:], new[-8:], epoch, time.monotonic() - killed))
            holder = new
        job = JobSpec(
            name="bench",
            model_config={"vocab_size": 256, "n_positions": 64, "n_embd": 128, "n_layer": 4, "n_head": 4},
            min_peers=1,
            out_dir=workdir,
        )
        began = time.monotonic()
        submitted = client.data_owner().submit(job)
        rows.append(
            (
                "submit + plan a job",
                "-",
                submitted.reply.coordinator[-8:],
                submitted.epoch,
                time.monotonic() - began,
            )
        )
    print(
        f"\n{args.peers} peers, lease {args.lease:.0f} s (re-election target: within {3 * args.lease:.0f} s)"
    )
    print(f"{'EVENT':<22} {'OLD':<9} {'COORDINATOR':<12} {'EPOCH':>5} {'SECONDS':>8}")
    for event, old, new, ep, seconds in rows:
        print(f"{event:<22} {old:<9} {new:<12} {ep:>5} {seconds:>8.1f}")
    kills = [r[4] for r in rows if r[0].startswith("SIGKILL")]
    if kills:
        print(
            f"re-election: mean {statistics.mean(kills):.1f} s, max {max(kills):.1f} s "
            f"= {max(kills) / args.lease:.2f} lease periods"
        )


if __name__ == "__main__":
    main()
