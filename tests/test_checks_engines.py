"""The checks against other engines' reply shapes (tests/fake_engines.py): each engine is detected,
its token ids and spec-decode figures are read, and two-server mode (--plain-url) compares a drafting
server with a plain one token for token, failing (exit 1, first differing index) where they differ."""

from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from conftest import write_short_prompts
from dflash_bench.checks import adapters, prompts
from dflash_bench.checks.adapters import EngineClient
from dflash_bench.checks.client import Request
from dflash_bench.cli import app
from fake_engines import EngineServer
from fake_openai import FakeServer

SMALL = ("--known-tokens", "6", "--probe-tokens", "8", "--long-tokens", "4")


@pytest.fixture(autouse=True)
def short_prompts(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "PROMPTS_DIR", write_short_prompts(tmp_path / "prompts"))


def run(tmp_path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / f"{args[0]}.json"
    res = CliRunner().invoke(app, [*args, "--out", str(out)], env={"COLUMNS": "200"})
    return res.exit_code, json.loads(out.read_text()) if out.exists() else {}, res.output


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
def test_each_engine_is_detected_from_what_it_answers(engine):
    with EngineServer(engine) as server:
        client = EngineClient(server.url)
        try:
            assert client.detected.engine == engine
            assert client.describe()["reported"]["models"]["data"][0]["owned_by"]
        finally:
            client.close()


def test_our_server_and_mlx_lm_like_servers_are_told_apart():
    with FakeServer() as ours, FakeServer(mlx_lm_like=True) as other:
        assert EngineClient(ours.url).detected.engine == "dflash-bench"
        assert EngineClient(other.url).detected.engine == "openai-compatible"


@pytest.mark.parametrize("engine,stream", [("vllm", False), ("vllm", True), ("sglang", False), ("sglang", True),
                                           ("llama.cpp", False), ("llama.cpp", True)])
def test_token_ids_and_tokens_a_round_come_back_in_every_shape(engine, stream):
    with EngineServer(engine, drafts=True) as server:
        client = EngineClient(server.url)
        try:
            rec = client.send(Request("p", prompt="def f(x):", max_tokens=9, stream=stream))
            want = server.fake.generate(list(b"def f(x):"), {"max_tokens": 9})
            assert rec.ok, rec.error
            assert (rec.token_ids, rec.evidence, rec.completion_tokens) == (want, "token ids", 9)
            if engine != "vllm":  # vLLM reports its figures server-wide only (see the decode test)
                assert (rec.rounds, rec.tokens_per_round) == (3, 3.0)
            chat = client.send(Request("c", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=stream))
            # SGLang's chat path carries text only: re-tokenized by its /tokenize, marked text-level
            assert chat.evidence == ("text" if engine == "sglang" else "token ids") and chat.token_ids
        finally:
            client.close()


def test_vllm_spec_decode_counters_are_taken_as_deltas():
    with EngineServer("vllm", drafts=True) as server:
        client = EngineClient(server.url)
        try:
            before = client.spec_counters()
            client.send(Request("p", prompt="abc", max_tokens=9))
            assert adapters.tokens_per_round(before, client.spec_counters()) == 3.0
        finally:
            client.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp"])
def test_two_servers_that_agree_pass(tmp_path, engine):
    with EngineServer(engine, drafts=True) as drafted, EngineServer(engine) as plain:
        code, data, output = run(tmp_path, "exactness", "--url", drafted.url, "--plain-url", plain.url, *SMALL)
    assert code == 0, output
    agg = data["aggregates"]
    assert (agg["compared"], agg["equal"], agg["differ"]) == (5, 5, 0)
    assert agg["evidence"] == ("text" if engine == "sglang" else "token ids")
    assert data["server"]["adapter"]["engine"] == engine and data["server"]["plain"]["adapter"]["engine"] == engine
    assert data["server"]["plain"]["url"] == plain.url
    assert {r["labels"].get("server") for r in data["records"]} == {None, "plain"}
    assert "PASSED" in output and "plain server" in output


def test_two_servers_that_differ_fail_naming_the_first_differing_token(tmp_path):
    with EngineServer("vllm", drafts=True, diverge_at=3) as drafted, EngineServer("vllm") as plain:
        code, data, output = run(tmp_path, "exactness", "--url", drafted.url, "--plain-url", plain.url, *SMALL)
    assert code == 1 and data["complete"]
    rows = data["aggregates"]["prompts"]
    assert [(r["equal"], r["first_diff"]) for r in rows] == [(False, 3)] * 5
    assert all("drafted server's and the plain server's replies differ: first differing token at index 3"
               in f["message"] for f in data["verdict"]["failures"])
    assert "FAILED" in output


def test_a_plain_server_that_drafts_fails(tmp_path):
    with EngineServer("llama.cpp", drafts=True) as drafted, EngineServer("llama.cpp", drafts=True) as plain:
        code, data, _ = run(tmp_path, "exactness", "--url", drafted.url, "--plain-url", plain.url, *SMALL)
    assert code == 1 and any("drafted anyway" in f["message"] for f in data["verdict"]["failures"])


def test_concurrent_and_resume_take_the_plain_reply_from_the_plain_server(tmp_path):
    with EngineServer("vllm", drafts=True) as drafted, EngineServer("vllm") as plain:
        code, data, output = run(tmp_path, "concurrent", "--url", drafted.url, "--plain-url", plain.url,
                                 "--levels", "1,2", "--tokens", "6", "--reps", "1", "--temperatures", "0")
        assert code == 0, output
        assert data["aggregates"]["serial"][0]["equal"] == 2
        assert sum(r["labels"].get("server") == "plain" for r in data["records"]) == 2 + 1  # + the probe
        code, data, output = run(tmp_path, "resume", "--url", drafted.url, "--plain-url", plain.url, "--tokens", "6")
    assert code == 0, output
    assert [s["step"] for s in data["aggregates"]["steps"]] == ["fresh", "resumed", "plain"]
    assert data["aggregates"]["steps"][1]["cached_tokens"] > 0


def test_decode_reports_tokens_a_round_from_foreign_figures(tmp_path):
    for engine in ("vllm", "llama.cpp"):
        with EngineServer(engine, drafts=True) as server:
            code, data, output = run(tmp_path, "decode", "--url", server.url, "--levels", "1", "--tokens", "9",
                                     "--reps", "1")
        assert not data["verdict"]["failures"], output
        assert data["aggregates"]["tokens_per_round"]["code"]["1"]["plain"] == 3.0


def test_url_alone_on_a_foreign_server_keeps_exactness_not_run(tmp_path):
    with EngineServer("vllm", drafts=True) as server:
        code, data, _ = run(tmp_path, "exactness", "--url", server.url, *SMALL)
    assert code == 2 and "--plain-url" in {n["check"]: n["reason"] for n in data["not_run"]}["drafted_equals_plain"]


def test_bad_plain_url_is_named(tmp_path):
    code, _, output = run(tmp_path, "exactness", "--plain-url", "http://127.0.0.1:9")
    assert code == 2 and "--plain-url needs --url" in output
    with EngineServer("vllm") as server:
        code, _, output = run(tmp_path, "exactness", "--url", server.url, "--plain-url", server.url + "/")
        assert code == 2 and "is --url itself" in output
        code, data, _ = run(tmp_path, "exactness", "--url", server.url, "--plain-url", "http://127.0.0.1:9")
    assert code == 2 and not data["complete"] and "--plain-url http://127.0.0.1:9" in data["incomplete_reason"]


def test_a_server_with_an_empty_health_body_is_alive():
    with EngineServer("vllm") as server:
        assert httpx.get(f"{server.url}/health").text == ""
        from dflash_bench.checks.server import AttachedServer
        with AttachedServer(server.url) as attached:
            assert attached.health == {}
