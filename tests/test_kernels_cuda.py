"""The CUDA Top-K kernel selects the same entries as the CPU reference (runs only with CUDA)."""

import pytest
import torch

from fusionp2p.compression.topk import k_for_ratio, topk_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("numel", [1_000, 100_000, 10_000_000])
@pytest.mark.parametrize("ratio", [10, 100, 1000])
def test_cuda_topk_matches_the_reference(numel: int, ratio: int) -> None:
    from fusionp2p.kernels import topk_cuda

    torch.manual_seed(numel + ratio)
    x = torch.randn(numel)
    k = k_for_ratio(numel, ratio)
    got = topk_cuda(x.cuda(), k).cpu()
    assert got.numel() == k
    assert torch.equal(got, topk_reference(x, k))


def test_wire_format_round_trips_from_a_cuda_tensor() -> None:
    from fusionp2p.compression.wire import decode, encode

    x = torch.randn(1 << 20, device="cuda")
    encoded = encode(x, 100)
    dense = decode(encoded.header, encoded.body, device="cuda")
    kept = dense.reshape(-1)[encoded.indices]
    assert torch.equal(kept, x[encoded.indices])
