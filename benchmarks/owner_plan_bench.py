"""Plans that leave the data owner out against plans that count it (issue 39).

    .venv/bin/python -m benchmarks.owner_plan_bench      # ~10 s, cost model only

Issue 39's case: two sites a and b of two hosts each (fast inside, 44 Mbit/s and 40 ms
one way between them), the data owner in site a, one peer per other host, GPT-2 configs
traced for real (fake tensors). For each model and one-way latency, the table shows the
plan OP-Fence makes when the data owner is left out (as before issue 39: the peers
only, the runtime then moves the embeddings, a tied LM head and the loss to the data
owner), the estimate that plan reported, and the estimate of what then runs (the same
plan with the data owner's part framed around it, its hops and its step round trip
counted); then the plan made with the data owner as a peer of the plan. Prints a
Markdown table.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fusionp2p.opdag.ir import LOSS_ID, OpDag
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.planning import NO_COMPRESSION, CostConfig, Stage, Topology, estimate, op_fence, plan_job
from fusionp2p.planning.owner import OwnerFrame, owner_part
from fusionp2p.records import ModelSpec

MODELS = {
    "gpt2 2x128": {"n_layer": 2, "n_embd": 128, "n_head": 4},
    "gpt2 8x384": {"n_layer": 8, "n_embd": 384, "n_head": 6},
}
SITE = [0, 0, 1, 1]  # peer0 (the data owner) and peer1 in site a, peer2 and peer3 in b


def two_sites(one_way_s: float, speed: float) -> Topology:
    cross = np.not_equal.outer(SITE, SITE)
    return Topology.from_arrays(
        [f"peer{i}" for i in range(4)],
        [speed] * 4,
        [8e9] * 4,
        np.where(cross, 5.5e6, 1.25e8),
        np.where(cross, one_way_s, 1e-4),
        site=SITE,
    )


def unpinned(dag: OpDag) -> OpDag:
    """The OP-DAG as planners saw it before issue 39: no loss node, nothing pinned."""
    nodes = tuple(replace(n, pinned=False) for n in dag.nodes if n.id != LOSS_ID)
    return OpDag(nodes, name=dag.name)


def sites(topo: Topology, stages: list[Stage]) -> str:
    return "".join("ab"[SITE[s.peer]] for s in stages)


def main() -> None:
    cost = CostConfig(n_micro_batches=4, compression=NO_COMPRESSION)
    speed = 21e9  # the WAN benchmark's 0.25x emulated device, training FLOP/s
    print(
        "| model | one way ms | left out: stages | its estimate s | what runs s "
        "| counted: stages | estimate s |"
    )
    print("|---|---:|---|---:|---:|---|---:|")
    for name, config in MODELS.items():
        spec = ModelSpec("gpt2", {**config, "vocab_size": 256}, input_shape=(4, 128))
        dag = trace_spec(spec, fake=True).dag
        part = owner_part(dag)
        assert part is not None
        for one_way in (0.0, 0.040):
            topo = two_sites(one_way, speed)
            old = op_fence(unpinned(dag), topo.without("peer0"), cost)
            middle = [
                Stage(topo.peer_ids.index(peer), tuple(i for i in st.nodes if part.head <= i < part.tail))
                for peer, st in zip(old.peer_ids, old.stages, strict=True)
            ]
            runs = OwnerFrame(0, part).frame(middle)
            new = plan_job(dag, topo, "peer0", method="op-fence", cost=cost)
            new_stages = [
                Stage(topo.peer_ids.index(p), s.nodes) for p, s in zip(new.peer_ids, new.stages, strict=True)
            ]
            print(
                f"| {name} | {one_way * 1e3:.0f} | {sites(topo, runs)} | {old.expected_s:.3f} | "
                f"{estimate(dag, topo, runs, cost).expected_s:.3f} | {sites(topo, new_stages)} | "
                f"{new.expected_s:.3f} |"
            )


if __name__ == "__main__":
    main()
