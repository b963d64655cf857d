"""Two replicas of a stage average their gradients through hivemind's all-reduce (real DHT
nodes and averager processes on loopback); a replica alone is left out at its deadline."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import hivemind
import pytest
import torch

from fusionp2p.errors import ConfigError
from fusionp2p.runtime.averaging import AveragingResult, StageAverager, group_key, parameter_digest

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
        assert parameter_digest(grads[0]) == parameter_digest(grads[1])
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
    assert parameter_digest([torch.ones(3)]) != parameter_digest([torch.ones(3) * 2])
