"""Every check end to end against the bundled server (`dflash-bench serve`, started and stopped by
the check itself) on the tiny random llama fixture and a DFlash drafter made for it: the drafter
really drafts, so drafted-vs-plain, concurrent, resume and cancel exercise the engine's draft path."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_bench.checks import prompts
from dflash_bench.cli import app
from conftest import write_short_prompts

pytestmark = pytest.mark.slow

fixtures = pytest.importorskip("dflash_bench.fixtures.small")
pytest.importorskip("dflash_bench.engine.server")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = fixtures.write_fixture("llama", root / "llama")
    drafter = fixtures.write_fixture("dflash", root / "dflash", target="llama")
    return ["--target", str(target), "--drafter", str(drafter), "--context", "8192", "--startup-timeout", "300"]


def check(command: str, pair: list[str], tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / f"{command}.json"
    res = CliRunner().invoke(app, [command, *pair, "--out", str(out), *extra], env={"COLUMNS": "200"})
    data = json.loads(out.read_text())
    assert data["complete"], data["incomplete_reason"]
    assert data["server"]["managed"] and "DFlash drafts" in data["server"]["startup_line"]
    return res.exit_code, data


@pytest.fixture
def fewer_prompts(tmp_path, monkeypatch):
    """Three known-answer prompts and the shorter long prompt (still past a 512-token window), to keep
    the CPU run short."""
    folder = write_short_prompts(tmp_path / "prompts", known_prompts=3, long_paragraphs=None)
    monkeypatch.setattr(prompts, "PROMPTS_DIR", folder)


def test_exactness_drafted_equals_plain_on_the_bundled_server(pair, tmp_path, fewer_prompts):
    code, data = check("exactness", pair, tmp_path, "--known-tokens", "8", "--probe-tokens", "24",
                       "--long-tokens", "8")
    assert code == 0, data["verdict"]
    assert data["server"]["capabilities"] == {"dflash": True, "token_ids": True, "cached_tokens": True,
                                              "drafter": "DFlash", "probe_error": None, "refused": None,
                                              "two_server": False}
    rows = data["aggregates"]["prompts"]
    assert [r["kind"] for r in rows] == ["known"] * 3 + ["code", "chat", "long"]
    assert all(r["equal"] is True for r in rows) and rows[-1]["prompt_tokens"] > 512
    drafted = [r for r in data["records"] if r["draft"] is True and r["labels"].get("kind")]
    assert sum(r["drafted"] for r in drafted) > 0  # the drafter proposed tokens that the target verified
    assert all(r["drafted"] == 0 for r in data["records"] if r["draft"] is False)


def test_concurrent_equals_solo_on_the_bundled_server(pair, tmp_path):
    code, data = check("concurrent", pair, tmp_path, "--tokens", "12", "--reps", "1", "--levels", "1,2")
    assert code == 0, data["verdict"]
    assert sum(c["equal"] for c in data["aggregates"]["cells"]) == 6


def test_resumed_equals_fresh_on_the_bundled_server(pair, tmp_path):
    code, data = check("resume", pair, tmp_path, "--tokens", "8", "--prompt", "wrenmouth-1200")
    assert code == 0, data["verdict"]
    steps = {s["step"]: s for s in data["aggregates"]["steps"]}
    assert steps["resumed"]["cached_tokens"] > 0


def test_cancel_changes_nothing_on_the_bundled_server(pair, tmp_path):
    code, data = check("cancel", pair, tmp_path, "--probe-tokens", "12", "--prefill-tokens", "3000",
                       "--drop-after-seconds", "0.1")
    assert code == 0, data["verdict"]
    assert not data["not_run"]


def test_decode_and_prefill_receipts_compare(pair, tmp_path):
    code, decode = check("decode", pair, tmp_path, "--tokens", "16", "--reps", "2", "--levels", "1,2")
    assert code == 0, decode["verdict"]
    assert decode["server"]["peak_memory_bytes"] > 0
    code, prefill = check("prefill", pair, tmp_path, "--sizes", "128,512", "--rounds", "2")
    assert code == 0, prefill["verdict"]
    assert [a["tokens"] for a in prefill["aggregates"]["arrays"].values()] == [128, 512]
    res = CliRunner().invoke(app, ["compare", str(tmp_path / "decode.json"), str(tmp_path / "decode.json")])
    assert res.exit_code == 0, res.output
