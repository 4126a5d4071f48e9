"""exactness: every prompt drafted and with `"draft": false` (greedy, ignore_eos) gives the same tokens.

In two-server mode (--plain-url, checks/pair.py) the plain reply comes from the second server, and
each row says what the comparison rests on (token ids, token pieces or re-tokenized text).

Prompts: the known-answer questions (each also checked for its expected answer), the code and chat
probes, and prompts longer than the drafter's sliding window (so its full layer is exercised).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_bench.checks import pair
from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.runner import NO_DFLASH, NO_HASH, Context

CHECK = "drafted_equals_plain"


@dataclass
class ExactnessSettings:
    known_tokens: int = 64
    probe_tokens: int = 256
    long_tokens: int = 256
    window: int = 512


def prompt_list(s: ExactnessSettings) -> list[tuple[prompt_sets.Prompt, int]]:
    probes = prompt_sets.probes()
    return ([(p, s.known_tokens) for p in prompt_sets.known_answers()]
            + [(probes["code"], s.probe_tokens), (probes["chat"], s.probe_tokens)]
            + [(p, s.long_tokens) for p in prompt_sets.long_prompts()])


def run(ctx: Context, s: ExactnessSettings) -> None:
    caps = ctx.capabilities()
    compare = caps.drafts and caps.hashes
    if caps.refused:
        pass  # capabilities() filed the refusal as not run
    elif not caps.dflash and not caps.two_server:
        ctx.receipt.skip(CHECK, NO_DFLASH)
    elif not caps.hashes:
        ctx.receipt.skip(CHECK, NO_HASH)
    items = prompt_list(s)
    advance = ctx.task("exactness", len(items) * (2 if compare else 1))
    ctx.plan(CHECK, [prompt.id for prompt, _ in items])
    rows: list[dict] = []
    _totals(ctx, rows)
    for prompt, max_tokens in items:
        drafted = ctx.send(prompt.request(draft=True if caps.dflash else None, max_tokens=max_tokens),
                           mode="drafted" if caps.dflash else "default", kind=prompt.kind)
        advance()
        row = {"prompt_id": prompt.id, "kind": prompt.kind, "prompt_tokens": drafted.prompt_tokens,
               "completion_tokens": drafted.completion_tokens, "drafted_sha": drafted.token_sha,
               "drafted_tokens_per_round": drafted.tokens_per_round, "equal": None, "first_diff": None}
        if drafted.status != "ok" and not compare:
            ctx.receipt.fail(CHECK, prompt.id, f"{prompt.id}: drafted request {drafted.status}: {drafted.error}")
        if compare:
            plain = ctx.send_plain(prompt.request(draft=False, max_tokens=max_tokens), mode="plain",
                                   kind=prompt.kind)
            advance()
            what = "the drafted server's and the plain server's replies" if caps.two_server \
                else "drafted and plain replies"
            cmp = ctx.expect_equal(CHECK, prompt.id, drafted, plain, what)
            row.update(plain_sha=plain.token_sha, plain_tokens_per_round=plain.tokens_per_round,
                       equal=cmp.equal, first_diff=cmp.index, evidence=pair.evidence(drafted, plain))
            if (plain.drafted or 0) > 0 or (plain.tokens_per_round or 0) > 1.0:
                ctx.receipt.fail(CHECK, prompt.id, f"{prompt.id}: the draft:false reply reports {plain.drafted} "
                                 f"drafted tokens and {plain.tokens_per_round} tokens a round: the server drafted anyway")
        if prompt.expect is not None:
            row["known_answer"] = _known_answer(ctx, prompt, drafted.text)
        if prompt.kind == "long" and drafted.prompt_tokens is not None and drafted.prompt_tokens <= s.window:
            ctx.receipt.warn(CHECK, prompt.id, f"{prompt.id}: {drafted.prompt_tokens} prompt tokens do not pass the "
                             f"drafter's {s.window}-token window (--window)")
        rows.append(row)
        _totals(ctx, rows)
        ctx.reached(prompt.id)


def _totals(ctx: Context, rows: list[dict]) -> None:
    """The aggregates after each prompt, so a run cut short keeps (and prints) the prompts it compared."""
    known = [r["known_answer"] for r in rows if "known_answer" in r]
    ctx.receipt.aggregates.update(
        prompts=rows,
        equal=sum(r["equal"] is True for r in rows), compared=sum(r["equal"] is not None for r in rows),
        differ=sum(r["equal"] is False for r in rows), evidence=pair.weakest(rows),
        known_answers={"right": sum(known), "asked": len(known)},
    )


def verified_as(model: str | None, dtype: str | None) -> str | None:
    """The name a prompt's `verified_with` gives a model served in `dtype`: the model's name for float32 (or a server
    that names no dtype), else the name and the dtype, "SmolLM2-135M-Instruct (bfloat16)". A greedy reply can turn on
    a last bit (session 50: mlx-lm's own bf16 forward misses 4 of the 10 answers float32 gets right), so an answer
    holds as verified only in the arithmetic it was seen in."""
    if model is None or dtype in (None, "float32"):
        return model
    return f"{model} ({dtype})"


def _known_answer(ctx: Context, prompt: prompt_sets.Prompt, text: str) -> bool:
    """A miss fails only against a model (in its dtype: `verified_as`) the prompt was verified with; against others
    it is a warning."""
    right = prompt.expect.lower() in text.lower()
    if not right:
        model = verified_as(ctx.receipt.server.get("target") or ctx.client.model, ctx.receipt.server.get("dtype"))
        message = f"{prompt.id}: expected {prompt.expect!r} in the answer, got {text[:80]!r}"
        if model in prompt.verified_with:
            ctx.receipt.fail("known_answers", prompt.id, message)
        else:
            named = f"model {model!r}" if model else "the server's model, which it does not name"
            ctx.receipt.warn("known_answers", prompt.id, f"{message} (not verified with {named})")
    return right
