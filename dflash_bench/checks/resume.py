"""resume: a long prompt served twice with the prompt cache on; the second resumes from the cache
(cached_tokens > 0) and equals the fresh reply, and both equal the drafter-less (`"draft": false`) reply.

Any engine: on a server that does not report cached_tokens (llama-cpp-python) the repeated request is
still compared with the first on tokens, with a warning that the cache's part is not shown; in
two-server mode (--plain-url, checks/pair.py) the plain reply comes from the second server.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_bench.checks import pair
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
        ctx.receipt.warn(CHECK, "server", f"{NO_CACHED}: whether the repeated request resumed from a cache is "
                         "not shown; it is compared with the first all the same")
    prompt = pick_prompt(s)
    draft = True if caps.dflash else None
    with_plain = caps.dflash or caps.two_server
    advance = ctx.task("resume", 3 if with_plain else 2)
    steps: list[dict] = []
    ctx.receipt.aggregates["steps"] = steps  # filled as it goes, so a cut-short run keeps its steps
    ctx.plan(CHECK, ["fresh", "resumed"])
    if with_plain:
        ctx.plan("resumed_equals_plain", ["plain"])

    def step(name: str) -> Record:
        send = ctx.send_plain if name == "plain" else ctx.send
        rec = send(prompt.request(draft=False if name == "plain" else draft, max_tokens=s.tokens), step=name)
        advance()
        steps.append({"step": name, "prompt_id": prompt.id, "prompt_tokens": rec.prompt_tokens,
                      "cached_tokens": rec.cached_tokens, "token_sha": rec.token_sha,
                      "completion_tokens": rec.completion_tokens, "evidence": rec.evidence,
                      "tokens_per_round": rec.tokens_per_round, "status": rec.status})
        return rec

    fresh = step("fresh")
    ctx.reached("fresh")
    resumed = step("resumed")
    cache_on = (ctx.receipt.server.get("settings") or {}).get("prompt_cache_gib")
    if fresh.cached_tokens:
        ctx.receipt.unverify(CHECK, prompt.id, f"the first request already resumed ({fresh.cached_tokens} cached "
                             "tokens): the server held this prompt before the run, so no fresh reply was seen")
    if resumed.status == "ok" and caps.cached_tokens and not resumed.cached_tokens:
        if ctx.server.managed and cache_on:
            ctx.receipt.fail(CHECK, prompt.id, f"the second request did not resume (cached_tokens "
                             f"{resumed.cached_tokens}) with --prompt-cache-gib {cache_on}")
        else:
            ctx.receipt.skip(CHECK, "the second request did not resume (cached_tokens 0): is the server's "
                                    "prompt cache on (--prompt-cache-gib)?")
    elif not fresh.cached_tokens:
        cmp = ctx.expect_equal(CHECK, prompt.id, resumed, fresh, "resumed and fresh replies" if caps.cached_tokens
                               else "repeated and first replies (the server reports no cached_tokens)")
        ctx.receipt.aggregates.update(equal=cmp.equal, first_diff=cmp.index, evidence=pair.evidence(resumed, fresh))
    ctx.reached("resumed")
    if with_plain:
        plain = step("plain")
        ctx.expect_equal("resumed_equals_plain", prompt.id, resumed, plain, "resumed and draft:false replies")
        ctx.reached("plain")
    else:
        ctx.receipt.skip("resumed_equals_plain", NO_DFLASH)
