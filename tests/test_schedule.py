"""planning.schedule replays the runtime's 1F1B schedule over a plan's peers and links."""

from __future__ import annotations

import pytest

from fusionp2p.planning.cost import stage_in_flight
from fusionp2p.planning.schedule import Hop, simulate


def _chain(peers: list[str], hop_s: float, site: dict[str, str]) -> list[Hop]:
    def res(a: int, b: int) -> tuple[str, str] | None:
        x, y = site[peers[a]], site[peers[b]]
        return None if peers[a] == peers[b] else (x, y)

    return [Hop(k, k + 1, hop_s, hop_s, res(k, k + 1), res(k + 1, k)) for k in range(len(peers) - 1)]


def test_one_stage_runs_its_micro_batches_one_after_another() -> None:
    assert simulate([1.0], [2.0], ["p"], [], 4, [1]) == pytest.approx(12.0)


def test_a_balanced_pipeline_takes_its_critical_path_plus_the_bottleneck_per_extra_micro_batch() -> None:
    # worked by hand: F0 [0,1], F1 [1,2], B1 [2,4], B0 [4,6] ... the last B0 ends at 15
    peers = ["a", "b"]
    hops = [Hop(0, 1, 0.0, 0.0, ("a", "b"), ("b", "a"))]
    assert simulate([1.0, 1.0], [2.0, 2.0], peers, hops, 4, stage_in_flight(4, peers)) == pytest.approx(15.0)
    # one micro-batch: exactly the critical path, the hop's seconds included both ways
    slow = [Hop(0, 1, 0.5, 0.25, ("a", "b"), ("b", "a"))]
    assert simulate([1.0, 1.0], [2.0, 2.0], peers, slow, 1, [1, 1]) == pytest.approx(
        1 + 0.5 + 1 + 2 + 0.25 + 2
    )


def test_a_shared_site_link_carries_one_transfer_at_a_time_backward_first() -> None:
    # x y x, every hop 1 s each way on the x->y / y->x site links, no compute; worked by hand:
    # x->y: fwd m0 [0,1], fwd m1 [1,2], grad(1->2) m0 [2,3] (backward before m1's), m1 [3,4];
    # y->x: fwd m0 [1,2], fwd m1 [2,3], grad(0->1) m0 [3,4], m1 [4,5]
    site = {"x1": "x", "y1": "y", "x2": "x"}
    peers = ["x1", "y1", "x2"]
    took = simulate([0.0] * 3, [0.0] * 3, peers, _chain(peers, 1.0, site), 2, stage_in_flight(2, peers))
    assert took == pytest.approx(5.0)  # L + (n_b - 1) * B would say 4 + 2 = 6
    # each site link carries 2 s per micro-batch: 4 of them need more than 8 s, and the
    # pipeline keeps them under 4 times the 4 s critical path
    four = simulate([0.0] * 3, [0.0] * 3, peers, _chain(peers, 1.0, site), 4, stage_in_flight(4, peers))
    assert 4 * 2.0 < four < 4 * 4.0


def test_stages_of_one_peer_share_its_device_and_their_hop_is_free() -> None:
    peers = ["a", "a"]
    hops = [Hop(0, 1, 5.0, 5.0, None, None)]  # the two stages share a peer: nothing on a wire
    assert simulate([1.0, 1.0], [1.0, 1.0], peers, hops, 3, stage_in_flight(3, peers)) == pytest.approx(12.0)


def test_a_cycle_is_an_error_not_a_hang() -> None:
    hops = [Hop(0, 1, 0.1, 0.1, ("a", "b"), ("b", "a")), Hop(1, 0, 0.1, 0.1, ("b", "a"), ("a", "b"))]
    with pytest.raises(ValueError, match="cannot finish"):
        simulate([1.0, 1.0], [1.0, 1.0], ["a", "b"], hops, 2, [2, 1])


@pytest.mark.parametrize(("n_micro_batches", "by_hand"), [(1, 10.0), (4, 22.0), (16, 82.0)])
def test_latency_delays_each_transfer_without_occupying_its_link(
    n_micro_batches: int, by_hand: float
) -> None:
    """Two stages, 1 s forward and 1 s backward each, tiny tensors (no link occupancy) and
    3 s of one-way latency. By hand: F0(m0) [0,1] and F0(m1) [1,2] (stage 0 holds 2);
    they arrive at 4 and 5; F1 B1 of m0 [4,6], of m1 [6,8]; the gradients arrive at 9 and 11;
    B0(m0) [9,10] admits F0(m2) [10,11], B0(m1) [11,12] admits F0(m3) [12,13]: every pair
    of micro-batches after the first ends 10 s later (one round trip of the window). Priced
    as link occupancy, m1 would wait 3 s for m0 to leave the link, and so on."""
    peers = ["a", "b"]
    hops = [Hop(0, 1, 0.0, 0.0, ("a", "b"), ("b", "a"), 3.0, 3.0)]
    in_flight = stage_in_flight(n_micro_batches, peers)
    assert simulate([1.0, 1.0], [1.0, 1.0], peers, hops, n_micro_batches, in_flight) == pytest.approx(by_hand)
    occupied = [Hop(0, 1, 3.0, 3.0, ("a", "b"), ("b", "a"))]  # the old model: latency as busy time
    if n_micro_batches > 1:
        assert simulate([1.0, 1.0], [1.0, 1.0], peers, occupied, n_micro_batches, in_flight) > by_hand


@pytest.mark.parametrize(("window", "by_hand"), [(1, 6.4), (2, 4.3), (64, 2.4)])
def test_a_stream_keeps_at_most_its_window_of_transfers_unacknowledged(window: int, by_hand: float) -> None:
    """No compute, 0.1 s on the link each way, 1 s one-way latency, 3 micro-batches. By
    hand with a window of 1: m0 leaves [0, 0.1], arrives at 1.1, its ACK is back at 2.1,
    so m1 leaves [2.1, 2.2] and m2 [4.2, 4.3]; the gradients go back the same way, each
    after its own ACK: [1.1, 1.2] acknowledged at 3.2, [3.2, 3.3] at 5.3, then [5.3, 5.4]
    arrives at 6.4. A window of 2 lets m1 follow m0 and makes only m2 wait for m0's ACK:
    it leaves [2.1, 2.2] and arrives at 3.2, and its gradient leaves then, as gradient 0's
    ACK is back (arrived at 2.2, back at 3.2): [3.2, 3.3], arriving at 4.3. The runtime's
    64 never binds here: 0.3 s of sends, 1 s there, 0.1 s more of gradients, 1 s back."""
    peers = ["a", "b"]
    hops = [Hop(0, 1, 0.1, 0.1, ("a", "b"), ("b", "a"), 1.0, 1.0)]
    got = simulate([0.0, 0.0], [0.0, 0.0], peers, hops, 3, [3, 3], window=window)
    assert got == pytest.approx(by_hand)
