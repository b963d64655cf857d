"""The one encoding of which OP-DAG positions a stage runs: flat ``[start, end)`` pairs.

``(0, 5, 9, 12)`` is positions 0..4 and 9..11. A published plan stage and a job setup carry
a stage's positions this way, so a stage peer compares the two directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fusionp2p.errors import RecordError
from fusionp2p.records.limits import MAX_NODES

__all__ = ["check_ranges", "expand_ranges", "node_ranges"]


def node_ranges(positions: Iterable[int]) -> tuple[int, ...]:
    """Positions as flat [start, end) pairs, in order."""
    out: list[int] = []
    for pos in sorted(positions):
        if out and out[-1] == pos:
            out[-1] = pos + 1
        else:
            out += [pos, pos + 1]
    return tuple(out)


def check_ranges(ranges: Sequence[int], what: str) -> None:
    """Raises RecordError unless ``ranges`` are increasing, non-empty [start, end) pairs
    inside ``[0, MAX_NODES]``."""
    if len(ranges) % 2 or any(
        not 0 <= a < b <= MAX_NODES for a, b in zip(ranges[::2], ranges[1::2], strict=True)
    ):
        raise RecordError(f"{what} must be [start, end) pairs in [0, {MAX_NODES}], got {tuple(ranges)[:8]}")
    if any(b > c for b, c in zip(ranges[1:-1:2], ranges[2::2], strict=True)):
        raise RecordError(f"{what} must be increasing and disjoint, got {tuple(ranges)[:8]}")


def expand_ranges(ranges: Sequence[int]) -> tuple[int, ...]:
    """The positions ``ranges`` name, in order."""
    return tuple(i for start, end in zip(ranges[::2], ranges[1::2], strict=True) for i in range(start, end))
