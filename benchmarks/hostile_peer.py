"""The attacks of the security issue, replayed against one real peer; its memory after each.

    python -m benchmarks.hostile_peer [--json out.json]

Starts one `fusionp2p peer` (and a second one as an honest stage neighbour is not needed:
this process plays both the job owner and the stranger), measures the peer's resident
memory (RSS, and its peak) before and after each attack, and prints a table. Every
process it starts ends with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import psutil
from hivemind.p2p import P2P

from fusionp2p.config import OptimizerConfig, format_bytes
from fusionp2p.errors import FusionP2PError
from fusionp2p.launch import LocalSwarm, PeerProcess
from fusionp2p.net.framing import FRAME_VERSION, HEADER, FrameKind
from fusionp2p.net.transport import P2PTransport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import EXEC_PROTOCOL, ExecControl, ModelSpec, pack_message
from fusionp2p.runtime.codec import ExecClient
from fusionp2p.runtime.driver import PipelineDriver
from fusionp2p.runtime.job_setup import JobOptions

TESTS = Path(__file__).parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the helpers the security tests use, and their user model

from exec_helpers import fake_setups, first_forward  # noqa: E402


def rss(peer: PeerProcess) -> tuple[int, int]:
    status = Path(f"/proc/{peer.popen.pid}/status").read_text()
    peak = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM"))
    return psutil.Process(peer.popen.pid).memory_info().rss, peak


async def huge_frame(stranger: P2PTransport, peer: PeerProcess) -> str:
    """One frame that declares 512 MiB of junk, then sends 8 MiB of it."""
    stream = await stranger.open(peer.peer_id, EXEC_PROTOCOL, timeout=30)
    stream._writer.write(HEADER.pack(FRAME_VERSION, int(FrameKind.DATA), 512 << 20) + bytes(8 << 20))
    try:
        kind, reply = await stream.recv(max_payload=1 << 20, timeout=10)
        return f"{kind.name}: {reply.decode()[:70]}"
    except FusionP2PError as e:
        return f"closed: {e}"
    finally:
        await stream.close()


async def partial_frames(stranger: P2PTransport, peer: PeerProcess, n: int = 500) -> str:
    """``n`` concurrent streams, each holding 100 bytes of an 8 MiB frame; how long are they held?"""
    outcomes: dict[str, int] = {}
    start = time.monotonic()
    held: list[float] = []

    async def one() -> None:
        try:
            stream = await stranger.open(peer.peer_id, EXEC_PROTOCOL, timeout=60)
        except FusionP2PError:
            outcomes["not opened"] = outcomes.get("not opened", 0) + 1
            return
        try:
            stream._writer.write(HEADER.pack(FRAME_VERSION, int(FrameKind.DATA), 8 << 20) + bytes(100))
            kind, _ = await stream.recv(max_payload=1 << 20, timeout=120)
            key = f"{kind.name} reply"
        except FusionP2PError:
            key = "dropped"
        finally:
            held.append(time.monotonic() - start)
            await stream.close()
        outcomes[key] = outcomes.get(key, 0) + 1

    await asyncio.gather(*(one() for _ in range(n)))
    return f"{outcomes}, all gone after {max(held, default=0):.0f} s"


async def duplicate_opdata(owner: P2PTransport, peer: PeerProcess, copies: int = 135) -> str:
    """A job whose edge carries 32 MiB; its owner (a legit neighbour) sends one OpData ``copies`` times."""
    spec = ModelSpec("user_models:SkipNet", {"hidden": 4096}, input_shape=(2048, 12), input_dtype="float32")
    driver = await PipelineDriver.create(
        owner,
        spec,
        RuntimeLayout((owner.peer_id, peer.peer_id)),
        JobOptions(loss="classification", optimizer=OptimizerConfig(), timeout=120),
        addresses={peer.peer_id: peer.multiaddrs},
    )
    try:
        header = first_forward(driver.partition, driver.job, largest=True)
        body = bytes(header.body_bytes)
        stream = await owner.open(peer.peer_id, EXEC_PROTOCOL, timeout=30)
        kinds: dict[str, int] = {}
        first = 0
        for i in range(copies):
            if i == 1:
                await asyncio.sleep(1.0)  # the first copy is computed: the job's own working set
                first = rss(peer)[0]
            try:
                await stream.send(FrameKind.DATA, pack_message(header, body), timeout=60)
                kind, _ = await stream.recv(max_payload=1 << 20, timeout=60)
                kinds[kind.name] = kinds.get(kind.name, 0) + 1
            except FusionP2PError:
                kinds["closed"] = kinds.get("closed", 0) + 1
                await stream.close()
                stream = await owner.open(peer.peer_id, EXEC_PROTOCOL, timeout=30)
        await stream.close()
        grown = format_bytes(rss(peer)[0] - first)
        return f"{copies} x {format_bytes(len(body))}: {kinds}; the duplicates added {grown} RSS"
    finally:
        await driver.aclose()


async def huge_model(owner: P2PTransport, peer: PeerProcess) -> str:
    """A gpt2 setup with n_embd = 65536 (the schema's bound), traced fake here too."""
    spec = ModelSpec(
        "gpt2", {"n_layer": 2, "n_embd": 65536, "n_head": 64, "vocab_size": 50257}, input_shape=(1, 8)
    )
    peers = [(owner.peer_id, []), (peer.peer_id, peer.multiaddrs)]
    body = fake_setups(spec, peers, job="huge")[1].to_wire()
    client = ExecClient(owner, peer.peer_id, timeout=120)
    try:
        await client.request(ExecControl(command="setup", job="huge", body_bytes=len(body)), body)
        return "accepted (!)"
    except FusionP2PError as e:
        return f"refused: {str(e)[-120:]}"
    finally:
        await client.aclose()


async def malformed(stranger: P2PTransport, peer: PeerProcess) -> str:
    """A list as a record's kind, and a setup nested 60,000 levels deep (under the 64 KiB a
    control message may take, so the peer's decoder meets it)."""
    import msgpack

    replies = []
    wire = msgpack.packb({"kind": ["exec_control"], "v": 1})
    deep = b"\x91" * 60_000 + b"\x90"  # msgpack: an array holding an array ... holding []
    for payload in (
        len(wire).to_bytes(2, "big") + wire,
        pack_message(ExecControl(command="setup", job="deep", body_bytes=len(deep)), deep),
    ):
        stream = await stranger.open(peer.peer_id, EXEC_PROTOCOL, timeout=30)
        try:
            await stream.send(FrameKind.DATA, payload, timeout=30)
            kind, reply = await stream.recv(max_payload=1 << 20, timeout=30)
            replies.append(f"{kind.name}: {reply.decode()[:60]}")
        finally:
            await stream.close()
    return " | ".join(replies)


async def attack_all(local: LocalSwarm) -> list[dict[str, object]]:
    peer = local.peers[0]
    p2ps = [
        await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, initial_peers=local.initial_peers
        )
        for _ in range(2)
    ]
    owner, stranger = (P2PTransport(p) for p in p2ps)
    rows = []
    try:
        for name, attack in (
            ("512 MiB frame of junk", huge_frame(stranger, peer)),
            ("500 streams x partial 8 MiB frame", partial_frames(stranger, peer)),
            ("135 duplicate 32 MiB OpData", duplicate_opdata(owner, peer)),
            ("gpt2 with n_embd 65536", huge_model(owner, peer)),
            ("list as kind, deep setup", malformed(stranger, peer)),
        ):
            before, peak_before = rss(peer)
            start = time.monotonic()
            outcome = await attack
            after, peak_after = rss(peer)
            rows.append(
                {
                    "attack": name,
                    "rss_before": before,
                    "rss_after": after,
                    "peak_growth": peak_after - peak_before,
                    "seconds": time.monotonic() - start,
                    "outcome": outcome,
                    "alive": peer.popen.poll() is None,
                }
            )
            print(f"  {name}: {outcome}", flush=True)
    finally:
        for p2p in p2ps:
            await p2p.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH", "")]))}
    ModelRegistry(allow=["user_models:SkipNet"])  # fails here, not on the peer, if it cannot import
    print("starting one peer...", flush=True)
    with LocalSwarm(  # no coordinator: the peer takes unplanned jobs, the widest surface
        1,
        swarm="hostile",
        env=env,
        allow_models=["user_models:SkipNet"],
        log_level="warning",
        peer_args=[["--no-coordinator"]],
    ) as local:
        idle, _ = rss(local.peers[0])
        rows = asyncio.run(attack_all(local))
    print(f"\nidle peer RSS {format_bytes(idle)}\n")
    print(f"{'attack':<36} {'RSS before':>11} {'RSS after':>11} {'peak growth':>12} {'s':>5}  alive")
    for r in rows:
        print(
            f"{r['attack']:<36} {format_bytes(r['rss_before']):>11} {format_bytes(r['rss_after']):>11} "
            f"{format_bytes(r['peak_growth']):>12} {r['seconds']:>5.1f}  {r['alive']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["alive"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
