"""The checks against a real `mlx_lm.server` (mlx-lm's own OpenAI-compatible server) on the tiny llama
fixture: the harness must work with a server that knows nothing of `draft`, /tokenize or /metrics and
gives token ids only in non-streamed `logprobs`, and report what it cannot check as not run or
unverified, never as passed.

The server runs with its prompt cache off (`--prompt-cache-size 0`: prefill must be cold) and with no
Hugging Face cache folder, where its /v1/models answers 200 with an empty body.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from conftest import stop_server, write_short_prompts
from dflash_bench.checks import prompts
from dflash_bench.checks.server import free_port
from dflash_bench.cli import app

pytestmark = pytest.mark.slow

pytest.importorskip("mlx_lm.server")
fixtures = pytest.importorskip("dflash_bench.fixtures.small")

NO_DFLASH = "no `dflash` block"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fixtures.write_fixture("llama", tmp_path_factory.mktemp("mlx-lm") / "llama")


@pytest.fixture(scope="module")
def mlx_lm_server(model, tmp_path_factory):
    """`python -m mlx_lm server --model FIXTURE` on a free loopback port; yields its URL."""
    root = tmp_path_factory.mktemp("mlx-lm-server")
    port = free_port()
    env = dict(os.environ, HF_HUB_CACHE=str(root / "no-hf-cache"), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "--prompt-cache-size", "0"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240  # a shared, loaded CPU can take minutes to import MLX
        while True:
            assert proc.poll() is None, (root / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "mlx_lm.server did not answer /health within 240 s"
            time.sleep(0.2)
        yield url
    finally:
        stop_server(proc, log)


@pytest.fixture
def short_prompts(tmp_path, monkeypatch):
    """Two known-answer prompts and one long prompt of two paragraphs (still past 512 fixture tokens):
    mlx_lm prefills the full 2,900-token long prompt in about 8 s on CPU."""
    folder = write_short_prompts(tmp_path / "prompts")
    monkeypatch.setattr(prompts, "PROMPTS_DIR", folder)


def check(command: str, url: str, tmp_path, *extra: str) -> tuple[int, dict, str]:
    out = tmp_path / f"{command}.json"
    res = CliRunner().invoke(app, [command, "--url", url, "--out", str(out), *extra], env={"COLUMNS": "200"})
    data = json.loads(out.read_text())
    assert data["complete"], data["incomplete_reason"]
    server = data["server"]
    assert (server["managed"], server["health"], server["model"]) == (False, {"status": "ok"}, None)
    # token ids from `logprobs` (non-streamed replies: checks/adapters.py)
    assert server["capabilities"] | {"probe_error": None} == {
        "dflash": False, "token_ids": True, "cached_tokens": True, "drafter": None, "probe_error": None, "refused": None,
        "two_server": False}
    assert (server["adapter"]["engine"], server["adapter"]["evidence"]) == ("mlx_lm", "token ids")
    return res.exit_code, data, res.output


def not_run(data: dict) -> dict[str, str]:
    return {n["check"]: n["reason"] for n in data["not_run"]}


def test_decode_measures_plain_replies_and_reports_drafted_not_run(mlx_lm_server, tmp_path):
    code, data, _ = check("decode", mlx_lm_server, tmp_path, "--levels", "1,2", "--tokens", "16", "--reps", "2")
    assert code == 2 and not data["verdict"]["passed"] and not data["verdict"]["failures"]
    assert NO_DFLASH in not_run(data)["decode_drafted"]
    agg = data["aggregates"]
    assert agg["modes"] == ["plain"]
    for role in ("code", "chat"):
        assert agg["single_tps"][role]["plain"]["n"] == 2 and agg["single_tps"][role]["plain"]["median"] > 0
        assert all(agg["aggregate_tps"][role][level]["plain"]["median"] > 0 for level in ("1", "2"))
    measured = [r for r in data["records"] if r["labels"].get("mode")]
    assert len(measured) == 2 * (1 + 2) * 2
    assert all(r["status"] == "ok" and r["draft"] is None and r["completion_tokens"] for r in measured)
    assert data["server"]["peak_memory_bytes"] is None  # no /metrics: not reported, not zero


def test_prefill_makes_its_arrays_with_the_model_tokenizer_when_the_server_has_none(mlx_lm_server, model, tmp_path):
    code, data, _ = check("prefill", mlx_lm_server, tmp_path, "--sizes", "64,128", "--rounds", "2")
    assert code == 2 and "no POST /tokenize" in not_run(data)["prefill"] and "--tokenizer" in not_run(data)["prefill"]

    code, data, _ = check("prefill", mlx_lm_server, tmp_path, "--sizes", "64,128", "--rounds", "2",
                          "--tokenizer", str(model))
    assert code == 2 and not data["verdict"]["failures"] and not data["verdict"]["unverified"]
    assert set(not_run(data)) == {"prefill_drafted"}
    agg = data["aggregates"]
    assert agg["tokenizer"] == f"local {model}"
    assert {n: a["tokens"] for n, a in agg["arrays"].items()} == {"64": 64, "128": 128}
    for size in ("64", "128"):
        assert agg["sizes"][size]["plain"]["tps"]["n"] == 2 and agg["sizes"][size]["plain"]["tps"]["median"] > 0
    measured = [r for r in data["records"] if r["labels"].get("phase") == "measure"]
    # the server tokenized each array's text to exactly the array, and prefilled it cold
    assert [(r["prompt_tokens"], r["cached_tokens"]) for r in measured] == [(64, 0), (128, 0)] * 2


def test_exactness_is_not_run_and_never_passed_without_the_draft_field(mlx_lm_server, tmp_path, short_prompts):
    code, data, output = check("exactness", mlx_lm_server, tmp_path, "--known-tokens", "4", "--probe-tokens", "8",
                               "--long-tokens", "4")
    assert code == 2 and data["verdict"]["passed"] is False and not data["verdict"]["failures"]
    assert NO_DFLASH in not_run(data)["drafted_equals_plain"]
    rows = data["aggregates"]["prompts"]
    assert [r["prompt_id"] for r in rows] == ["capital-france", "capital-japan", "fibonacci-chat", "gpu-chat",
                                              "wrenmouth-short"]
    assert rows[-1]["prompt_tokens"] > 512
    # token ids but no `draft`: nothing is compared (None), never equal
    assert all(r["equal"] is None and r["drafted_sha"] and "plain_sha" not in r for r in rows)
    assert (data["aggregates"]["equal"], data["aggregates"]["compared"]) == (0, 0)
    assert output.count("unverified") >= len(rows) and "not run: drafted_equals_plain" in output
    assert "NOT PASSED" in output
    # the `draft` field is never sent to a server that does not know it
    assert all(r["draft"] is None for r in data["records"] if r["labels"].get("kind"))
    # the random fixture answers wrong: a warning (not verified with this model), not a failure
    assert {w["check"] for w in data["verdict"]["warnings"]} == {"known_answers"}
