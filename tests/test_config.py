import pytest

from fusionp2p.config import PeerConfig, ProbeConfig, Timeouts
from fusionp2p.errors import ConfigError


def test_defaults_are_valid() -> None:
    config = PeerConfig()
    assert config.record_ttl >= 2 * config.heartbeat
    assert config.probe.fanout >= 1


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PeerConfig(swarm="has space"), "swarm"),
        (lambda: PeerConfig(initial_peers=("127.0.0.1:80",)), "multiaddr"),
        (lambda: PeerConfig(device="tpu"), "device"),
        (lambda: PeerConfig(heartbeat=10.0, record_ttl=15.0), "twice"),
        (lambda: PeerConfig(upload_limit_mbps=-5.0), "upload_limit_mbps"),
        (lambda: PeerConfig(flops_override=float("nan")), "flops_override"),
        (lambda: PeerConfig(site="dc east"), "site"),
        (lambda: PeerConfig(site="x" * 65), "site"),
        (lambda: ProbeConfig(fanout=0), "fanout"),
        (lambda: ProbeConfig(min_bytes=10, initial_bytes=5), "min_bytes"),
        (lambda: ProbeConfig(window=0), "window"),
        (lambda: Timeouts(probe=0), "probe"),
    ],
)
def test_bad_values_raise_config_errors_that_name_them(make, match) -> None:
    with pytest.raises(ConfigError, match=match):
        make()
