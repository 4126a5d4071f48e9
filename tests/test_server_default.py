"""`dflash-bench serve` as users run it: a subprocess on loopback, the default model (SmolLM2-135M-Instruct),
driven by the official `openai` package and raw httpx; and startups that must be refused before
any weight loads."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

import dflash_bench  # noqa: F401
from dflash_bench.engine import gguf
from dflash_bench.engine.checkpoint import resolve
from dflash_bench.engine.request import token_sha
from dflash_bench.fixtures.small import write_fixture

from conftest import PUBLISHED

SERVE = [sys.executable, "-m", "dflash_bench", "serve"]
ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m dflash_bench serve ...` on a free port, its output in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([*SERVE, *args, "--port", str(self.port)], stdout=out,
                                         stderr=subprocess.STDOUT, cwd=ROOT,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))

    def wait_ready(self, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited with {self.proc.returncode}: {self.lines()}"
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200 and r.json()["status"] == "ready":  # 503 "warming" before
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"serve was not ready in {timeout} s: {self.lines()}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()

    def log_line(self, reply_id: str, timeout: float = 5.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines() if line.startswith(f"{reply_id} ")]
            if found:
                return found[0]
            time.sleep(0.05)
        raise AssertionError(f"no log line for {reply_id}: {self.lines()[-5:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc = ServeProcess(["default", "--no-drafter", "--parallel", "2", "--context", "1024", "--prompt-cache-gib", "0.25"],
                        tmp_path_factory.mktemp("serve-default") / "serve.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() in (0, -signal.SIGTERM)  # uvicorn shuts down gracefully, then re-raises the signal


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def test_startup_line_names_target_drafter_kind_streams_and_context_once(served) -> None:
    health = httpx.get(f"{served.url}/health").json()
    assert (health["model"], health["drafter"], health["streams"], health["context"]) == (
        "SmolLM2-135M-Instruct", None, 2, 1024)
    startup = [line for line in served.lines() if line.startswith("serving ")]
    assert len(startup) == 1
    assert re.match(rf"serving SmolLM2-135M-Instruct: no drafter, 2 streams of 1024 tokens, prompt cache 0\.25 GiB, "
                    rf"warmed \d+ shapes in [\d.]+ s, at {re.escape(served.url)}; plan: 2 streams of 1024 tokens: ", startup[0])
    assert "; self-check passed on cpu (" in startup[0] and "window == steps" in startup[0]


def test_openai_completions_streamed_and_not(served, client: openai.OpenAI) -> None:
    common = dict(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=6, temperature=0)
    whole = client.completions.create(**common, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = whole.choices[0]
    ids = choice.model_extra["token_ids"]
    dflash = whole.model_extra["dflash"]
    assert len(ids) == 6 == whole.usage.completion_tokens
    assert dflash["token_sha"] == token_sha(ids)
    assert (dflash["drafter"], dflash["drafted"], dflash["tokens_per_round"]) == (None, 0, 1.0)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert "Paris" in choice.text

    chunks = list(client.completions.create(**common, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [i for c in chunks if c.choices for i in c.choices[0].model_extra.get("token_ids", [])] == ids
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish[0].choices[0].finish_reason == "length" and finish[0].model_extra["dflash"]["token_sha"] == token_sha(ids)

    line = served.log_line(whole.id)  # one request log line per reply
    assert line == (f"{whole.id} prompt={whole.usage.prompt_tokens} cached=0 tokens=6 token_sha={token_sha(ids)} "
                    f"finish=length rounds={dflash['rounds']} accepted/drafted=0/0")


def test_openai_chat_streamed_and_not(client: openai.OpenAI) -> None:
    common = dict(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**common)
    answer = whole.choices[0].message.content
    assert "Paris" in answer
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.model_extra["dflash"]["token_sha"]
    chunks = list(client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_httpx_token_id_prompt_and_sse(served) -> None:
    text = "def fibonacci(n):"
    ids = httpx.post(f"{served.url}/tokenize", json={"prompt": text}).json()["tokens"]
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    by_text = httpx.post(f"{served.url}/v1/completions", json=body | {"prompt": text}, timeout=60).json()
    by_ids = httpx.post(f"{served.url}/v1/completions", json=body | {"prompt": ids}, timeout=60).json()
    assert by_ids["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body | {"prompt": ids, "stream": True},
                      timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert [i for p in payloads for i in p["choices"][0]["token_ids"]] == by_ids["choices"][0]["token_ids"]


def test_startup_line_names_a_dflash_drafter(tmp_path: Path) -> None:
    target, drafter = write_fixture("llama", tmp_path / "target"), write_fixture("dflash", tmp_path / "drafter")
    proc = ServeProcess([str(target), "--drafter", str(drafter), "--parallel", "2", "--context", "256"],
                        tmp_path / "serve.log")
    try:
        assert proc.wait_ready()["drafter"] == "DFlash"
        reply = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "The fox", "max_tokens": 8, "temperature": 0,
                                                               "ignore_eos": True}, timeout=60).json()
        assert reply["dflash"]["drafter"] == "DFlash" and reply["dflash"]["drafted"] > 0
    finally:
        proc.stop()
    [line] = [line for line in proc.lines() if line.startswith("serving ")]
    assert re.match(rf"serving target: DFlash drafts, 2 streams of 256 tokens, warmed \d+ shapes and 1 drafter pass in "
                    rf"[\d.]+ s, at {re.escape(proc.url)}; plan: 2 streams", line)


# -- refused startups --------------------------------------------------------------------------
def gguf_float32_bytes(path: Path) -> int:
    return sum(math.prod(t.shape) * 4 for t in gguf.read_header(path).tensors.values())


# Runs argv[2:] with its output in the file argv[1] and prints its exit code and peak RSS (ru_maxrss).
# Linux counts a child's memory from before its exec as its own (the parent's pages, when it is forked
# from pytest), so the measured process is started by this small interpreter instead.
MEASURE = ("import os, subprocess, sys\n"
           "with open(sys.argv[1], 'wb') as out:\n"
           "    pid = subprocess.Popen(sys.argv[2:], stdout=out, stderr=subprocess.STDOUT).pid\n"
           "    _, status, usage = os.wait4(pid, 0)\n"
           "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)\n")


def run_refused(args: list[str], tmp_path: Path) -> tuple[int, str, int]:
    """Run serve to its exit; return (exit code, output, the process's own peak RSS in bytes)."""
    log = tmp_path / "refused.log"
    measured = subprocess.run([sys.executable, "-c", MEASURE, str(log), *SERVE, *args, "--port", str(free_port())],
                              cwd=ROOT, capture_output=True, text=True, check=True)
    code, maxrss = map(int, measured.stdout.split())
    return code, log.read_text(), maxrss * (1 if sys.platform == "darwin" else 1024)


def test_drafter_for_another_target_stops_startup_before_the_weights_load(tmp_path: Path) -> None:
    drafter = write_fixture("dflash", tmp_path / "drafter-for-qwen3_5", target="qwen3_5")
    code, output, peak = run_refused(["default", "--drafter", str(drafter)], tmp_path)
    assert code == 1
    assert output.strip() == "DraftForAnotherTarget: hidden_size is 64 in the drafter, 576 in the target"
    # A load holds the float32 weights (538 MB); a refusing process holds the interpreter, its libraries
    # and the GGUF header's metadata (136 MB measured): a third of the weights tells them apart.
    assert peak < gguf_float32_bytes(resolve("default")) / 3


def test_published_target_refuses_a_drafter_for_another_target_from_configs_alone(tmp_path: Path) -> None:
    target = tmp_path / "qwen3.5-4b"  # config.json only: loading any weight would fail differently
    target.mkdir()
    (target / "config.json").write_text((PUBLISHED / "qwen3.5-4b.config.json").read_text())
    drafter = write_fixture("dflash", tmp_path / "drafter-for-llama", target="llama")
    code, output, peak = run_refused([str(target), "--drafter", str(drafter)], tmp_path)
    assert code == 1
    assert re.fullmatch(r"DraftForAnotherTarget: \S+ is \d+ in the drafter, \d+ in the target", output.strip())
    assert peak < 2560 * 248320 * 2  # the target's bf16 embedding alone


def test_drafter_none_serves_the_default_model_without_its_shipped_drafter(tmp_path: Path) -> None:
    proc = ServeProcess(["default", "--drafter", "none", "--parallel", "1", "--context", "256"], tmp_path / "serve.log")
    try:
        assert proc.wait_ready()["drafter"] is None
    finally:
        proc.stop()
    [line] = [line for line in proc.lines() if line.startswith("serving ")]
    assert "no drafter" in line
