"""stress against the fake server: a load with random hang-ups passes when the server keeps its
probes and memory, fails when drops leak memory, and its draw and percentiles are reproducible."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dflash_bench.checks.receipt import percentiles
from dflash_bench.checks.stress import StressSettings, draw
from dflash_bench.cli import app
from fake_openai import FakeServer

# Slow enough chunks (20 ms each) that hang-ups drawn within 0.3 s land mid-reply.
LOAD = ("--requests", "40", "--concurrency", "4", "--max-tokens", "24", "--max-prompt-words", "40",
        "--drop-within", "0.3", "--probe-tokens", "8", "--timeout", "30")


def stress(url: str, tmp_path, *extra: str):
    out = tmp_path / "stress.json"
    res = CliRunner().invoke(app, ["stress", "--url", url, "--out", str(out), *LOAD, *extra], env={"COLUMNS": "200"})
    return res, json.loads(out.read_text())


def test_a_load_with_hang_ups_that_changes_nothing_passes(tmp_path):
    with FakeServer(chunk_delay=0.02) as fake:
        res, data = stress(fake.url, tmp_path)
        dropped_by_server = fake.fake.dropped
    assert res.exit_code == 0, res.output
    c = data["aggregates"]["counts"]
    assert c["planned"] == c["sent"] == 40 and c["not_sent"] == 0 and c["http_5xx"] == 0 and c["errors"] == {}
    assert c["completed"] + c["dropped"] == 40 and c["dropped"] > 0 and dropped_by_server > 0
    assert c["drops_planned"] >= c["dropped"]
    load = [r for r in data["records"] if r["labels"].get("phase") == "load"]
    assert len(load) == 40 and {r["stream"] for r in load} == {True, False} and {r["draft"] for r in load} == {True, False}
    assert all(r["token_ids"] is None and r["text"] == "" for r in load)
    assert all(p["equal"] is True for p in data["aggregates"]["probes"]) and len(data["aggregates"]["probes"]) == 2
    lat = data["aggregates"]["latency"]
    assert lat["total_seconds"]["n"] == c["completed"] and lat["ttft_seconds"]["p50"] > 0
    rss = data["aggregates"]["rss"]
    assert rss["source"].startswith("/metrics") and rss["before_bytes"] == rss["after_bytes"] == rss["peak_bytes"]
    mem = data["aggregates"]["memory"]
    assert mem["baseline_bytes"] == mem["after_bytes"]
    assert "completed / dropped" in res.output and "TTFT" in res.output
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "stress.json")], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "server RSS before / peak / after" in shown.output


def test_a_server_that_keeps_memory_after_drops_fails(tmp_path):
    with FakeServer(chunk_delay=0.02, leak_per_drop=5e6) as fake:
        res, data = stress(fake.url, tmp_path)
    assert res.exit_code == 1
    assert {f["check"] for f in data["verdict"]["failures"]} == {"memory_returns_to_baseline"}
    mem = data["aggregates"]["memory"]
    assert mem["after_bytes"] > mem["baseline_bytes"] + mem["tolerance_bytes"]
    assert data["aggregates"]["rss"]["peak_bytes"] > data["aggregates"]["rss"]["before_bytes"]


def test_a_5xx_fails_and_a_4xx_is_only_warned(tmp_path):
    with FakeServer(chunk_delay=0.02, error_every=7) as fake:
        res, data = stress(fake.url, tmp_path, "--requests", "12")
    assert res.exit_code == 1
    c = data["aggregates"]["counts"]
    assert c["http_5xx"] >= 1 and c["errors"]["http 500"] == c["http_5xx"]
    assert {f["check"] for f in data["verdict"]["failures"]} == {"no_5xx_no_hang"}
    with FakeServer(chunk_delay=0.02, context=120) as fake:  # the longer prompts are refused past the window
        res, data = stress(fake.url, tmp_path, "--requests", "8")
    assert data["aggregates"]["counts"]["errors"].get("http 400") and data["verdict"]["warnings"]
    assert res.exit_code == 0, data["verdict"]


def test_the_load_is_drawn_from_the_seed():
    s = StressSettings(requests=50, seed=7)
    a, b = draw(s, True), draw(s, True)
    assert [(p.request, p.hang_up_after) for p in a] == [(p.request, p.hang_up_after) for p in b]
    assert [p.request for p in draw(StressSettings(requests=50, seed=8), True)] != [p.request for p in a]
    assert all(1 <= p.request.max_tokens <= 64 for p in a) and 10 <= sum(p.hang_up_after is not None for p in a) <= 40
    assert all(p.request.draft is None for p in draw(s, False))


def test_percentiles_interpolate_between_ranks():
    assert percentiles([]) == {"n": 0, "p50": None, "p90": None, "p99": None}
    p = percentiles([float(v) for v in range(1, 101)])
    assert p["n"] == 100 and p["p50"] == 50.5 and abs(p["p90"] - 90.1) < 1e-9 and abs(p["p99"] - 99.01) < 1e-9
