"""prefill: cold prompt speed at exact sizes, drafted and plain side by side in one server.

The arrays: the public lighthouse paragraph repeated, tokenized once by the server, cut to the first
N ids; each must decode and re-encode to itself (else trailing ids are dropped until it does, and
the receipt says so). Their hashes go in the receipt and the arrays in a side file beside it.
Every measured request must report cached_tokens 0 and prompt_tokens equal to its array's length.

A server without /tokenize (mlx_lm.server) can still be measured with `--tokenizer` (the model's
folder or GGUF): the arrays are made here and sent as their text, which re-encodes to exactly those
ids, and the server's prompt_tokens confirms it tokenized them the same way.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.client import Client, Request, token_sha
from dflash_bench.checks.receipt import canonical_json, summary, write_atomic
from dflash_bench.checks.runner import NO_CACHED, NO_DFLASH, Context
from dflash_bench.engine.errors import DFlashBenchError

CHECK = "prefill"
MAX_DROPPED = 16


class NoTokenizer(DFlashBenchError):
    """The server has no /tokenize or /detokenize, or they do not round-trip."""


@dataclass
class PrefillSettings:
    sizes: tuple[int, ...] = (512, 2048, 8192)
    rounds: int = 3
    warmup: int = 1
    tokenizer: str | None = None  # used only when the server has no /tokenize


class LocalTokenizer:
    """The model's tokenizer read here, with the client's tokenize/detokenize shape (no special tokens)."""

    def __init__(self, path: str) -> None:
        from dflash_bench.engine import gguf
        from dflash_bench.engine.tokenizer import Tokenizer

        self.path = Path(path)
        if self.path.is_file():
            self.tokenizer = Tokenizer.from_gguf_metadata(gguf.read_header(self.path).metadata)
        else:
            self.tokenizer = Tokenizer.from_dir(self.path)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def lighthouse_ids(client: Client | LocalTokenizer, count: int) -> list[int]:
    """At least `count` ids of the repeated paragraph, tokenized in one call."""
    paragraph, sep = prompt_sets.prefill_paragraph()
    per = client.tokenize(paragraph)
    if per is None:
        raise NoTokenizer("the server has no POST /tokenize")
    text = sep.join([paragraph] * (count // max(len(per), 1) + 2))
    ids = client.tokenize(text)
    if len(ids) < count:
        raise NoTokenizer(f"/tokenize gave {len(ids)} ids for a text meant to hold {count}")
    return ids


def exact_arrays(client: Client | LocalTokenizer, sizes: tuple[int, ...]) -> dict[int, dict]:
    """{size: {"ids", "dropped"}}: the first N ids, cut back until detokenize/tokenize round-trips."""
    ids = lighthouse_ids(client, max(sizes))
    out = {}
    for size in sizes:
        for dropped in range(MAX_DROPPED + 1):
            candidate = ids[: size - dropped]
            text = client.detokenize(candidate)
            if text is None:
                raise NoTokenizer("the server has no POST /detokenize")
            if client.tokenize(text) == candidate:
                out[size] = {"ids": candidate, "dropped": dropped}
                break
        else:
            raise NoTokenizer(f"the first {size} ids do not decode and re-encode to themselves even after "
                              f"dropping {MAX_DROPPED} trailing ids")
    return out


def side_file(out: Path) -> Path:
    return out.with_name(out.stem + ".prefill-arrays.json")


def run(ctx: Context, s: PrefillSettings) -> None:
    caps = ctx.capabilities()
    local = None
    try:
        try:
            arrays = exact_arrays(ctx.client, s.sizes)
        except NoTokenizer:
            if s.tokenizer is None:
                raise
            local = LocalTokenizer(s.tokenizer)
            arrays = exact_arrays(local, s.sizes)
    except NoTokenizer as err:
        hint = "" if s.tokenizer else " (pass --tokenizer with the model's folder to make the arrays here)"
        ctx.receipt.skip(CHECK, f"{err}{hint}")
        return
    ctx.receipt.aggregates["tokenizer"] = "server" if local is None else f"local {local.path}"
    texts = {n: local.detokenize(a["ids"]) for n, a in arrays.items()} if local is not None else {}
    path = side_file(ctx.out_path)
    write_atomic(path, canonical_json({str(n): a["ids"] for n, a in arrays.items()}))
    ctx.receipt.side_files["prefill_arrays"] = path.name
    ctx.receipt.aggregates["arrays"] = {
        str(n): {"requested": n, "tokens": len(a["ids"]), "dropped": a["dropped"], "token_sha": token_sha(a["ids"]),
                 "sha256": hashlib.sha256(",".join(map(str, a["ids"])).encode()).hexdigest()}
        for n, a in arrays.items()}
    for n, a in arrays.items():
        if a["dropped"]:
            ctx.receipt.warn(CHECK, str(n), f"size {n}: dropped {a['dropped']} trailing ids so the array "
                             "decodes and re-encodes to itself")
    if not caps.dflash:
        ctx.receipt.skip("prefill_drafted", NO_DFLASH)
    if not caps.cached_tokens:
        ctx.receipt.unverify(CHECK, "cached_tokens", NO_CACHED + ", so a cold prompt pass cannot be confirmed")
    modes = {"drafted": True, "plain": False} if caps.dflash else {"plain": None}
    advance = ctx.task("prefill", s.warmup + s.rounds * len(s.sizes) * len(modes))
    first = arrays[s.sizes[0]]["ids"]
    for i in range(s.warmup):
        ctx.send(_request(first, next(iter(modes.values())), texts.get(s.sizes[0])), phase="warmup", size=len(first))
        advance()
    seconds: dict[str, dict[int, list]] = {m: {n: [] for n in s.sizes} for m in modes}
    sources: set[str] = set()
    unconfirmed = False
    ctx.plan(CHECK, [f"size {n}" for n in s.sizes])
    for rnd in range(s.rounds):
        for n in s.sizes:
            ids = arrays[n]["ids"]
            for mode, draft in modes.items():
                rec = ctx.send(_request(ids, draft, texts.get(n)), phase="measure", size=n, round=rnd, mode=mode)
                advance()
                subject = f"size {n} round {rnd} {mode}"
                if rec.status != "ok":
                    ctx.receipt.fail(CHECK, subject, f"{subject}: request {rec.status}: {rec.error}")
                    continue
                if rec.cached_tokens:
                    ctx.receipt.fail(CHECK, subject, f"{subject}: cached_tokens {rec.cached_tokens}, must be 0 "
                                     "(turn the server's prompt cache off: the bundled server's --prompt-cache-gib 0, "
                                     "mlx_lm.server's --prompt-cache-size 0)")
                if rec.prompt_tokens is not None and rec.prompt_tokens != len(ids):
                    ctx.receipt.fail(CHECK, subject, f"{subject}: prompt_tokens {rec.prompt_tokens}, "
                                     f"the array holds {len(ids)}")
                if rec.prompt_tokens is None and local is not None and not unconfirmed:
                    unconfirmed = True
                    ctx.receipt.unverify(CHECK, "prompt_tokens", "the server reports no prompt_tokens, so whether it "
                                         "tokenized the arrays' text to the arrays cannot be confirmed")
                sources.add("server prefill_seconds" if rec.prefill_seconds is not None else "client wall time")
                seconds[mode][n].append(rec.prefill_seconds if rec.prefill_seconds is not None else rec.elapsed)
                _sizes(ctx, seconds, arrays, sources)
            if rnd == s.rounds - 1:
                ctx.reached(f"size {n}")


def _sizes(ctx: Context, seconds: dict[str, dict[int, list]], arrays: dict[int, dict], sources: set[str]) -> None:
    """The summaries after every measurement, so a run cut short keeps (and prints) the sizes it measured."""
    ctx.receipt.aggregates["sizes"] = {
        str(n): {mode: {"seconds": summary(by_size[n]),
                        "tps": summary([len(arrays[n]["ids"]) / t for t in by_size[n] if t])}
                 for mode, by_size in seconds.items()}
        for n in arrays}
    ctx.receipt.aggregates["seconds_source"] = sorted(sources)


def _request(ids: list[int], draft: bool | None, text: str | None = None) -> Request:
    """The array as ids, or as its text when the ids were made here (the text re-encodes to them)."""
    return Request(prompt_id=f"lighthouse-{len(ids)}", prompt=ids if text is None else text, max_tokens=1,
                   temperature=0.0, draft=draft)
