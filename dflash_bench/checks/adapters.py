"""Per-engine adapters: how to get token ids (and spec-decode figures) out of a server that is not ours.

The checks compare replies token for token. Our server returns `token_ids` and a `dflash` block;
other engines carry the same facts in their own shapes, so each adapter turns a request into the
engine's fields and its replies back into the shape `client._Reply` reads (choices[].token_ids,
usage). What a reply proves is its evidence: "token ids" (the server's own ids), "token pieces"
(one text piece a token, each mapped to its id with the server's tokenizer) or "text" (the reply's
text re-tokenized: a first differing index is then an index into the re-tokenized text). The engine
is detected from what the server answers (GET /v1/models' owned_by, /props, /health, the `Server`
header) and written into the receipt with those answers.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import httpx

from dflash_bench.checks.client import Client, Record, Request, _Reply, parse_metrics, token_sha

TOKEN_IDS, TOKEN_PIECES, TEXT = "token ids", "token pieces", "text"

# vLLM's spec-decode counters on /metrics (Prometheus counters carry the _total suffix).
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


class Adapter:
    """An OpenAI-compatible server we know nothing more about: replies are text only."""

    name = "openai-compatible"
    evidence: str | None = None  # what its replies carry without re-tokenizing; None: text only
    has_counters = False  # spec-decode counters on /metrics (see counters)

    def prepare(self, req: Request, body: dict) -> tuple[Request, dict]:
        """The request as this engine takes it; our extras (`draft`) go only to our server."""
        body.pop("draft", None)
        return req, body

    def normalize(self, chunk: dict, state: dict) -> dict:
        """One reply or stream chunk in the shape `_Reply.feed` reads; `state` lives for one reply."""
        return chunk

    def figures(self, chunk: dict, state: dict) -> None:
        """Keeps a reply's spec-decode figures (drafted, accepted, rounds) in `state` where it has them."""

    def counters(self, metrics: dict[str, float] | None) -> dict[str, float] | None:
        """Server-wide spec-decode counters from /metrics, to take before/after a measurement."""
        return None


class DFlashBench(Adapter):
    """Ours: token ids, `draft` and the `dflash` block are native."""

    name = "dflash-bench"
    evidence = TOKEN_IDS

    def prepare(self, req: Request, body: dict) -> tuple[Request, dict]:
        return req, body


class VLLM(Adapter):
    """vLLM: `return_token_ids` puts choices[].token_ids in replies and stream chunks; its spec-decode
    counters are server-wide, so a measurement takes their deltas."""

    name = "vllm"
    evidence = TOKEN_IDS
    has_counters = True

    def counters(self, metrics: dict[str, float] | None) -> dict[str, float] | None:
        if not metrics or VLLM_DRAFTS not in metrics:
            return None
        return {"drafts": metrics[VLLM_DRAFTS], "draft_tokens": metrics.get(VLLM_DRAFT_TOKENS, 0.0),
                "accepted": metrics.get(VLLM_ACCEPTED, 0.0)}


class SGLang(Adapter):
    """SGLang: completions go to its native /generate, whose replies carry `output_ids` and a
    `meta_info` with the token counts and `spec_verify_ct` (verify rounds); chat stays on the OpenAI
    path, which carries text only. Streamed /generate chunks are cumulative; normalize cuts deltas."""

    name = "sglang"
    evidence = TOKEN_IDS

    def prepare(self, req: Request, body: dict) -> tuple[Request, dict]:
        body.pop("draft", None)
        if req.messages is not None:
            body.pop("return_token_ids", None)
            return req, body
        key = "text" if isinstance(req.prompt, str) else "input_ids"
        params = {"max_new_tokens": req.max_tokens, "temperature": req.temperature, "ignore_eos": req.ignore_eos}
        if req.seed is not None:
            params["sampling_seed"] = req.seed
        return (dataclasses.replace(req, endpoint="/generate"),
                {key: req.prompt, "sampling_params": params, "stream": req.stream})

    def normalize(self, chunk: dict, state: dict) -> dict:
        if "output_ids" not in chunk and "meta_info" not in chunk:
            return chunk
        ids, text = chunk.get("output_ids") or [], chunk.get("text") or ""
        new_ids, new_text = ids[state.get("ids", 0):], text[state.get("text", 0):]
        state.update(ids=len(ids), text=len(text))
        meta = chunk.get("meta_info") or {}
        finish = meta.get("finish_reason")
        choice = {"text": new_text, "token_ids": new_ids,
                  "finish_reason": finish.get("type") if isinstance(finish, dict) else finish}
        usage = {"prompt_tokens": meta.get("prompt_tokens"), "completion_tokens": meta.get("completion_tokens")}
        if meta.get("cached_tokens") is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": meta["cached_tokens"]}
        return {"choices": [choice], "usage": usage if meta else None}

    def figures(self, chunk: dict, state: dict) -> None:
        meta = chunk.get("meta_info") or {}
        if meta.get("spec_verify_ct"):
            state["rounds"] = int(meta["spec_verify_ct"])


class LlamaCpp(Adapter):
    """llama.cpp's llama-server: completions go to its native /completion with `return_tokens`
    (ids in `tokens`, in every stream chunk too); chat asks for `logprobs`, whose entries carry each
    token's `id`. Replies' `timings` carry `draft_n` and `draft_n_accepted` when it drafts."""

    name = "llama.cpp"
    evidence = TOKEN_IDS

    def prepare(self, req: Request, body: dict) -> tuple[Request, dict]:
        body.pop("draft", None)
        if req.messages is not None:
            body.update(logprobs=True, top_logprobs=0)
            return req, body
        native = {"prompt": req.prompt, "n_predict": req.max_tokens, "temperature": req.temperature,
                  "ignore_eos": req.ignore_eos, "return_tokens": True, "stream": req.stream}
        if req.seed is not None:
            native["seed"] = req.seed
        return dataclasses.replace(req, endpoint="/completion"), native

    def normalize(self, chunk: dict, state: dict) -> dict:
        if "choices" in chunk:
            for choice in chunk["choices"]:
                content = (choice.get("logprobs") or {}).get("content") or []
                if content and all("id" in c for c in content):
                    choice["token_ids"] = [int(c["id"]) for c in content]
            return chunk
        choice = {"text": chunk.get("content", ""), "token_ids": chunk.get("tokens") or []}
        if chunk.get("stop"):
            choice["finish_reason"] = {"limit": "length"}.get(chunk.get("stop_type"), "stop")
        out: dict = {"choices": [choice]}
        if "tokens_evaluated" in chunk or "tokens_predicted" in chunk:
            out["usage"] = {"prompt_tokens": chunk.get("tokens_evaluated"),
                            "completion_tokens": chunk.get("tokens_predicted")}
            if chunk.get("tokens_cached") is not None:
                out["usage"]["prompt_tokens_details"] = {"cached_tokens": chunk["tokens_cached"]}
        return out

    def figures(self, chunk: dict, state: dict) -> None:
        timings = chunk.get("timings") or {}
        if "draft_n" in timings:
            state["drafted"] = int(timings["draft_n"])
            state["accepted"] = int(timings.get("draft_n_accepted") or 0)


class LlamaCppPython(Adapter):
    """llama-cpp-python's server: no ids in replies, but `logprobs` lists one text piece a token
    (completions: logprobs.tokens; chat: logprobs.content[].token); each piece is mapped to its id
    with the server's POST /extras/tokenize (a piece that is not exactly one token, such as half of
    a UTF-8 character, leaves the reply to text-level evidence)."""

    name = "llama-cpp-python"
    evidence = TOKEN_PIECES

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.ids: dict[str, int | None] = {}
        self.prefix: list[int] | None = None

    def prepare(self, req: Request, body: dict) -> tuple[Request, dict]:
        for key in ("draft", "return_token_ids", "ignore_eos"):
            body.pop(key, None)
        if req.messages is not None:
            body.update(logprobs=True, top_logprobs=0)
        else:
            body["logprobs"] = 0
        return req, body

    def normalize(self, chunk: dict, state: dict) -> dict:
        for choice in chunk.get("choices") or []:
            logprobs = choice.get("logprobs") or {}
            pieces = logprobs.get("tokens")
            if pieces is None and logprobs.get("content") is not None:
                pieces = [c.get("token") for c in logprobs["content"]]
            if pieces is None:
                continue
            ids = [self.piece_id(p) for p in pieces]
            if any(i is None for i in ids):
                state["unmapped"] = True
            else:
                choice["token_ids"] = ids
        return chunk

    def piece_id(self, piece: str | None) -> int | None:
        if not piece:
            return None
        if piece not in self.ids:
            if self.prefix is None:  # what tokenize adds to any text (a BOS on some models)
                self.prefix = self._tokenize("")
            ids = self._tokenize(piece)[len(self.prefix):]
            self.ids[piece] = ids[0] if len(ids) == 1 else None
        return self.ids[piece]

    def _tokenize(self, text: str) -> list[int]:
        r = self.http.post("/extras/tokenize", json={"input": text}, timeout=30.0)
        r.raise_for_status()
        return [int(i) for i in r.json()["tokens"]]


class MlxLm(Adapter):
    """mlx_lm.server: a non-streamed reply asked for `logprobs` lists each token's `id` in
    logprobs.content; streamed chunks carry text only."""

    name = "mlx_lm"
    evidence = TOKEN_IDS

    def prepare(self, req: Request, body: dict) -> tuple[Request, dict]:
        body.pop("draft", None)
        if not req.stream:
            body["logprobs"] = True
        return req, body

    def normalize(self, chunk: dict, state: dict) -> dict:
        for choice in chunk.get("choices") or []:
            content = (choice.get("logprobs") or {}).get("content") or []
            if content and all("id" in c for c in content):
                choice["token_ids"] = [int(c["id"]) for c in content]
        return chunk


@dataclasses.dataclass
class Detected:
    """Which engine a server is, why we think so, and what it answered (for the receipt)."""

    engine: str
    because: str
    reported: dict


def _get(http: httpx.Client, path: str) -> tuple[object | None, httpx.Headers | None]:
    """A GET's JSON and headers; None for anything that is not a 200 with JSON."""
    try:
        r = http.get(path, timeout=10.0)
    except httpx.HTTPError:
        return None, None
    if r.status_code != 200:
        return None, r.headers
    try:
        return r.json(), r.headers
    except ValueError:
        return None, r.headers


def detect(http: httpx.Client) -> Detected:
    """Reads /health, /v1/models and /props (each optional) and names the engine from them."""
    health, headers = _get(http, "/health")
    models, _ = _get(http, "/v1/models")
    props, _ = _get(http, "/props")
    server_header = headers.get("server") if headers is not None else None
    reported = {"health": health, "models": models, "props": props, "server_header": server_header}
    owners = [m.get("owned_by") for m in (models or {}).get("data") or [] if isinstance(m, dict)] \
        if isinstance(models, dict) else []
    health = health if isinstance(health, dict) else {}
    if "drafter" in health or "startup_line" in health:
        return Detected("dflash-bench", "/health names a drafter and a startup line", reported)
    for owner, engine in (("vllm", "vllm"), ("sglang", "sglang"), ("llamacpp", "llama.cpp"),
                          ("me", "llama-cpp-python")):
        if owner in owners:
            return Detected(engine, f"/v1/models owned_by {owner!r}", reported)
    if isinstance(props, dict) and ("build_info" in props or "default_generation_settings" in props):
        return Detected("llama.cpp", "/props answers with llama-server's fields", reported)
    if server_header and server_header.startswith("BaseHTTP") and health == {"status": "ok"}:
        return Detected("mlx_lm", f"Server {server_header!r} and /health {{'status': 'ok'}}", reported)
    return Detected("openai-compatible", "no engine-specific answer", reported)


def adapter_for(engine: str, http: httpx.Client) -> Adapter:
    simple: dict[str, Callable[[], Adapter]] = {
        "dflash-bench": DFlashBench, "vllm": VLLM, "sglang": SGLang, "llama.cpp": LlamaCpp, "mlx_lm": MlxLm}
    if engine == "llama-cpp-python":
        return LlamaCppPython(http)
    return simple.get(engine, Adapter)()


class EngineReply(_Reply):
    """`_Reply` fed through an adapter, with the text-level fallback where the engine gives no ids."""

    def __init__(self, adapter: Adapter, retokenize: Callable[[str], list[int] | None] | None) -> None:
        super().__init__()
        self.adapter, self.retokenize, self.state = adapter, retokenize, {}

    def feed(self, chunk: dict) -> int:
        self.adapter.figures(chunk, self.state)
        return super().feed(self.adapter.normalize(chunk, self.state))

    def fill(self, rec: Record) -> None:
        if self.state.get("unmapped"):
            self.ids = None  # some pieces had no single id: fall back to the text
        super().fill(rec)
        if rec.token_ids is not None:
            rec.evidence = TOKEN_IDS if self.adapter.evidence != TOKEN_PIECES else TOKEN_PIECES
        elif rec.ok and self.retokenize is not None and (rec.text or rec.completion_tokens == 0):
            ids = self.retokenize(rec.text)
            if ids is not None:
                rec.token_ids, rec.token_sha, rec.sha_source, rec.evidence = ids, token_sha(ids), "text", TEXT
        drafted, accepted, rounds = (self.state.get(k) for k in ("drafted", "accepted", "rounds"))
        done = rec.completion_tokens or (len(rec.token_ids) if rec.token_ids is not None else None)
        if drafted is not None and not rec.has_dflash:
            rec.drafted, rec.accepted = drafted, accepted
            # each verify round keeps its accepted drafts plus one token of the target's own
            rounds = done - accepted if done else None
        if rounds and done and not rec.has_dflash:
            rec.rounds, rec.tokens_per_round = rounds, done / rounds


class EngineClient(Client):
    """A `Client` that speaks to the detected engine through its adapter."""

    def __init__(self, base_url: str, timeout: float = 600.0, api_key: str | None = None,
                 tokenizer: Callable[[str], list[int]] | None = None) -> None:
        super().__init__(base_url, timeout, api_key)
        self.detected = detect(self.http)
        self.adapter = adapter_for(self.detected.engine, self.http)
        self.local_tokenizer = tokenizer

    def prepare(self, req: Request) -> tuple[Request, dict]:
        return self.adapter.prepare(req, req.body(self.model))

    def new_reply(self) -> _Reply:
        return EngineReply(self.adapter, self.retokenize)

    def retokenize(self, text: str) -> list[int] | None:
        """The text's ids by the model's tokenizer: --tokenizer's, else the server's own endpoint."""
        if self.local_tokenizer is not None:
            return self.local_tokenizer(text)
        if isinstance(self.adapter, LlamaCppPython):
            return self.adapter._tokenize(text)[len(self.adapter.prefix or self.adapter._tokenize("")):]
        try:
            return self.tokenize(text)
        except (httpx.HTTPError, KeyError, ValueError):
            return None

    def spec_counters(self) -> dict[str, float] | None:
        """The engine's server-wide spec-decode counters now (None where it has none)."""
        if not self.adapter.has_counters:
            return None
        try:
            r = self.http.get("/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        return self.adapter.counters(parse_metrics(r.text)) if r.status_code == 200 else None

    def describe(self) -> dict:
        evidence = self.adapter.evidence or (TEXT if self.local_tokenizer else None)
        return {"engine": self.detected.engine, "detected_from": self.detected.because, "evidence": evidence,
                "reported": self.detected.reported}


def tokens_per_round(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Tokens a verify round between two counter snapshots: 1 + accepted / drafts (the bonus token)."""
    if not before or not after:
        return None
    drafts = after["drafts"] - before["drafts"]
    return 1.0 + (after["accepted"] - before["accepted"]) / drafts if drafts > 0 else None
