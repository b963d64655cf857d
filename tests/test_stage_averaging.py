"""Two replicas of a stage average their gradients through hivemind's all-reduce (real DHT
nodes and averager processes on loopback); a replica alone is left out at its deadline."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import hivemind
import pytest
import torch

from fusionp2p.errors import ConfigError
from fusionp2p.net.dht_node import start_dht, stop_dht
from fusionp2p.net.validation import MAX_DECLARATION_LIFETIME
from fusionp2p.runtime.averaging import (
    AveragingResult,
    StageAverager,
    fingerprints_agree,
    group_key,
    matchmaking_seconds,
    parameter_fingerprint,
)

pytestmark = pytest.mark.swarm  # starts DHT and averager processes


@pytest.fixture
def dhts() -> Iterator[tuple[hivemind.DHT, hivemind.DHT]]:
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = hivemind.DHT(
        start=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        initial_peers=[str(a) for a in first.get_visible_maddrs()],
    )
    try:
        yield first, second
    finally:
        second.shutdown()
        first.shutdown()


def test_two_replicas_get_the_weighted_mean_and_a_lone_one_is_left_out(dhts) -> None:
    shapes = [torch.zeros(1000, 3), torch.zeros(7)]
    averagers = [
        StageAverager(dht, shapes, job="job-1", plan_version=2, stage=1, replicas=2, deadline_s=20.0)
        for dht in dhts
    ]
    try:
        grads = [
            [torch.full((1000, 3), 1.0), torch.full((7,), -1.0)],
            [torch.full((1000, 3), 3.0), torch.ones(7)],
        ]
        results: dict[int, AveragingResult] = {}

        def step(i: int, weight: float) -> None:
            results[i] = averagers[i].average(grads[i], weight)

        threads = [threading.Thread(target=step, args=(i, w)) for i, w in ((0, 1.0), (1, 3.0))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert all(results[i].group_size == 2 for i in (0, 1))
        for g in grads:  # (1 x 1 + 3 x 3) / 4 and (1 x -1 + 3 x 1) / 4, on both replicas
            assert torch.allclose(g[0], torch.full((1000, 3), 2.5)) and torch.allclose(
                g[1], torch.full((7,), 0.5)
            )
        assert fingerprints_agree(parameter_fingerprint(grads[0]), parameter_fingerprint(grads[1]))
        lone = StageAverager(
            dhts[0], shapes, job="job-1", plan_version=2, stage=3, replicas=2, deadline_s=2.0
        )
        try:
            mine = [torch.full((1000, 3), 7.0), torch.zeros(7)]
            result = lone.average(mine, 1.0)  # nobody else holds stage 3: left out at the deadline
            assert result.left_out and 1.5 < result.seconds < 15
            assert torch.all(mine[0] == 7.0)  # its own gradients, untouched
        finally:
            lone.close()
    finally:
        for averager in averagers:
            averager.close()


def test_group_keys_name_job_plan_and_stage_and_refuse_what_a_dht_key_cannot_hold() -> None:
    assert group_key("run-7", 3, 2) == "fusionp2p_avg_run-7_v3_s2"
    assert group_key("run-7", 3, 2) != group_key("run-7", 4, 2) != group_key("run-7", 3, 1)
    with pytest.raises(ConfigError, match="cannot name an averaging group"):
        group_key("a.b", 1, 0)
    assert group_key("run-7", 3, 2, "QmOwner") == "fusionp2p_avg_QmOwner_run-7_v3_s2"


def test_fingerprints_tell_rounding_from_a_diverged_replica() -> None:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(300, 20, generator=g), torch.randn(20, generator=g)]
    mine = parameter_fingerprint(params)
    rounded = [p * (1 + 1e-7 * torch.randn(p.shape, generator=g)) for p in params]  # ~1 ulp apart
    assert fingerprints_agree(mine, parameter_fingerprint(rounded))
    stepped = [p - 1e-3 * torch.sign(torch.randn(p.shape, generator=g)) for p in params]  # one Adam step
    assert not fingerprints_agree(mine, parameter_fingerprint(stepped))
    one = [params[0].clone(), params[1].clone()]
    one[1][3] += 0.1  # a single parameter off
    assert not fingerprints_agree(mine, parameter_fingerprint(one))


def test_an_average_with_a_peer_outside_the_replicas_is_thrown_away(dhts, caplog) -> None:
    """hivemind matches averagers by key alone: a peer that is not one of the stage's
    replicas can join the group. The replica that knows its members keeps its own
    gradients and logs a protocol error."""
    shapes = [torch.zeros(5)]
    honest_id = dhts[0].peer_id.to_base58()
    honest = StageAverager(
        dhts[0],
        shapes,
        job="j",
        plan_version=1,
        stage=1,
        replicas=2,
        deadline_s=20.0,
        members=(honest_id, "QmTheOtherReplicaThatNeverCame1111111111111111"),
    )
    stranger = StageAverager(dhts[1], shapes, job="j", plan_version=1, stage=1, replicas=2, deadline_s=20.0)
    try:
        mine, theirs = [torch.ones(5)], [torch.full((5,), 1000.0)]
        results: dict[str, AveragingResult] = {}
        threads = [
            threading.Thread(target=lambda: results.update(h=honest.average(mine, 1.0))),
            threading.Thread(target=lambda: results.update(s=stranger.average(theirs, 1.0))),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert results["s"].group_size == 2  # the all-reduce itself ran
        assert results["h"].left_out and torch.all(mine[0] == 1.0)
        assert "joined the average; it is thrown away" in caplog.text
    finally:
        honest.close()
        stranger.close()


def test_replicas_with_an_hour_long_deadline_still_find_each_other_through_validated_dhts() -> None:
    """A WAN job's averaging deadline may be an hour; hivemind declares an averager in the
    DHT until its matchmaking ends, and fusionp2p's validators refuse declarations that
    live past ``MAX_DECLARATION_LIFETIME``: the matchmaking window is capped under it, or
    (as a one-hour job on the emulated WAN found) nobody ever finds the group."""
    assert matchmaking_seconds(20.0) == 10.0
    assert matchmaking_seconds(3600.0) <= MAX_DECLARATION_LIFETIME / 2
    first = start_dht(initial_peers=[])
    second = start_dht(initial_peers=[str(a) for a in first.get_visible_maddrs()])
    averagers: list[StageAverager] = []
    try:
        shapes = [torch.zeros(5)]
        averagers = [
            StageAverager(dht, shapes, job="job-2", plan_version=1, stage=1, replicas=2, deadline_s=3600.0)
            for dht in (first, second)
        ]
        grads = [[torch.full((5,), 1.0)], [torch.full((5,), 3.0)]]
        results: dict[int, AveragingResult] = {}

        def step(i: int) -> None:
            results[i] = averagers[i].average(grads[i], 1.0)

        threads = [threading.Thread(target=step, args=(i,), daemon=True) for i in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(90)
        assert sorted(results) == [0, 1] and all(r.group_size == 2 for r in results.values())
        assert all(torch.allclose(g[0], torch.full((5,), 2.0)) for g in grads)
    finally:
        for averager in averagers:
            averager.close()
        stop_dht(second)
        stop_dht(first)
