"""Fake vLLM, SGLang and llama.cpp servers, in the shapes their documentation gives, for the adapters.

Each answers what the engine's own server answers where checks/adapters.py looks: vLLM's /v1/models
`owned_by: "vllm"`, `return_token_ids` -> choices[].token_ids and its spec-decode counters on
/metrics; SGLang's `owned_by: "sglang"`, native /generate with cumulative `output_ids` and
`meta_info` (prompt/completion/cached tokens, `spec_verify_ct`), text-only chat and /tokenize;
llama.cpp's /props (`build_info`), /completion with `return_tokens` (`tokens`, `timings` with
`draft_n`/`draft_n_accepted`, `tokens_evaluated`/`tokens_cached`) and chat logprobs entries with `id`.
Replies are tests/fake_openai.py's deterministic tokens; `diverge_at` makes a "drafting" fake differ
from a plain one there, and `drafts` makes it report drafting figures (3 tokens a round).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from fake_openai import Fake, _text, free_port


def _sse(chunks: list[dict], done: bool = True):
    async def events():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0.0005)
        if done:
            yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


def make_app(engine: str, fake: Fake, drafts: bool) -> Starlette:
    counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    owned = {"vllm": "vllm", "sglang": "sglang", "llama.cpp": "llamacpp"}[engine]

    def run(body: dict, ids: list[int], max_tokens: int) -> list[int]:
        out = fake.generate(ids, {**body, "max_tokens": max_tokens})
        if drafts:  # 3 tokens a round: one of the target's own plus 2 accepted of 4 drafted
            rounds = -(-len(out) // 3)
            counters.update(drafts=counters["drafts"] + rounds, draft_tokens=counters["draft_tokens"] + 4 * rounds,
                            accepted=counters["accepted"] + len(out) - rounds)
        return out

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": owned}]})

    async def health(request: Request):
        return PlainTextResponse("") if engine == "vllm" else JSONResponse({"status": "ok"})

    async def props(request: Request):
        if engine != "llama.cpp":
            return PlainTextResponse("Not Found", status_code=404)
        return JSONResponse({"build_info": "b0-fake", "model_path": "fake.gguf", "total_slots": 1,
                             "default_generation_settings": {"n_ctx": 4096}})

    async def metrics(request: Request):
        if engine != "vllm":
            return PlainTextResponse("Not Found", status_code=404)
        lines = [f'vllm:spec_decode_num_{k}_total{{engine="0",model_name="fake"}} {float(v)}'
                 for k, v in (("drafts", counters["drafts"]), ("draft_tokens", counters["draft_tokens"]),
                              ("accepted_tokens", counters["accepted"]))]
        return PlainTextResponse("# TYPE vllm:spec_decode_num_drafts counter\n" + "\n".join(lines) + "\n")

    async def tokenize(request: Request):
        body = await request.json()
        return JSONResponse({"tokens": list(body["prompt"].encode()), "count": len(body["prompt"].encode())})

    async def openai(request: Request):
        body = await request.json()
        chat = request.url.path.endswith("chat/completions")
        ids = fake.prompt_ids(body)
        out = run(body, ids, body.get("max_tokens", 16))
        cached = fake.cached(ids)
        choice: dict = {"index": 0, "finish_reason": "length"}
        text = _text(out)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if engine == "vllm" and body.get("return_token_ids"):
            choice["token_ids"] = out
        if engine == "llama.cpp" and body.get("logprobs"):
            choice["logprobs"] = {"content": [{"id": i, "token": f" t{i}", "logprob": -0.1, "bytes": [],
                                               "top_logprobs": []} for i in out]}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        reply: dict = {"id": "x", "object": "chat.completion" if chat else "text_completion", "usage": usage}
        if engine == "llama.cpp":
            reply["timings"] = {"prompt_n": len(ids) - cached, "predicted_n": len(out)}
            if drafts:
                reply["timings"].update(draft_n=4 * -(-len(out) // 3), draft_n_accepted=len(out) - -(-len(out) // 3))
        if not body.get("stream"):
            return JSONResponse({**reply, "choices": [choice]})
        pieces = []
        for i, tok in enumerate(out):
            c = {"index": 0, "finish_reason": None}
            if chat:
                c["delta"] = {"content": f" t{tok}"}
            else:
                c["text"] = f" t{tok}"
            if "token_ids" in choice:
                c["token_ids"] = [tok]
            if "logprobs" in choice:
                c["logprobs"] = {"content": [{"id": tok, "token": f" t{tok}", "logprob": -0.1, "top_logprobs": []}]}
            pieces.append({"choices": [c]})
        return _sse(pieces + [{**reply, "choices": []}])

    async def generate(request: Request):  # SGLang's native endpoint
        body = await request.json()
        params = body.get("sampling_params") or {}
        ids = list(body["text"].encode()) if "text" in body else body["input_ids"]
        out = run({"temperature": params.get("temperature", 0)}, ids, params.get("max_new_tokens", 16))
        cached = fake.cached(ids)
        meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": cached,
                "finish_reason": {"type": "length", "length": len(out)}}
        if drafts:
            meta["spec_verify_ct"] = -(-len(out) // 3)
        if not body.get("stream"):
            return JSONResponse({"text": _text(out), "output_ids": out, "meta_info": meta})
        chunks = [{"text": _text(out[:n]), "output_ids": out[:n],
                   "meta_info": {**meta, "completion_tokens": n, "finish_reason": None}} for n in range(1, len(out))]
        return _sse(chunks + [{"text": _text(out), "output_ids": out, "meta_info": meta}])

    async def completion(request: Request):  # llama.cpp's native endpoint
        body = await request.json()
        ids = list(body["prompt"].encode()) if isinstance(body["prompt"], str) else body["prompt"]
        out = run({"temperature": body.get("temperature", 0)}, ids, body.get("n_predict", 16))
        cached = fake.cached(ids)
        final = {"content": "" if body.get("stream") else _text(out), "tokens": [] if body.get("stream") else out,
                 "stop": True, "stop_type": "limit", "tokens_evaluated": len(ids), "tokens_predicted": len(out),
                 "tokens_cached": cached, "timings": {"prompt_n": len(ids) - cached, "predicted_n": len(out)}}
        if drafts:
            final["timings"].update(draft_n=4 * -(-len(out) // 3), draft_n_accepted=len(out) - -(-len(out) // 3))
        if not body.get("stream"):
            return JSONResponse(final)
        chunks = [{"content": f" t{tok}", "tokens": [tok], "stop": False} for tok in out]
        return _sse(chunks + [final], done=False)

    return Starlette(routes=[
        Route("/v1/models", models), Route("/health", health), Route("/props", props), Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]), Route("/generate", generate, methods=["POST"]),
        Route("/completion", completion, methods=["POST"]),
        Route("/v1/completions", openai, methods=["POST"]), Route("/v1/chat/completions", openai, methods=["POST"]),
    ])


class EngineServer:
    """One fake engine on a free loopback port (uvicorn in a thread)."""

    def __init__(self, engine: str, drafts: bool = False, diverge_at: int | None = None) -> None:
        self.fake = Fake(diverge_at=diverge_at)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(engine, self.fake, drafts), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> EngineServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake engine did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
