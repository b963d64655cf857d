"""The reference for Top-K between stages: the whole graph in one piece, where a reader on
another stage than a float tensor's producer sees that tensor masked to its Top-K."""

from __future__ import annotations

import torch

from fusionp2p.compression import encode
from fusionp2p.opdag.split import Partition
from fusionp2p.runtime.losses import LOSSES


def masked_reference(program, part: Partition, batches, ratio: float, loss: str):
    """Losses per micro-batch and gradients per parameter (losses scaled by 1/len(batches))."""
    crossing = {
        v
        for v, info in part.values.items()
        if info.is_float and any(part.segments[r].stage != part.stage_of[v] for r in part.readers[v])
    }
    assert crossing
    signature = program.graph_signature
    params = {t: torch.nn.Parameter(program.state_dict[t].detach().clone()) for t in signature.parameters}
    state = {p: params[t] for p, t in signature.inputs_to_parameters.items()}
    losses = []
    for x, y in batches:
        env: dict = {}
        masked: dict = {}
        for node in program.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = state.get(node.name, x)
            elif node.op == "call_function":
                here = part.stage_of[node.name]

                def read(a, env=env, masked=masked, here=here):
                    far = a.name in masked and part.stage_of.get(a.name, here) != here
                    return masked[a.name] if far else env[a.name]

                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), read)
                env[node.name] = node.target(*args, **kwargs)
                if node.name in crossing:
                    value = env[node.name]
                    encoded = encode(value.detach(), ratio, rows=True)  # as the runtime selects
                    assert encoded.header.index_format != "dense"
                    mask = torch.zeros(value.numel(), dtype=torch.bool)
                    mask[encoded.indices] = True
                    masked[node.name] = value * mask.reshape(value.shape)
            elif node.op == "output":
                logits = node.args[0][0].name
                value = LOSSES[loss]([masked.get(logits, env[logits])], y)
                losses.append(value.item())
                (value / len(batches)).backward()
    return losses, {name: p.grad for name, p in params.items()}
