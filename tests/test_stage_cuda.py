"""A stage on a GPU computes what the same stage computes on the CPU (runs only with CUDA).

A GPT-2 split in 3 stages runs in process, messages routed by hand as between peers,
once with every stage on the CPU and once with the non-data stages on ``cuda``, dense and
with Top-K between stages (the selection then runs in ``fusionp2p.kernels``).
"""

import pytest
import torch

from fusionp2p.opdag.split import op_node_names, partition
from fusionp2p.opdag.trace import trace_spec
from fusionp2p.records import ModelSpec
from fusionp2p.runtime.losses import LOSSES
from fusionp2p.runtime.torch_executor import TorchExecutor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPEC = ModelSpec("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 101}, input_shape=(2, 16))


def _run(devices: list[str], ratios: dict[int, float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    traced = trace_spec(SPEC)
    n = len(op_node_names(traced.program.graph))
    part = partition(traced.program, [i * 3 // n for i in range(n)], 3)
    exes = [
        TorchExecutor(
            traced.program, part, s, job="j", n_micro_batches=2, loss_fn=LOSSES["lm"], ratios=ratios, device=d
        )
        for s, d in enumerate(devices)
    ]
    g = torch.Generator().manual_seed(0)
    queue = []
    for m in range(2):
        x = torch.randint(0, 101, SPEC.input_shape, generator=g)
        queue += exes[0].start(0, m, {part.segments[0].nodes[0]: x}, x)
        while queue:
            msg = queue.pop(0)
            queue += exes[msg.header.dst_stage].accept(msg.header, msg.body)
    grads = {k: p.grad.cpu() for e in exes for k, p in e.params.items()}
    return [exes[0].losses[m] for m in range(2)], grads


@pytest.mark.parametrize("ratios", [{}, {0: 8.0, 1: 8.0, 2: 8.0}], ids=["dense", "topk"])
def test_a_cuda_stage_matches_the_cpu(ratios: dict[int, float]) -> None:
    cpu_losses, cpu_grads = _run(["cpu", "cpu", "cpu"], ratios)
    gpu_losses, gpu_grads = _run(["cpu", "cuda", "cuda"], ratios)
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
