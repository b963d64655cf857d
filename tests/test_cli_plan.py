"""`fusionp2p plan` on a swarm file: the plan next to the baselines, a PNG, stage records as JSON."""

import dataclasses
import json
from dataclasses import asdict

import pytest
from job_helpers import peer_record

from fusionp2p.cli import main
from fusionp2p.planning import synthetic_swarm
from fusionp2p.records import PlanStageRecord

SMALL_GPT2 = '{"n_layer": 4, "n_embd": 256, "n_head": 4}'


@pytest.fixture
def swarm_file(tmp_path):
    peers, links, _ = synthetic_swarm(5, n_peers=8)
    path = tmp_path / "swarm.json"
    path.write_text(
        json.dumps(
            {
                "swarm": "s",
                "at": 0.0,
                "peers": [asdict(p) for p in peers],
                "links": [asdict(lk) for lk in links],
            }
        )
    )
    return path


def test_plan_prints_op_fence_and_baselines_and_draws_a_png(swarm_file, tmp_path, capsys) -> None:
    png = tmp_path / "plan.png"
    code = main(
        [
            "plan",
            "--swarm-file",
            str(swarm_file),
            "--model",
            "gpt2",
            "--model-config",
            SMALL_GPT2,
            "--seq-len",
            "256",
            "--png",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "plan op-fence:" in out
    for name in ("equal-number/none", "equal-number/uniform", "equal-computation/adaptive"):
        assert name in out
    assert png.read_bytes().startswith(b"\x89PNG")


def test_plan_json_gives_valid_stage_records(swarm_file, capsys) -> None:
    assert (
        main(
            [
                "plan",
                "--swarm-file",
                str(swarm_file),
                "--model",
                "llama",
                "--model-config",
                '{"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, '
                '"intermediate_size": 688, "vocab_size": 1000}',
                "--seq-len",
                "128",
                "--json",
            ]
        )
        == 0
    )
    records = [PlanStageRecord.from_dict(r) for r in json.loads(capsys.readouterr().out)]
    assert [r.stage for r in records] == list(range(len(records)))


def test_plan_reports_bad_input_clearly(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"peers": [{"peer_id": "x"}]}')
    assert main(["plan", "--swarm-file", str(bad)]) == 1
    assert "peers[0] is not a valid record" in capsys.readouterr().err
    assert main(["plan", "--swarm-file", str(tmp_path / "missing.json")]) == 1
    assert "cannot read swarm file" in capsys.readouterr().err


def test_status_prints_nothing_a_peer_wrote_as_a_terminal_command() -> None:
    from fusionp2p.cli_jobs import format_runs
    from fusionp2p.cli_swarm import format_status, printable
    from fusionp2p.records import RunStatusRecord

    evil = "\x1b[2J\x1b[31mALERT: send your key to\u202e evil\nfake line"
    run = RunStatusRecord(f"run{evil}", "Qm" + "a" * 44, "job-1", 1, 2, 0.5, 1, 1, 0, (evil,), 0.0)
    peer = dataclasses.replace(peer_record("Qm" + "b" * 44), device_name="cpu\x1b]0;owned\x07")
    text = format_runs([printable(run)], 0.0) + "\n" + format_status([printable(peer)], [], 0.0)
    assert not any(ch in text for ch in "\x1b\x07\u202e") and "ALERT" in text
    assert text.count("fake line") == 2 and "\nfake line" not in text  # no forged line
