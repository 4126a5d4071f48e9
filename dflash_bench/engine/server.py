"""The OpenAI-compatible HTTP layer over the Engine: requests in, replies with `usage` and `dflash` out.

This module only translates. Behind the guard (engine/http_guard.py: Host, API key, content type,
body size) it reads a body, parses it (engine/openai_schema.py), turns the prompt into token ids,
submits one engine Request and follows its Handle's events; text comes from the ids
(engine/textstream.py). Parsing and tokenizing run in worker threads, bounded by the context window
before the whole text is tokenized, so a long prompt never stalls the loop: /health and running
streams keep answering. The engine runs rounds in its own thread; each request gets a small thread
that forwards its events into the asyncio loop, so waiting costs the loop nothing and no event is
lost when the client goes away. A client that disconnects is cancelled: the engine drops its
stream at the next round.

Every reply carries `usage` (with `prompt_tokens_details.cached_tokens`) and a `dflash` block
(engine/reply_block.py) whose `token_sha` hashes the returned token ids; streams end with `data: [DONE]`.
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
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from dflash_bench.engine.engine import Engine
from dflash_bench.engine.http_guard import (
    BODY_FLOOR,
    Access,
    ClientGone,
    Guard,
    Refused,
    default_body_limit,
    error_body,
    read_body,
)
from dflash_bench.engine.errors import ContextExceeded
from dflash_bench.engine.openai_schema import (
    BadRequest,
    Body,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Message,
    TokenizeRequest,
    parse,
)
from dflash_bench.engine.reply_block import DflashBlock
from dflash_bench.engine.request import Event, Handle, Request, Stats, token_sha
from dflash_bench.engine.server_metrics import Metrics
from dflash_bench.engine.textstream import Delta, TextStream
from dflash_bench.engine.tokenizer import TooManyTokens

log = logging.getLogger("dflash_bench.server")

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the window
DISCONNECT_POLL = 0.05  # seconds between disconnect checks while a request runs


class Warming(Exception):
    """The engine is still loading."""


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
        return DflashBlock.from_stats(self.stats, self.text.tokens).model_dump()

    def reply(self) -> dict[str, Any]:
        whole = Delta(self.text.text, self.text.tokens)
        return self.head() | {"choices": [self.choice(whole, self.finish)], "usage": self.usage(),
                              "dflash": self.dflash()}


def past_window(prompt_tokens: int, max_tokens: int | None, context: int, prompt_param: str,
                limit_param: str | None) -> BadRequest:
    """The context_length_exceeded refusal, naming the field a client would change: the prompt when it
    alone fills the window (or the reply's length was not given), else the reply's limit as sent."""
    fault = prompt_param if limit_param is None or prompt_tokens >= context else limit_param
    if max_tokens is None:
        said = f"{prompt_param} ({prompt_tokens} tokens) leaves no room for a reply"
    else:
        said = (f"{prompt_param} ({prompt_tokens} tokens) plus {limit_param or 'max_tokens'} ({max_tokens}) is "
                f"{prompt_tokens + max_tokens}")
    return BadRequest(f"{fault}: {said}, past the context window of {context}", fault, "context_length_exceeded",
                      prompt_tokens=prompt_tokens, max_tokens=max_tokens, context=context)


class Served:
    """What the app serves: the engine (None while it loads), who may use it, and the reply counters."""

    def __init__(self, engine: Engine | None = None, access: Access | None = None) -> None:
        self.engine = None
        self.access = access or Access()
        self.metrics = Metrics()
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: Engine) -> None:
        """The engine is loaded (and running rounds): /health turns ready."""
        self.metrics.rounds_base = engine.status().rounds
        self.engine = engine

    def ready(self) -> Engine:
        if self.engine is None:
            raise Warming()
        return self.engine

    def body_limit(self) -> int:
        """serve --max-body-mib, else sized from the context (the floor while loading)."""
        if self.access.max_body_bytes is not None:
            return self.access.max_body_bytes
        return default_body_limit(self.engine.settings.context) if self.engine else BODY_FLOOR

    async def read(self, http: HTTPRequest, model: type[Body]) -> Body:
        """The body as `model`, parsed in a worker thread; a `model` id other than the one served is
        refused as OpenAI does (404 model_not_found)."""
        engine = self.ready()
        body = await asyncio.to_thread(parse, model, await read_body(http, self.body_limit()))
        named = getattr(body, "model", None)
        if named is not None and named != engine.model_name:
            raise BadRequest(f"model: the model {named[:200]!r} does not exist; this server serves "
                             f"{engine.model_name!r} (GET /v1/models)", "model", "model_not_found", status=404)
        return body

    # -- prompts (in worker threads) -----------------------------------------------------------
    def check_ids(self, ids: list[int], param: str) -> list[int]:
        engine = self.ready()
        vocab = engine.loaded.config.vocab_size if engine.loaded else engine.tokenizer.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise BadRequest(f"{param}[{i}]: token id {t} is outside the vocabulary (0..{vocab - 1})",
                                 f"{param}[{i}]")
        return ids

    def encode_text(self, text: str, add_special_tokens: bool, param: str, room: int, counted: bool = True) -> list[int]:
        """`text`'s ids, refused once it cannot fit in `room` tokens: unread when its length in characters
        already says so, else (when `counted`) as soon as it is tokenized, before its ids are built.
        /tokenize is not `counted`: clients tokenize text longer than a prompt to cut it to size."""
        tokenizer = self.ready().tokenizer
        if len(text) > room * tokenizer.longest_token:
            raise BadRequest(f"{param}: {len(text)} characters cannot fit in {room} tokens (no token here is longer "
                             f"than {tokenizer.longest_token} characters)", param, "context_length_exceeded")
        try:
            return tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=room if counted else None)
        except TooManyTokens as err:
            raise BadRequest(f"{param}: {err.count} tokens, past the {room} that fit", param,
                             "context_length_exceeded", prompt_tokens=err.count) from None

    def encode_chat(self, messages: list[Message], kwargs: dict[str, Any] | None, add_generation_prompt: bool,
                    room: int, counted: bool = True) -> list[int]:
        tokenizer = self.ready().tokenizer
        try:
            text = tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in messages],
                                                 add_generation_prompt=add_generation_prompt, **(kwargs or {}))
        except (jinja2.TemplateError, TypeError) as err:
            raise BadRequest(f"messages: the chat template refused them ({err})", "messages") from None
        return self.encode_text(text, False, "messages", room, counted)

    def room(self, prompt_param: str, max_tokens: int | None, limit_param: str | None) -> int:
        """Tokens a prompt may take beside a reply of `max_tokens` (None: at least one token); a limit
        that fills the window alone is refused before anything is tokenized."""
        context = self.ready().settings.context
        if max_tokens is not None and max_tokens >= context:
            fault = limit_param or "max_tokens"
            raise BadRequest(f"{fault}: {max_tokens} leaves no room for the prompt in the context window of "
                             f"{context}", fault, "context_length_exceeded", max_tokens=max_tokens, context=context)
        return context - (max_tokens or 1)

    # -- one completion ------------------------------------------------------------------------
    async def respond(self, http: HTTPRequest, body: CompletionRequest | ChatRequest, prompt: list[int],
                      max_tokens: int, prompt_param: str, limit_param: str | None) -> JSONResponse | StreamingResponse:
        engine = self.ready()
        request = Request(prompt, max_tokens, body.temperature, body.top_p, max(body.top_k, 0), body.seed,
                          body.draft, body.ignore_eos)
        try:  # in a worker thread: submit waits for the round in progress to end
            handle = await asyncio.to_thread(engine.submit, request)
        except ContextExceeded as err:
            raise past_window(err.prompt_tokens, err.max_tokens, err.context, prompt_param, limit_param) from None
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
            return JSONResponse(error_body(job.final.error if job.final else "engine failure", "engine_error",
                                           kind="server_error"), 500)
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
    """One short drafted request in the caller's thread, before `engine.start()`: after the engine's own
    warm-up (every forward shape on scratch states: warmup.py) this runs the lanes end to end once, so an
    engine that cannot run a round stops startup here instead of failing the first client."""
    prompt = engine.tokenizer.encode("Hello") if engine.tokenizer else []
    result = engine.generate(Request(prompt or [0], max_tokens=4, temperature=0.0, ignore_eos=True))
    if result.finish == "error":
        raise RuntimeError(f"the warm-up request failed: {result.error}")


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(engine: Engine | None = None, access: Access | None = None) -> FastAPI:
    """The ASGI app over `engine`, behind `access` (default: loopback names, no API key, the body limit
    sized from the context); with no engine it answers /health 503 "warming" until
    `app.state.served.attach()`. The caller owns the engine (loads it, starts its round thread, stops it)."""
    app = FastAPI(title="dflash-bench", docs_url=None, redoc_url=None, openapi_url=None)
    served = app.state.served = Served(engine, access)
    app.add_middleware(Guard, access=served.access, limit=served.body_limit)

    @app.exception_handler(BadRequest)
    async def bad_request(_: HTTPRequest, err: BadRequest) -> JSONResponse:
        outcome = "context_length_exceeded" if err.code == "context_length_exceeded" else "invalid_request"
        served.metrics.refused(outcome)
        log.info("refused %s: %s", outcome, err.message)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Refused)
    async def refused(_: HTTPRequest, err: Refused) -> JSONResponse:
        return err.response()

    @app.exception_handler(ClientGone)
    async def client_gone(_: HTTPRequest, __: ClientGone) -> Response:
        log.info("dropped: the client hung up before its body was whole")
        return Response(status_code=400)  # nobody reads it; answering ends the request without a traceback

    @app.exception_handler(HTTPException)
    async def http_error(_: HTTPRequest, err: HTTPException) -> JSONResponse:
        """Unknown paths (404) and methods (405) in OpenAI's error shape too."""
        return JSONResponse(error_body(str(err.detail), "not_found" if err.status_code == 404 else "invalid_request"),
                            err.status_code, err.headers)

    @app.exception_handler(Warming)
    async def warming(_: HTTPRequest, __: Warming) -> JSONResponse:
        return JSONResponse(error_body("the model is still loading", "warming", kind="server_error"), 503)

    @app.get("/health")
    async def health() -> JSONResponse:
        """503 until the engine is loaded and warmed up (readiness probes, llama.cpp's convention), then 200."""
        e = served.engine
        if e is None:
            return JSONResponse({"status": "warming"}, 503)
        s, now = e.settings, e.status()
        return JSONResponse({"status": "ready", "model": e.model_name, "drafter": e.drafter_kind,
                             "parallel": s.parallel, "streams": s.parallel, "active_streams": now.active_streams,
                             "waiting_requests": now.waiting_requests, "context": s.context,
                             "prompt_cache_gib": s.prompt_cache_gib, "startup_line": e.startup_line(),
                             # the activations' dtype: a known answer verified in float32 may flip in bf16 (exactness)
                             "dtype": str(e.backend.dtype).removeprefix("mlx.core."),
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
        body = await served.read(http, CompletionRequest)
        max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_MAX_TOKENS
        if isinstance(body.prompt, str):
            room = served.room("prompt", max_tokens, "max_tokens")
            prompt = await asyncio.to_thread(served.encode_text, body.prompt, True, "prompt", room)
        else:
            prompt = await asyncio.to_thread(served.check_ids, body.prompt, "prompt")
        return await served.respond(http, body, prompt, max_tokens, "prompt", "max_tokens")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await served.read(http, ChatRequest)
        room = served.room("messages", body.limit, body.limit_param)
        prompt = await asyncio.to_thread(served.encode_chat, body.messages, body.chat_template_kwargs,
                                         body.add_generation_prompt, room)
        context = served.ready().settings.context
        max_tokens = body.limit if body.limit is not None else max(1, context - len(prompt))
        return await served.respond(http, body, prompt, max_tokens, "messages", body.limit_param)

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest) -> JSONResponse:
        body = await served.read(http, TokenizeRequest)
        context = served.ready().settings.context
        if body.prompt is not None:  # text that could not fit the window is refused unread, as a prompt is
            ids = await asyncio.to_thread(served.encode_text, body.prompt, body.add_special_tokens, "prompt", context,
                                          False)
        else:
            ids = await asyncio.to_thread(served.encode_chat, body.messages, body.chat_template_kwargs,
                                          body.add_generation_prompt, context, False)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": context})

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest) -> JSONResponse:
        body = await served.read(http, DetokenizeRequest)
        ids = await asyncio.to_thread(served.check_ids, body.tokens, "tokens")
        return JSONResponse({"prompt": await asyncio.to_thread(served.ready().tokenizer.decode, ids)})

    return app
