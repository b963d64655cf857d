"""The data owner's pipeline driver: sets a job up on every stage and drives its iterations.

The data owner traces the model from its spec under a fake tensor mode (nothing
allocated), splits it (``opdag.split``), keeps the stage that reads the raw inputs and
computes the loss, and sends every other stage its setup (spec, assignment, peers). Each
stage makes its own initial tensors from the spec's seed (``opdag.init``), so no weights
travel at setup and this process never holds another stage's tensors; only a restored
checkpoint's tensors are sent, each stage its own, as safetensors chunks. An
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
import math
from collections.abc import Collection, Mapping, Sequence

import safetensors.torch
import torch

from fusionp2p.config import DEFAULT_TIMEOUTS, ExecLimits
from fusionp2p.errors import ConfigError, FusionP2PError, ProtocolError
from fusionp2p.net.framing import FrameKind
from fusionp2p.net.transport import Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.ir import LOSS_ID
from fusionp2p.opdag.spec import resolve_spec
from fusionp2p.opdag.split import Partition, balanced_assignment, op_node_names, partition
from fusionp2p.opdag.trace import TracedModel, trace_spec
from fusionp2p.planning import RuntimeLayout
from fusionp2p.records import (
    CONTROL_REPLY_BYTES,
    FETCHABLE,
    FINGERPRINT,
    STEP_REPLY,
    ExecControl,
    JobSetup,
    ModelSpec,
    ReplicaGroup,
    ShardOrder,
    ShardReport,
)
from fusionp2p.runtime.averaging import Fingerprint, parameter_fingerprint
from fusionp2p.runtime.codec import ExecClient, unpack_message
from fusionp2p.runtime.engines import check_stage_memory, memory_allowance
from fusionp2p.runtime.job_setup import JobOptions, stage_setups
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.runtime.memory import stage_memory
from fusionp2p.runtime.pretrained import PretrainedWeights
from fusionp2p.runtime.restore import Restore, check_report, request_shard
from fusionp2p.runtime.service import ExecutorService, ServicePolicy
from fusionp2p.runtime.shards import shard_name
from fusionp2p.runtime.stage_start import StageStart
from fusionp2p.runtime.stage_tensors import belongs_to_stage, chunks
from fusionp2p.runtime.torch_executor import TorchExecutor

__all__ = ["PipelineDriver", "owner_service"]

logger = logging.getLogger(__name__)

_SAFETENSORS_SLACK = 64 << 10  # header of a safetensors blob, beyond its tensors' bytes


def _positions(traced: TracedModel, layout: RuntimeLayout) -> tuple[int, ...]:
    """The layout's assignment as a stage per OP-DAG position (by default contiguous pieces
    of equal forward FLOPs).

    Raises:
        ConfigError: node names the graph does not have, or misses some.
    """
    ops = op_node_names(traced.program.graph)
    given = layout.assignment
    if given is None:
        flops = [n.fwd_flops for n in traced.dag.nodes if n.id != LOSS_ID]  # the loss is the data owner's
        return tuple(balanced_assignment(flops, len(layout.peers)))
    if isinstance(given, Mapping):
        unknown, missing = set(given) - set(ops), [n for n in ops if n not in given]
        if unknown or missing:
            raise ConfigError(f"assignment names unknown nodes {sorted(unknown)[:5]} or misses {missing[:5]}")
        return tuple(int(given[n]) for n in ops)
    return tuple(int(s) for s in given)


def _trace_and_split(
    spec: ModelSpec, registry: ModelRegistry, layout: RuntimeLayout, expect_dag: str | None
) -> tuple[TracedModel, tuple[int, ...], Partition]:
    traced = trace_spec(spec, registry, fake=True)
    if expect_dag is not None and traced.dag.fingerprint != expect_dag:
        raise ConfigError(
            f"the plan splits OP-DAG {expect_dag}, this model traced to {traced.dag.fingerprint}"
        )
    assignment = _positions(traced, layout)
    part = partition(traced.program, assignment, len(layout.peers), data_stage=layout.data_stage)
    return traced, assignment, part


async def owner_service(transport: Transport, options: JobOptions, jobs: int = 1) -> ExecutorService:
    """The exec service a data owner runs its own stage(s) of ``jobs`` jobs on: it takes no
    setups, only its stages' OpData."""
    policy = ServicePolicy(
        accept_setups=False,
        max_jobs=jobs,
        limits=options.limits,
        timeout=options.timeout,
        shard_dir=options.shard_dir,
    )
    return await ExecutorService(transport, policy).start()


class PipelineDriver:
    """Runs a job from the data owner. Create with ``await PipelineDriver.create(...)``."""

    def __init__(
        self,
        service: ExecutorService,
        executor: TorchExecutor,
        traced: TracedModel,
        part: Partition,
        setups: list[JobSetup],
        clients: dict[int, ExecClient],
        limits: ExecLimits,
        start: StageStart | None = None,
    ) -> None:
        self.service = service
        self.owns_service = True  # False for a replica: the replicated driver closes the service
        self.executor = executor
        self.traced = traced
        self.partition = part
        self.setups = setups
        self.iteration = 0
        self.stage_seconds: list[float] = []  # per stage: compute seconds of the last iteration
        self.stage_held: list[int] = []  # per stage: most micro-batches held at once in the last iteration
        # per stage: (seconds averaging, replicas averaged together) in the last step; (0, 0): alone
        self.stage_averaging: list[tuple[float, int]] = []
        self._clients = clients
        self._limits = limits
        self._input_name = next(s for s in part.segments if s.kind == "source").nodes[0]
        self._start = start

    @property
    def job(self) -> str:
        return self.executor.job

    @property
    def n_micro_batches(self) -> int:
        return self.executor.n_micro_batches

    @property
    def stage_owners(self) -> list[str]:
        """The peers that run this job's other stages."""
        return [client.peer_id for client in self._clients.values()]

    @classmethod
    async def create(
        cls,
        transport: Transport,
        spec: ModelSpec,
        layout: RuntimeLayout,
        options: JobOptions | None = None,
        *,
        addresses: Mapping[str, Sequence[str]] | None = None,
        registry: ModelRegistry | None = None,
        initial_state: Mapping[str, torch.Tensor] | None = None,
        pretrained: PretrainedWeights | None = None,
        restore: Restore | None = None,
        exclude: Collection[str] = (),
        service: ExecutorService | None = None,
    ) -> PipelineDriver:
        """Traces and splits the model, and sets up every stage.

        ``layout.peers[s]`` runs stage ``s``; the data stage is this process (its peer id
        must be the transport's). ``addresses[peer]`` are multiaddrs to dial a peer at.
        ``registry`` builds the model here (default: the built-in families, installed entry
        points and ``spec.family`` itself if it is an import path, since this process chose
        it); every stage peer builds it from its own registry. Each stage makes its initial
        tensors from ``spec.seed``; ``initial_state`` (a checkpoint: every tensor by name,
        optimizer state as ``name#key``) replaces them on every stage, this one included,
        each stage receiving its own part. Without one, ``pretrained`` weights (checked
        before any stage hears of the job) replace each stage's saved tensors, read here one
        at a time and sent to their stage only. ``restore`` (a checkpoint kept by the stages,
        needing ``options.shard_secret``) has every stage, this one included, read its
        tensors from the shards' holders but ``exclude``, peer to peer. ``service``: the
        exec service this process's stage joins (one per process: replicas share it; the
        caller closes it); by default the driver starts its own.

        Raises:
            ConfigError: a bad layout, options or model config, or a checkpoint that does
                not match the model.
            LimitError: this process's own stage needs more than ``options.max_memory``.
            ProtocolError / PeerUnreachableError: a stage refused its setup (the peer's
                reason is in the message) or is unreachable.
        """
        options = options or JobOptions()
        addresses = addresses or {}
        data_stage = layout.data_stage
        if not 0 <= data_stage < len(layout.peers) or layout.peers[data_stage] != transport.peer_id:
            raise ConfigError(f"stage {data_stage} must be this data owner ({transport.peer_id[:12]})")
        registry = registry or ModelRegistry.for_data_owner(spec.family)
        resolve_spec(
            spec, registry
        )  # an unknown family or a bad config fails here, before any peer hears of it
        traced, assignment, part = await asyncio.to_thread(
            _trace_and_split, spec, registry, layout, options.expect_dag
        )
        if part.moved:  # one line; each move at debug level
            logger.info("assignment adjusted: %d node(s) moved, e.g. %s", len(part.moved), part.moved[0])
        for note in part.moved:
            logger.debug("assignment adjusted: %s", note)
        start = await StageStart.prepare(
            transport,
            traced,
            part,
            layout.peers,
            options,
            state=initial_state,
            pretrained=pretrained,
            restore=restore,
            exclude=exclude,
        )
        setups = stage_setups(
            spec,
            traced.dag.fingerprint,
            assignment,
            part,
            layout,
            options,
            addresses,
            weights=start.weights,
            restore=start.sources,
        )
        need = stage_memory(
            traced, part, data_stage, in_flight=setups[data_stage].in_flight, optimizer=options.optimizer
        )
        check_stage_memory(
            need,
            memory_allowance(options.max_memory),
            f"the data owner's stage {data_stage} of job {options.job}",
            "this data owner allows ([train] max_memory)",
        )
        executor = TorchExecutor(
            traced.program,
            part,
            data_stage,
            job=options.job,
            n_micro_batches=options.n_micro_batches,
            optimizer=options.optimizer,
            loss_fn=LOSSES[options.loss],
            ratios=dict(setups[data_stage].ratios),
            plan_version=options.plan_version,
            ratio_warmup=options.ratio_warmup,
            materialize=False,
            initial=await start.own_initial(spec, registry, data_stage),
        )
        await start.load_own(executor, data_stage, transport, options)
        owns_service = service is None
        if service is None:
            service = await owner_service(transport, options)
        service.install(executor, setups[data_stage], owner=transport.peer_id)
        start.grant_local(service.shards.store, layout.peers, options)
        clients = {
            s: ExecClient(transport, peer_id, timeout=options.timeout)
            for s, peer_id in enumerate(layout.peers)
            if s != data_stage
        }
        driver = cls(service, executor, traced, part, setups, clients, options.limits, start)
        driver.owns_service = owns_service
        try:
            for s, peer_id in enumerate(layout.peers):
                if s != data_stage and addresses.get(peer_id):
                    await transport.connect(peer_id, addresses[peer_id], timeout=options.timeout)
            await asyncio.gather(*(driver._setup_stage(s) for s in clients))
        except BaseException:
            await driver.aclose()
            raise
        logger.info(
            "job %s: %d stages, %d segments, %d micro-batches",
            options.job,
            len(layout.peers),
            len(part.segments),
            options.n_micro_batches,
        )
        return driver

    def _stage_tensors(self, stage: int, *, trainable_only: bool) -> dict[str, torch.Tensor]:
        """A stage's tensors as shapes and dtypes (``meta`` tensors, from the fake trace):
        all of them, or its trainable parameters (what fetch returns)."""
        program = self.traced.program
        state = {**getattr(program, "constants", {}), **program.state_dict}
        trainable = set(program.graph_signature.inputs_to_parameters.values())
        return {
            name: torch.empty(tuple(state[name].shape), dtype=state[name].dtype, device="meta")
            for name in self.partition.params[stage]
            if name in trainable or not trainable_only
        }

    async def _setup_stage(self, stage: int) -> None:
        body = self.setups[stage].to_wire()
        client = self._clients[stage]
        await client.request(ExecControl(command="setup", job=self.job, body_bytes=len(body)), body)
        tensors = self._start.sent(stage) if self._start is not None else None
        if tensors is None:
            return  # the stage gets its own tensors
        if self._start is not None and await self._load_local(stage, client):
            return
        pieces = iter(chunks(tensors, self._limits.weights_chunk_bytes))
        while (chunk := await asyncio.to_thread(next, pieces, None)) is not None:
            data = safetensors.torch.save(chunk)
            await client.request(ExecControl(command="weights", job=self.job, body_bytes=len(data)), data)

    async def _load_local(self, stage: int, client: ExecClient) -> bool:
        """Whether ``stage`` loaded its pretrained tensors from its peer's own copy."""
        assert self._start is not None
        record = await asyncio.to_thread(self._start.local_record, stage)
        if record is None:
            return False
        wire = record.to_wire()
        try:
            await client.request(ExecControl(command="load_local", job=self.job, body_bytes=len(wire)), wire)
            return True
        except ProtocolError as e:  # no copy there, or another one: send the tensors instead
            logger.info("stage %d loads no local pretrained weights (%s); sending them", stage, e)
            return False

    async def checkpoint(self, step: int, replicas: Mapping[int, str]) -> list[ShardReport]:
        """Every stage writes its shard of ``step`` on its own disk and copies it to
        ``replicas[stage]`` (this process's own shard stays here); their reports, checked.

        Raises:
            ConfigError: the job keeps no shards (no ``JobOptions.shard_secret``).
            ProtocolError / PeerUnreachableError: a stage refused, failed or is gone.
        """
        own_setup = self.setups[self.executor.stage]
        if not own_setup.shard_ns:
            raise ConfigError(f"job {self.job} keeps no shard checkpoints (it has no run secret)")
        version, data_stage = self.executor.plan_version, self.partition.data_stage
        job = self.service.jobs[self.job]
        own = ShardOrder(step, shard_name(version, data_stage))
        _, body = unpack_message(await self.service.shards.checkpoint(job, own.to_wire()))
        reports = [ShardReport.from_wire(body)]
        stages = list(self._clients)
        orders = [ShardOrder(step, shard_name(version, s), replicas.get(s, "")) for s in stages]
        got = await asyncio.gather(
            *(request_shard(self._clients[s], self.job, o) for s, o in zip(stages, orders, strict=True))
        )
        for stage, order, report in zip(stages, orders, got, strict=True):
            names = set(self.partition.params[stage])
            holders = {self.setups[stage].peer_of(stage), *([order.replica] if order.replica else [])}
            check_report(report, order.shard, names, holders)
            reports.append(report)
        return reports

    async def run_iteration(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Forward and backward of one iteration's micro-batches on every stage; the losses.

        Raises:
            ValueError: not ``n_micro_batches`` batches.
            ConfigError: a micro-batch's inputs are not of the traced shape and dtype
                (nothing was sent).
            ProtocolError: a stage failed or did not finish in time.
        """
        if len(batches) != self.n_micro_batches:
            raise ValueError(f"expected {self.n_micro_batches} micro-batches, got {len(batches)}")
        spec = self.setups[self.executor.stage].spec
        shape, dtype = tuple(spec.input_shape), getattr(torch, spec.input_dtype)
        for m, (inputs, _) in enumerate(batches):  # checked here: a stage would fail deep in its graph
            if tuple(inputs.shape) != shape or inputs.dtype != dtype:
                raise ConfigError(
                    f"micro-batch {m}: inputs of shape {list(inputs.shape)} ({inputs.dtype}), but the model "
                    f"was traced for {list(shape)} ({dtype}): every micro-batch must have that shape"
                )
        window = self.setups[self.executor.stage].in_flight
        for m, (inputs, labels) in enumerate(batches):
            if m >= window:  # 1F1B: a new micro-batch only when an old one finished its backward
                await self.service.wait_done(self.job, m - window + 1)
            start = functools.partial(
                self.executor.start, self.iteration, m, {self._input_name: inputs}, labels
            )
            await self.service.submit(self.job, start, starts=m)
        await self.service.wait_ready(self.job)
        return [self.executor.losses[m] for m in range(self.n_micro_batches)]

    async def step(self) -> None:
        """Every stage applies its optimizer once its backward of this iteration finished."""
        header = ExecControl(
            command="step", job=self.job, iteration=self.iteration, n_micro_batches=self.n_micro_batches
        )
        own, replies = await asyncio.gather(
            self.service.step(self.job),
            asyncio.gather(*(client.request(header) for client in self._clients.values())),
        )
        reports = {self.partition.data_stage: own}
        for stage, (_, payload) in zip(self._clients, replies, strict=True):
            fine = len(payload) == STEP_REPLY.size
            reports[stage] = STEP_REPLY.unpack(payload) if fine else (math.nan, 0, math.nan, 0)
        self.stage_seconds = [reports[s][0] for s in sorted(reports)]
        self.stage_held = [reports[s][1] for s in sorted(reports)]
        self.stage_averaging = [(reports[s][2], reports[s][3]) for s in sorted(reports)]
        self.iteration += 1

    async def train_step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One iteration and its optimizer step; the mean micro-batch loss."""
        losses = await self.run_iteration(batches)
        await self.step()
        return sum(losses) / len(losses)

    async def fetch(self, what: str) -> dict[str, torch.Tensor]:
        """Every stage's parameters (``"params"``), this iteration's gradients (``"grads"``),
        or everything a checkpoint holds (``"state"``: every tensor and the optimizer's)."""
        if what not in FETCHABLE or what == "fingerprint":
            raise ValueError(f"fetch one of {FETCHABLE[:-1]}, not {what!r} (fingerprints())")
        header = ExecControl(
            command="fetch",
            job=self.job,
            what=what,
            iteration=self.iteration,
            n_micro_batches=self.n_micro_batches,
        )
        if what == "grads":
            await self.service.wait_ready(self.job)
        read = {"params": self.executor.state_dict, "grads": self.executor.grads, "state": None}[what]
        local = read() if read is not None else await asyncio.to_thread(self.executor.full_state)
        merged = dict(safetensors.torch.load(local))

        async def remote(stage: int, client: ExecClient) -> dict[str, torch.Tensor]:
            weights = self._stage_tensors(stage, trainable_only=what != "state")
            nbytes = sum(t.numel() * t.element_size() for t in weights.values())
            if what == "state":  # optimizer state: at most three tensors the size of each, plus a step
                nbytes = 4 * nbytes + 64 * len(weights)
            limit = nbytes + _SAFETENSORS_SLACK
            kind, payload = await client.request(header, max_reply=limit + CONTROL_REPLY_BYTES)
            if kind is not FrameKind.DATA:
                raise ProtocolError(f"fetch {what} from stage {stage}: expected DATA, got {kind.name}")
            _, body = unpack_message(payload)
            try:
                tensors = safetensors.torch.load(bytes(body))
            except Exception as e:
                raise ProtocolError(
                    f"fetch {what} from stage {stage}: not safetensors: {str(e)[:200]}"
                ) from e
            trainable = self._stage_tensors(stage, trainable_only=True)
            wrong = sorted(n for n, t in tensors.items() if not belongs_to_stage(n, t, weights, trainable))
            if wrong:
                raise ProtocolError(
                    f"fetch {what} from stage {stage}: tensors that are not this stage's {wrong[:3]}"
                )
            return tensors

        for tensors in await asyncio.gather(*(remote(s, c) for s, c in self._clients.items())):
            merged.update(tensors)
        return merged

    async def fingerprints(self) -> dict[int, Fingerprint]:
        """Per stage, statistics of its parameters (``runtime.averaging.parameter_fingerprint``).

        Raises:
            ProtocolError / PeerUnreachableError: a stage refused, failed or is gone.
        """
        header = ExecControl(command="fetch", job=self.job, what="fingerprint", iteration=self.iteration)
        own = parameter_fingerprint(await self.service.in_pool(self.executor.param_tensors))

        async def remote(stage: int, client: ExecClient) -> Fingerprint:
            kind, payload = await client.request(header, max_reply=FINGERPRINT.size + CONTROL_REPLY_BYTES)
            _, body = unpack_message(payload)
            if kind is not FrameKind.DATA or len(body) != FINGERPRINT.size:
                raise ProtocolError(f"stage {stage} of job {self.job}: not a parameter fingerprint")
            values = FINGERPRINT.unpack(bytes(body))
            if not all(math.isfinite(v) for v in values):
                raise ProtocolError(f"stage {stage} of job {self.job}: parameters that are not finite")
            return values[0], values[1], values[2], values[3]

        stages = list(self._clients)
        got = await asyncio.gather(*(remote(s, self._clients[s]) for s in stages))
        return {self.partition.data_stage: own, **dict(zip(stages, got, strict=True))}

    async def regroup(self, generation: int, replica: int, peers: Mapping[int, tuple[str, ...]]) -> None:
        """Tells each stage ``s`` of this replica to average with ``peers[s]`` from now on,
        as the ``replica``-th of them, in averaging group ``generation``.

        Raises:
            ProtocolError / PeerUnreachableError: a stage refused or is gone.
        """

        async def tell(stage: int, client: ExecClient) -> None:
            body = ReplicaGroup(generation, replica, peers[stage]).to_wire()
            await client.request(ExecControl(command="regroup", job=self.job, body_bytes=len(body)), body)

        await asyncio.gather(*(tell(s, c) for s, c in self._clients.items()))

    async def unresponsive(self, timeout: float = DEFAULT_TIMEOUTS.ping) -> list[str]:
        """The stage owners that said they leave the swarm, and those that do not answer a
        ping within ``timeout`` s (dead or stopped); each is asked on a fresh stream, so a
        stuck request of the job cannot hide it."""
        leaving = self.service.leaving(self.job)
        ping = ExecControl(command="ping", job=self.job)

        async def alive(peer_id: str) -> bool:
            client = ExecClient(self.service.transport, peer_id, timeout=timeout)
            try:
                await asyncio.wait_for(client.request(ping), timeout)
                return True
            except (TimeoutError, FusionP2PError) as e:
                logger.info("job %s: stage owner %s does not answer: %s", self.job, peer_id[-8:], e)
                return False
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.aclose(), timeout)

        peers = [client.peer_id for client in self._clients.values() if client.peer_id not in leaving]
        answers = await asyncio.gather(*(alive(p) for p in peers))
        return sorted(leaving) + [p for p, ok in zip(peers, answers, strict=True) if not ok]

    async def aclose(self, teardown_timeout: float = DEFAULT_TIMEOUTS.teardown) -> None:
        """Tears the job down on every stage (best effort, each within ``teardown_timeout``
        s) and stops serving it here."""
        teardown = ExecControl(command="teardown", job=self.job)

        async def end(client: ExecClient) -> None:
            try:
                await asyncio.wait_for(client.request(teardown), teardown_timeout)
            except Exception as e:  # the stage may be gone; it frees the job on its own then
                logger.debug("teardown of job %s at %s: %s", self.job, client.peer_id[:12], e)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), teardown_timeout)

        await asyncio.gather(*(end(c) for c in self._clients.values()))
        if self.owns_service:
            await self.service.aclose()
