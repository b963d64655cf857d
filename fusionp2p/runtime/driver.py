"""The data owner's pipeline driver: sets a job up on every stage and drives its iterations.

The data owner traces the model from its spec, splits it (``opdag.split``), keeps the
stage that reads the raw inputs and computes the loss, and sends every other stage its
setup (spec, assignment, peers) and its initial weights as safetensors bytes. An
iteration injects each micro-batch's inputs locally; OpData then flows stage to stage
and back; when the data owner's backward is done for every micro-batch it asks every
stage to ``step``, and each one answers once its own backward finished and its
optimizer ran. Inputs, labels and the loss never leave this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Mapping, Sequence

import safetensors.torch
import torch

from fusionp2p.config import OptimizerConfig
from fusionp2p.errors import ConfigError, ProtocolError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import FrameStream, Transport
from fusionp2p.opdag.spec import ModelSpec
from fusionp2p.opdag.split import Partition, balanced_assignment, op_node_names, partition
from fusionp2p.opdag.trace import TracedModel, trace_module
from fusionp2p.records import ExecControl
from fusionp2p.runtime.service import EXEC_PROTOCOL, ExecutorService, JobSetup, request, unpack_message
from fusionp2p.runtime.torch_executor import LOSSES, TorchExecutor

__all__ = ["PipelineDriver"]

logger = logging.getLogger(__name__)


class PipelineDriver:
    """Runs a job from the data owner. Create with ``await PipelineDriver.create(...)``."""

    def __init__(
        self,
        service: ExecutorService,
        executor: TorchExecutor,
        traced: TracedModel,
        part: Partition,
        setups: list[JobSetup],
        streams: dict[int, FrameStream],
        timeout: float,
    ) -> None:
        self.service = service
        self.executor = executor
        self.traced = traced
        self.partition = part
        self.setups = setups
        self.iteration = 0
        self._streams = streams
        self._locks = {stage: asyncio.Lock() for stage in streams}
        self._timeout = timeout
        self._input_name = next(s for s in part.segments if s.kind == "source").nodes[0]

    @property
    def job(self) -> str:
        return self.executor.job

    @property
    def n_micro_batches(self) -> int:
        return self.executor.n_micro_batches

    @classmethod
    async def create(
        cls,
        transport: Transport,
        spec: ModelSpec,
        assignment: Sequence[int] | Mapping[str, int] | None,
        peers: Sequence[tuple[str, Sequence[str]]],
        *,
        data_stage: int = 0,
        n_micro_batches: int = 1,
        optimizer: OptimizerConfig | None = None,
        loss: str = "lm",
        ratios: Mapping[int, float] | None = None,
        timeout: float = 120.0,
        job: str | None = None,
    ) -> PipelineDriver:
        """Traces and splits the model, and sets up every stage.

        ``peers[s]`` is ``(peer id, multiaddrs)`` of stage ``s``'s owner; the data
        stage's entry is this process (its peer id must be the transport's). Without an
        ``assignment`` (a stage per operator node) the stages get contiguous pieces of equal
        forward FLOPs.

        Raises:
            ConfigError: a bad assignment, loss or peer list.
            ProtocolError / PeerUnreachableError: a stage refused its setup or is unreachable.
        """
        if loss not in LOSSES:
            raise ConfigError(f"loss must be one of {sorted(LOSSES)}, got {loss!r}")
        n_stages = len(peers)
        if not 0 <= data_stage < n_stages or peers[data_stage][0] != transport.peer_id:
            raise ConfigError(f"stage {data_stage} must be this data owner ({transport.peer_id[:12]})")
        optimizer = optimizer or OptimizerConfig()
        job = job or uuid.uuid4().hex[:12]

        def trace() -> tuple[TracedModel, Partition]:
            traced = trace_module(spec.build(), [spec.example_input()], strip_prefix=spec.strip_prefix)
            stages = assignment
            if stages is None:
                stages = balanced_assignment([n.fwd_flops for n in traced.dag.nodes], n_stages)
            return traced, partition(traced.program, stages, n_stages, data_stage=data_stage)

        traced, part = await asyncio.to_thread(trace)
        for note in part.moved:
            logger.info("assignment adjusted: %s", note)
        ops = op_node_names(traced.program.graph)
        stage_list = tuple(part.stage_of[n] for n in ops)
        ratio_items = tuple(sorted((ratios or {}).items()))
        setups = [
            JobSetup(
                job=job,
                spec_json=spec.to_json(),
                assignment=stage_list,
                n_stages=n_stages,
                stage=s,
                data_stage=data_stage,
                peers=tuple((p, tuple(m)) for p, m in peers),
                n_micro_batches=n_micro_batches,
                optimizer=optimizer,
                fingerprint=part.fingerprint,
                ratios=ratio_items,
            )
            for s in range(n_stages)
        ]
        executor = TorchExecutor(
            traced.program,
            part,
            data_stage,
            job=job,
            n_micro_batches=n_micro_batches,
            optimizer=optimizer,
            loss_fn=LOSSES[loss],
            ratios=dict(ratio_items),
        )
        service = await ExecutorService(transport, timeout=timeout).start()
        service.install(executor, setups[data_stage])
        streams: dict[int, FrameStream] = {}
        driver = cls(service, executor, traced, part, setups, streams, timeout)
        try:
            for s, (peer_id, maddrs) in enumerate(peers):
                if s != data_stage:
                    if maddrs:
                        await transport.connect(peer_id, maddrs, timeout=timeout)
                    streams[s] = await transport.open(peer_id, EXEC_PROTOCOL, timeout=timeout)
            driver._locks = {stage: asyncio.Lock() for stage in streams}
            await asyncio.gather(*(driver._setup_stage(s) for s in streams))
        except BaseException:
            await driver.aclose()
            raise
        logger.info(
            "job %s: %d stages, %d segments, %d micro-batches",
            job,
            n_stages,
            len(part.segments),
            n_micro_batches,
        )
        return driver

    async def _setup_stage(self, stage: int) -> None:
        setup = self.setups[stage]
        body = setup.to_json()
        await self._control(stage, ExecControl(command="setup", job=self.job, body_bytes=len(body)), body)
        state = self.traced.program.state_dict
        trainable = set(self.traced.program.graph_signature.inputs_to_parameters.values())
        weights = {
            name: state[name].detach().contiguous()
            for name in self.partition.params[stage]
            if name in trainable
        }
        data = safetensors.torch.save(weights)
        await self._control(stage, ExecControl(command="weights", job=self.job, body_bytes=len(data)), data)

    async def _control(self, stage: int, header: ExecControl, body: bytes = b"") -> tuple[FrameKind, bytes]:
        async with self._locks[stage]:
            return await request(self._streams[stage], header, body, timeout=self._timeout)

    async def run_iteration(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Forward and backward of one iteration's micro-batches on every stage; the losses.

        Raises:
            ValueError: not ``n_micro_batches`` batches.
            ProtocolError: a stage failed or did not finish in time.
        """
        if len(batches) != self.n_micro_batches:
            raise ValueError(f"expected {self.n_micro_batches} micro-batches, got {len(batches)}")
        for m, (inputs, labels) in enumerate(batches):
            self.service.submit(
                functools.partial(self.executor.start, self.iteration, m, {self._input_name: inputs}, labels)
            )
        await self.service.wait_ready(self.iteration, self.n_micro_batches)
        return [self.executor.losses[m] for m in range(self.n_micro_batches)]

    async def step(self) -> None:
        """Every stage applies its optimizer once its backward of this iteration finished."""
        iteration = self.iteration
        header = ExecControl(
            command="step", job=self.job, iteration=iteration, n_micro_batches=self.n_micro_batches
        )

        async def local() -> None:
            await self.service.wait_ready(iteration, self.n_micro_batches)
            await self.service.in_pool(functools.partial(self.executor.step, iteration))

        await asyncio.gather(local(), *(self._control(s, header) for s in self._streams))
        self.iteration += 1

    async def train_step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One iteration and its optimizer step; the mean micro-batch loss."""
        losses = await self.run_iteration(batches)
        await self.step()
        return sum(losses) / len(losses)

    async def fetch(self, what: str) -> dict[str, torch.Tensor]:
        """Every stage's parameters (``"params"``) or this iteration's gradients (``"grads"``)."""
        header = ExecControl(
            command="fetch",
            job=self.job,
            what=what,
            iteration=self.iteration,
            n_micro_batches=self.n_micro_batches,
        )
        if what == "grads":
            await self.service.wait_ready(self.iteration, self.n_micro_batches)
        local = self.executor.grads() if what == "grads" else self.executor.state_dict()
        merged = dict(safetensors.torch.load(local))
        replies = await asyncio.gather(*(self._control(s, header) for s in self._streams))
        for kind, payload in replies:
            if kind is not FrameKind.DATA:
                raise ProtocolError(f"fetch {what}: expected DATA, got {kind.name}")
            _, body = unpack_message(payload)
            merged.update(safetensors.torch.load(body))
        return merged

    async def aclose(self) -> None:
        for stream in self._streams.values():
            with contextlib.suppress(Exception):
                await stream.send(FrameKind.END, timeout=2.0)
            await stream.close()
        await self.service.aclose()
