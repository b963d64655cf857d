"""How close a peer's memory check comes to what a stage really takes.

    python -m benchmarks.stage_memory [--json out.json]

For a few GPT-2 configs, one `fusionp2p peer` runs stage 1 of a 2-stage job (this process
is the data owner); the peer's peak resident memory (VmHWM) is read before the setup and
after two training iterations, and set beside the estimate the peer checked against
``--max-memory`` (``fusionp2p.runtime.memory.stage_memory`` on a fake trace). The estimate
should not be below what the stage takes, and not far above.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch
from hivemind.p2p import P2P

from fusionp2p.config import OptimizerConfig, format_bytes
from fusionp2p.launch import LocalSwarm, PeerProcess
from fusionp2p.net.transport import P2PTransport
from fusionp2p.opdag.spec import ModelSpec
from fusionp2p.opdag.split import op_node_names, partition
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.memory import stage_memory

CASES = [  # (config, input shape, micro-batches)
    ({"n_layer": 4, "n_embd": 512, "n_head": 8, "vocab_size": 8192, "n_positions": 256}, (4, 128), 4),
    ({"n_layer": 8, "n_embd": 768, "n_head": 12, "vocab_size": 16384, "n_positions": 256}, (4, 256), 2),
    ({"n_layer": 2, "n_embd": 1024, "n_head": 16, "vocab_size": 50257, "n_positions": 128}, (2, 128), 1),
]


def peak(peer: PeerProcess) -> int:
    status = Path(f"/proc/{peer.popen.pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM"))


async def run_job(transport: P2PTransport, peer: PeerProcess, spec: ModelSpec, n_mb: int) -> None:
    traced = trace_spec(spec, fake=True)
    n = len(op_node_names(traced.program.graph))
    driver = await PipelineDriver.create(
        transport,
        spec,
        [i * 2 // n for i in range(n)],
        [(transport.peer_id, []), (peer.peer_id, peer.multiaddrs)],
        n_micro_batches=n_mb,
        optimizer=OptimizerConfig(),
        timeout=300,
    )
    try:
        vocab = spec.config["vocab_size"]
        for _ in range(2):
            ids = [torch.randint(0, vocab, spec.input_shape) for _ in range(n_mb)]
            await driver.train_step([(x, x) for x in ids])
    finally:
        await driver.aclose()


def estimate(spec: ModelSpec, n_mb: int) -> dict[str, int]:
    traced = trace_spec(spec, fake=True)
    n = len(op_node_names(traced.program.graph))
    part = partition(traced.program, [i * 2 // n for i in range(n)], 2)
    need = stage_memory(traced, part, 1, in_flight=n_mb, optimizer=OptimizerConfig())
    return {
        "model": need.model,
        "state": need.state,
        "grads": need.grads,
        "optimizer": need.optimizer,
        "activations": need.activations,
        "total": need.total,
    }


async def measure(local: LocalSwarm, spec: ModelSpec, n_mb: int) -> int:
    """The peak RSS growth of a fresh peer running stage 1 of ``spec`` (after a warm-up job)."""
    peer = local.peers[0]
    p2p = await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, initial_peers=local.initial_peers
    )
    transport = P2PTransport(p2p)
    try:
        warm = ModelSpec(
            "gpt2", {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64}, input_shape=(1, 8)
        )
        await run_job(transport, peer, warm, 1)  # imports transformers on the peer
        before = peak(peer)
        await run_job(transport, peer, spec, n_mb)
        return peak(peer) - before
    finally:
        await p2p.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for config, shape, n_mb in CASES:  # a fresh peer each: VmHWM never goes down
        spec = ModelSpec("gpt2", config, input_shape=shape)
        with LocalSwarm(1, swarm="memory", log_level="warning") as local:
            grown = asyncio.run(measure(local, spec, n_mb))
        need = estimate(spec, n_mb)
        rows.append(
            {
                "config": config,
                "input_shape": shape,
                "micro_batches": n_mb,
                "estimate": need,
                "measured_peak_growth": grown,
            }
        )
        print(f"  {config} x {n_mb}: estimate {format_bytes(need['total'])}, measured {format_bytes(grown)}")
    print(f"\n{'model':<34} {'mb':>3} {'estimate':>10} {'measured':>10} {'est/meas':>9}   (estimate parts)")
    for r in rows:
        c, need = r["config"], r["estimate"]
        name = f"gpt2 L{c['n_layer']} d{c['n_embd']} V{c['vocab_size']} {r['input_shape']}"
        ratio = need["total"] / max(1, r["measured_peak_growth"])
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in need.items() if k != "total")
        print(
            f"{name:<34} {r['micro_batches']:>3} {format_bytes(need['total']):>10} "
            f"{format_bytes(r['measured_peak_growth']):>10} {ratio:>8.2f}x   ({parts})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
