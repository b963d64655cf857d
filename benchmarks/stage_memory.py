"""What each stage peer really holds, beside what its memory check predicted.

    python -m benchmarks.stage_memory [--json out.json] [--quick]

For each case, fresh peer processes run stages 1.. of a GPT-2 job (this process, the data
owner, runs stage 0 and builds the whole model) for two AdamW iterations. Per stage peer:
its resident memory when idle, the growth of its peak (VmHWM) over the job, and the need
the peer checked against ``--max-memory`` before allocating anything (its tensors,
gradients, optimizer slots, and the activations of the micro-batches in flight, from a
fake trace: the peer never builds the whole model). Target (the runtime issue): the peak
stays within 1.5 x the need + the idle RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

from fusionp2p.config import OptimizerConfig, format_bytes
from fusionp2p.launch import LocalSwarm, PeerProcess
from fusionp2p.net.transport import P2PTransport
from fusionp2p.opdag.split import op_node_names, partition
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import RuntimeLayout
from fusionp2p.planning.cost import in_flight
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.memory import stage_memory

MEDIUM = {"n_layer": 24, "n_embd": 1024, "n_head": 16, "vocab_size": 50257, "n_positions": 256}
CASES = [  # (name, config, input shape, micro-batches, stages)
    ("gpt2-medium", MEDIUM, (1, 128), 2, 3),
    ("gpt2 L8 d768", {"n_layer": 8, "n_embd": 768, "n_head": 12, "vocab_size": 16384}, (4, 256), 4, 3),
    ("gpt2 L4 d512", {"n_layer": 4, "n_embd": 512, "n_head": 8, "vocab_size": 8192}, (4, 128), 4, 2),
]


def rss(peer: PeerProcess) -> tuple[int, int]:
    """(current, peak) resident bytes of a peer process."""
    values = {}
    for line in Path(f"/proc/{peer.popen.pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def assignment(spec: ModelSpec, n_stages: int) -> list[int]:
    traced = trace_spec(spec, fake=True)
    n = len(op_node_names(traced.program.graph))
    return [i * n_stages // n for i in range(n)]


def needs(spec: ModelSpec, n_stages: int, n_mb: int) -> list[dict[str, int]]:
    traced = trace_spec(spec, fake=True)
    part = partition(traced.program, assignment(spec, n_stages), n_stages)
    out = []
    for stage in range(1, n_stages):
        need = stage_memory(
            traced, part, stage, in_flight=in_flight(n_mb, n_stages), optimizer=OptimizerConfig()
        )
        out.append(
            {
                "state": need.state,
                "grads": need.grads,
                "optimizer": need.optimizer,
                "activations": need.activations,
                "total": need.total,
            }
        )
    return out


async def run_job(local: LocalSwarm, spec: ModelSpec, n_mb: int, n_stages: int) -> list[tuple[int, int, int]]:
    """Per stage peer: (idle RSS, peak RSS after a warm-up job, peak RSS after the job)."""
    from hivemind.p2p import P2P

    p2p = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, initial_peers=local.initial_peers
    )
    transport = P2PTransport(p2p)
    peers = (transport.peer_id, *(p.peer_id for p in local.peers))
    addresses = {p.peer_id: p.multiaddrs for p in local.peers}
    try:
        idle = [rss(p)[0] for p in local.peers]
        warm = ModelSpec(
            "gpt2", {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64}, input_shape=(1, 8)
        )
        driver = await PipelineDriver.create(
            transport,
            warm,
            RuntimeLayout(peers, assignment(warm, n_stages)),
            JobOptions(timeout=300),
            addresses=addresses,
        )
        await driver.aclose()  # each peer has imported transformers and traced once
        before = [rss(p)[1] for p in local.peers]
        driver = await PipelineDriver.create(
            transport,
            spec,
            RuntimeLayout(peers, assignment(spec, n_stages)),
            JobOptions(n_micro_batches=n_mb, optimizer=OptimizerConfig(), timeout=600),
            addresses=addresses,
        )
        try:
            vocab = spec.config["vocab_size"]
            for _ in range(2):
                ids = [torch.randint(0, vocab, spec.input_shape) for _ in range(n_mb)]
                loss = await driver.train_step([(x, x) for x in ids])
                print(f"    loss {loss:.3f}", flush=True)
        finally:
            await driver.aclose()
        return [(i, b, rss(p)[1]) for i, p, b in zip(idle, local.peers, before, strict=True)]
    finally:
        await p2p.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--quick", action="store_true", help="skip GPT-2 medium")
    args = parser.parse_args(argv)
    rows = []
    for name, config, shape, n_mb, n_stages in CASES[1:] if args.quick else CASES:
        spec = ModelSpec("gpt2", config, input_shape=shape)
        print(f"  {name}: {n_stages} stages, {n_mb} micro-batches of {shape}", flush=True)
        with LocalSwarm(
            n_stages - 1,
            swarm="memory",
            log_level="warning",
            peer_args=[["--no-coordinator"]] * (n_stages - 1),
        ) as local:
            measured = asyncio.run(run_job(local, spec, n_mb, n_stages))
        for stage, (need, (idle, warm, peak)) in enumerate(
            zip(needs(spec, n_stages, n_mb), measured, strict=True), 1
        ):
            rows.append(
                {
                    "model": name,
                    "stage": stage,
                    "micro_batches": n_mb,
                    "need": need,
                    "idle_rss": idle,
                    "peak_before": warm,
                    "peak": peak,
                }
            )
    print(
        f"\n{'model':<14} {'stage':>5} {'need':>10} {'peak growth':>12} {'growth/need':>12} {'idle RSS':>10} "
        f"{'peak RSS':>10} {'target':>10}"
    )
    for r in rows:
        need, grown = r["need"]["total"], r["peak"] - r["peak_before"]
        target = 1.5 * need + r["idle_rss"]
        print(
            f"{r['model']:<14} {r['stage']:>5} {format_bytes(need):>10} {format_bytes(grown):>12} "
            f"{grown / need:>11.2f}x {format_bytes(r['idle_rss']):>10} {format_bytes(r['peak']):>10} "
            f"{format_bytes(target):>10}{'' if r['peak'] <= target else '  OVER'}"
        )
    print(
        "need = the stage's tensors + gradients + optimizer slots + activations in flight (its memory check)"
    )
    print("target = 1.5 x need + idle RSS; the peak includes a warm-up job (imports, a tiny trace)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
