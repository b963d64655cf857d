"""Throughput of the OpData path against a raw libp2p binary stream and plain asyncio TCP.

    python -m benchmarks.stream_bench [--mib 64] [--repeats 3] [--delay-ms 10] [--json out.json]

A second process (this module with ``--serve``) runs a real exec service whose executor
accepts every OpData without computing (so the path is measured, not the model), a raw
libp2p handler and a TCP server that read frames and acknowledge each. This process sends
``--mib`` MiB per case as 1, 4 and 16 MiB tensors and as 4 KiB messages, over each path,
the median of ``--repeats`` runs; then the same through a userspace relay that delays
every byte by ``--delay-ms`` each way (the RTT windowing must hide). Prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hivemind.p2p import P2P

from fusionp2p.config import ExecLimits, OptimizerConfig
from fusionp2p.net.framing import FrameKind, read_frame, write_frame
from fusionp2p.net.transport import FrameStream, P2PTransport
from fusionp2p.records import ExecControl, JobSetup, ModelSpec, OpData
from fusionp2p.runtime.codec import ExecClient
from fusionp2p.runtime.executor import Executor, Message
from fusionp2p.runtime.opdata_stream import OpDataSender
from fusionp2p.runtime.service import ExecutorService, ServicePolicy

RAW_PROTOCOL = "/fusionp2p/bench-raw/1"
SIZES = [(1 << 20, "1 MiB"), (4 << 20, "4 MiB"), (16 << 20, "16 MiB"), (4 << 10, "4 KiB")]
_MAX = 64 << 20


class NullExecutor(Executor):
    """Takes any forward OpData of a float32 vector and computes nothing."""

    def __init__(self, job: str) -> None:
        self.job, self.stage, self.iteration = job, 1, 0

    def check(self, header: OpData) -> None:
        pass

    def accept(self, header: OpData, body: bytes) -> list[Message]:
        return []

    def micro_batches_done(self, iteration: int) -> int:
        return 1

    def step(self, iteration: int) -> None:
        self.iteration += 1

    def state_dict(self) -> bytes:
        return b""

    def full_state(self) -> bytes:
        return b""

    def grads(self) -> bytes:
        return b""

    def load_state(self, data: bytes | bytearray) -> int:
        return 0

    def missing_state(self) -> int:
        return 0

    def max_message_bytes(self) -> int:
        return _MAX

    def state_sizes(self) -> dict[str, int]:
        return {}


async def _ack_frames(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        while True:
            kind, _ = await read_frame(reader, max_payload=_MAX, timeout=3600)
            if kind is FrameKind.END:
                return
            await write_frame(writer, FrameKind.ACK, b"\x01")


async def serve(info_path: str) -> None:
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    transport = P2PTransport(p2p)
    limits = ExecLimits(inbound_bytes=1 << 30, inbound_bytes_per_peer=512 << 20)
    policy = ServicePolicy(limits=limits, timeout=120)
    null_engine = {"torch": lambda setup, *_: NullExecutor(setup.job)}
    service = await ExecutorService(transport, policy, engines=null_engine).start()

    async def raw(stream: FrameStream) -> None:
        await _ack_frames(stream._reader, stream._writer)

    await transport.serve(RAW_PROTOCOL, raw)
    tcp = await asyncio.start_server(_ack_frames, "127.0.0.1", 0)
    info = {
        "peer_id": transport.peer_id,
        "maddrs": [str(m) for m in await p2p.get_visible_maddrs()],
        "tcp_port": tcp.sockets[0].getsockname()[1],
    }
    Path(info_path + ".tmp").write_text(json.dumps(info))
    os.replace(info_path + ".tmp", info_path)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    tcp.close()
    await service.aclose()
    await p2p.shutdown()


# -- client --------------------------------------------------------------------------------


async def _stream_frames(writer, recv_ack, payload: bytes, count: int) -> None:
    """Writes ``count`` frames back to back while a task reads one ACK per frame."""

    async def acks() -> None:
        for _ in range(count):
            await recv_ack()

    reader_task = asyncio.create_task(acks())
    for _ in range(count):
        await write_frame(writer, FrameKind.DATA, payload)
    await reader_task


async def raw_libp2p(transport: P2PTransport, peer_id: str, size: int, total: int) -> float:
    stream = await transport.open(peer_id, RAW_PROTOCOL, timeout=30)
    payload, count = bytes(size), max(1, total // size)
    start = time.perf_counter()
    await _stream_frames(stream._writer, lambda: stream.recv(max_payload=16, timeout=120), payload, count)
    elapsed = time.perf_counter() - start
    await stream.close()
    return elapsed


async def raw_tcp(port: int, size: int, total: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload, count = bytes(size), max(1, total // size)
    start = time.perf_counter()
    await _stream_frames(writer, lambda: read_frame(reader, max_payload=16, timeout=120), payload, count)
    elapsed = time.perf_counter() - start
    writer.close()
    return elapsed


class OpDataPath:
    """A job set up on the serving process, and a sender that streams OpData to it."""

    def __init__(self, transport: P2PTransport, peer_id: str, job: str) -> None:
        self.transport, self.peer_id = transport, peer_id
        self.control = ExecClient(transport, peer_id, timeout=120)
        self.job = job
        self.iteration = 0

    async def setup(self) -> None:
        body = JobSetup(
            job=self.job,
            spec=ModelSpec("gpt2"),
            peers=((self.transport.peer_id, ()), (self.peer_id, ())),
            node_ranges=((0, 1), (1, 2)),
            stage=1,
            data_stage=0,
            n_micro_batches=1,
            optimizer=OptimizerConfig(),
            fingerprint="0" * 16,
        ).to_wire()
        await self.control.request(ExecControl(command="setup", job=self.job, body_bytes=len(body)), body)

    async def teardown(self) -> None:
        await self.control.request(ExecControl(command="teardown", job=self.job))
        await self.control.aclose()

    def _header(self, i: int, size: int) -> OpData:
        return OpData(
            job=self.job,
            direction="forward",
            producer=f"p{i}",
            consumers=("c",),
            requires_grad=False,
            iteration=self.iteration,
            micro_batch=0,
            shape=(size // 4,),
            dtype="float32",
            body_bytes=size,
            src_stage=0,
            dst_stage=1,
        )

    async def _next_iteration(self) -> None:
        await self.control.request(ExecControl(command="step", job=self.job))  # `seen` is per iteration
        self.iteration += 1

    async def stop_and_wait(self, size: int, total: int) -> float:
        """Each OpData waits for its ACK before the next goes: how the runtime sent before."""
        client = ExecClient(self.transport, self.peer_id, timeout=120)
        body = bytes(size)
        start = time.perf_counter()
        for i in range(max(1, total // size)):
            await client.request(self._header(i, size), body)
        elapsed = time.perf_counter() - start
        await client.aclose()
        await self._next_iteration()
        return elapsed

    async def run(self, size: int, total: int) -> float:
        count = max(1, total // size)
        body = bytes(size)
        failures: list[str] = []

        async def done(_: int) -> None:
            pass

        async def failed(reason: str) -> None:
            failures.append(reason)

        sender = OpDataSender(self.transport, self.peer_id, timeout=120, on_done=done, on_error=failed)
        start = time.perf_counter()
        for i in range(count):
            header = self._header(i, size)
            await sender.put(Message(header, body))
        await sender.drained()
        elapsed = time.perf_counter() - start
        if failures:
            raise RuntimeError(failures[0])
        await sender.aclose()
        await self._next_iteration()
        return elapsed


class _Window:
    """TCP's congestion window as a WAN link makes a sender see it, for a relay whose own
    sockets see no round trip: at most ``cwnd`` bytes in flight, acknowledged one round trip
    after they left; each acknowledged byte grows the window by one (slow start doubles it
    every round trip), and a line idle for longer than ``IDLE_S`` starts again from
    ``INITIAL`` (Linux's slow start after idle)."""

    INITIAL = 10 * 1460
    MAX = 16 << 20
    IDLE_S = 0.3

    def __init__(self, rtt: float) -> None:
        self.rtt, self.cwnd, self.in_flight, self.last = rtt, self.INITIAL, 0, 0.0
        self.opened = asyncio.Event()
        self.opened.set()

    async def take(self, limit: int) -> int:
        """Bytes the sender may put on the line now (waits for room)."""
        if self.in_flight == 0 and time.monotonic() - self.last > self.IDLE_S:
            self.cwnd = self.INITIAL
        while self.in_flight >= self.cwnd:
            self.opened.clear()
            await self.opened.wait()
        return min(limit, self.cwnd - self.in_flight)

    def sent(self, nbytes: int, delivered_at: float) -> None:
        self.in_flight += nbytes
        loop = asyncio.get_running_loop()
        loop.call_at(
            loop.time() + max(0.0, delivered_at - time.monotonic()) + self.rtt / 2, self._ack, nbytes
        )

    def _ack(self, nbytes: int) -> None:
        self.in_flight -= nbytes
        self.cwnd = min(self.MAX, self.cwnd + nbytes)
        self.last = time.monotonic()
        self.opened.set()


class DelayRelay:
    """A TCP relay that delays every byte by ``delay`` seconds each way; given a ``rate``
    (bytes/s, 0: none) it carries at most that much each way, and with ``slow_start`` it
    ramps up as TCP over that round trip would (``_Window``). Run in its own process."""

    def __init__(self, target_port: int, delay: float, rate: float = 0.0, slow_start: bool = False) -> None:
        self.target_port, self.delay, self.rate, self.slow_start = target_port, delay, rate, slow_start

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        window = _Window(2 * self.delay) if self.slow_start else None
        free_at = 0.0  # when the rate-limited line is done with what it carried so far

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.close()
                    return
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(data)
                await writer.drain()

        task = asyncio.create_task(deliver())
        with contextlib.suppress(Exception):
            while True:
                limit = 64 << 10 if self.rate else 1 << 20
                if window is not None:
                    limit = await window.take(limit)
                data = await reader.read(limit)
                due = time.monotonic() + self.delay
                if self.rate and data:
                    free_at = max(free_at, time.monotonic()) + len(data) / self.rate
                    due = free_at + self.delay
                if window is not None and data:
                    window.sent(len(data), due)
                await queue.put((due, data))
                if not data:
                    break
        with contextlib.suppress(BaseException):
            await task

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        with contextlib.suppress(BaseException):
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def serve(self, info_path: str) -> None:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        Path(info_path + ".tmp").write_text(json.dumps({"port": server.sockets[0].getsockname()[1]}))
        os.replace(info_path + ".tmp", info_path)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        server.close()


async def measure(info: dict, relay_port: int, mib: int, repeats: int, delay_ms: float) -> list[dict]:
    total = mib << 20
    rows = []
    clients = {}
    routes = [("", info["maddrs"][0]), (f" +{2 * delay_ms:.0f} ms RTT", f"/ip4/127.0.0.1/tcp/{relay_port}")]
    for route, (name, maddr) in enumerate(routes):
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
        transport = P2PTransport(p2p)
        await transport.connect(info["peer_id"], [maddr], timeout=30)
        path = OpDataPath(transport, info["peer_id"], f"bench{os.getpid()}-{route}")
        await path.setup()
        clients[name] = p2p
        for size, label in SIZES:
            volume = total if size >= 1 << 20 else min(total, 32 << 20)
            cases = {
                "opdata": functools.partial(path.run, size, volume),
                "opdata stop-and-wait": functools.partial(path.stop_and_wait, size, min(volume, 8 << 20)),
                "raw libp2p": functools.partial(raw_libp2p, transport, info["peer_id"], size, volume),
            }
            if not name:
                cases["tcp"] = functools.partial(raw_tcp, info["tcp_port"], size, volume)
            for kind, run in cases.items():
                times = [await run() for _ in range(repeats)]
                seconds = statistics.median(times)
                count = max(1, (min(volume, 8 << 20) if "stop" in kind else volume) // size)
                rows.append(
                    {
                        "path": kind + name,
                        "message": label,
                        "mb_per_s": count * size / seconds / 1e6,
                        "messages_per_s": count / seconds,
                    }
                )
                print(
                    f"  {kind + name:<24} {label:>7}: {rows[-1]['mb_per_s']:8.1f} MB/s "
                    f"{rows[-1]['messages_per_s']:9.0f} msg/s",
                    flush=True,
                )
        await path.teardown()
    for p2p in clients.values():
        await p2p.shutdown()
    return rows


def _start(children: list[subprocess.Popen[bytes]], args: list[str], info_path: str) -> dict:
    """Starts this module as a child (serving, or relaying) and reads what it reports."""
    mode = args or ["--serve", info_path]
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.stream_bench", *mode, "--info", info_path])
    children.append(child)
    deadline = time.monotonic() + 60
    while not os.path.exists(info_path):
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the child {mode[0]} did not start")
        time.sleep(0.1)
    return json.loads(Path(info_path).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", metavar="INFO_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--relay-to", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--info", help=argparse.SUPPRESS)
    parser.add_argument("--mib", type=int, default=64, help="MiB sent per case (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay of the relay")
    parser.add_argument(
        "--rate-mbps", type=float, default=0.0, help="the relay's bandwidth each way (0: none)"
    )
    parser.add_argument("--slow-start", action="store_true", help="the relay ramps up as TCP over its RTT")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    if args.relay_to:
        import uvloop  # the relay must not be the bottleneck

        relay = DelayRelay(args.relay_to, args.delay_ms / 1000, args.rate_mbps * 1e6 / 8, args.slow_start)
        uvloop.run(relay.serve(args.info))
        return 0
    with tempfile.TemporaryDirectory(prefix="fusionp2p-bench-") as tmp:
        children = []
        try:
            info = _start(children, [], os.path.join(tmp, "serve.json"))
            port = int(info["maddrs"][0].split("/tcp/")[1].split("/")[0])
            relay_args = ["--relay-to", str(port), "--delay-ms", str(args.delay_ms)]
            relay = _start(children, relay_args, os.path.join(tmp, "relay.json"))
            rows = asyncio.run(measure(info, relay["port"], args.mib, args.repeats, args.delay_ms))
        finally:
            for child in children:
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(15)
                except subprocess.TimeoutExpired:
                    child.kill()
    by = {(r["path"], r["message"]): r for r in rows}
    delayed = next(r["path"].removeprefix("opdata") for r in rows if r["path"].startswith("opdata +"))
    print(
        f"\n{'message':>8} {'opdata':>8} {'stop&wait':>10} {'raw p2p':>8} {'tcp':>8} {'op/raw':>7} "
        f"| {'opdata':>8} {'stop&wait':>10} {'raw p2p':>8} {'op/raw':>7} {'op kept':>8}   <- with{delayed}"
    )
    for _, label in SIZES:
        unit = "mb_per_s" if label != "4 KiB" else "messages_per_s"
        o, sw, r, t = (by[(k, label)][unit] for k in ("opdata", "opdata stop-and-wait", "raw libp2p", "tcp"))
        od, swd, rd = (
            by[(k + delayed, label)][unit] for k in ("opdata", "opdata stop-and-wait", "raw libp2p")
        )
        print(
            f"{label:>8} {o:>8.1f} {sw:>10.1f} {r:>8.1f} {t:>8.1f} {o / r:>6.2f}x "
            f"| {od:>8.1f} {swd:>10.1f} {rd:>8.1f} {od / rd:>6.2f}x {od / o:>7.2f}x"
        )
    print("(MB/s; the 4 KiB row is messages/s. op kept = opdata with the delay / without it)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
