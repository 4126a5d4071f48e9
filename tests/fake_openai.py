"""A tiny fake OpenAI-compatible server with the bundled server's extras, for testing the checks.

Its replies are a deterministic function of the prompt ids (and the seed when sampling), so
drafted equals plain and concurrent equals solo unless a knob says otherwise:
`diverge_at` makes drafted replies differ from plain at that token index; `mlx_lm_like` drops the
`dflash` block, token ids and cached_tokens (as mlx_lm.server replies). Tokens are bytes of the
text (ids < 256 round-trip through /tokenize and /detokenize); generated ids are 256 and up.

Run as a script it takes `serve`'s arguments (TARGET --host --port ...) for ManagedServer tests;
`--die-after N` makes the process exit at once (os._exit, as a SIGKILL would leave it) when a
completion request arrives after N replies, so a check sees its server die mid-run.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route


def sha12(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:12]


@dataclass
class Fake:
    context: int = 4096
    cache: bool = True
    diverge_at: int | None = None
    mlx_lm_like: bool = False
    prefill_seconds_per_token: float = 0.0
    chunk_delay: float = 0.0005
    active_memory: float = 1_000_000.0
    leak_per_drop: float = 0.0
    lie_sha: bool = False
    refuse_past_window: bool = True
    drafter: str | None = "DFlash"
    dtype: str | None = None  # the activations' dtype /health names (ours does), or none
    ignore_seed: bool = False
    die_after: int | None = None  # only in a process of its own (the script): it ends the process
    error_every: int = 0  # every n-th completion request is answered 500
    asked: int = 0
    seen: list[tuple[int, ...]] = field(default_factory=list)
    models_asked: set = field(default_factory=set)
    dropped: int = 0
    completed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def prompt_ids(self, body: dict) -> list[int]:
        if "messages" in body:
            text = "".join(f"<{m['role']}>{m['content']}" for m in body["messages"]) + "<assistant>"
            return list(text.encode())
        prompt = body["prompt"]
        return list(prompt.encode()) if isinstance(prompt, str) else [int(i) for i in prompt]

    def generate(self, ids: list[int], body: dict) -> list[int]:
        key = ",".join(map(str, ids))
        if body.get("temperature", 0) > 0:
            key += f"|seed={body.get('seed') if not self.ignore_seed else time.perf_counter_ns()}"
        out = [256 + int(hashlib.sha256(f"{key}|{i}".encode()).hexdigest()[:6], 16) % 40000
               for i in range(body.get("max_tokens", 16))]
        if self.diverge_at is not None and body.get("draft", True) and self.diverge_at < len(out):
            out[self.diverge_at] += 1
        return out

    def cached(self, ids: list[int]) -> int:
        if not self.cache:
            return 0
        with self.lock:
            best = 0
            for prev in self.seen:
                n = 0
                for a, b in zip(prev, ids):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
            self.seen.append(tuple(ids))
        return min(best, len(ids) - 1)

    def reply_parts(self, body: dict, ids: list[int], out: list[int], cached: int) -> tuple[dict, dict]:
        drafted = body.get("draft", True)
        tpr = 0.0 if len(out) < 2 else 3.0 if drafted else 1.0  # the first token comes from the prompt pass
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}
        dflash = {"token_sha": sha12(out[::-1] if self.lie_sha else out), "rounds": -(-len(out) // int(tpr)) if tpr else 0, "drafted": len(out) * 2 if drafted else 0,
                  "accepted": len(out) - 1 if drafted else 0, "tokens_per_round": tpr,
                  "drafter": self.drafter if drafted else None, "prefill_seconds": 0.001 + len(ids) * 1e-6,
                  "decode_seconds": 0.01}
        if not self.mlx_lm_like:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage, dflash


def _text(ids: list[int]) -> str:
    return "".join(f" t{i}" for i in ids)


# The fake "knows" the known-answer prompts of dflash_bench/prompts/known_answers.json: it starts those replies' text
# with the expected answer (their token ids stay the generated ones).
ANSWERS = {p["text"]: p["expect"] for p in json.loads(
    (Path(__file__).resolve().parents[1] / "dflash_bench" / "prompts" / "known_answers.json").read_text())["prompts"]}


def answer_for(body: dict) -> str:
    messages = body.get("messages") or []
    return ANSWERS.get(messages[-1].get("content"), "") if messages else ""


def make_app(fake: Fake) -> Starlette:
    async def health(request: Request):
        if fake.mlx_lm_like:  # mlx_lm.server names no model and lists every model in its cache
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ready", "model": "fake", "drafter": "DFlash", "parallel": 4,
                             "context": fake.context, **({"dtype": fake.dtype} if fake.dtype else {})})

    async def models(request: Request):
        names = ["some/cached-model", "fake"] if fake.mlx_lm_like else ["fake"]
        return JSONResponse({"object": "list", "data": [{"id": n, "object": "model"} for n in names]})

    async def metrics(request: Request):
        return PlainTextResponse(f"# TYPE dflash_active_memory_bytes gauge\ndflash_active_memory_bytes {fake.active_memory}\n"
                                 f"process_resident_memory_bytes {fake.active_memory + 50e6}\n"
                                 f"dflash_peak_memory_bytes 2000000\ndflash_requests_total{{kind=\"a\"}} 3\n")

    async def tokenize(request: Request):
        body = await request.json()
        return JSONResponse({"tokens": list(body["prompt"].encode())})

    async def detokenize(request: Request):
        body = await request.json()
        return JSONResponse({"prompt": bytes(body["tokens"]).decode(errors="replace")})

    async def complete(request: Request):
        if fake.die_after is not None and fake.completed + fake.dropped >= fake.die_after:
            os._exit(9)
        body = await request.json()
        with fake.lock:
            fake.asked += 1
            broken = fake.error_every and fake.asked % fake.error_every == 0
        if broken:
            return JSONResponse({"error": {"message": "internal error", "type": "server_error"}}, status_code=500)
        fake.models_asked.add(body.get("model"))
        chat = request.url.path.endswith("chat/completions")
        ids = fake.prompt_ids(body)
        if fake.refuse_past_window and len(ids) + body.get("max_tokens", 16) > fake.context:
            return JSONResponse({"error": {"code": "context_length_exceeded", "type": "invalid_request_error",
                                           "message": f"{len(ids)} prompt tokens exceed the context {fake.context}"}},
                                status_code=400)
        out = fake.generate(ids, body)
        usage, dflash = fake.reply_parts(body, ids, out, fake.cached(ids))
        want_ids = body.get("return_token_ids") and not fake.mlx_lm_like

        answer = answer_for(body)

        def choice(piece: list[int], final: bool, first: bool = True) -> dict:
            c = {"index": 0, "finish_reason": "length" if final else None}
            text = (answer if first else "") + _text(piece)
            if chat:
                c["delta" if body.get("stream") else "message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            if want_ids:
                c["token_ids"] = piece
            return c

        if not body.get("stream"):
            await asyncio.sleep(len(ids) * fake.prefill_seconds_per_token)
            reply = {"id": "x", "object": "chat.completion" if chat else "text_completion",
                     "choices": [choice(out, True)], "usage": usage}
            if not fake.mlx_lm_like:
                reply["dflash"] = dflash
            with fake.lock:
                fake.completed += 1
            return JSONResponse(reply)

        step = 3 if body.get("draft", True) else 1

        async def events():
            finished = False
            try:
                yield ": prefilling\n\n"
                await asyncio.sleep(len(ids) * fake.prefill_seconds_per_token)
                for start in range(0, len(out), step):
                    piece = out[start:start + step]
                    yield f"data: {json.dumps({'choices': [choice(piece, False, start == 0)]})}\n\n"
                    await asyncio.sleep(fake.chunk_delay)
                last = {"choices": [], "usage": usage}
                if not fake.mlx_lm_like:
                    last["dflash"] = dflash
                yield f"data: {json.dumps(last)}\n\n"
                # the reply is whole once its usage went: a client that reads [DONE] and closes can
                # have the generator cancelled at that last yield, which would count it as dropped
                finished = True
                yield "data: [DONE]\n\n"
            finally:
                with fake.lock:
                    if finished:
                        fake.completed += 1
                    else:
                        fake.dropped += 1
                        fake.active_memory += fake.leak_per_drop

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/completions", complete, methods=["POST"]), Route("/v1/chat/completions", complete, methods=["POST"]),
    ])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """The fake on a free loopback port, served by uvicorn in a thread."""

    def __init__(self, **options) -> None:
        self.fake = Fake(**options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(self.fake), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


if __name__ == "__main__":  # `serve`-style arguments, for ManagedServer tests
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if "--die" in args:
        print("fake: refusing to start", flush=True)
        sys.exit(3)
    print(f"fake serve {args[0]}: DFlash drafts for 4 streams of 4096 tokens", flush=True)
    def option(flag: str) -> str | None:
        return args[args.index(flag) + 1] if flag in args else None

    fake = Fake(die_after=int(option("--die-after")) if option("--die-after") else None,
                context=int(option("--context") or 4096), cache=option("--prompt-cache-gib") not in ("0", "0.0"))
    uvicorn.run(make_app(fake), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
