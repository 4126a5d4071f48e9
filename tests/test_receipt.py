"""Receipts: canonical JSON, atomic writes, the schema, exit codes, and a receipt left by every run."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from dflash_bench.checks.client import Request
from dflash_bench.checks.receipt import (
    SCHEMA_VERSION,
    BadReceipt,
    Receipt,
    canonical_json,
    exit_code,
    summary,
    write_atomic,
)
from dflash_bench.checks.runner import RunSpec, run_check
from fake_openai import FakeServer


def sample() -> Receipt:
    r = Receipt.new("exactness", ["dflash-bench", "exactness"], {"tokens": 4, "levels": (1, 4)})
    r.records.append({"prompt_id": "p", "endpoint": "/v1/completions", "status": "ok", "token_sha": "abc",
                      "ttft": float("nan")})
    r.aggregates["z"] = {"b": 1, "a": 2}
    r.finish(True)
    return r


def test_canonical_json_sorts_keys_at_every_depth_and_is_stable():
    text = canonical_json(sample().to_dict())
    pairs_seen = []
    json.loads(text, object_pairs_hook=lambda pairs: pairs_seen.append([k for k, _ in pairs]) or dict(pairs))
    assert all(keys == sorted(keys) for keys in pairs_seen)
    assert text == canonical_json(json.loads(text)) and text.endswith("\n")


def test_canonical_json_writes_nan_as_null_and_tuples_as_lists():
    data = json.loads(canonical_json(sample().to_dict()))
    assert data["records"][0]["ttft"] is None and data["settings"]["levels"] == [1, 4]


def test_receipt_names_schema_version_command_tool_and_environment():
    data = sample().to_dict()
    assert data["schema"] == "dflash-bench/receipt" and data["schema_version"] == SCHEMA_VERSION
    assert data["command"] == ["dflash-bench", "exactness"]
    assert data["tool"]["version"] and "commit" in data["tool"]["git"]
    env = data["environment"]
    for key in ("os", "cpu", "memory_bytes", "python", "mlx", "blas"):
        assert key in env, key
    assert env["mlx"]["version"] and env["mlx"]["default_device"] and env["blas"]["kind"]
    assert set(data["verdict"]) >= {"passed", "failures", "unverified"} and "not_run" in data


def test_a_receipt_names_mlxs_settings_from_the_environment(monkeypatch):
    """An `MLX_*` variable (a graph's size on a CUDA device) moves timings, not bits: the receipt says it was set."""
    for key in [k for k in os.environ if k.startswith("MLX_")]:
        monkeypatch.delenv(key)
    assert sample().to_dict()["environment"]["mlx"]["settings"] == {}
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "400")
    monkeypatch.setenv("MLXNOT", "1")
    assert sample().to_dict()["environment"]["mlx"]["settings"] == {"MLX_MAX_OPS_PER_BUFFER": "400"}


def test_a_copy_whose_git_is_not_its_own_names_its_revision(monkeypatch):
    """DFLASH_BENCH_COMMIT speaks for the tree where `.git` would not (the GPU machine's stale copy)."""
    monkeypatch.setenv("DFLASH_BENCH_COMMIT", "fb0f200+dirty")
    assert sample().to_dict()["tool"]["git"] == {"commit": "fb0f200", "dirty": True}
    monkeypatch.setenv("DFLASH_BENCH_COMMIT", "fb0f200")
    assert sample().to_dict()["tool"]["git"] == {"commit": "fb0f200", "dirty": False}
    monkeypatch.delenv("DFLASH_BENCH_COMMIT")
    assert sample().to_dict()["tool"]["git"] != {"commit": "fb0f200", "dirty": False}


def test_a_malformed_named_revision_stops_a_command_in_one_line(monkeypatch):
    from typer.testing import CliRunner

    from dflash_bench.cli import app

    monkeypatch.setenv("DFLASH_BENCH_COMMIT", "HEAD~1")
    result = CliRunner().invoke(app, ["plan", "default", "--context", "256"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "dflash-bench: DFLASH_BENCH_COMMIT='HEAD~1' is not a commit SHA with an optional '+dirty'"]


def test_write_then_load_round_trips(tmp_path):
    r = sample()
    r.fail("drafted_equals_plain", "p", "differ")
    r.write(tmp_path / "r.json")
    back = Receipt.load(tmp_path / "r.json")
    assert canonical_json(back.to_dict()) == canonical_json(r.to_dict())


def test_atomic_write_leaves_the_old_file_when_replace_fails(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text("old\n")

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        write_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["r.json"]


def test_an_atomic_write_gets_a_new_files_mode_not_mkstemps_owner_only(tmp_path):
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "r.json", "x\n")
    finally:
        os.umask(umask)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    write_atomic(tmp_path / "sub" / "r.json", "x\n")
    assert os.listdir(tmp_path / "sub") == ["r.json"]


def test_load_refuses_another_schema_version(tmp_path):
    data = sample().to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(BadReceipt, match="schema_version"):
        Receipt.load(tmp_path / "r.json")


def test_load_reads_a_version_1_receipt_as_it_is(tmp_path):
    data = sample().to_dict()
    data["schema_version"] = 1
    (tmp_path / "r.json").write_text(json.dumps(data))
    assert Receipt.load(tmp_path / "r.json").kind == "exactness"


def test_load_names_the_key_that_breaks_the_contract(tmp_path):
    data = sample().to_dict()
    data["aggregates"] = {"prompts": [{"prompt_id": "p"}]}  # a row without its kind
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(BadReceipt, match=r"aggregates\.prompts\.0\.kind"):
        Receipt.load(tmp_path / "r.json")


def test_load_refuses_a_file_that_is_not_a_receipt(tmp_path):
    (tmp_path / "r.json").write_text("[1, 2]")
    with pytest.raises(BadReceipt, match="schema"):
        Receipt.load(tmp_path / "r.json")


def test_summary_gives_median_spread_and_per_rep_values():
    s = summary([10.0, 12.0, 11.0, None])
    assert s == {"n": 3, "median": 11.0, "min": 10.0, "max": 12.0, "spread": 2.0 / 11.0, "values": [10.0, 12.0, 11.0]}
    assert summary([])["median"] is None


def test_exit_codes_passed_failed_incomplete_interrupted():
    r = sample()
    assert exit_code(r) == 0 and r.passed
    r.skip("serial", "no dflash block")
    assert exit_code(r) == 2 and not r.passed
    r = sample()
    r.unverify("x", "p", "no hash")
    assert exit_code(r) == 2
    r.fail("x", "p", "differ")
    assert exit_code(r) == 1
    r = sample()
    r.finish(False, "server died")
    assert exit_code(r) == 2 and not r.passed
    assert exit_code(r, interrupted=True) == 130


@pytest.fixture(scope="module")
def fake():
    with FakeServer() as server:
        yield server


def _cut_short(error: BaseException):
    def body(ctx):
        ctx.send(Request("first", prompt="hello", max_tokens=3), step="before")
        raise error

    return body


@pytest.mark.parametrize("error, code, reason", [
    (httpx.ReadTimeout("timed out"), 2, "ReadTimeout"),
    (httpx.RemoteProtocolError("server disconnected"), 2, "RemoteProtocolError"),
    (KeyboardInterrupt(), 130, "interrupted"),
    (RuntimeError("a bug"), 2, "RuntimeError: a bug"),
])
def test_a_run_cut_short_still_writes_its_receipt_marked_incomplete(fake, tmp_path, error, code, reason):
    out = tmp_path / "r.json"
    receipt, got = run_check(RunSpec("exactness", out, url=fake.url), {"n": 1}, _cut_short(error))
    assert got == code
    data = json.loads(out.read_text())
    assert data["complete"] is False and reason in data["incomplete_reason"]
    assert data["verdict"]["passed"] is False
    assert [r["prompt_id"] for r in data["records"]] == ["first"]
    assert data["server"]["url"] == fake.url and data["server"]["managed"] is False


def test_a_server_that_is_not_there_leaves_an_incomplete_receipt(tmp_path):
    out = tmp_path / "r.json"
    receipt, code = run_check(RunSpec("exactness", out, url="http://127.0.0.1:9"), {}, lambda ctx: None)
    assert code == 2 and not receipt.complete and "/health" in receipt.incomplete_reason
    assert json.loads(out.read_text())["complete"] is False


def test_a_finished_run_is_complete_and_records_the_peak_footprint(fake, tmp_path):
    receipt, code = run_check(RunSpec("exactness", tmp_path / "r.json", url=fake.url), {}, lambda ctx: None)
    assert code == 0 and receipt.complete and receipt.server["peak_memory_bytes"] == 2_000_000
