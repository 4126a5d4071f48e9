"""The OpenAI-compatible HTTP layer over the Engine: requests in, replies with `usage` and `dflash` out.

This module only translates. It parses a body (engine/openai_schema.py), turns the prompt into
token ids, submits one engine Request and follows its Handle's events; text comes from the ids
(engine/textstream.py). The engine runs rounds in its own thread; each request gets a small thread
that forwards its events into the asyncio loop, so waiting costs the loop nothing and no event is
lost when the client goes away. A client that disconnects is cancelled: the engine drops its
stream at the next round.

Every reply carries `usage` (with `prompt_tokens_details.cached_tokens`) and a `dflash` block whose
`token_sha` hashes the returned token ids; streams end with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import jinja2
from fastapi import BackgroundTasks, FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dflash_bench.engine.engine import Engine
from dflash_bench.engine.lanes import ContextExceeded
from dflash_bench.engine.openai_schema import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Message,
    TokenizeRequest,
    parse,
)
from dflash_bench.engine.request import Event, Handle, Request, Stats, token_sha
from dflash_bench.engine.textstream import Delta, TextStream

log = logging.getLogger("dflash_bench.server")

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the window
DISCONNECT_POLL = 0.05  # seconds between disconnect checks while a request runs
OUTCOMES = ("stop", "length", "cancelled", "error", "context_length_exceeded", "invalid_request")
TOTALS = ("stream_rounds", "drafted_tokens", "accepted_tokens", "prompt_tokens", "cached_tokens", "completion_tokens")


class Warming(Exception):
    """The engine is still loading."""


class Metrics:
    """Counters over replies, updated from the loop and from forwarding threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.totals = dict.fromkeys(TOTALS, 0)
        self.rounds_base = 0  # the engine's rounds before serving (the warm-up's)

    def refused(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def finished(self, outcome: str, stats: Stats, completion_tokens: int) -> None:
        with self.lock:
            self.requests[outcome] += 1
            for name, value in (("stream_rounds", stats.rounds), ("drafted_tokens", stats.drafted),
                                ("accepted_tokens", stats.accepted), ("prompt_tokens", stats.prompt_tokens),
                                ("cached_tokens", stats.cached_tokens), ("completion_tokens", completion_tokens)):
                self.totals[name] += value

    def render(self, engine: Engine | None) -> str:
        """Prometheus text format: counters, then the engine's gauges."""
        lines = ["# HELP dflash_requests_total Replies by outcome (finish reason, or why refused).",
                 "# TYPE dflash_requests_total counter"]
        with self.lock:
            lines += [f'dflash_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
            counters = {
                "rounds": (engine.lanes.rounds - self.rounds_base if engine else 0, "Engine rounds (one target forward each)."),
                **{k: (v, f"Sum over finished requests of {k.replace('_', ' ')}.") for k, v in self.totals.items()},
            }
        for name, (value, text) in counters.items():
            lines += [f"# HELP dflash_{name}_total {text}", f"# TYPE dflash_{name}_total counter",
                      f"dflash_{name}_total {value}"]
        memory = engine.memory() if engine else {}
        gauges = {
            "active_streams": (engine.active_streams if engine else 0, "Streams holding a lane."),
            "waiting_requests": (len(engine.lanes.waiting) if engine else 0, "Requests waiting for a lane."),
            "peak_memory_bytes": (memory.get("peak_bytes", 0), "Peak MLX memory since start."),
            "active_memory_bytes": (memory.get("active_bytes", 0), "MLX memory in use now."),
            "baseline_memory_bytes": (memory.get("baseline_bytes", 0), "MLX memory in use once loaded, idle."),
            "prompt_cache_bytes": (memory.get("prompt_cache_bytes", 0), "Bytes held by the prompt cache."),
        }
        for name, (value, text) in gauges.items():
            lines += [f"# HELP dflash_{name} {text}", f"# TYPE dflash_{name} gauge", f"dflash_{name} {value}"]
        return "\n".join(lines) + "\n"


@dataclass
class Job:
    """One completion on its way through the engine, and what its reply needs."""

    chat: bool
    body: CompletionRequest | ChatRequest
    model: str
    handle: Handle
    text: TextStream
    created: int = field(default_factory=lambda: int(time.time()))
    final: Event | None = None
    abandoned: bool = False
    recorded: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def id(self) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{self.handle.request.id}"

    @property
    def finish(self) -> str:
        """A stop string ends the reply even though the engine saw its rest cancelled."""
        if self.text.stopped:
            return "stop"
        return self.final.finish if self.final else "cancelled"

    @property
    def stats(self) -> Stats:
        if self.final and self.final.stats:
            return self.final.stats
        return Stats(prompt_tokens=len(self.handle.request.prompt))

    def head(self) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if self.body.stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, delta: Delta, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if not self.chat:
            choice["text"] = delta.text
        elif self.body.stream:
            choice["delta"] = {"content": delta.text} if delta.text else {}
        else:
            choice["message"] = {"role": "assistant", "content": delta.text}
        choice |= {"logprobs": None, "finish_reason": finish}
        if self.body.return_token_ids:
            choice["token_ids"] = delta.tokens
        return choice

    def usage(self) -> dict[str, Any]:
        s, n = self.stats, len(self.text.tokens)
        return {"prompt_tokens": s.prompt_tokens, "completion_tokens": n, "total_tokens": s.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": s.cached_tokens}}

    def dflash(self) -> dict[str, Any]:
        s = self.stats
        return {"token_sha": token_sha(self.text.tokens), "rounds": s.rounds, "drafted": s.drafted,
                "accepted": s.accepted, "tokens_per_round": s.tokens_per_round, "drafter": s.drafter,
                "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds,
                "ttft_seconds": s.ttft_seconds, "seed": s.seed}

    def reply(self) -> dict[str, Any]:
        whole = Delta(self.text.text, self.text.tokens)
        return self.head() | {"choices": [self.choice(whole, self.finish)], "usage": self.usage(),
                              "dflash": self.dflash()}


class Served:
    """What the app serves: the engine (None while it loads) and the reply counters."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = None
        self.metrics = Metrics()
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: Engine) -> None:
        """The engine is loaded (and running rounds): /health turns ready."""
        self.metrics.rounds_base = engine.lanes.rounds
        self.engine = engine

    def ready(self) -> Engine:
        if self.engine is None:
            raise Warming()
        return self.engine

    # -- prompts -------------------------------------------------------------------------------
    def check_ids(self, ids: list[int], param: str) -> list[int]:
        engine = self.ready()
        vocab = engine.loaded.config.vocab_size if engine.loaded else engine.tokenizer.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise BadRequest(f"{param}[{i}]: token id {t} is outside the vocabulary (0..{vocab - 1})",
                                 f"{param}[{i}]")
        return ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.ready().tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages: list[Message], kwargs: dict[str, Any] | None, add_generation_prompt: bool) -> list[int]:
        tokenizer = self.ready().tokenizer
        try:
            text = tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in messages],
                                                 add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except (jinja2.TemplateError, TypeError) as err:
            raise BadRequest(f"messages: the chat template refused them ({err})", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    # -- one completion ------------------------------------------------------------------------
    async def respond(self, http: HTTPRequest, body: CompletionRequest | ChatRequest, prompt: list[int],
                      max_tokens: int, prompt_param: str) -> JSONResponse | StreamingResponse:
        engine = self.ready()
        request = Request(prompt, max_tokens, body.temperature, body.top_p, max(body.top_k, 0), body.seed,
                          body.draft, body.ignore_eos)
        try:  # in a worker thread: submit waits for the round in progress to end
            handle = await asyncio.to_thread(engine.submit, request)
        except ContextExceeded as err:
            raise BadRequest(str(err), prompt_param, "context_length_exceeded", prompt_tokens=err.prompt_tokens,
                             max_tokens=err.max_tokens, context=err.context) from None
        except ValueError as err:
            raise BadRequest(f"{prompt_param}: {err}", prompt_param) from None
        job = Job(isinstance(body, ChatRequest), body, engine.model_name, handle,
                  TextStream(engine.tokenizer.backend, body.stop))
        events = self.forward(job)
        if body.stream:
            after = BackgroundTasks()  # runs once the response ends, even if the stream never started
            after.add_task(self.abandon, job)
            return StreamingResponse(self.sse(http, job, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"}, background=after)
        async for _ in self.follow(http, job, events):
            pass
        self.record(job)
        if job.finish == "error":
            return JSONResponse({"error": {"message": job.final.error if job.final else "engine failure",
                                           "type": "server_error", "param": None, "code": "engine_error"}}, 500)
        return JSONResponse(job.reply())

    def forward(self, job: Job) -> asyncio.Queue[Event]:
        """A thread that moves the handle's events into the loop; it ends with the finish event,
        which the engine always sends (and records the reply itself if the client has gone)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def run() -> None:
            for event in job.handle:
                if event.finish is not None:
                    with job.lock:
                        job.final = event
                        gone = job.abandoned
                    if gone:
                        self.record(job)
                        return
                loop.call_soon_threadsafe(events.put_nowait, event)

        threading.Thread(target=run, name=f"dflash-{job.handle.request.id}", daemon=True).start()
        return events

    async def follow(self, http: HTTPRequest, job: Job, events: asyncio.Queue[Event]) -> AsyncIterator[Delta]:
        """Text and token deltas as rounds produce them, until the finish event; cancels the request
        when the client disconnects or a stop string appears."""
        next_check = 0.0
        while True:
            if not job.handle.cancelled.is_set() and time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL
                if await http.is_disconnected():
                    job.handle.cancel()
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
            except asyncio.TimeoutError:
                continue
            if event.tokens:
                delta = job.text.feed(event.tokens)
                if job.text.stopped:
                    job.handle.cancel()
                if delta:
                    yield delta
            if event.finish is not None:
                tail = job.text.finish()
                if tail:
                    yield tail
                return

    async def sse(self, http: HTTPRequest, job: Job, events: asyncio.Queue[Event]) -> AsyncIterator[str]:
        try:
            if job.chat:  # the first chunk names the role
                role = job.choice(Delta("", []), None) | {"delta": {"role": "assistant", "content": ""}}
                yield _data(job.head() | {"choices": [role]})
            async for delta in self.follow(http, job, events):
                yield _data(job.head() | {"choices": [job.choice(delta, None)]})
            self.record(job)
            if job.finish == "error":
                error = job.final.error if job.final else "engine failure"
                yield _data({"error": {"message": error, "type": "server_error", "param": None, "code": "engine_error"}})
            else:
                yield _data(job.head() | {"choices": [job.choice(Delta("", []), job.finish)], "dflash": job.dflash()})
                if job.body.include_usage:
                    yield _data(job.head() | {"choices": [], "usage": job.usage()})
            yield "data: [DONE]\n\n"
        finally:
            self.abandon(job)

    def abandon(self, job: Job) -> None:
        """The client went away before its reply was recorded: cancel the request (the engine drops it
        at its next round) and record it once its finish event is in, here or in the forwarding thread."""
        with job.lock:
            if job.recorded:
                return
            job.abandoned = True
            done = job.final is not None
        job.handle.cancel()
        if done:
            self.record(job)

    def record(self, job: Job) -> None:
        """Count the reply and log its line, once."""
        with job.lock:
            if job.recorded:
                return
            job.recorded = True
        s, finish = job.stats, job.finish
        self.metrics.finished(finish, s, len(job.text.tokens))
        log.info("%s prompt=%d cached=%d tokens=%d token_sha=%s finish=%s rounds=%d accepted/drafted=%d/%d",
                 job.id, s.prompt_tokens, s.cached_tokens, len(job.text.tokens), token_sha(job.text.tokens),
                 finish, s.rounds, s.accepted, s.drafted)


def warm_up(engine: Engine) -> None:
    """One short drafted request in the caller's thread, before `engine.start()`: the first round
    pays one-off costs (kernel set-up, allocator growth) before /health says ready, and an engine
    that cannot run a round stops startup here instead of failing the first client."""
    prompt = engine.tokenizer.encode("Hello") if engine.tokenizer else []
    result = engine.generate(Request(prompt or [0], max_tokens=4, temperature=0.0, ignore_eos=True))
    if result.finish == "error":
        raise RuntimeError(f"the warm-up request failed: {result.error}")


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(engine: Engine | None = None) -> FastAPI:
    """The ASGI app over `engine`; with None it answers /health as warming until `app.state.served.attach()`.
    The caller owns the engine (loads it, starts its round thread, stops it)."""
    app = FastAPI(title="dflash-bench", docs_url=None, redoc_url=None, openapi_url=None)
    served = app.state.served = Served(engine)

    @app.exception_handler(BadRequest)
    async def bad_request(_: HTTPRequest, err: BadRequest) -> JSONResponse:
        outcome = "context_length_exceeded" if err.code == "context_length_exceeded" else "invalid_request"
        served.metrics.refused(outcome)
        log.info("refused %s: %s", outcome, err.message)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(Warming)
    async def warming(_: HTTPRequest, __: Warming) -> JSONResponse:
        return JSONResponse({"error": {"message": "the model is still loading", "type": "server_error",
                                       "param": None, "code": "warming"}}, status_code=503)

    @app.get("/health")
    async def health() -> JSONResponse:
        e = served.engine
        if e is None:
            return JSONResponse({"status": "warming"})
        s = e.settings
        return JSONResponse({"status": "ready", "model": e.model_name, "drafter": e.drafter_kind,
                             "parallel": s.parallel, "streams": s.parallel, "active_streams": e.active_streams,
                             "waiting_requests": len(e.lanes.waiting), "context": s.context,
                             "prompt_cache_gib": s.prompt_cache_gib, "startup_line": e.startup_line(),
                             # the weights served, for receipts (checks copy every *sha256 key)
                             "target_sha256": e.loaded.weights_sha256 if e.loaded else None,
                             "drafter_sha256": getattr(e.drafter, "weights_sha256", None),
                             # the row rule proven on this machine, and why drafts are off if they are
                             "selfcheck": e.selfcheck.as_dict() if e.selfcheck else None,
                             "drafting_refused": e.drafting_refused})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        e = served.ready()
        return JSONResponse({"object": "list", "data": [{"id": e.model_name, "object": "model", "created": 0,
                                                         "owned_by": "dflash-bench", "max_model_len": e.settings.context}]})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(served.metrics.render(served.engine), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        served.ready()
        body = parse(CompletionRequest, await http.body())
        if isinstance(body.prompt, str):
            prompt = served.encode_text(body.prompt)
        else:
            prompt = served.check_ids(body.prompt, "prompt")
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS
        return await served.respond(http, body, prompt, max_tokens, "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        engine = served.ready()
        body = parse(ChatRequest, await http.body())
        prompt = served.encode_chat(body.messages, body.chat_template_kwargs, body.add_generation_prompt)
        max_tokens = body.limit if body.limit is not None else max(1, engine.settings.context - len(prompt))
        return await served.respond(http, body, prompt, max_tokens, "messages")

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest) -> JSONResponse:
        engine = served.ready()
        body = parse(TokenizeRequest, await http.body())
        if body.prompt is not None:
            ids = served.encode_text(body.prompt, body.add_special_tokens)
        else:
            ids = served.encode_chat(body.messages, body.chat_template_kwargs, body.add_generation_prompt)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.settings.context})

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest) -> JSONResponse:
        engine = served.ready()
        body = parse(DetokenizeRequest, await http.body())
        ids = served.check_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(ids)})

    return app
