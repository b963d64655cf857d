"""What each fault costs a training run: detection, recovery, redone steps, checkpoints.

    python -m benchmarks.fault_bench [--peers 5] [--steps 40] [--every 5] [--out benchmarks/results]

Starts a local swarm (real peer processes, lease 5 s) and trains a small GPT-2 once per
fault, injecting it at step ``--at``:

- ``stage SIGKILL``: a stage owner of the running plan dies;
- ``stage SIGSTOP``: a stage owner stops (a straggler that never answers), and is woken
  once the run is on its new plan;
- ``stage slowed 4x``: a stage owner is stopped 3/4 of the time (it still answers pings):
  the straggler rule re-plans around it from a fresh checkpoint, without redoing a step;
- ``coordinator SIGKILL``: the lease holder dies (if it also held a stage, that stage is
  lost too; otherwise training goes on and the new lease is polled once a step);
- ``none``: no fault, for the checkpoint overhead and the step time.

Per fault: time to detect (injection to the data owner's ``peer_lost`` or ``straggler``
event, or to a new lease for the coordinator), time to the first step on the new plan, steps redone,
and the checkpoint overhead per step (checkpoint seconds / period / step seconds). Writes
``fault_bench.json`` and ``fault_bench.md`` under ``--out`` and prints the table; every
process is ended on exit.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fusionp2p.launch import LocalSwarm
from fusionp2p.swarm import Swarm
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.supervision import EventLog

LEASE_S = 5.0
PEER_ARGS = [
    *("--heartbeat", "1", "--record-ttl", "5", "--probe-period", "2"),
    *("--lease-seconds", str(LEASE_S), "--job-idle-timeout", "30"),
]
GPT = {"vocab_size": 256, "n_positions": 64, "n_embd": 96, "n_layer": 3, "n_head": 4}
FAULTS = ("none", "stage SIGKILL", "stage SIGSTOP", "stage slowed 4x", "coordinator SIGKILL")


class _Throttle(threading.Thread):
    """Slows a peer process down: stopped 3/4 of every 0.2 s (a straggler that still answers)."""

    def __init__(self, local: LocalSwarm, index: int) -> None:
        super().__init__(daemon=True)
        self.local, self.index, self.done = local, index, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.local.signal(self.index, signal.SIGSTOP)
            time.sleep(0.15)
            self.local.signal(self.index, signal.SIGCONT)
            time.sleep(0.05)
        self.local.signal(self.index, signal.SIGCONT)


def _job(out: Path, name: str, steps: int, every: int) -> JobSpec:
    return JobSpec(
        name=name,
        model_config=dict(GPT),
        seq_len=64,
        max_bytes=400_000,
        batch_size=8,
        micro_batch_size=2,
        lr=2e-3,
        steps=steps,
        checkpoint_every=every,
        min_peers=2,
        wait_peers_s=60.0,
        deadline_s=6.0,
        straggler_min_s=0.3,
        out_dir=str(out),
    )


def _wait(client: Swarm, idle: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len([p for p in client.peers() if p.state == "idle"]) >= idle and client.coordinator():
            return
        time.sleep(0.5)
    raise SystemExit(f"fewer than {idle} idle peers and a coordinator after {timeout:.0f} s")


def _run_fault(local: LocalSwarm, client: Swarm, fault: str, job: JobSpec, at: int) -> dict[str, Any]:
    index = {p.peer_id: i for i, p in enumerate(local.peers)}
    mark: dict[str, Any] = {}

    def on_step(row: dict[str, Any]) -> None:
        if row["step"] == at and "time" not in mark and fault != "none":
            lease = client.coordinator()
            holder = lease.holder if lease is not None else ""
            if fault == "coordinator SIGKILL":
                mark["peer"], sig = holder, signal.SIGKILL
            else:
                others = [p for p in row["peers"] if p != holder] or row["peers"]
                mark["peer"] = others[-1]
                sig = signal.SIGKILL if fault == "stage SIGKILL" else signal.SIGSTOP
            mark["held_stage"] = mark["peer"] in row["peers"]
            mark["version"] = row["plan_version"]
            mark["time"] = time.time()
            mark["epoch"] = lease.epoch if lease is not None else 0
            if fault == "stage slowed 4x":
                mark["throttle"] = _Throttle(local, index[mark["peer"]])
                mark["throttle"].start()
            else:
                local.signal(index[mark["peer"]], sig)
            return
        if fault == "coordinator SIGKILL" and "time" in mark and "new_lease" not in mark:
            now = client.coordinator()  # polled once a step: training does not wait for it
            if now is not None and now.epoch > mark["epoch"]:
                mark["new_lease"] = time.time()
        if "time" in mark and row["plan_version"] > mark["version"] and "first_new" not in mark:
            mark["first_new"] = time.time()
            if fault == "stage SIGSTOP":
                local.signal(index[mark["peer"]], signal.SIGCONT)
            if "throttle" in mark:
                mark["throttle"].done.set()

    try:
        result = client.train(job, progress=False, out=lambda *_: None, on_step=on_step)
    finally:
        if "throttle" in mark:
            mark["throttle"].done.set()
            mark["throttle"].join()
        if fault == "stage SIGSTOP" and "peer" in mark:
            local.signal(index[mark["peer"]], signal.SIGCONT)
    events = EventLog.read(result.run_dir / "events.jsonl")
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["step_s"] for r in rows[2:])
    checkpoints = [r["checkpoint_s"] for r in rows if "checkpoint_s" in r]
    lost = next((e for e in events if e["event"] in ("peer_lost", "step_failed", "straggler")), None)
    restored = next((e for e in events if e["event"] == "restored"), None)
    detect = None
    if "new_lease" in mark and not mark.get("held_stage"):
        detect = mark["new_lease"] - mark["time"]
    elif lost is not None and "time" in mark:
        detect = lost["time"] - mark["time"]
    return {
        "fault": fault,
        "detect_s": detect,
        "first_new_plan_step_s": mark["first_new"] - mark["time"] if "first_new" in mark else None,
        "steps_redone": restored["redone"] if restored else 0,
        "replans": result.replans,
        "step_s": step_s,
        "checkpoint_s": statistics.mean(checkpoints) if checkpoints else 0.0,
        "checkpoint_period": job.checkpoint_every,
        "checkpoint_overhead": (statistics.mean(checkpoints) / job.checkpoint_every / step_s)
        if checkpoints
        else 0.0,
        "final_loss": result.losses[-1],
        "coordinator_held_a_stage": mark.get("held_stage") if fault == "coordinator SIGKILL" else None,
    }


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Fault handling, {args.peers} local peers + a data owner on one 2-core machine, GPT-2 "
        f"(n_embd {GPT['n_embd']}, {GPT['n_layer']} layers), {args.steps} steps, fault at step {args.at}, "
        f"checkpoint every {args.every} steps, lease {LEASE_S:.0f} s, step deadline floor 6 s, "
        "straggler: 3 steps over 1.5x and 0.3 s over the calibrated step time.",
        "",
        "| fault | detect s | first step on new plan s | steps redone | re-plans | step s "
        "| checkpoint s | checkpoint overhead | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['fault']} | {_cell(r['detect_s'], '.1f')} | {_cell(r['first_new_plan_step_s'], '.1f')} "
            f"| {r['steps_redone']} | {r['replans']} | {r['step_s']:.2f} | {r['checkpoint_s']:.3f} "
            f"| {100 * r['checkpoint_overhead']:.1f}% | {r['final_loss']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--at", type=int, default=12, help="the step after which the fault is injected")
    parser.add_argument("--every", type=int, default=5, help="checkpoint period in steps")
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = []
    with (
        tempfile.TemporaryDirectory() as workdir,
        LocalSwarm(args.peers, swarm="faults", workdir=workdir, peer_args=[PEER_ARGS] * args.peers) as local,
        Swarm(local.initial_peers, swarm=local.swarm) as client,
    ):
        for i, fault in enumerate(args.faults):
            _wait(client, 2)
            job = _job(Path(workdir) / "runs", f"fault-{i}", args.steps, args.every)
            print(f"running with fault: {fault} ...", flush=True)
            rows.append(_run_fault(local, client, fault, job, args.at))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fault_bench.json").write_text(json.dumps(rows, indent=2))
    table = _markdown(rows, args)
    (out / "fault_bench.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
