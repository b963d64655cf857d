"""Units of fault handling: deadlines and stragglers, checkpoint periods and files, a
stage's optimizer state round trip, and what a re-plan request may ask for."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
import safetensors.torch
import torch
from job_helpers import peer_record

from fusionp2p.config import OptimizerConfig
from fusionp2p.errors import ConfigError, ProtocolError, RecordError
from fusionp2p.records import JobRequest, ModelSpec, ShardReport
from fusionp2p.runtime.stage_state import StageState
from fusionp2p.training.checkpoint import (
    choose_replicas,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
)
from fusionp2p.training.job_spec import JobSpec
from fusionp2p.training.supervision import CheckpointPolicy, EventLog, StepClock

A = "QmAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
B = "QmBBBBBBBBBBBBBBBBBBBBBBBBBB"


def _clock(**changes: float) -> StepClock:
    args = {"deadline_s": 10.0, "slack": 4.0, "factor": 1.5, "patience": 3, "min_excess_s": 0.5}
    args.update(changes)
    return StepClock(**args)  # type: ignore[arg-type]


def test_a_step_deadline_follows_the_plans_calibrated_step_time() -> None:
    clock = _clock(estimate_s=1.0)
    assert clock.deadline() == 30.0  # not calibrated: 3 x the floor (first steps allocate, warm caches)
    clock = _clock(estimate_s=20.0)
    assert clock.deadline() == 80.0  # ... or slack x the cost model's estimate, if more
    for seconds in (9.0, 9.0, 5.0, 6.0, 7.0):  # two warm-up steps, then three that calibrate
        clock.observe(seconds, [seconds])
    assert clock.expected_s == 6.0 and clock.deadline() == 24.0
    assert _clock(deadline_s=50.0, estimate_s=0.0).deadline() == 150.0


def test_a_straggler_is_patience_slow_steps_in_a_row_and_jitter_is_not() -> None:
    clock = _clock()
    for _ in range(5):
        clock.observe(2.0, [0.1, 1.0, 0.5])
    clock.observe(3.6, [0.1, 2.6, 0.5])
    clock.observe(2.2, [0.1, 1.0, 0.5])  # one normal step resets the count
    for _ in range(2):
        clock.observe(3.6, [0.1, 2.6, 0.5])
    assert not clock.straggling()
    clock.observe(4.0, [0.1, 3.0, 0.5])
    assert clock.straggling()
    factors = clock.speed_factors()  # stage 1 computes 2.6x slower now; the others as before
    assert factors[0] == 1.0 and factors[2] == 1.0 and factors[1] == pytest.approx(1.0 / 2.6)
    tiny = _clock(min_excess_s=0.5)
    for seconds in (0.1, 0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3):  # 3x slower, but 0.2 s: jitter
        tiny.observe(seconds, [seconds])
    assert not tiny.straggling()


def test_the_automatic_checkpoint_period_keeps_checkpoints_under_a_tenth_of_the_steps() -> None:
    fixed = CheckpointPolicy(7)
    fixed.measured(cost_s=100.0, step_s=1.0)
    assert fixed.period == 7 and fixed.due(14, 7) and not fixed.due(13, 7)
    auto = CheckpointPolicy(0)
    assert auto.period == 5  # the first comes early, to be measured
    auto.measured(cost_s=2.0, step_s=1.0)
    assert auto.period == 20 and auto.overhead(1.0) == pytest.approx(0.1)
    auto.measured(cost_s=0.01, step_s=1.0)
    assert auto.period == 1
    auto.measured(cost_s=1000.0, step_s=1.0)
    assert auto.period == 50  # bounded: at most 50 steps are ever redone


def test_checkpoints_are_tagged_manifests_and_only_the_last_two_kept(tmp_path: Path) -> None:
    a, b = "Qm" + "a" * 44, "Qm" + "b" * 44
    shards = [
        ShardReport("v1-s0", 100, (("w", "1" * 64),), (a,)),
        ShardReport("v1-s1", 200, (("v", "2" * 64), ("v#exp_avg", "3" * 64)), (b, a)),
    ]
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step, shards, plan_version=step // 5, epoch=3, data_owner=a)
    found = list_checkpoints(tmp_path)
    assert [c.step for c in found] == [10, 15] and [c.plan_version for c in found] == [2, 3]
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.epoch == 3
    restore = latest.restore()
    assert restore.step == 15 and list(restore.shards) == shards  # holders and digests, no tensor
    z = "Qm" + "z" * 44  # a resumed data owner, with another PeerID, holds its run directory's shards
    assert [r.holders for r in latest.restore(data_owner=z).shards] == [(z,), (b, z)]
    (tmp_path / "checkpoints" / "step-000020.json").write_text("{torn")  # a crash mid-write elsewhere
    assert latest_checkpoint(tmp_path) == latest
    assert latest_checkpoint(tmp_path / "nothing") is None
    manifest = tmp_path / "checkpoints" / "step-000015.json"
    body = json.loads(manifest.read_text())
    body["shards"][1]["holders"] = [a]  # a holder swapped by hand: the signature no longer fits
    manifest.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match="is not signed with its run's secret"):
        latest_checkpoint(tmp_path).restore()
    manifest.write_text("{torn")
    assert [c.step for c in list_checkpoints(tmp_path)] == [10]


def test_replicas_go_to_the_fastest_other_stage_peer() -> None:
    owners = {1: "A", 2: "B", 3: "C"}
    bandwidth = {("A", "B"): 1.0, ("A", "C"): 5.0, ("B", "A"): 3.0, ("B", "C"): 2.0, ("C", "A"): 1.0}
    assert choose_replicas(owners, bandwidth, "D") == {1: "C", 2: "A", 3: "A"}  # C->B unmeasured: 0
    assert choose_replicas({1: "A"}, {}, "D") == {1: "D"}  # a lone stage peer copies to the data owner


def _stage() -> tuple[StageState, torch.export.ExportedProgram]:
    program = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(1, 3),))
    return StageState(program, list(program.state_dict), optimizer=OptimizerConfig(lr=0.1)), program


def _steps(stage: StageState, n: int, value: float) -> None:
    for _ in range(n):
        for param in stage.params.values():
            param.grad = torch.full_like(param, value)
        stage.step()


def test_a_stage_restored_from_its_full_state_trains_on_exactly_as_the_original() -> None:
    original, program = _stage()
    _steps(original, 3, 0.5)
    data = original.save_full()
    names = set(safetensors.torch.load(data))
    assert {"weight", "bias", "weight#exp_avg", "weight#exp_avg_sq", "weight#step"} <= names
    restored = StageState(
        program, list(program.state_dict), optimizer=OptimizerConfig(lr=0.1), materialize=False
    )
    assert restored.load(data) == 0
    _steps(original, 2, -0.3)
    _steps(restored, 2, -0.3)
    for name in ("weight", "bias"):
        assert torch.equal(original.tensors[name], restored.tensors[name])
    fresh, _ = _stage()  # without the optimizer state, the same weights train differently
    fresh.load(
        safetensors.torch.save({k: v for k, v in safetensors.torch.load(data).items() if "#" not in k})
    )
    _steps(fresh, 2, -0.3)
    assert not torch.equal(fresh.tensors["weight"], original.tensors["weight"])


@pytest.mark.parametrize(
    ("name", "tensor", "match"),
    [
        ("weight#exp_avg", torch.ones(5), "does not fit"),
        ("weight#exec", torch.ones(2, 3), "no optimizer state"),
        ("ghost#exp_avg", torch.ones(2, 3), "no optimizer state"),
        ("weight#exp_avg", torch.ones(2, 3, dtype=torch.int64), "does not fit"),
    ],
)
def test_a_stage_refuses_optimizer_state_that_is_not_its_own(
    name: str, tensor: torch.Tensor, match: str
) -> None:
    stage, _ = _stage()
    before = stage.tensors["weight"].clone()
    data = safetensors.torch.save({"weight": torch.zeros(2, 3), name: tensor})
    with pytest.raises(ProtocolError, match=match):
        stage.load(data)
    assert torch.equal(stage.tensors["weight"], before)  # nothing was loaded


def test_a_replan_request_names_peers_and_can_only_slow_them_down() -> None:
    spec = ModelSpec("gpt2", {"n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 256}, input_shape=(1, 8))
    request = JobRequest(
        "job-1-p2",
        spec,
        2,
        "none",
        "op-fence",
        peer_record(A),
        (),
        max_ratio=20.0,
        replaces="job-1",
        exclude=(B,),
        speeds=((B, 0.25),),
    )
    assert JobRequest.from_wire(request.to_wire()) == request
    body = request.to_body()
    for key, value, match in (
        ("speeds", [[B, 2.0]], "factor in"),
        ("speeds", [[B, 0]], "factor in"),
        ("exclude", ["not a peer"], "not a PeerID"),
        ("exclude", [B] * 300, "at most"),
        ("replaces", "../etc", "not a job name"),
    ):
        with pytest.raises(RecordError, match=match):
            JobRequest.from_wire(msgpack.packb({**body, key: value}))


def test_fault_settings_come_from_the_job_file_and_are_checked() -> None:
    job = JobSpec.from_toml("[fault]\ndeadline_s = 5\nstraggler_steps = 2\nmax_replans = 0\n")
    assert (job.deadline_s, job.straggler_steps, job.max_replans) == (5, 2, 0)
    with pytest.raises(ConfigError, match=r"\[fault\] deadline_slack"):
        JobSpec.from_toml("[fault]\ndeadline_slack = 0.5\n")
    with pytest.raises(ConfigError, match=r"\[fault\] retries: unknown key"):
        JobSpec.from_toml("[fault]\nretries = 3\n")


def test_events_are_lines_and_records(tmp_path: Path) -> None:
    printed: list[str] = []
    log = EventLog(tmp_path / "events.jsonl", out=printed.append)
    log.emit("peer_lost", "step 3 failed", step=3, lost=[A])
    log.emit("restored", "back to step 0", step=0, redone=3)
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write("torn line\n")
    rows = EventLog.read(tmp_path / "events.jsonl")
    assert [r["event"] for r in rows] == ["peer_lost", "restored"] and rows[0]["lost"] == [A]
    assert printed == ["[peer_lost] step 3 failed", "[restored] back to step 0"]
