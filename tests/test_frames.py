"""Receipts as pandas tables: `table` (printed, CSV, Parquet) and `compare --trend` over a series,
`compare --markdown` for a CI summary."""

from __future__ import annotations

import pandas as pd
import pytest
from typer.testing import CliRunner

from dflash_bench.checks import frames
from dflash_bench.checks.receipt import Receipt
from dflash_bench.cli import app

DECODES = ["receipts/decode-default-plain-serve.json", "receipts/decode-default-drafted-serve.json",
           "receipts/decode-default.json"]


def loaded(paths):
    return [(p, Receipt.load(p)) for p in paths]


def test_aggregates_become_one_row_per_numeric_leaf_with_the_receipts_commit():
    frame = frames.aggregates_frame(loaded(DECODES[:1]))
    row = frame[frame["metric"] == "single_tps.code.plain.median"].iloc[0]
    assert row["kind"] == "decode" and row["commit"] and row["value"] > 0


def test_records_keep_their_labels_as_columns():
    frame = frames.records_frame(loaded(["receipts/decode-default-itl.json"]))
    assert {"labels.probe", "labels.mode", "ttft", "tpot"} <= set(frame.columns)
    assert "token_ids" not in frame.columns


def test_table_writes_csv_and_parquet(tmp_path):
    result = CliRunner().invoke(app, ["table", *DECODES[:2], "--csv", str(tmp_path / "a.csv")])
    assert result.exit_code == 0, result.output
    assert set(pd.read_csv(tmp_path / "a.csv")["receipt"]) == set(DECODES[:2])
    pytest.importorskip("pyarrow", reason="the parquet extra (pyarrow) is not installed")
    result = CliRunner().invoke(app, ["table", DECODES[0], "--records", "--parquet", str(tmp_path / "r.parquet")])
    assert result.exit_code == 0 and len(pd.read_parquet(tmp_path / "r.parquet")) > 10


def test_a_trend_orders_receipts_by_when_they_ran():
    frame = frames.trend(loaded(list(reversed(DECODES))), ["single_tps.code.drafted.median"])
    assert list(frame.index) == ["single_tps.code.drafted.median"]
    stamps = [c.split(" ", 1)[1] for c in frame.columns]
    assert stamps == sorted(stamps) and len(stamps) == 3


def test_compare_with_more_than_two_receipts_prints_the_trend():
    result = CliRunner().invoke(app, ["compare", *DECODES, "--markdown"])
    assert result.exit_code == 0
    assert result.output.startswith("| metric |") and "single_tps.code.drafted.median" in result.output


def test_compare_markdown_gives_the_before_after_table_and_verdict():
    result = CliRunner().invoke(app, ["compare", *DECODES[:2], "--markdown"])
    assert "| single-stream tok/s | code | drafted |" in result.output
    assert result.output.rstrip().endswith("**") and "beyond the runs' spread" in result.output
