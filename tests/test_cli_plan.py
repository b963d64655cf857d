"""`fusionp2p plan` on a swarm file: the plan next to the baselines, a PNG, stage records as JSON."""

import dataclasses
import json
from dataclasses import asdict

import pytest
from job_helpers import peer_record

from fusionp2p.cli import main
from fusionp2p.planning import synthetic_swarm
from fusionp2p.records import PlanStageRecord
from fusionp2p.records.node_ranges import expand_ranges

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


TINY_DECODER = (
    '{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, '
    '"intermediate_size": 128, "vocab_size": 500}'
)


@pytest.mark.parametrize(
    ("family", "extra"),
    [
        ("mistral", ["--model-config", TINY_DECODER, "--seq-len", "32"]),
        ("qwen2", ["--model-config", TINY_DECODER, "--seq-len", "32"]),
        ("gpt_neox", ["--model-config", TINY_DECODER, "--seq-len", "32"]),
        ("gpt2", ["--model-config", SMALL_GPT2, "--seq-len", "32", "--trace"]),
        ("resnet", ["--model-config", '{"width": 8}', "--image-size", "16"]),
        ("digits-cnn", ["--channels", "1", "--image-size", "8"]),
    ],
)
def test_plan_takes_every_registered_family(swarm_file, capsys, family, extra) -> None:
    from fusionp2p.opdag.families import ModelRegistry

    assert family in ModelRegistry().names()
    assert main(["plan", "--swarm-file", str(swarm_file), "--model", family, *extra, "--json"]) == 0
    records = [PlanStageRecord.from_dict(r) for r in json.loads(capsys.readouterr().out)]
    assert records and [r.stage for r in records] == list(range(len(records)))
    placed = sorted(p for r in records for p in expand_ranges(r.node_ranges))
    assert len(placed) == placed[-1] + 1  # every node placed once
    assert len(placed) > (5 if family == "digits-cnn" else 60)  # one node per operator: traced


def test_plan_names_the_families_and_the_shape_a_model_cannot_take(swarm_file, capsys) -> None:
    assert main(["plan", "--swarm-file", str(swarm_file), "--model", "gtp2"]) == 1
    err = capsys.readouterr().err
    assert "no model family 'gtp2'" in err and "gpt_neox" in err and "resnet" in err
    assert main(["plan", "--swarm-file", str(swarm_file), "--model", "digits-cnn"]) == 1
    assert "digits-cnn cannot take (3, 32, 32) images" in capsys.readouterr().err
    bad_key = ["--model", "qwen2", "--model-config", '{"n_layer": 2}']
    assert main(["plan", "--swarm-file", str(swarm_file), *bad_key]) == 1
    assert "n_layer" in capsys.readouterr().err
