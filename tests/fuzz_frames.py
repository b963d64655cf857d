"""Random and mutated frames for the protocols a peer serves (test_security.py sends them).

Each payload is the raw bytes a hostile stranger writes on a fresh stream: junk, frames
with lying lengths, valid messages with wrong types in every field, truncated and
bit-flipped valid messages. Seeded, so a failure reproduces.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import msgpack
from hivemind.proto import dht_pb2

from fusionp2p.config import OptimizerConfig
from fusionp2p.net.framing import FRAME_VERSION, HEADER, FrameKind
from fusionp2p.records import (
    EXEC_COMMANDS,
    EXEC_PROTOCOL,
    PROBE_PROTOCOL,
    ExecControl,
    JobSetup,
    ModelSpec,
    OpData,
    pack_message,
)

__all__ = ["FrameFuzzer"]

_WRONG = [
    None,
    True,
    -1,
    0,
    2**64 + 1,
    -(2**63),
    1.5,
    float("inf"),
    "",
    "x" * 5000,
    [],
    [1, "a"],
    {},
    {"k": {}},
]


def frame(kind: int, payload: bytes, *, version: int = FRAME_VERSION, length: int | None = None) -> bytes:
    return HEADER.pack(version, kind, len(payload) if length is None else length) + payload


class FrameFuzzer:
    """Makes payloads; ``stranger`` and ``target`` are PeerIDs put into otherwise valid messages."""

    DHT_PROTOCOLS = ("DHTProtocol.rpc_ping", "DHTProtocol.rpc_store", "DHTProtocol.rpc_find")

    def __init__(self, rng: random.Random, *, stranger: str, target: str) -> None:
        self.rng = rng
        self.stranger = stranger
        self.target = target

    # -- building blocks -----------------------------------------------------------------
    def junk(self, n: int | None = None) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, 3000) if n is None else n)

    def wrong(self) -> object:
        return self.rng.choice(_WRONG)

    def setup_body(self) -> dict:
        setup = JobSetup(
            job="fuzz",
            spec=ModelSpec("gpt2", {"n_layer": 1, "n_embd": 8, "n_head": 2}, input_shape=(1, 4)),
            peers=((self.stranger, ()), (self.target, ())),
            node_ranges=((0, 1), (1, 3)),
            stage=1,
            data_stage=0,
            n_micro_batches=1,
            optimizer=OptimizerConfig(),
            fingerprint="0" * 16,
        )
        return msgpack.unpackb(setup.to_wire())

    def pack(self, body: object) -> bytes:
        try:
            return msgpack.packb(body, use_bin_type=True)
        except (OverflowError, ValueError, TypeError):
            return msgpack.packb({"kind": "job_setup", "v": [body.__class__.__name__]}, use_bin_type=True)

    def mutate_setup(self, body: dict) -> bytes:
        choice = self.rng.random()
        if choice < 0.5:  # a wrong type in one field, at any depth
            target = body
            key = self.rng.choice(sorted(target))
            if isinstance(target[key], dict) and target[key] and self.rng.random() < 0.5:
                target = target[key]
                key = self.rng.choice(sorted(target))
            target[key] = self.wrong()
            return self.pack(body)
        if choice < 0.6:  # nested far deeper than any field
            deep: object = []
            for _ in range(400):
                deep = [deep]
            return self.pack({**body, "spec": {**body["spec"], "config": {"deep": deep}}})
        if choice < 0.7:
            return self.pack({**body, "node_ranges": [[0, 2**40]] * 2})
        if choice < 0.8:
            return self.pack(body)[: self.rng.randint(0, 200)]
        if choice < 0.9:
            return b"\xc1" + self.pack(body)
        body["spec"]["family"] = self.rng.choice(["os:system", "subprocess:run", "builtins:eval", "x" * 200])
        return self.pack(body)

    def control(self) -> bytes:
        command = self.rng.choice(EXEC_COMMANDS)
        if command == "setup":
            body = self.mutate_setup(self.setup_body())
        else:
            body = self.junk(self.rng.choice([0, 8, 1000]))
        header = ExecControl(command=command, job=self.rng.choice(["fuzz", "x" * 200]), body_bytes=len(body))
        return pack_message(header, body)

    def raw_record(self, kind: str) -> bytes:
        fields: dict[str, object] = {"kind": kind, "v": self.rng.choice([1, 2, 99, "1"])}
        names = ["command", "job", "iteration", "what", "body_bytes", "direction", "producer", "consumers"]
        names += ["requires_grad", "micro_batch", "shape", "dtype", "compression", "src_stage", "dst_stage"]
        for name in names:
            if self.rng.random() < 0.7:
                fields[name] = self.wrong()
        try:
            wire = msgpack.packb(fields, use_bin_type=True)
        except (OverflowError, ValueError):
            wire = msgpack.packb({"kind": [kind]}, use_bin_type=True)
        body = self.junk(self.rng.randint(0, 64))
        return struct.pack("!H", len(wire)) + wire + body

    def opdata(self) -> bytes:
        shape = tuple(self.rng.choice([1, 3, 64, 2**20]) for _ in range(self.rng.randint(0, 4)))
        header = OpData(
            job=self.rng.choice(["fuzz", "x"]),
            direction=self.rng.choice(["forward", "backward"]),
            producer=self.rng.choice(["linear", "x" * 255]),
            consumers=("a",) * self.rng.randint(1, 60),
            requires_grad=self.rng.random() < 0.5,
            iteration=self.rng.randint(0, 2**40),
            micro_batch=self.rng.randint(0, 5),
            shape=shape,
            dtype=self.rng.choice(["float32", "int64", "bool"]),
            body_bytes=self.rng.randint(0, 4096),
            src_stage=self.rng.randint(0, 70),
            dst_stage=self.rng.randint(0, 70),
        )
        return pack_message(header, self.junk(header.body_bytes))

    # -- payloads per protocol -------------------------------------------------------------
    def exec_payload(self) -> bytes:
        makers: list[Callable[[], bytes]] = [
            lambda: self.junk(),
            lambda: frame(self.rng.randint(0, 255), self.junk(), version=self.rng.randint(0, 255)),
            lambda: frame(
                int(FrameKind.DATA), self.junk(100), length=self.rng.choice([2**32 - 1, 512 << 20, 1 << 20])
            ),
            lambda: frame(int(FrameKind.DATA), self.control()),
            lambda: frame(
                int(FrameKind.DATA), self.raw_record(self.rng.choice(["exec_control", "opdata", "peer"]))
            ),
            lambda: frame(int(FrameKind.DATA), self.opdata()),
            lambda: frame(int(FrameKind.DATA), self.control())[: self.rng.randint(1, 80)],
            lambda: self.flip(frame(int(FrameKind.DATA), self.control())),
            lambda: (
                frame(int(FrameKind.DATA), pack_message(ExecControl(command="ping", job="p"))) + self.junk()
            ),
            lambda: frame(self.rng.choice([int(k) for k in FrameKind]), self.junk(self.rng.randint(0, 64))),
        ]
        return self.rng.choice(makers)()

    def probe_payload(self) -> bytes:
        makers: list[Callable[[], bytes]] = [
            lambda: self.junk(),
            lambda: frame(int(FrameKind.PING), self.junk(self.rng.choice([4, 65, 5000]))),
            lambda: frame(int(FrameKind.DATA), b"", length=2**32 - 1),
            lambda: b"".join(frame(int(FrameKind.DATA), self.junk(1000)) for _ in range(5)) + frame(4, b""),
            lambda: frame(self.rng.randint(0, 255), self.junk(64)),
            lambda: self.flip(frame(int(FrameKind.PING), b"1234")),
        ]
        return self.rng.choice(makers)()

    def dht_payload(self, protocol: str) -> bytes:
        if self.rng.random() < 0.3:
            return self.junk()
        if protocol.endswith("store"):
            n = self.rng.randint(0, 5)
            request = dht_pb2.StoreRequest(
                keys=[self.junk(20) for _ in range(n)],
                subkeys=[self.junk(8) for _ in range(self.rng.randint(0, 5))],
                values=[self.junk(self.rng.randint(0, 3000)) for _ in range(self.rng.randint(0, 5))],
                expiration_time=[self.rng.uniform(-1e12, 1e12) for _ in range(n)],
                in_cache=[self.rng.random() < 0.5 for _ in range(n)],
            )
        elif protocol.endswith("find"):
            request = dht_pb2.FindRequest(
                keys=[self.junk(self.rng.randint(0, 64)) for _ in range(self.rng.randint(0, 50))]
            )
        else:
            request = dht_pb2.PingRequest(validate=self.rng.random() < 0.5)
        data = request.SerializeToString()
        return self.flip(data) if data and self.rng.random() < 0.5 else data

    def flip(self, data: bytes) -> bytes:
        out = bytearray(data)
        for _ in range(self.rng.randint(1, 8)):
            if out:
                out[self.rng.randrange(len(out))] ^= 1 << self.rng.randrange(8)
        return bytes(out)

    def payloads(self, n: int, *, protocols: list[str]) -> list[tuple[str, bytes]]:
        out = []
        for i in range(n):
            protocol = protocols[i % len(protocols)]
            if protocol == EXEC_PROTOCOL:
                out.append((protocol, self.exec_payload()))
            elif protocol == PROBE_PROTOCOL:
                out.append((protocol, self.probe_payload()))
            else:
                out.append((protocol, self.dht_payload(protocol)))
        return out
