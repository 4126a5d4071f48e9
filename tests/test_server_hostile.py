"""A corpus of hostile and malformed requests, through one connection pool, against the real server on
loopback (a tiny llama fixture behind an API key): not one 5xx, not one hang, every refusal in OpenAI's
error shape naming the field at fault, and afterwards the same pool gets the same reply as before.

The corpus is generated from categories (bad JSON, bad types for each field, out-of-range values,
surrogates, deep nesting, huge integers, unsupported fields, content types, oversize bodies, model
ids, auth, Host headers, paths and methods), so each category covers every field and endpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import pytest

from dflash_bench.engine.constants import MIB
from dflash_bench.engine.http_guard import Access, Hosts
from dflash_bench.engine.openai_schema import MAX_DEPTH, UNSUPPORTED
from dflash_bench.engine.server import create_app

from test_server_api import PROMPT, LiveServer, checkpoints, engine_for  # noqa: F401  (checkpoints: a fixture)

KEY = "sk-test-corpus"
COMPLETION, CHAT, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
USER = [{"role": "user", "content": "hello"}]
GOOD = {  # the smallest valid body of each endpoint; a case changes one thing
    COMPLETION: {"prompt": "hi", "max_tokens": 1, "temperature": 0},
    CHAT: {"messages": USER, "max_tokens": 1, "temperature": 0},
    TOKENIZE: {"prompt": "hi"},
    DETOKENIZE: {"tokens": [1, 2]},
}
REFERENCE = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@dataclass
class Case:
    """One request; `param` is the field its refusal must name (None: any refusal, or a reply)."""

    name: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"
    param: str | None = None
    status: int | None = None  # the exact status expected, when the category decides it
    chunked: bool = False  # sent without a length, in pieces: the server must count it as it comes

    def content(self) -> bytes | Iterator[bytes] | None:
        if not self.chunked or self.body is None:
            return self.body
        return (self.body[i:i + 65536] for i in range(0, len(self.body), 65536))


def body(path: str, **changes: Any) -> bytes:
    return json.dumps(GOOD[path] | changes).encode()


def raw_json(path: str, key: str, literal: str) -> bytes:
    """GOOD[path] with `key` set to a JSON literal written as is (surrogate escapes, huge numbers)."""
    return json.dumps(GOOD[path]).encode()[:-1] + f', "{key}": {literal}}}'.encode()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def corpus() -> list[Case]:
    cases: list[Case] = []

    def add(name: str, path: str, data: bytes, param: str | None = None, status: int | None = None, **kw) -> None:
        cases.append(Case(f"{name} {path}", path, data, param=param, status=status, **kw))

    # bad JSON, on every endpoint
    broken = [b"", b"{", b'{"prompt": "hi",}', b"{'prompt': 'hi'}", b'{"prompt": "hi"} x', b"null", b"[]", b"1",
              b'"text"', b'{"prompt": NaN}', b'{"max_tokens": Infinity}', b'{"temperature": -Infinity}',
              b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b'{"a": 1 /* c */}', b"\x00", b"{\xff: 1}"]
    for path in GOOD:
        for data in broken:
            add(f"bad json {data[:12]!r}", path, data, status=400)

    # bad types for each field
    generation = {"model": [1, True, [], {}], "max_tokens": ["8", 1.5, True, [], {}], "temperature": ["0", True, [], {}],
                  "top_p": ["1", False, []], "top_k": ["1", 1.5, True], "seed": ["1", 1.5, True, []],
                  "n": ["1", 1.5], "stop": [5, [1], [""], {}, ""], "stream": ["yes", 1, None], "ignore_eos": ["no", 0],
                  "draft": [0, "false", None], "return_token_ids": [1, "true"], "stream_options": ["x", []]}
    for path in (COMPLETION, CHAT):
        for name, values in generation.items():
            for value in values:
                add(f"type {name}={value!r}", path, body(path, **{name: value}), name, 400)
    for value in (None, 5, {"a": 1}, [1.5], [True], [[1]], ["a"], ""):
        add(f"type prompt={value!r}", COMPLETION, body(COMPLETION, prompt=value), "prompt", 400)
    for value, param in ((None, "messages"), ("hi", "messages"), ({}, "messages"), ([], "messages"), ([1], "messages[0]"),
                         (["hi"], "messages[0]")):
        add(f"type messages={value!r}", CHAT, body(CHAT, messages=value), param, 400)
    for value, param in ((5, "messages[0].content"), ([{"type": "image_url", "image_url": "x"}], "messages[0].content"),
                         (None, None), ({"text": "x"}, "messages[0].content")):
        if param:
            add(f"type content={value!r}", CHAT, body(CHAT, messages=[{"role": "user", "content": value}]), param, 400)
    for value in ("robot", "", "USER", 5, None, "function"):
        add(f"role {value!r}", CHAT, body(CHAT, messages=[{"role": value, "content": "x"}]), "messages[0].role", 400)
    for name, value in (("chat_template_kwargs", []), ("chat_template_kwargs", "x"), ("add_generation_prompt", 1),
                        ("max_completion_tokens", "5")):
        add(f"type {name}={value!r}", CHAT, body(CHAT, **{name: value}), name, 400)
    for name, value in (("add_special_tokens", "yes"), ("messages", [])):
        add(f"type {name}={value!r}", TOKENIZE, json.dumps({"prompt": "hi"} | {name: value} if name != "messages"
                                                           else {name: value}).encode(), name, 400)
    for value, param in (("1,2", "tokens"), (None, "tokens"), ([1.5], "tokens[0]"), ([2, "1"], "tokens[1]"),
                         ([True], "tokens[0]"), ({}, "tokens")):
        add(f"type tokens={value!r}", DETOKENIZE, body(DETOKENIZE, tokens=value), param, 400)

    # out-of-range values
    ranges = {"temperature": [-0.5, 2.5, 1e308], "top_p": [0, 1.01, -0.1], "top_k": [-2, 2**21, 2**62], "n": [0, 2, 128],
              "max_tokens": [0, -5], "seed": [-(2**63) - 1, 2**64], "stop": [["a", "b", "c", "d", "e"], ["x"] * 1000]}
    for path in (COMPLETION, CHAT):
        for name, values in ranges.items():
            for value in values:
                add(f"range {name}={str(value)[:20]}", path, body(path, **{name: value}), name, 400)
    for value in ([-1], [10**6], [1, 2, 512]):
        add(f"range prompt ids {value[-1]}", COMPLETION, body(COMPLETION, prompt=value), None, 400)
        add(f"range tokens {value[-1]}", DETOKENIZE, body(DETOKENIZE, tokens=value), None, 400)
    add("range temperature 1e999", COMPLETION, raw_json(COMPLETION, "temperature", "1e999"), "temperature", 400)
    # past the window: the refusal names the field the client sent
    add("window max_tokens", COMPLETION, body(COMPLETION, max_tokens=10**4), "max_tokens", 400)
    add("window max_tokens", CHAT, body(CHAT, max_tokens=10**4), "max_tokens", 400)
    add("window max_completion_tokens", CHAT, body(CHAT, max_completion_tokens=10**6), "max_completion_tokens", 400)
    add("window ids", COMPLETION, body(COMPLETION, prompt=[5] * 600), "prompt", 400)
    add("window text", COMPLETION, body(COMPLETION, prompt="word " * 30000), "prompt", 400)
    add("window chat", CHAT, body(CHAT, messages=[{"role": "user", "content": "word " * 30000}]), "messages", 400)

    # lone surrogates, escaped and as raw bytes, in every text field
    text_fields = [(COMPLETION, "prompt", lambda s: {"prompt": s}),
                   (COMPLETION, "stop", lambda s: {"stop": s}),
                   (COMPLETION, "stop[1]", lambda s: {"stop": ["ok", s]}),
                   (COMPLETION, "model", lambda s: {"model": s}),
                   (CHAT, "messages[0].content", lambda s: {"messages": [{"role": "user", "content": s}]}),
                   (CHAT, "messages[0].content[0].text",
                    lambda s: {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]}),
                   (CHAT, "messages[0].role", lambda s: {"messages": [{"role": s, "content": "x"}]}),
                   (CHAT, "messages[0].name", lambda s: {"messages": [{"role": "user", "content": "x", "name": s}]}),
                   (CHAT, "chat_template_kwargs.x", lambda s: {"chat_template_kwargs": {"x": s}}),
                   (TOKENIZE, "prompt", lambda s: {"prompt": s}),
                   (TOKENIZE, "messages[0].content", lambda s: {"prompt": None, "messages": [{"role": "user",
                                                                                               "content": s}]})]
    marker = "SURROGATE"
    forms = {"escaped high": b'"a\\ud800b"', "escaped low": b'"\\udfff"', "escaped reversed pair": b'"\\udc00\\ud800"',
             "raw high": b'"a\xed\xa0\x80b"', "raw low": b'"\xed\xbf\xbf"', "raw invalid byte": b'"a\xffb"',
             "raw truncated": b'"\xe2\x82"'}
    for path, param, make in text_fields:
        template = json.dumps(GOOD[path] | make(marker)).encode()
        for form, literal in forms.items():
            add(f"surrogate {form} in {param}", path, template.replace(f'"{marker}"'.encode(), literal), param, 400)
    add("surrogate in a key", CHAT, b'{"messages": [{"role": "user", "content": "x", "\\ud800": 1}]}', "messages[0]", 400)

    # deep nesting, inside a field and at the root
    for depth in (MAX_DEPTH + 1, 200, 5000, 100_000):
        add(f"nesting {depth} in kwargs", CHAT, raw_json(CHAT, "chat_template_kwargs", '{"x": ' + nested(depth) + "}"),
            None, 400)
        add(f"nesting {depth} in prompt", COMPLETION, raw_json(COMPLETION, "prompt", nested(depth)), None, 400)
        add(f"nesting {depth} at the root", TOKENIZE, nested(depth).encode(), None, 400)

    # huge integers
    for digits in (40, 4301, 50_000):
        huge = "9" * digits
        for path, name in ((COMPLETION, "max_tokens"), (COMPLETION, "seed"), (CHAT, "top_k"), (CHAT, "temperature"),
                           (CHAT, "max_completion_tokens")):
            add(f"huge int {digits} {name}", path, raw_json(path, name, huge), name, 400)
        add(f"huge int {digits} in ids", COMPLETION, raw_json(COMPLETION, "prompt", f"[1, {huge}]"), "prompt[1]", 400)
        add(f"huge int {digits} in tokens", DETOKENIZE, raw_json(DETOKENIZE, "tokens", f"[-{huge}]"), "tokens[0]", 400)

    # OpenAI fields this server does not implement, with values that ask for something
    asking = {"logprobs": True, "top_logprobs": 5, "best_of": 3, "echo": True, "suffix": "end", "logit_bias": {"5": 100},
              "presence_penalty": 0.5, "frequency_penalty": 1, "tools": [{"type": "function"}], "tool_choice": "auto",
              "functions": [{"name": "f"}], "function_call": "auto", "response_format": {"type": "json_object"},
              "modalities": ["audio"], "audio": {}, "prediction": {}, "reasoning_effort": "low",
              "web_search_options": {}, "verbosity": "low", "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 4,
              "stop_token_ids": [1], "guided_json": {}, "guided_regex": "a", "guided_choice": ["a"],
              "guided_grammar": "g", "grammar": "g", "json_schema": {}}
    assert set(asking) == set(UNSUPPORTED)
    for path in (COMPLETION, CHAT):
        for name, value in asking.items():
            add(f"unsupported {name}", path, body(path, **{name: value}), name, 400)
    add("unsupported logprobs 0 (not a no-op)", COMPLETION, body(COMPLETION, logprobs=0), "logprobs", 400)

    # wrong content types
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
                 "application/jsonx", "text/json"):
        for path in GOOD:
            cases.append(Case(f"content type {kind} {path}", path, json.dumps(GOOD[path]).encode(),
                              {"content-type": kind} if kind else {"content-type": ""}, status=415))

    # oversize bodies: with a length over the limit (refused unread), and chunked (counted as they come);
    # a 10 GB Content-Length is in test_server_guard.py (no client here would send so little after it)
    for path in GOOD:
        add("oversize body", path, body(path, padding="x" * (2 * MIB)), status=413)
        add("oversize chunked body", path, body(path, padding="x" * (2 * MIB)), status=413, chunked=True)

    # model ids
    for model in ("gpt-4", "", "../../etc/passwd", "target ", "TARGET", "x" * 10_000, "default"):
        for path in GOOD:
            add(f"model {model[:12]!r}", path, body(path, model=model), "model", 404)

    # auth, Host, paths and methods
    for auth in ({"authorization": ""}, {"authorization": "Bearer"}, {"authorization": f"Bearer {KEY}x"},
                 {"authorization": f"Basic {KEY}"}, {"authorization": KEY}, {"authorization": f"Bearer {KEY[:-1]}"}):
        for path in GOOD:
            cases.append(Case(f"auth {auth['authorization'][:12]!r} {path}", path, json.dumps(GOOD[path]).encode(),
                              auth, status=401))
        for path in ("/v1/models", "/metrics"):
            cases.append(Case(f"auth {auth['authorization'][:12]!r} {path}", path, None, auth, "GET", status=401))
    for host in ("evil.example", "127.0.0.1.evil.example", "localhost.evil.example", "[::2]:80", "10.0.0.1",
                 "attacker:8000"):
        for path, method in ((COMPLETION, "POST"), ("/health", "GET"), ("/v1/models", "GET")):
            cases.append(Case(f"host {host} {path}", path, json.dumps(GOOD[COMPLETION]).encode()
                              if method == "POST" else None, {"host": host}, method, status=421))
    for path, method, status in (("/v1/completions", "GET", 405), ("/health", "POST", 405), ("/v1/nothing", "POST", 404),
                                 ("/v1/embeddings", "POST", 404), ("/../etc/passwd", "GET", 404),
                                 ("/v1/chat/completions", "PUT", 405)):
        cases.append(Case(f"route {method} {path}", path, b"{}" if method != "GET" else None, method=method,
                          status=status))
    return cases


CORPUS = corpus()


@pytest.fixture(scope="module")
def guarded(checkpoints):  # noqa: F811
    engine = engine_for(checkpoints)
    with LiveServer(engine, create_app(engine, Access(Hosts.bound_to("127.0.0.1"), KEY))) as s:
        s.http.headers["authorization"] = f"Bearer {KEY}"
        yield s


def test_the_corpus_is_large_and_covers_every_category() -> None:
    assert len(CORPUS) >= 300
    categories = {c.name.split(" ", 1)[0] for c in CORPUS}
    assert categories >= {"bad", "type", "range", "window", "surrogate", "nesting", "huge", "unsupported", "content",
                          "oversize", "model", "auth", "host", "route", "role"}


def test_hostile_corpus_gets_no_5xx_and_leaves_the_pool_serving(guarded: LiveServer) -> None:
    before = guarded.complete(**REFERENCE)
    failures = []
    for case in CORPUS:
        headers = {"content-type": "application/json"} | case.headers
        try:
            r = guarded.http.request(case.method, case.path, content=case.content(), headers=headers,
                                     timeout=httpx.Timeout(20.0))
        except httpx.TimeoutException:
            failures.append(f"{case.name}: no answer in 20 s")
            continue
        problem = judge(case, r)
        if problem:
            failures.append(f"{case.name}: {problem}")
    assert not failures, f"{len(failures)} of {len(CORPUS)} mishandled:\n" + "\n".join(failures[:40])
    after = guarded.complete(**REFERENCE)
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert after["dflash"]["token_sha"] == before["dflash"]["token_sha"]
    assert guarded.wait_idle()["dflash_active_streams"] == 0


def judge(case: Case, r: httpx.Response) -> str | None:
    """What is wrong with the answer to `case`, or None."""
    if r.status_code >= 500:
        return f"{r.status_code} {r.text[:200]}"
    if case.status is not None and r.status_code != case.status:
        return f"status {r.status_code}, expected {case.status}: {r.text[:200]}"
    if r.status_code < 400:
        return None if case.param is None and case.status is None else f"accepted ({r.status_code})"
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"not an OpenAI error body: {r.text[:200]}"
    if not (isinstance(error.get("message"), str) and error["message"] and {"type", "param", "code"} <= set(error)):
        return f"not an OpenAI error body: {error}"
    if case.param is not None:
        if error["param"] != case.param:
            return f"param {error['param']!r}, expected {case.param!r}: {error['message'][:200]}"
        if not error["message"].startswith(f"{case.param}: "):
            return f"the message does not name {case.param}: {error['message'][:200]}"
    return None
