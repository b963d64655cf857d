"""Which measured links the planner believes: those both endpoints vouch for.

A peer publishes the links it measured from itself; nothing stops it from publishing any
number. So a direction ``u -> v`` counts only when ``v`` reported the reverse ``v -> u``
too (or ``u`` is trusted: the planning peer itself, or the data owner whose job it is),
and then at no more than ``ASYMMETRY`` times ``v``'s claim of the reverse, with the
larger of the two round trips. A peer can then neither invent a link to a peer that never
measured it back, nor claim a link (its own) faster than ``ASYMMETRY`` times what the other
end saw of it, nor claim to be nearer than the other end measured. It can still claim its
own links slower than they are: that only steers work away from it.
``planning.infer`` then gives each peer one vote in the cluster-level estimates, so a few
such peers cannot move the estimates of pairs they are not part of (the bound is there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from fusionp2p.records import LinkRecord

__all__ = ["ASYMMETRY", "vouched_links"]

ASYMMETRY = 8.0  # a direction counts at most this many times its reverse (asymmetric access links)


def vouched_links(links: Iterable[LinkRecord], trusted: Collection[str] = ()) -> list[LinkRecord]:
    """The links of ``links`` that count, each at the value that counts (see the module doc).

    Of two records of one direction the newer counts. A link from a ``trusted`` peer counts
    as it was measured, even one-sided.
    """
    claims: dict[tuple[str, str], LinkRecord] = {}
    for link in links:
        known = claims.get((link.src, link.dst))
        if known is None or link.measured_at > known.measured_at:
            claims[(link.src, link.dst)] = link
    counted = []
    for (src, dst), link in claims.items():
        back = claims.get((dst, src))
        if src in trusted:
            counted.append(link)
        elif back is not None:
            bandwidth = min(link.bandwidth_bytes_per_s, ASYMMETRY * back.bandwidth_bytes_per_s)
            rtt = max(link.rtt_s, back.rtt_s)
            if (bandwidth, rtt) == (link.bandwidth_bytes_per_s, link.rtt_s):
                counted.append(link)
            else:
                counted.append(dataclasses.replace(link, bandwidth_bytes_per_s=bandwidth, rtt_s=rtt))
    return counted
