"""A model split over 4 local peers, no process holding all of it: memory, setup bytes, first step.

    python -m benchmarks.large_model_bench [--models medium,large] [--json out.json]

Per case, 4 fresh peer processes run stages 1-4 of a GPT-2 job; this process, the data
owner, runs stage 0 (embeddings and the loss). Each stage makes its own tensors from the
spec's seed (``opdag.init``), so the data owner sends only the setups. Reported: the peak
resident memory (VmHWM) of every process against what its stage needs (its memory
check: tensors, gradients, AdamW slots, activations in flight), the bytes the data owner
sent to set the stages up, the time from ``PipelineDriver.create`` to the end of the
first step, a checkpoint (each stage writes its shard and copies it to another peer; the
data owner receives only the reports), and a recovery: the job set up again without the
last peer, its stages reading their tensors from the shards' holders (the lost peer's
stage from its replica), timed to the end of the first step after it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from fusionp2p.config import OptimizerConfig, format_bytes
from fusionp2p.launch import LocalSwarm
from fusionp2p.net.transport import P2PTransport
from fusionp2p.opdag.split import op_node_names, partition
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions, default_in_flight
from fusionp2p.runtime.memory import stage_memory
from fusionp2p.runtime.restore import Restore

MODELS = {  # GPT-2 medium and large
    "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257, "n_positions": 1024},
    "large": {"n_layer": 36, "n_embd": 1280, "n_head": 20, "vocab_size": 50257, "n_positions": 1024},
}
SHAPE, N_MB, N_PEERS = (1, 128), 2, 4
SECRET = b"benchmark-secret-0123456789abcdef"


def vm(pid: int | str) -> tuple[int, int]:
    """(current, peak) resident bytes of a process."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def layout(spec: ModelSpec) -> tuple[list[int], list[int]]:
    """Stage 0 gets the data owner's pinned nodes only (the split moves them there); the
    peers split the rest in contiguous pieces; and what each stage needs."""
    traced = trace_spec(spec, fake=True)
    n = len(op_node_names(traced.program.graph))
    assignment = [1 + i * N_PEERS // n for i in range(n)]
    part = partition(traced.program, assignment, N_PEERS + 1, data_stage=0)
    held = default_in_flight(N_MB, part)
    needs = [
        stage_memory(traced, part, s, in_flight=held[s], optimizer=OptimizerConfig()).total
        for s in range(N_PEERS + 1)
    ]
    return assignment, needs


def options(job: str, version: int, shard_dir: str) -> JobOptions:
    return JobOptions(
        job=job,
        n_micro_batches=N_MB,
        timeout=900,
        plan_version=version,
        run="bench",
        shard_secret=SECRET,
        shard_dir=shard_dir,
    )


async def run(local: LocalSwarm, spec: ModelSpec, assignment: list[int], shard_dir: str) -> dict[str, float]:
    from hivemind.p2p import P2P

    p2p = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, initial_peers=local.initial_peers
    )
    transport = P2PTransport(p2p)
    peers = (transport.peer_id, *(p.peer_id for p in local.peers))
    try:
        began = time.perf_counter()
        sent = transport.bytes_sent
        addresses = {p.peer_id: p.multiaddrs for p in local.peers}
        driver = await PipelineDriver.create(
            transport,
            spec,
            RuntimeLayout(peers, assignment),
            options("bench-a", 1, shard_dir),
            addresses=addresses,
        )
        setup_s, setup_bytes = time.perf_counter() - began, transport.bytes_sent - sent
        ids = [torch.randint(0, spec.config["vocab_size"], spec.input_shape) for _ in range(N_MB)]
        batches = [(x, x) for x in ids]
        try:
            loss = await driver.train_step(batches)
            first_step_s = time.perf_counter() - began
            print(f"    first loss {loss:.3f}", flush=True)
            began, received = time.perf_counter(), transport.bytes_received
            ring = [p.peer_id for p in local.peers]
            replicas = {s: ring[s % N_PEERS] for s in range(1, N_PEERS + 1)}  # the next peer
            reports = await driver.checkpoint(1, replicas)
            checkpoint_s, checkpoint_bytes = time.perf_counter() - began, transport.bytes_received - received
            shard_bytes = sum(r.nbytes for r in reports[1:])
        finally:
            await driver.aclose()
        lost = local.peers[-1].peer_id
        began, sent = time.perf_counter(), transport.bytes_sent
        n = len(assignment)
        survivors = (transport.peer_id, *(p.peer_id for p in local.peers[:-1]))
        driver = await PipelineDriver.create(
            transport,
            spec,
            RuntimeLayout(survivors, [1 + i * (N_PEERS - 1) // n for i in range(n)]),
            options("bench-b", 2, shard_dir),
            addresses=addresses,
            restore=Restore(1, tuple(reports)),
            exclude=(lost,),
        )
        try:
            restore_bytes = transport.bytes_sent - sent
            loss = await driver.train_step(batches)
            recover_s = time.perf_counter() - began
            print(f"    loss after recovery {loss:.3f}", flush=True)
        finally:
            await driver.aclose()
        return {
            "setup_s": setup_s,
            "setup_bytes": setup_bytes,
            "first_step_s": first_step_s,
            "checkpoint_s": checkpoint_s,
            "checkpoint_bytes": checkpoint_bytes,
            "shard_bytes": shard_bytes,
            "recover_s": recover_s,
            "restore_bytes": restore_bytes,
        }
    finally:
        await p2p.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="medium,large", help="comma-separated: medium, large")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        spec = ModelSpec("gpt2", MODELS[name], input_shape=SHAPE, seed=0)
        state = trace_spec(spec, fake=True).program.state_dict
        params = sum(t.numel() for t in {id(t): t for t in state.values()}.values())  # a tied one once
        assignment, needs = layout(spec)
        print(
            f"  gpt2-{name}: {params / 1e6:.0f}M parameters over {N_PEERS} peers + the data owner", flush=True
        )
        with LocalSwarm(
            N_PEERS, swarm="large", log_level="warning", peer_args=[["--no-coordinator"]] * N_PEERS
        ) as local:
            owner_idle = vm("self")[0]
            measured = asyncio.run(run(local, spec, assignment, str(local.workdir / "owner-shards")))
            peaks = [vm("self")[1], *(vm(p.popen.pid)[1] for p in local.peers)]
        rows.append(
            {
                "model": f"gpt2-{name}",
                "params": params,
                "needs": needs,
                "peaks": peaks,
                "owner_idle": owner_idle,
            }
            | measured
        )
    print(f"\n{'model':<12} {'process':<11} {'stage need':>11} {'peak RSS':>10}")
    for r in rows:
        for s, (need, peak) in enumerate(zip(r["needs"], r["peaks"], strict=True)):
            who = "data owner" if s == 0 else f"peer {s}"
            print(f"{r['model']:<12} {who:<11} {format_bytes(need):>11} {format_bytes(peak):>10}")
    print(
        f"\n{'model':<12} {'weights':>9} {'setup sent':>11} {'1st step s':>10} {'shards':>9} "
        f"{'ckpt in':>9} {'ckpt s':>7} {'recovery sent':>13} {'recovery s':>10}"
    )
    for r in rows:
        print(
            f"{r['model']:<12} {format_bytes(4 * r['params']):>9} {format_bytes(r['setup_bytes']):>11} "
            f"{r['first_step_s']:>10.1f} {format_bytes(r['shard_bytes']):>9} "
            f"{format_bytes(r['checkpoint_bytes']):>9} {r['checkpoint_s']:>7.1f} "
            f"{format_bytes(r['restore_bytes']):>13} {r['recover_s']:>10.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
