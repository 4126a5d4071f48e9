"""resume: a long prompt served twice with the prompt cache on; the second resumes from the cache
(cached_tokens > 0) and equals the fresh reply, and both equal the drafter-less (`"draft": false`) reply.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.client import Record
from dflash_bench.checks.runner import NO_CACHED, NO_DFLASH, NO_HASH, Context

CHECK = "resumed_equals_fresh"


@dataclass
class ResumeSettings:
    tokens: int = 256
    prompt_id: str | None = None  # default: the longest long prompt


def pick_prompt(s: ResumeSettings) -> prompt_sets.Prompt:
    longs = prompt_sets.long_prompts()
    if s.prompt_id is None:
        return max(longs, key=lambda p: len(p.text))
    for p in longs:
        if p.id == s.prompt_id:
            return p
    raise prompt_sets.BadPromptSet(f"--prompt {s.prompt_id!r} is not one of the long prompts "
                                   f"({', '.join(p.id for p in longs)})")


def run(ctx: Context, s: ResumeSettings) -> None:
    caps = ctx.capabilities()
    if not caps.hashes:
        ctx.receipt.skip(CHECK, NO_HASH)
        return
    if not caps.cached_tokens:
        ctx.receipt.skip(CHECK, NO_CACHED)
        return
    prompt = pick_prompt(s)
    draft = True if caps.dflash else None
    advance = ctx.task("resume", 3 if caps.dflash else 2)
    steps: list[dict] = []
    ctx.receipt.aggregates["steps"] = steps  # filled as it goes, so a cut-short run keeps its steps
    ctx.plan(CHECK, ["fresh", "resumed"])
    if caps.dflash:
        ctx.plan("resumed_equals_plain", ["plain"])

    def step(name: str) -> Record:
        rec = ctx.send(prompt.request(draft=False if name == "plain" else draft, max_tokens=s.tokens), step=name)
        advance()
        steps.append({"step": name, "prompt_id": prompt.id, "prompt_tokens": rec.prompt_tokens,
                      "cached_tokens": rec.cached_tokens, "token_sha": rec.token_sha,
                      "tokens_per_round": rec.tokens_per_round, "status": rec.status})
        return rec

    fresh = step("fresh")
    ctx.reached("fresh")
    resumed = step("resumed")
    cache_on = (ctx.receipt.server.get("settings") or {}).get("prompt_cache_gib")
    if fresh.cached_tokens:
        ctx.receipt.unverify(CHECK, prompt.id, f"the first request already resumed ({fresh.cached_tokens} cached "
                             "tokens): the server held this prompt before the run, so no fresh reply was seen")
    if resumed.status == "ok" and not resumed.cached_tokens:
        if ctx.server.managed and cache_on:
            ctx.receipt.fail(CHECK, prompt.id, f"the second request did not resume (cached_tokens "
                             f"{resumed.cached_tokens}) with --prompt-cache-gib {cache_on}")
        else:
            ctx.receipt.skip(CHECK, "the second request did not resume (cached_tokens 0): is the server's "
                                    "prompt cache on (--prompt-cache-gib)?")
    elif not fresh.cached_tokens:
        ctx.expect_equal(CHECK, prompt.id, resumed, fresh, "resumed and fresh replies")
    ctx.reached("resumed")
    if caps.dflash:
        plain = step("plain")
        ctx.expect_equal("resumed_equals_plain", prompt.id, resumed, plain, "resumed and draft:false replies")
        ctx.reached("plain")
    else:
        ctx.receipt.skip("resumed_equals_plain", NO_DFLASH)
