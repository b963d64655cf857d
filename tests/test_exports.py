"""The top-level package exports exactly its public API."""

import fusionp2p


def test_top_level_all() -> None:
    assert sorted(fusionp2p.__all__) == sorted(
        [
            "DEFAULT_SWARM",
            "ConfigError",
            "DataOwner",
            "ExecLimits",
            "FusionP2PError",
            "JobOptions",
            "JobSpec",
            "LimitError",
            "LinkRecord",
            "ModelFamily",
            "ModelRegistry",
            "ModelSpec",
            "OptimizerConfig",
            "PeerConfig",
            "PeerRecord",
            "PeerUnreachableError",
            "Pipeline",
            "ProbeConfig",
            "ProfileError",
            "ProtocolError",
            "RecordError",
            "Swarm",
            "SwarmError",
            "Timeouts",
            "__version__",
        ]
    )
    for name in fusionp2p.__all__:
        assert getattr(fusionp2p, name) is not None
    from fusionp2p.swarm import Swarm
    from fusionp2p.training.data_owner import DataOwner

    assert fusionp2p.Swarm is Swarm and fusionp2p.DataOwner is DataOwner
