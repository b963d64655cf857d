"""The DHT directory on one real hivemind node: plans round-trip, oversized stores are refused."""

import asyncio

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from fusionp2p.errors import RecordError
from fusionp2p.net.dht_node import start_dht
from fusionp2p.net.directory import SwarmDirectory
from fusionp2p.net.identity import ensure_identity, load_signing_key
from fusionp2p.records import PlanStageRecord


def _stage(epoch: int, stage: int, n: int, made_by: str) -> PlanStageRecord:
    return PlanStageRecord(
        plan_id=f"plan{epoch}",
        epoch=epoch,
        stage=stage,
        n_stages=n,
        peer_id=f"Qm{stage}",
        dag="gpt2:abc",
        node_ranges=(stage, stage + 1),
        links_to={str(stage + 1): 50.0},
        n_micro_batches=4,
        est_iteration_s=1.5,
        made_by=made_by,
        made_at=0.0,
    )


def test_plan_records_round_trip_and_the_newest_complete_plan_wins(tmp_path) -> None:
    identity = str(tmp_path / "coordinator.key")
    me = ensure_identity(identity).to_base58()
    key = load_signing_key(identity)
    # hivemind's MPFuture takes the thread's current loop (creating one if none): give it ours
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    dht = start_dht(initial_peers=[], identity_path=identity, signing_key=key)
    try:
        directory = SwarmDirectory(dht, "unit", owner_marker=RSASignatureValidator(key).local_public_key)

        async def run() -> tuple[dict, dict]:
            expiration = get_dht_time() + 30
            assert await directory.publish_plan([_stage(1, i, 2, me) for i in range(2)], expiration) == 2
            # a plan that misses a stage is not taken
            assert await directory.publish_plan([_stage(2, 0, 3, me)], expiration) == 1
            with pytest.raises(RecordError, match="exceeds"):
                await directory._store("unit.x", b"k", bytes(4000), expiration)
            return await directory.fetch_plans("plan1"), await directory.fetch_plans("plan2")

        complete, partial = loop.run_until_complete(run())
        assert [(r.epoch, r.stage) for r in complete[(1, me)]] == [(1, 0), (1, 1)]
        assert partial == {}
    finally:
        dht.shutdown()
        loop.close()
        asyncio.set_event_loop(None)
