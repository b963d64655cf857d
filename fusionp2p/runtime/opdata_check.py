"""What an inbound OpData header must be before a stage touches its body: checked
against the plan's partition, never trusted (a peer on a public swarm faces strangers)."""

from __future__ import annotations

from collections.abc import Sequence

from fusionp2p.errors import ProtocolError
from fusionp2p.opdag.split import Partition, Segment
from fusionp2p.records import OpData
from fusionp2p.runtime.tensor_wire import body_bytes, max_body_bytes

__all__ = ["check_opdata", "reader_segment"]


def check_opdata(header: OpData, p: Partition, *, stage: int, job: str, n_micro_batches: int) -> None:
    """Raises ``ProtocolError`` unless ``header`` is an OpData that stage ``stage`` of
    ``p`` can take for ``job``: its stages, producer, consumers, direction, shape, dtype
    and body size all as the partition says."""
    if header.job != job:
        raise ProtocolError(f"OpData for job {header.job!r}, this executor runs {job!r}")
    if not 0 <= header.micro_batch < n_micro_batches:
        raise ProtocolError(f"micro-batch {header.micro_batch} not in [0, {n_micro_batches})")
    if header.dst_stage != stage or not 0 <= header.src_stage < p.n_stages or header.src_stage == stage:
        raise ProtocolError(
            f"OpData from stage {header.src_stage} to {header.dst_stage} reached stage {stage}"
        )
    info = p.values.get(header.producer)
    if info is None:
        raise ProtocolError(f"unknown producer {header.producer!r}")
    if header.direction == "forward":
        if p.stage_of[header.producer] != header.src_stage:
            raise ProtocolError(f"{header.producer!r} is not produced on stage {header.src_stage}")
        readers = set(p.reader_nodes(header.producer, stage))
        if not readers or not set(header.consumers) <= readers:
            raise ProtocolError(
                f"consumers {list(header.consumers)[:4]} of {header.producer!r} are not on stage {stage}"
            )
        if header.requires_grad and not info.is_float:
            raise ProtocolError(f"{header.producer!r} is {info.dtype} and cannot require grad")
    else:
        if p.stage_of[header.producer] != stage:
            raise ProtocolError(f"gradient of {header.producer!r}, which stage {stage} does not produce")
        if reader_segment(p, header.producer, header.src_stage, header.consumers) is None:
            raise ProtocolError(
                f"no segment of stage {header.src_stage} reads {header.producer!r} "
                f"by {list(header.consumers)[:4]}"
            )
        if not info.is_float:
            raise ProtocolError(f"gradient of {header.producer!r}, which is {info.dtype}")
    if header.shape != info.shape or header.dtype != info.dtype:
        raise ProtocolError(
            f"{header.producer!r} is {info.shape}/{info.dtype}, OpData says {header.shape}/{header.dtype}"
        )
    expected = body_bytes(header)
    if expected is not None and expected != header.body_bytes:
        raise ProtocolError(
            f"header declares {header.body_bytes} body bytes, {header.shape} needs {expected}"
        )
    limit = max_body_bytes(info.shape, info.dtype)
    if header.body_bytes > limit:
        raise ProtocolError(f"body of {header.body_bytes} bytes > limit {limit} for {header.producer!r}")


def reader_segment(p: Partition, value: str, stage: int, consumers: Sequence[str]) -> Segment | None:
    """The segment of ``stage`` that reads ``value`` through exactly ``consumers``, if any."""
    for seg_id in p.readers.get(value, ()):
        seg = p.segments[seg_id]
        if seg.stage == stage and p.reader_names[value, seg_id] == tuple(consumers):
            return seg
    return None
