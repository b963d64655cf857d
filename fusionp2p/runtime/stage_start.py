"""Where a job's stages get their initial tensors, as its data owner sets them up.

One of four, checked before any stage hears of the job:

- ``seed``: each stage makes its own from the spec's seed (``opdag.init``); nothing is sent;
- ``shards``: each stage reads them from a checkpoint's shards, peer to peer, from the
  holders the data owner granted it (``runtime.restore``);
- ``owner`` (a checkpoint's tensors given here): the data owner sends each stage its part;
- pretrained weights: each stage makes its own from the seed, then the data owner sends it
  its saved tensors, read one at a time (``runtime.pretrained``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import safetensors.torch
import torch

from fusionp2p.errors import ConfigError
from fusionp2p.net.transport import Transport
from fusionp2p.opdag.families import ModelRegistry
from fusionp2p.opdag.split import Partition
from fusionp2p.opdag.trace import TracedModel
from fusionp2p.records import LocalWeights, ModelSpec, ShardSource
from fusionp2p.runtime.engines import stage_initial
from fusionp2p.runtime.executor import Executor
from fusionp2p.runtime.job_setup import JobOptions
from fusionp2p.runtime.pretrained import PretrainedWeights, SavedTensor, saved_tensors
from fusionp2p.runtime.restore import Restore, grant_sources, stage_sources
from fusionp2p.runtime.shard_store import ShardStore, namespace_of
from fusionp2p.runtime.shards import read_shards
from fusionp2p.runtime.stage_state import chunks
from fusionp2p.runtime.stage_tensors import check_checkpoint, restore_tensors

__all__ = ["StageStart"]

Named = Iterable[tuple[str, torch.Tensor]]


@dataclass
class StageStart:
    """How every stage of one job starts (see the module doc)."""

    part: Partition
    weights: str  # JobSetup.weights
    sources: dict[int, tuple[ShardSource, ...]] | None = None  # weights == "shards"
    state: Mapping[str, torch.Tensor] | None = None  # weights == "owner"
    pretrained: PretrainedWeights | None = None
    saved: dict[str, SavedTensor] = field(default_factory=dict)  # what the pretrained files replace

    @classmethod
    async def prepare(
        cls,
        transport: Transport,
        traced: TracedModel,
        part: Partition,
        peers: Sequence[str],
        options: JobOptions,
        *,
        state: Mapping[str, torch.Tensor] | None = None,
        pretrained: PretrainedWeights | None = None,
        restore: Restore | None = None,
        exclude: Collection[str] = (),
    ) -> StageStart:
        """Checks what the stages start from, and grants them a checkpoint's shards.

        Raises:
            ConfigError: a checkpoint that does not match the model, pretrained files that
                lack a tensor or have one of another shape, or shards without the run's
                secret or without a live holder.
            ProtocolError: no holder of a shard answers.
        """
        if state is not None:
            check_checkpoint(traced, part, state)
            return cls(part, "owner", state=state)
        if restore is not None:
            if not options.shard_secret or not options.run:
                raise ConfigError("restoring from shards needs the run and its shard secret (JobOptions)")
            ns = namespace_of(options.shard_secret)
            wanted = {
                s: stage_sources(restore, part.params[s], ns=ns, run=options.run, exclude=exclude)
                for s in range(len(peers))
            }
            granted = await grant_sources(
                transport, options.shard_secret, wanted, dict(enumerate(peers)), timeout=options.timeout
            )
            return cls(part, "shards", sources=granted)
        if pretrained is not None:
            saved = saved_tensors(traced.program)
            await asyncio.to_thread(pretrained.check, saved)
            return cls(part, "seed", pretrained=pretrained, saved=saved)
        return cls(part, "seed")

    async def own_initial(
        self, spec: ModelSpec, registry: ModelRegistry, stage: int
    ) -> dict[str, torch.Tensor] | None:
        """The data owner's own stage's tensors made from the seed (None: they come later)."""
        if self.weights != "seed":
            return None
        return await asyncio.to_thread(stage_initial, spec, registry, self.part.params[stage])

    async def load_own(
        self, executor: Executor, stage: int, transport: Transport, options: JobOptions
    ) -> None:
        """Loads the data owner's own stage's tensors, if they do not come from the seed."""
        if self.sources is not None:
            store = ShardStore(options.shard_dir) if options.shard_dir else None
            pieces = read_shards(
                transport,
                self.sources[stage],
                executor.state_sizes(),
                limits=options.limits,
                timeout=options.timeout,
                store=store,
            )
            async for data in pieces:
                await asyncio.to_thread(executor.load_state, data)
            return
        tensors = self.sent(stage)
        if tensors is not None:
            for chunk in chunks(tensors, options.limits.weights_chunk_bytes):
                await asyncio.to_thread(executor.load_state, safetensors.torch.save(chunk))

    def grant_local(self, store: ShardStore | None, peers: Sequence[str], options: JobOptions) -> None:
        """Lets the new stages read the shards this process holds (a lone stage peer's
        replica) from ``store``, the one its exec service serves."""
        if self.sources is None or store is None:
            return
        me = peers[self.part.data_stage]
        for stage, sources in self.sources.items():
            for source in sources:
                if stage != self.part.data_stage and me in source.holders:
                    store.grant(options.shard_secret, source.run, source.step, source.shard, [peers[stage]])

    def local_record(self, stage: int) -> LocalWeights | None:
        """What ``stage`` may load from its peer's own copy of the pretrained weights
        (``runtime.local_weights``; digests read here), or None: no pretrained weights."""
        if self.pretrained is None or not self.saved:
            return None
        names = [n for n in self.part.params[stage] if n in self.saved]
        return self.pretrained.local_record(names, self.saved)

    def sent(self, stage: int) -> Named | None:
        """The tensors the data owner sends ``stage`` (read one at a time where they come
        from files), or None: the stage gets its own."""
        names = self.part.params[stage]
        if self.state is not None:
            return restore_tensors(names, self.state).items()
        if self.pretrained is not None and self.saved:
            return self.pretrained.read([n for n in names if n in self.saved], self.saved)
        return None
