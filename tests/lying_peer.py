"""A peer whose coordinator lies (tests only), run as a ``LocalSwarm`` launcher:

    python tests/lying_peer.py python -m fusionp2p --log-level info peer ...

It is a real ``fusionp2p peer`` in every other way. When it plans a job it reads the swarm,
cites the records as an honest coordinator would, and then publishes the equal-number
baseline's plan of them (every candidate, itself included, in PeerID order) as if it were
the plan the job asked for: the lie of issue 32's attack run, a plan the coordinator chose.
"""

from __future__ import annotations

import sys
from typing import Any

from fusionp2p.cli import main
from fusionp2p.coordination.coordinator import Coordinator
from fusionp2p.planning import Topology, plan_job

_honest = Coordinator._plan_over


def _lying(request: Any, dag: Any, found: Any, cost: Any) -> Any:
    _, peers, links = _honest(request, dag, found, cost)
    lie = plan_job(
        dag, Topology.from_records(peers, links), request.owner.peer_id, method="equal-number", cost=cost
    )
    return lie, peers, links


if __name__ == "__main__":
    Coordinator._plan_over = staticmethod(_lying)  # type: ignore[method-assign]
    argv = sys.argv[1:]
    start = next(i for i in range(len(argv) - 1) if argv[i : i + 2] == ["-m", "fusionp2p"]) + 2
    raise SystemExit(main(argv[start:]))
