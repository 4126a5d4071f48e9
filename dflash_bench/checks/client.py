"""The HTTP client the checks use: one request in, one `Record` out (streamed or not).

A record keeps everything a receipt needs about one request, whatever the server is: fields a
server does not send stay None, so a check can tell "not reported" from "zero". HTTP errors become
records (a refusal can be the expected outcome); transport errors (server gone, timeout) raise, so
the run stops and its receipt is marked incomplete.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

import httpx

from dflash_bench.checks.lifecycle import interrupt_pending
from dflash_bench.engine.reply_block import DflashBlock
from dflash_bench.engine.request import token_sha  # noqa: F401  (the one formula; checks re-export it)

# The /metrics gauges the checks read, named in one place.
PEAK_MEMORY_METRIC = "dflash_peak_memory_bytes"
ACTIVE_MEMORY_METRIC = "dflash_active_memory_bytes"


@dataclass
class Request:
    """One request; `prompt` is text or token ids (completions), `messages` a chat."""

    prompt_id: str
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    seed: int | None = None
    draft: bool | None = True
    ignore_eos: bool = True
    return_token_ids: bool = True
    stream: bool = False
    endpoint: str | None = None  # an engine's own path (checks/adapters.py), else the OpenAI one

    @property
    def path(self) -> str:
        if self.endpoint:
            return self.endpoint
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"

    def body(self, model: str | None) -> dict:
        body: dict = {"max_tokens": self.max_tokens, "temperature": self.temperature, "stream": self.stream}
        if model:
            body["model"] = model
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        if self.seed is not None:
            body["seed"] = self.seed
        if self.draft is not None:
            body["draft"] = self.draft
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.return_token_ids:
            body["return_token_ids"] = True
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass
class Record:
    """What one request did. status: ok, error (HTTP error reply), dropped (we closed it), bad_reply."""

    prompt_id: str
    endpoint: str
    draft: bool | None
    temperature: float
    seed: int | None
    max_tokens: int
    stream: bool
    status: str = "ok"
    error: str | None = None
    http_status: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    token_sha: str | None = None
    sha_source: str | None = None
    token_ids: list[int] | None = None
    text: str = ""
    finish_reason: str | None = None
    ttft: float | None = None
    decode_seconds: float | None = None
    first_chunk_tokens: int | None = None
    elapsed: float | None = None
    tokens_per_round: float | None = None
    rounds: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    drafter: str | None = None
    prefill_seconds: float | None = None
    server_decode_seconds: float | None = None
    has_dflash: bool = False
    acceptance_histogram: list[int] | None = None
    acceptance_by_depth: list[float | None] | None = None
    drafted_by_depth: list[int] | None = None
    chunk_times: list[float] | None = None  # streamed: seconds from sending to each chunk that carried tokens
    chunk_tokens: list[int] | None = None  # streamed: the tokens each of those chunks carried
    tpot: float | None = None  # streamed: time per output token after the first chunk (vLLM bench's TPOT)
    evidence: str | None = None  # what token_ids are: "token ids", "token pieces" or "text" (checks/adapters.py)
    labels: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def decode_tps(self) -> float | None:
        """Client-side decode rate: tokens after the first chunk over the time after it (streamed only)."""
        if not self.decode_seconds or self.completion_tokens is None:
            return None
        after_first = self.completion_tokens - (self.first_chunk_tokens or 1)
        return after_first / self.decode_seconds if after_first > 0 else None

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies as vLLM bench counts them: the gaps between consecutive chunks."""
        times = self.chunk_times or []
        return [b - a for a, b in zip(times, times[1:])]


def sse_events(lines: Iterable[str]) -> Iterator[str]:
    """Server-sent events' data payloads: data lines joined until a blank line; comments skipped."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _error_text(response: httpx.Response) -> str:
    try:
        payload = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:500]
    err = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(err, dict):
        parts = [str(err[k]) for k in ("code", "type", "message") if err.get(k)]
        return ": ".join(dict.fromkeys(parts)) or json.dumps(err)[:500]
    return str(err)[:500]


class _Reply:
    """Collects a reply's pieces, from one JSON body or from many stream chunks."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] | None = None
        self.usage: dict | None = None
        self.dflash: DflashBlock | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None

    def feed(self, chunk: dict) -> int:
        """Takes one chunk (or a whole reply); returns how many tokens it carried."""
        if chunk.get("error"):
            self.error = _error_text_from(chunk["error"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("dflash"), dict) and chunk["dflash"]:
            self.dflash = DflashBlock.model_validate(chunk["dflash"])
        carried = 0
        for choice in chunk.get("choices") or []:
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or choice.get("message") or {}).get("content")
            if piece:
                self.text.append(piece)
            ids = choice.get("token_ids")
            if ids:
                self.ids = (self.ids or []) + [int(i) for i in ids]
                carried += len(ids)
            elif piece:
                carried += 1
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return carried

    def fill(self, rec: Record) -> None:
        rec.text = "".join(self.text)
        rec.finish_reason = self.finish_reason
        rec.token_ids = self.ids
        usage = self.usage or {}
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")
        if rec.completion_tokens is None and self.ids is not None:
            rec.completion_tokens = len(self.ids)
        d = self.dflash
        if d is not None:
            rec.has_dflash = True
            rec.token_sha = d.token_sha
            rec.sha_source = "server" if rec.token_sha else None
            rec.tokens_per_round = d.tokens_per_round
            rec.rounds, rec.drafted, rec.accepted = d.rounds, d.drafted, d.accepted
            rec.drafter = d.drafter
            rec.prefill_seconds = d.prefill_seconds
            rec.server_decode_seconds = d.decode_seconds
            rec.acceptance_histogram, rec.acceptance_by_depth = d.acceptance_histogram, d.acceptance_by_depth
            rec.drafted_by_depth = d.drafted_by_depth
        if self.ids is not None:
            own = token_sha(self.ids)
            if rec.token_sha is None:
                rec.token_sha, rec.sha_source = own, "ids"
            elif rec.token_sha != own:
                rec.status = "bad_reply"
                rec.error = f"token_sha {rec.token_sha} does not match the returned token ids (their sha {own})"
        if self.error:
            rec.status, rec.error = "error", self.error


def _error_text_from(err) -> str:
    if isinstance(err, dict):
        return ": ".join(str(err[k]) for k in ("code", "message") if err.get(k)) or json.dumps(err)
    return str(err)


class Client:
    """A thread-safe client for one server (httpx pools the connections)."""

    def __init__(self, base_url: str, timeout: float = 600.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=10.0), headers=headers,
                                 limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self.model: str | None = None

    def close(self) -> None:
        self.http.close()

    def health(self) -> dict:
        r = self.http.get("/health", timeout=10.0)
        r.raise_for_status()
        return r.json()

    def models(self) -> list[str]:
        r = self.http.get("/v1/models", timeout=10.0)
        r.raise_for_status()
        return [m.get("id") for m in r.json().get("data", [])]

    def pick_model(self, health: dict | None = None) -> str | None:
        """The model name requests carry: the one /health names, else the only one /v1/models lists,
        else none (a server such as mlx_lm.server loads whatever model a request names, so never guess).
        A /v1/models that fails in any way lists nothing: mlx_lm.server answers 200 with an empty body
        when it finds no Hugging Face cache folder to scan."""
        named = (health or {}).get("model")
        if isinstance(named, str) and named:
            self.model = named
            return named
        try:
            names = self.models()
        except (httpx.HTTPError, ValueError, AttributeError):
            names = []
        self.model = names[0] if len(names) == 1 else None
        return self.model

    def metrics(self) -> dict[str, float] | None:
        """Prometheus text as {name: value} (unlabelled samples, or the sum of labelled ones); None if absent."""
        r = self.http.get("/metrics", timeout=10.0)
        if r.status_code != 200:
            return None
        return parse_metrics(r.text)

    def metric(self, name: str) -> float | None:
        values = self.metrics()
        return None if values is None else values.get(name)

    def tokenize(self, text: str) -> list[int] | None:
        """Token ids from POST /tokenize (no special tokens added), or None if the server has no such endpoint."""
        r = self.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        if r.status_code in (404, 405):
            return None
        r.raise_for_status()
        return [int(i) for i in r.json()["tokens"]]

    def detokenize(self, ids: list[int]) -> str | None:
        r = self.http.post("/detokenize", json={"tokens": ids})
        if r.status_code in (404, 405):
            return None
        r.raise_for_status()
        return r.json()["prompt"]

    def prepare(self, req: Request) -> tuple[Request, dict]:
        """The request and its body as sent; an engine adapter (checks/adapters.py) reshapes both."""
        return req, req.body(self.model)

    def new_reply(self) -> _Reply:
        return _Reply()

    def send(self, req: Request, *, drop_after_tokens: int | None = None,
             drop_after_seconds: float | None = None, hang_up_after: float | None = None,
             labels: dict | None = None) -> Record:
        """Sends one request. With `drop_after_tokens` (streams) the connection is closed after that many
        tokens; with `drop_after_seconds` it is closed if no token came by then, or at the first token;
        with `hang_up_after` (streamed or not) it is closed about that many seconds after sending, whatever
        has come (a stream is checked between chunks, and no read waits longer than that)."""
        interrupt_pending()  # a signal whose interrupt was dropped stops the run here (lifecycle.py)
        rec = Record(prompt_id=req.prompt_id, endpoint=req.path, draft=req.draft, temperature=req.temperature,
                     seed=req.seed, max_tokens=req.max_tokens, stream=req.stream, labels=dict(labels or {}))
        req, body = self.prepare(req)
        rec.endpoint = req.path
        t0 = time.perf_counter()
        if not req.stream:
            try:
                r = self.http.post(req.path, json=body, timeout=httpx.Timeout(
                    self.timeout, connect=10.0, read=hang_up_after or self.timeout))
            except httpx.ReadTimeout:
                if hang_up_after is None:
                    raise
                rec.status, rec.elapsed = "dropped", time.perf_counter() - t0
                return rec
            rec.elapsed = time.perf_counter() - t0
            if r.status_code != 200:
                rec.status, rec.http_status, rec.error = "error", r.status_code, _error_text(r)
                return rec
            reply = self.new_reply()
            reply.feed(r.json())
            reply.fill(rec)
            return rec
        return self._stream(req, body, rec, t0, drop_after_tokens, drop_after_seconds, hang_up_after)

    def _stream(self, req: Request, body: dict, rec: Record, t0: float, drop_after_tokens: int | None,
                drop_after_seconds: float | None, hang_up_after: float | None) -> Record:
        timeout = httpx.Timeout(self.timeout, connect=10.0,
                                read=min(drop_after_seconds or self.timeout, hang_up_after or self.timeout))
        reply, tokens, t_first, t_last = self.new_reply(), 0, None, None
        rec.chunk_times, rec.chunk_tokens = [], []
        try:
            with self.http.stream("POST", req.path, json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    r.read()
                    rec.status, rec.http_status, rec.error = "error", r.status_code, _error_text(r)
                    rec.elapsed = time.perf_counter() - t0
                    return rec
                for data in sse_events(r.iter_lines()):
                    interrupt_pending()
                    if data.strip() == "[DONE]":
                        break
                    carried = reply.feed(json.loads(data))
                    if carried:
                        now = time.perf_counter()
                        if t_first is None:
                            t_first, rec.first_chunk_tokens = now, carried
                        t_last, tokens = now, tokens + carried
                        rec.chunk_times.append(now - t0)
                        rec.chunk_tokens.append(carried)
                    if (drop_after_tokens is not None and tokens >= drop_after_tokens) or (
                            drop_after_seconds is not None and tokens > 0) or (
                            hang_up_after is not None and time.perf_counter() - t0 >= hang_up_after):
                        rec.status = "dropped"
                        break
        except httpx.ReadTimeout:
            if drop_after_seconds is None and hang_up_after is None:
                raise
            rec.status = "dropped"
        rec.elapsed = time.perf_counter() - t0
        status = rec.status
        reply.fill(rec)
        if status == "dropped":
            rec.status, rec.completion_tokens = "dropped", tokens
        if t_first is not None:
            rec.ttft = t_first - t0
            rec.decode_seconds = t_last - t_first if t_last > t_first else None
            after_first = tokens - rec.first_chunk_tokens
            rec.tpot = rec.decode_seconds / after_first if rec.decode_seconds and after_first > 0 else None
        return rec

    def send_many(self, requests: list[Request], labels: dict | None = None) -> tuple[list[Record], float]:
        """Sends requests at once (one thread each, released together); returns records and wall seconds."""
        if len(requests) == 1:
            t0 = time.perf_counter()
            rec = self.send(requests[0], labels=labels)
            return [rec], time.perf_counter() - t0
        gate = threading.Barrier(len(requests) + 1)

        def go(req: Request) -> Record:
            gate.wait()
            return self.send(req, labels=labels)

        pool = ThreadPoolExecutor(max_workers=len(requests))
        try:
            futures = [pool.submit(go, req) for req in requests]
            gate.wait()
            t0 = time.perf_counter()
            records = [f.result() for f in futures]
            wall = time.perf_counter() - t0
        finally:
            # On Ctrl-C or an error, release threads still at the gate and do not wait here for
            # streams still running: the runner closes the client (and stops a managed server).
            gate.abort()
            pool.shutdown(wait=False, cancel_futures=True)
        return records, wall


def parse_metrics(text: str) -> dict[str, float]:
    """A small reader for Prometheus text: enough for gauges and counters."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if not head:
            continue
        name = head.split("{", 1)[0].strip()
        try:
            number = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + number if "{" in head else number
    return out
