"""The checks' HTTP client: SSE parsing and per-request records, against the in-process fake server."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from dflash_bench.checks.client import Client, Request, parse_metrics, sse_events, token_sha
from fake_openai import FakeServer


@pytest.fixture(scope="module")
def fake():
    with FakeServer(context=32768) as server:
        yield server


@pytest.fixture
def client(fake):
    c = Client(fake.url, timeout=30)
    c.pick_model()
    yield c
    c.close()


def test_token_sha_is_first_12_hex_of_sha256_over_comma_joined_ids():
    assert token_sha([1, 22, 333]) == hashlib.sha256(b"1,22,333").hexdigest()[:12]
    assert token_sha([]) == hashlib.sha256(b"").hexdigest()[:12]


def test_sse_events_join_multiline_data_skip_comments_and_keep_done():
    lines = [": keep-alive", "", "data: {\"a\":", "data: 1}", "", "event: x", "data:[DONE]", ""]
    assert list(sse_events(lines)) == ['{"a":\n1}', "[DONE]"]


def test_sse_event_without_trailing_blank_line_is_not_lost():
    assert list(sse_events(["data: last"])) == ["last"]


def test_parse_metrics_reads_gauges_and_sums_labelled_samples():
    text = "# HELP g a gauge\n# TYPE g gauge\ng 12.5\nc{kind=\"a\"} 2\nc{kind=\"b\"} 3\nbad line\n"
    assert parse_metrics(text) == {"g": 12.5, "c": 5.0}


def test_plain_reply_record_has_usage_hash_ids_and_dflash_fields(client):
    rec = client.send(Request("p", prompt="hello", max_tokens=9, draft=True))
    assert rec.status == "ok"
    assert rec.prompt_tokens == 5 and rec.completion_tokens == 9 and rec.cached_tokens is not None
    assert len(rec.token_ids) == 9 and rec.token_sha == token_sha(rec.token_ids) and rec.sha_source == "server"
    assert rec.has_dflash and rec.tokens_per_round == 3.0 and rec.drafter == "DFlash"
    assert rec.ttft is None and rec.elapsed > 0


def test_streamed_record_equals_unstreamed_and_times_the_first_token(client):
    plain = client.send(Request("p", prompt="stream me", max_tokens=10, draft=False))
    streamed = client.send(Request("p", prompt="stream me", max_tokens=10, draft=False, stream=True))
    assert streamed.status == "ok"
    assert streamed.token_ids == plain.token_ids and streamed.token_sha == plain.token_sha
    assert streamed.text == plain.text and streamed.completion_tokens == 10
    assert streamed.ttft is not None and 0 < streamed.ttft <= streamed.elapsed
    assert streamed.first_chunk_tokens == 1 and streamed.decode_seconds > 0
    assert streamed.decode_tps == pytest.approx(9 / streamed.decode_seconds)


def test_chat_stream_collects_delta_content(client):
    rec = client.send(Request("c", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True))
    assert rec.status == "ok" and rec.text.count(" t") == 6 and len(rec.token_ids) == 6


def test_http_error_becomes_a_record_with_status_and_code(client):
    rec = client.send(Request("long", prompt=[5] * 40000, max_tokens=4))
    assert rec.status == "error" and rec.http_status == 400
    assert "context_length_exceeded" in rec.error


def test_dropping_a_stream_closes_the_connection(fake, client):
    before = fake.fake.dropped
    rec = client.send(Request("d", prompt="drop", max_tokens=300, stream=True), drop_after_tokens=6)
    assert rec.status == "dropped" and 6 <= rec.completion_tokens < 300
    for _ in range(100):
        if fake.fake.dropped > before:
            break
        time.sleep(0.01)
    assert fake.fake.dropped == before + 1


def test_send_many_returns_one_record_per_request_in_order(client):
    reqs = [Request(f"s{i}", prompt=f"prompt {i}", max_tokens=5, stream=True) for i in range(4)]
    records, wall = client.send_many(reqs)
    assert [r.prompt_id for r in records] == ["s0", "s1", "s2", "s3"] and wall > 0
    assert len({r.token_sha for r in records}) == 4


def test_a_token_sha_that_disagrees_with_the_ids_is_a_bad_reply():
    with FakeServer(lie_sha=True) as server:
        rec = Client(server.url).send(Request("p", prompt="hello", max_tokens=5))
    assert rec.status == "bad_reply" and "does not match" in rec.error


def test_mlx_lm_like_reply_has_no_hash_ids_or_cached_tokens():
    with FakeServer(mlx_lm_like=True) as server:
        rec = Client(server.url).send(Request("p", prompt="hello", max_tokens=5))
    assert rec.status == "ok" and rec.completion_tokens == 5
    assert rec.token_sha is None and rec.token_ids is None and rec.cached_tokens is None and not rec.has_dflash


def test_tokenize_and_detokenize_round_trip(client):
    ids = client.tokenize("A lighthouse keeper")
    assert client.detokenize(ids) == "A lighthouse keeper"


def test_every_body_the_checks_send_parses_under_the_bundled_servers_schema():
    schema = pytest.importorskip("dflash_bench.engine.openai_schema")
    bodies = [
        (schema.CompletionRequest, Request("a", prompt="text", max_tokens=4, temperature=0.7, seed=3, draft=False)),
        (schema.CompletionRequest, Request("b", prompt=[1, 2, 3], max_tokens=1, stream=True)),
        (schema.ChatRequest, Request("c", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)),
    ]
    for model, req in bodies:
        parsed = schema.parse(model, json.dumps(req.body("m")).encode())
        assert parsed.draft == (req.draft is not False) and parsed.ignore_eos and parsed.return_token_ids
        assert parsed.temperature == req.temperature and parsed.include_usage == req.stream
