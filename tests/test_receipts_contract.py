"""The receipt as a contract: every committed file in receipts/ validates against the schema and
renders with `show`, the reply's `dflash` block is one model on both sides, and `schema` prints a
versioned JSON Schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_bench.checks.schema import SCHEMA_VERSION, load_document
from dflash_bench.cli import app
from dflash_bench.engine.reply_block import DflashBlock
from dflash_bench.engine.request import Stats

RECEIPTS = sorted((Path(__file__).parent.parent / "receipts").glob("*.json"))


def test_receipts_folder_is_not_empty():
    assert len(RECEIPTS) > 20


@pytest.mark.parametrize("path", RECEIPTS, ids=lambda p: p.name)
def test_every_committed_receipt_validates_and_shows(path):
    load_document(path)
    result = CliRunner().invoke(app, ["show", str(path)])
    assert result.exit_code == 0, result.output
    assert "no table" not in result.output and result.output.strip()


def test_show_prints_the_engine_speed_table_and_the_training_table():
    """The 9B's engine-speed receipt shows ours beside mlx-lm at each level (code at 1 stream: 153.08 against
    mlx-lm's 106.77 tok/s on session 58's H100) and that drafted == plain held at T 0.7 too; the training receipt
    its held-out table."""
    runner = CliRunner()
    speed = runner.invoke(app, ["show", "receipts/engine-speed-qwen3.5-9b-4bit-gpu-h100.json"], env={"COLUMNS": "250"})
    row = next(line for line in speed.output.splitlines() if "code" in line and "plain" in line and "153.08" in line)
    assert "engine speed (tok/s" in speed.output and "106.77" in row and "1.43x" in row
    assert "at T 0.7" in speed.output
    train = runner.invoke(app, ["show", "receipts/train-smollm2-135m-dflash-v10.json"])
    assert "held-out measurements" in train.output and "mean" in train.output


def test_show_prints_an_older_engine_speed_receipts_one_stream_mlx_lm_row(tmp_path):
    """Receipts written before mlx-lm ran at every level hold one mlx-lm cell a probe (its `generate_step` at one
    stream and ours over it), which `show` prints as a row of its own; no committed receipt holds one any more."""
    from dflash_bench.checks.receipt import Receipt, summary

    r = Receipt.new("engine-speed", ["dflash-bench", "engine-speed"], {"levels": [1]})
    r.aggregates = {"code": {"plain": {"1": {"aggregate_tok_s": summary([1.2]), "stream_tok_s": summary([1.2])}},
                             "mlx-lm": {"stream_tok_s": summary([5.58]), "ours_over_mlx_lm": 0.22}}}
    r.finish(True)
    r.write(tmp_path / "old.json")
    out = CliRunner().invoke(app, ["show", str(tmp_path / "old.json")], env={"COLUMNS": "250"}).output
    row = next(line for line in out.splitlines() if "mlx-lm generate" in line)
    assert "5.58" in row and "0.22" in row


def test_tables_are_not_cut_to_80_columns_when_stdout_is_not_a_terminal():
    out = CliRunner().invoke(app, ["show", "receipts/exactness-default.json"]).output
    assert "drafted sha" in out and "pro…" not in out
    assert max(len(line) for line in out.splitlines()) > 80


def test_schema_prints_a_versioned_json_schema_naming_every_document():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["schema_version"] == SCHEMA_VERSION and schema["$id"].endswith(f"v{SCHEMA_VERSION}")
    names = set(schema["$defs"])
    for name in ("DecodeReceipt", "EngineSpeedReceipt", "CompareDoc", "TrainingReceipt", "DecodeAggregates"):
        assert name in names, name


def test_the_dflash_block_counts_acceptance_per_round_and_depth():
    stats = Stats()
    for drafted, accepted in ((3, 3), (3, 1), (3, 0), (0, 0)):  # the last round drafted nothing
        stats.count_round(drafted, accepted)
    block = DflashBlock.from_stats(stats, [1, 2, 3])
    assert block.rounds == 4 and block.drafted == 9 and block.accepted == 4
    assert block.acceptance_histogram == [1, 1, 0, 1]  # rounds accepting 0, 1, 2, 3 drafts
    assert block.drafted_by_depth == [3, 3, 3] and block.acceptance_by_depth == [2 / 3, 1 / 3, 1 / 3]
    assert DflashBlock.model_validate(block.model_dump()) == block  # what the server writes, the client reads
