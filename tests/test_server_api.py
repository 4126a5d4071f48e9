"""The OpenAI-compatible server on loopback, over a tiny llama fixture and its DFlash drafter (fast).

Each server here is the real app under uvicorn on a free port, with a real engine running rounds in
its own thread; the clients are raw httpx (the `openai` package is used in test_server_default.py).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

import dflash_bench  # noqa: F401
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import token_sha
from dflash_bench.engine.server import create_app, warm_up
from dflash_bench.fixtures.small import write_fixture

PROMPT = "The quick brown fox jumps over the lazy dog."
LONG = 480  # max_tokens that, throttled, keeps a stream busy for seconds on the fixture (context 512)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """create_app(engine) under uvicorn on a free loopback port, in a thread; stops the engine after."""

    def __init__(self, engine: Engine, app=None) -> None:
        self.engine = engine
        self.app = app or create_app(engine)
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.http = httpx.Client(base_url=self.url, timeout=60.0)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.engine.stop()

    def complete(self, path: str = "/v1/completions", **body) -> dict:
        r = self.http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, path: str = "/v1/completions", **body) -> list:
        """Every SSE payload of a streamed reply, decoded ('[DONE]' kept as a string)."""
        out = []
        with self.http.stream("POST", path, json=body | {"stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    out.append(data if data == "[DONE]" else json.loads(data))
        return out

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its full name, labels included."""
        text = self.http.get("/metrics").text
        return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}

    def wait_idle(self, timeout: float = 20.0, replies: int | None = None) -> dict[str, float]:
        """Metrics once no stream is active or waiting (and, if given, once `replies` replies are counted)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            counted = sum(v for k, v in m.items() if k.startswith("dflash_requests_total"))
            if m["dflash_active_streams"] == 0 and m["dflash_waiting_requests"] == 0 and counted >= (replies or 0):
                return m
            assert time.monotonic() < deadline, f"the server did not go idle: {m}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("server-fixtures")
    return write_fixture("llama", root / "target"), write_fixture("dflash", root / "drafter")


def engine_for(checkpoints: tuple[Path, Path], **settings) -> Engine:
    chosen = {"parallel": 4, "context": 512, "prompt_cache_gib": 0.05, "chunk": 16} | settings
    engine = Engine(checkpoints[0], checkpoints[1], Settings(**chosen))
    warm_up(engine)
    engine.start()
    return engine


def start(checkpoints: tuple[Path, Path], **settings) -> LiveServer:
    return LiveServer(engine_for(checkpoints, **settings))


@contextmanager
def throttled(engine: Engine, seconds: float = 0.02) -> Iterator[None]:
    """Each target forward first sleeps `seconds`, so a LONG stream takes seconds on any CPU and a disconnect test
    drops it mid-stream: the fixture alone can finish LONG tokens into the socket buffers in well under a second."""
    target = engine.target
    real = target.forward

    def forward(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    target.forward = forward
    try:
        yield
    finally:
        del target.forward


@pytest.fixture(scope="module")
def server(checkpoints):
    with start(checkpoints) as s:
        yield s


def ids_of_stream(events: list) -> list[int]:
    return [i for e in events if isinstance(e, dict) for c in e.get("choices", []) for i in c.get("token_ids", [])]


# -- identity ----------------------------------------------------------------------------------
def test_health_and_models_name_the_target_drafter_streams_and_context(server: LiveServer) -> None:
    health = server.http.get("/health").json()
    assert health | {"active_streams": 0} == health
    assert (health["status"], health["model"], health["drafter"], health["streams"], health["context"]) == (
        "ready", "target", "DFlash", 4, 512)
    assert re.match(r"serving target: DFlash drafts, 4 streams of 512 tokens, prompt cache 0\.05 GiB, warmed \d+ shapes "
                    r"and 1 drafter pass in [\d.]+ s; self-check passed on ", health["startup_line"])
    assert health["selfcheck"]["passed"] and health["drafting_refused"] is None
    models = server.http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["target"]


def test_warming_until_the_engine_is_attached(checkpoints) -> None:
    engine = engine_for(checkpoints)
    with LiveServer(engine, create_app()) as s:
        warming = s.http.get("/health")
        assert (warming.status_code, warming.json()) == (503, {"status": "warming"})
        r = s.http.post("/v1/completions", json={"prompt": PROMPT})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "warming")
        s.app.state.served.attach(engine)
        ready = s.http.get("/health")
        assert (ready.status_code, ready.json()["status"]) == (200, "ready")
        assert_still_serving(s)


# -- replies -----------------------------------------------------------------------------------
def test_token_sha_is_the_hash_of_the_returned_ids(server: LiveServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    reply = server.complete(**body)
    ids = reply["choices"][0]["token_ids"]
    assert len(ids) == 12 == reply["usage"]["completion_tokens"]
    assert reply["dflash"]["token_sha"] == token_sha(ids)
    assert reply["choices"][0]["text"] == server.engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert set(reply["dflash"]) >= {"token_sha", "rounds", "drafted", "accepted", "tokens_per_round", "drafter",
                                    "prefill_seconds", "decode_seconds"}
    assert reply["dflash"]["drafter"] == "DFlash" and reply["dflash"]["drafted"] > 0

    events = server.stream(**body, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    final = next(e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"])
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert ids_of_stream(events) == ids
    assert final["dflash"]["token_sha"] == token_sha(ids) and final["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == reply["choices"][0]["text"]


def test_usage_comes_only_when_asked_in_a_stream(server: LiveServer) -> None:
    events = server.stream(prompt=PROMPT, max_tokens=3, temperature=0)
    assert events[-1] == "[DONE]"
    assert not any("usage" in e for e in events[:-1])


def test_token_id_prompt_equals_the_same_text_prompt(server: LiveServer) -> None:
    ids = server.http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    common = {"max_tokens": 10, "temperature": 0.7, "seed": 5, "ignore_eos": True, "return_token_ids": True}
    by_text = server.complete(prompt=PROMPT, **common)
    by_ids = server.complete(prompt=ids, **common)
    assert by_ids["choices"][0]["token_ids"] == by_text["choices"][0]["token_ids"]
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_beside_drafted_streams_equals_drafted(server: LiveServer, temperature: float) -> None:
    prompts = [PROMPT, "Once upon a time there was a small model"]
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": temperature, "seed": 11, "ignore_eos": True,
               "return_token_ids": True, "draft": draft} for p in prompts for draft in (True, False)]
    with ThreadPoolExecutor(len(bodies)) as pool:  # all four share rounds (4 streams)
        replies = list(pool.map(lambda b: server.complete(**b), bodies))
    for drafted, plain in (replies[0:2], replies[2:4]):
        assert plain["choices"][0]["token_ids"] == drafted["choices"][0]["token_ids"]
        assert plain["dflash"]["token_sha"] == drafted["dflash"]["token_sha"]
        assert (drafted["dflash"]["drafter"], plain["dflash"]["drafter"]) == ("DFlash", None)
        assert drafted["dflash"]["drafted"] > 0 and plain["dflash"]["drafted"] == 0
        assert plain["dflash"]["tokens_per_round"] == 1.0


def test_resumed_prompt_reports_cached_tokens_and_equals_fresh(server: LiveServer) -> None:
    prompt = "A resumed prompt: " + " ".join(f"item{i}" for i in range(12))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    fresh, resumed = server.complete(**body), server.complete(**body)
    n = fresh["usage"]["prompt_tokens"]
    assert n > 32
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16  # the last chunk boundary
    assert resumed["choices"][0]["token_ids"] == fresh["choices"][0]["token_ids"]


def test_chat_uses_the_chat_template(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    count = server.http.post("/tokenize", json={"messages": messages}).json()["count"]
    template = server.engine.tokenizer.apply_chat_template(messages)
    assert count == len(server.engine.tokenizer.encode(template))
    reply = server.complete("/v1/chat/completions", messages=messages, max_tokens=4, temperature=0,
                            chat_template_kwargs={"enable_thinking": False}, return_token_ids=True)
    assert reply["object"] == "chat.completion" and reply["usage"]["prompt_tokens"] == count
    assert reply["choices"][0]["message"]["role"] == "assistant"
    events = server.stream("/v1/chat/completions", messages=messages, max_tokens=4, temperature=0)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == (
        reply["choices"][0]["message"]["content"])


def test_stop_string_trims_the_text_and_the_ids(server: LiveServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    full = server.complete(**body)["choices"][0]
    text, ids = full["text"], full["token_ids"]
    at = next(i for i in range(len(text) // 2, len(text) - 2) if text.find(text[i:i + 2]) == i)
    stop = text[at:at + 2]
    for reply in (server.complete(**body, stop=[stop]), None):
        if reply is None:
            events = server.stream(**body, stop=stop)
            got_text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
            got_ids = ids_of_stream(events)
            finish = next(e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"])
            sha, reason = finish["dflash"]["token_sha"], finish["choices"][0]["finish_reason"]
        else:
            got_text, got_ids = reply["choices"][0]["text"], reply["choices"][0]["token_ids"]
            sha, reason = reply["dflash"]["token_sha"], reply["choices"][0]["finish_reason"]
        assert (got_text, reason) == (text[:at], "stop")
        assert got_ids == ids[: len(got_ids)] and len(got_ids) < len(ids)
        assert sha == token_sha(got_ids)
    server.wait_idle()


def test_tokenize_and_detokenize_round_trip(server: LiveServer) -> None:
    tokens = server.http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert server.http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": PROMPT}


# -- refusals ----------------------------------------------------------------------------------
def assert_still_serving(server: LiveServer) -> None:
    reply = server.complete(prompt=PROMPT, max_tokens=2, temperature=0)
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")


def test_past_the_window_is_refused_with_the_numbers(server: LiveServer) -> None:
    ids = server.http.post("/tokenize", json={"prompt": PROMPT * 60}).json()["tokens"][:510]
    r = server.http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert (error["prompt_tokens"], error["max_tokens"], error["context"]) == (510, 3, 512)
    assert "510 tokens" in error["message"] and "512" in error["message"]
    assert_still_serving(server)
    reply = server.complete(prompt=ids, max_tokens=2, temperature=0, ignore_eos=True)  # exactly the window
    assert (reply["usage"]["prompt_tokens"], reply["usage"]["completion_tokens"]) == (510, 2)


COMPLETION, CHAT = "/v1/completions", "/v1/chat/completions"
MALFORMED = [
    (COMPLETION, b'{"prompt": "hi", "max_tokens": 4', None, "invalid_json"),
    (COMPLETION, b'["prompt", "hi"]', None, "invalid_json"),
    (COMPLETION, {"prompt": "hi", "max_tokens": -1}, "max_tokens", "invalid_value"),
    (COMPLETION, {"prompt": "hi", "max_tokens": "8"}, "max_tokens", "invalid_type"),
    (COMPLETION, {"max_tokens": 4}, "prompt", "missing_field"),
    (COMPLETION, {"prompt": ["a", "b"]}, "prompt", "invalid_value"),
    (COMPLETION, {"prompt": [1, 10**6]}, "prompt[1]", "invalid_value"),
    (COMPLETION, {"prompt": ""}, "prompt", "invalid_value"),
    (COMPLETION, {"prompt": "hi", "stop": 5}, "stop", "invalid_value"),
    (COMPLETION, {"prompt": "hi", "temperature": -0.5}, "temperature", "invalid_value"),
    (COMPLETION, {"prompt": "hi", "top_p": 1.5}, "top_p", "invalid_value"),
    (COMPLETION, {"prompt": "hi", "stream": "yes"}, "stream", "invalid_type"),
    (COMPLETION, {"prompt": "hi", "draft": 0}, "draft", "invalid_type"),
    (COMPLETION, {"prompt": "hi", "seed": 1.5}, "seed", "invalid_type"),
    (COMPLETION, {"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "invalid_type"),
    (COMPLETION, {"prompt": "hi", "n": 2}, "n", "invalid_value"),
    (CHAT, {"messages": "hello"}, "messages", "invalid_type"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role", "missing_field"),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content", "invalid_value"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": []}, "chat_template_kwargs",
     "invalid_type"),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, None, "invalid_value"),
    ("/tokenize", {"messages": []}, "messages", "invalid_value"),
    ("/detokenize", {"tokens": "1,2"}, "tokens", "invalid_type"),
]


@pytest.mark.parametrize("path,body,param,code", MALFORMED, ids=lambda v: str(v)[:40] if not isinstance(v, str) else v)
def test_malformed_request_is_refused_naming_the_field(server: LiveServer, path, body, param, code) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = server.http.post(path, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    if param is not None:
        assert error["message"].startswith(f"{param}: ")
    assert_still_serving(server)


def test_unknown_fields_are_ignored(server: LiveServer) -> None:
    reply = server.complete(prompt=PROMPT, max_tokens=2, logprobs=None, user="me", frobnicate={"x": 1})
    assert reply["usage"]["completion_tokens"] == 2


# -- failures and disconnects ------------------------------------------------------------------
def test_engine_failure_in_a_stream_sends_an_error_event_then_done(server: LiveServer) -> None:
    target = server.engine.target
    real, fail = target.forward, threading.Event()

    def forward(*args, **kwargs):
        if fail.is_set():
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    target.forward = forward
    events = []
    try:
        with server.http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "stream": True,
                                                                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    fail.set()  # the next round fails
    finally:
        del target.forward
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error" and "injected failure" in error["message"]
    assert server.wait_idle()["dflash_active_streams"] == 0
    assert_still_serving(server)


def test_dropped_stream_frees_its_lane_and_changes_nothing_after(checkpoints) -> None:
    probe = {"prompt": "Every request carries a prompt", "max_tokens": 24, "temperature": 0.7, "seed": 3,
             "ignore_eos": True, "return_token_ids": True}
    with start(checkpoints, prompt_cache_gib=0) as fresh:
        reference = fresh.complete(**probe)
    with start(checkpoints, prompt_cache_gib=0) as s:
        before = s.wait_idle()
        with throttled(s.engine):
            with s.http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "stream": True,
                                                               "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    if '"text"' in line:
                        assert s.http.get("/health").json()["active_streams"] == 1
                        break  # closing the iterator drops the connection after the first tokens
            after = s.wait_idle(timeout=10, replies=1)  # far sooner than the LONG throttled tokens would take
        assert s.http.get("/health").json()["active_streams"] == 0
        assert after['dflash_requests_total{outcome="cancelled"}'] == 1
        assert after['dflash_requests_total{outcome="length"}'] == 0
        assert after["dflash_completion_tokens_total"] < LONG
        assert after["dflash_active_memory_bytes"] == before["dflash_active_memory_bytes"]
        assert after["dflash_active_memory_bytes"] == after["dflash_baseline_memory_bytes"]
        again = s.complete(**probe)
    assert again["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]
    assert again["dflash"]["token_sha"] == reference["dflash"]["token_sha"]


def test_dropped_non_streaming_client_is_cancelled(checkpoints) -> None:
    with start(checkpoints, prompt_cache_gib=0) as s, throttled(s.engine):
        with pytest.raises(httpx.ReadTimeout):
            s.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True},
                        timeout=httpx.Timeout(60.0, read=0.5))
        after = s.wait_idle(timeout=10, replies=1)
        assert after['dflash_requests_total{outcome="cancelled"}'] == 1, after
        assert after["dflash_completion_tokens_total"] < LONG
        assert_still_serving(s)


def test_metrics_count_what_the_replies_report(checkpoints) -> None:
    with start(checkpoints) as s:
        replies = [s.complete(prompt=p, max_tokens=6, temperature=0, ignore_eos=True, draft=d)
                   for p, d in ((PROMPT, True), (PROMPT, False), ("Another prompt", True))]
        s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**4})
        s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        m = s.wait_idle()
    assert m['dflash_requests_total{outcome="length"}'] == 3
    assert m['dflash_requests_total{outcome="context_length_exceeded"}'] == 1
    assert m['dflash_requests_total{outcome="invalid_request"}'] == 1
    for metric, key in (("drafted_tokens", "drafted"), ("accepted_tokens", "accepted"), ("stream_rounds", "rounds")):
        assert m[f"dflash_{metric}_total"] == sum(r["dflash"][key] for r in replies)
    for metric, key in (("prompt_tokens", "prompt_tokens"), ("completion_tokens", "completion_tokens")):
        assert m[f"dflash_{metric}_total"] == sum(r["usage"][key] for r in replies)
    assert m["dflash_rounds_total"] >= max(r["dflash"]["rounds"] for r in replies)
    assert m["dflash_active_streams"] == 0
    assert m["dflash_peak_memory_bytes"] >= m["dflash_active_memory_bytes"] > 0
    assert m["dflash_baseline_memory_bytes"] > 0
