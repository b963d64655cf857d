"""Pictures of a plan: the clustered bandwidth graph with each peer's stage."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import networkx as nx
import numpy as np

from fusionp2p.planning import Plan, Topology

__all__ = ["draw_plan"]


def _cluster_layout(topo: Topology, plan: Plan) -> dict[int, np.ndarray]:
    """Clusters on a big circle, each cluster's peers on a small circle around its center."""
    groups = [[topo.peer_ids.index(pid) for pid in c] for c in plan.clusters] or [list(range(len(topo)))]
    pos = {}
    for c, members in enumerate(groups):
        angle = 2 * math.pi * c / len(groups)
        center = np.array([math.cos(angle), math.sin(angle)]) * (3.0 if len(groups) > 1 else 0.0)
        radius = 0.4 + 0.12 * len(members)
        for k, peer in enumerate(members):
            a = 2 * math.pi * k / len(members)
            pos[peer] = center + radius * np.array([math.cos(a), math.sin(a)])
    return pos


def draw_plan(plan: Plan, topo: Topology, path: str, title: str = "") -> None:
    """Writes a PNG: peers colored by bandwidth cluster, edges by bandwidth, labels by stage."""
    graph = nx.Graph()
    n = len(topo)
    cluster_of = {pid: c for c, members in enumerate(plan.clusters) for pid in members}
    stage_of = {pid: k for k, pid in enumerate(plan.peer_ids)}
    for i, pid in enumerate(topo.peer_ids):
        graph.add_node(i, cluster=cluster_of.get(pid, 0))
    for i in range(n):
        for j in range(i + 1, n):
            bw = min(topo.bandwidth[i, j], topo.bandwidth[j, i])
            graph.add_edge(i, j, bw=bw, weight=math.log10(max(bw, 1.0)))
    pos = _cluster_layout(topo, plan)
    fig, ax = plt.subplots(figsize=(9, 7))
    widths = [0.2 + 2.5 * (d["weight"] - 5) / 5 for _, _, d in graph.edges(data=True)]
    nx.draw_networkx_edges(
        graph, pos, ax=ax, width=[max(w, 0.1) for w in widths], alpha=0.35, edge_color="gray"
    )
    used = [stage_of.get(pid) for pid in topo.peer_ids]
    colors = [graph.nodes[i]["cluster"] for i in range(n)]
    nx.draw_networkx_nodes(
        graph,
        pos,
        ax=ax,
        node_color=colors,
        cmap="tab10",
        vmin=0,
        vmax=9,
        node_size=[900 if u is not None else 300 for u in used],
        edgecolors=["black" if u is not None else "white" for u in used],
        linewidths=2,
    )
    labels = {i: (f"S{used[i]}\n" if used[i] is not None else "") + topo.peer_ids[i][-4:] for i in range(n)}
    nx.draw_networkx_labels(graph, pos, labels=labels, ax=ax, font_size=8)
    for lk in plan.estimate.links:
        if lk.wire_bytes:
            a, b = topo.peer_ids.index(plan.peer_ids[lk.src]), topo.peer_ids.index(plan.peer_ids[lk.dst])
            ax.annotate(
                "",
                xy=tuple(pos[b]),
                xytext=tuple(pos[a]),
                arrowprops={"arrowstyle": "->", "color": "crimson", "lw": 2},
            )
            mid = (pos[a] + pos[b]) / 2
            ax.text(mid[0], mid[1], f"r={lk.ratio:.0f}", color="crimson", fontsize=8)
    ax.set_title(
        title
        or f"{plan.method}: {len(plan.stages)} stages, {plan.iteration_s:.3f} s/iteration "
        "(color = bandwidth cluster, S = stage, edge width = log bandwidth)",
        fontsize=9,
    )
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
