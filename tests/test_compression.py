"""Top-K: the fast path equals the reference, the wire format round-trips, bad payloads are refused."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fusionp2p.compression import (
    ErrorFeedback,
    LinkCompressor,
    PayloadError,
    decode,
    decode_at,
    encode,
    encode_at,
    k_for_ratio,
    paper_bytes,
    topk_fast,
    topk_reference,
    topk_rows,
)
from fusionp2p.config import RatioWarmup
from fusionp2p.errors import ConfigError
from fusionp2p.records import TopKHeader


@pytest.mark.parametrize("numel", [10, 70_000, 1_000_000])
@pytest.mark.parametrize("ratio", [10, 100, 1000])
def test_fast_topk_selects_exactly_the_reference_set(numel: int, ratio: int) -> None:
    gen = torch.Generator().manual_seed(numel + ratio)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 3
    k = k_for_ratio(numel, ratio)
    fast = topk_fast(x, k, generator=gen)
    assert fast.numel() == k
    assert torch.equal(fast, topk_reference(x, k))


def test_fast_topk_falls_back_when_the_sample_misjudges(monkeypatch) -> None:
    from fusionp2p.compression import topk as topk_module

    calls = []
    reference = topk_module.topk_reference
    monkeypatch.setattr(topk_module, "_SLACK", 0.05)  # a threshold far above the k-th value
    monkeypatch.setattr(topk_module, "topk_reference", lambda f, k: calls.append(k) or reference(f, k))
    x = torch.randn(1 << 20)
    assert torch.equal(topk_fast(x, 10_000), reference(x, 10_000))
    assert calls == [10_000]


@pytest.mark.parametrize(
    ("numel", "ratio", "fmt"),
    [
        (1_000_000, 100, "delta16"),
        (10_000, 2, "bitmap"),
        (3_000_000, 20_000, "int32"),
        (1000, 1, "dense"),
    ],
)
@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
def test_wire_format_round_trips_and_picks_the_smallest_index_encoding(
    numel, ratio, fmt, value_dtype
) -> None:
    x = torch.randn(numel).reshape(-1, 10) if numel % 10 == 0 else torch.randn(numel)
    encoded = encode(x, ratio, value_dtype=value_dtype)
    header = TopKHeader.from_wire(encoded.header.to_wire())
    assert header.index_format == fmt
    dense = decode(header, encoded.body)
    assert dense.shape == x.shape and dense.dtype == x.dtype
    flat, got = x.reshape(-1), dense.reshape(-1)
    idx = encoded.indices
    assert torch.equal(got[idx], flat[idx].to(getattr(torch, value_dtype)).float())
    assert int((got != 0).sum()) <= header.k
    if fmt != "dense":
        assert torch.equal(idx, topk_reference(flat, header.k))
        assert len(encoded.body) < paper_bytes(header.k)  # fp32 values + int64 indices


def _corrupt(header: TopKHeader, body: bytes, case: str) -> tuple[TopKHeader, bytes]:
    if case == "short_body":
        return header, body[:-3]
    if case == "long_body":
        return header, body + b"\0\0\0\0"
    if case == "k_too_big":
        return dataclasses.replace(header, k=header.k + 1), body
    if case == "index_bytes":
        return dataclasses.replace(header, index_bytes=header.index_bytes + 4), body
    if case == "index_out_of_range":
        idx = bytearray(body)
        idx[4 * (header.k - 1) : 4 * header.k] = (header.numel + 5).to_bytes(4, "little")
        return header, bytes(idx)
    if case == "unsorted":
        idx = bytearray(body)
        idx[0:4], idx[4:8] = idx[4:8], idx[0:4]
        return header, bytes(idx)
    if case == "dtype":
        return dataclasses.replace(header, value_dtype="float16"), body
    if case == "huge":
        return dataclasses.replace(header, shape=(1 << 40,), numel=1 << 40), body
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "short_body",
        "long_body",
        "k_too_big",
        "index_bytes",
        "index_out_of_range",
        "unsorted",
        "dtype",
        "huge",
    ],
)
def test_a_payload_whose_header_disagrees_with_its_body_is_refused(case: str) -> None:
    x = torch.randn(3_000_000)
    encoded = encode(x, 20_000)  # int32 indices: easy to corrupt by hand
    assert encoded.header.index_format == "int32"
    header, body = _corrupt(encoded.header, encoded.body, case)
    with pytest.raises(PayloadError):
        decode(header, body)


def test_bitmap_and_delta_payloads_are_checked_too() -> None:
    bitmap = encode(torch.randn(10_003), 2)
    assert bitmap.header.index_format == "bitmap"
    section = bitmap.header.index_bytes
    every = b"\xff" * (section - 1) + b"\x07" + bitmap.body[section:]  # all positions marked
    with pytest.raises(PayloadError, match="bitmap marks"):
        decode(bitmap.header, every)
    past_end = bytearray(bitmap.body)
    past_end[section - 1] |= 0x80  # bit 10_007: past the end of the tensor
    with pytest.raises(PayloadError, match="past the end"):
        decode(bitmap.header, bytes(past_end))
    delta = encode(torch.randn(1_000_000), 100)
    assert delta.header.index_format == "delta16"
    broken = dataclasses.replace(delta.header, base=999_990)
    with pytest.raises(PayloadError, match="inside"):
        decode(broken, delta.body)


def test_error_feedback_carries_what_was_dropped_and_stays_bounded() -> None:
    torch.manual_seed(0)
    feedback = ErrorFeedback(max_bytes=3 * 4 * 1000)
    grads = [torch.randn(1000) for _ in range(50)]
    sent = torch.zeros(1000)
    for g in grads:
        enc = feedback.compress("link0/w", g, 10)
        sent += decode(enc.header, enc.body)
    # everything not sent yet is exactly the residual: nothing is lost
    residual = feedback._residuals["link0/w"]
    assert torch.allclose(sent + residual, torch.stack(grads).sum(0), atol=1e-4)
    for name in ("a", "b", "c"):
        feedback.compress(name, torch.randn(1000), 10)
    assert feedback.nbytes <= 3 * 4 * 1000 and feedback.evicted >= 1
    feedback.reset()
    assert feedback.nbytes == 0


def test_link_compressor_uses_the_plans_ratio() -> None:
    link = LinkCompressor(50.0, feedback=ErrorFeedback())
    act = link.activations(torch.randn(10_000))
    grad = link.gradient(("stage1", "h"), torch.randn(10_000))
    assert act.header.k == grad.header.k == 200


def test_shared_index_gradient_is_the_exact_gradient_of_the_compressed_forward() -> None:
    h = torch.randn(6, 40, requires_grad=True)
    enc = encode(h.detach(), 10)
    mask = torch.zeros(h.numel(), dtype=torch.bool)
    mask[enc.indices] = True
    sent = decode(enc.header, enc.body)
    # autograd's gradient of a loss through "keep the top entries" is the masked gradient
    weights = torch.randn(6, 40)
    (h * mask.reshape(h.shape) * weights).sum().backward()
    grad_at_receiver = weights  # d loss / d sent
    back = encode_at(grad_at_receiver, enc.indices)
    assert back.header.index_format == "shared" and back.header.index_bytes == 0
    assert len(back.body) == 4 * enc.header.k  # values only: no index bytes on the way back
    torch.testing.assert_close(decode_at(back.header, back.body, enc.indices), h.grad)
    assert torch.equal(sent.reshape(-1)[enc.indices], h.detach().reshape(-1)[enc.indices])


def test_shared_index_payload_errors() -> None:
    grad = torch.randn(100)
    idx = torch.tensor([3, 7, 50])
    back = encode_at(grad, idx)
    with pytest.raises(PayloadError, match="k=3"):
        decode_at(back.header, back.body, torch.tensor([3, 7]))
    with pytest.raises(PayloadError, match="k=3"):
        decode_at(back.header, back.body[:-1], idx)
    with pytest.raises(PayloadError, match="outside"):
        decode_at(back.header, back.body, torch.tensor([3, 7, 100]))
    with pytest.raises(PayloadError, match="decode_at"):
        decode(back.header, back.body)
    plain = encode(grad, 10)
    with pytest.raises(PayloadError, match="shared"):
        decode_at(plain.header, plain.body, plain.indices)


def test_row_wise_topk_keeps_each_row_s_largest_and_decodes_like_any_payload() -> None:
    g = torch.Generator().manual_seed(3)
    h = torch.randn(4, 16, 200, generator=g)
    enc = encode(h, 20.0, rows=True)
    k_row = math.ceil(200 / 20)
    assert enc.header.k == 4 * 16 * k_row and enc.header.index_format == "delta16"  # gaps < 2 rows
    dense = decode(enc.header, enc.body)
    for row_in, row_out in zip(h.reshape(-1, 200), dense.reshape(-1, 200), strict=True):
        want = torch.topk(row_in.abs(), k_row).indices
        assert set(row_out.nonzero().squeeze(1).tolist()) == set(want.tolist())
        torch.testing.assert_close(row_out[want], row_in[want])
    assert torch.equal(enc.indices, topk_rows(h, k_row)) and torch.all(enc.indices.diff() > 0)
    narrow = encode(torch.randn(8, 5, generator=g), 8.0, rows=True)  # rows under 4 x ratio: global
    assert narrow.header.k == math.ceil(40 / 8)


def test_the_ratio_warmup_grows_geometrically_and_a_replan_continues_it() -> None:
    ramp = RatioWarmup(steps=4)
    assert [ramp.ratio(16.0, t) for t in range(6)] == pytest.approx([1, 2, 4, 8, 16, 16])
    resumed = RatioWarmup(steps=4, done=2)  # a new pipeline from the job's step 2
    assert [resumed.ratio(16.0, t) for t in range(3)] == pytest.approx([4, 8, 16])
    assert RatioWarmup().ratio(16.0, 0) == 16.0 and ramp.ratio(1.0, 1) == 1.0
    with pytest.raises(ConfigError, match="steps"):
        RatioWarmup(steps=-1)
