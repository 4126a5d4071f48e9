"""decode: how fast replies come, drafted and plain side by side in one server.

Per probe (code, chat) and level L: L copies of the probe sent at once, `reps` times, each rep
drafted then plain (the same requests with `"draft": false`), so slow drift hits both modes alike.
Single-stream tok/s is the client's decode rate of the level-1 replies (tokens after the first
chunk over the time after it); aggregate tok/s is all completion tokens over the wall time.
Latency is vLLM bench's, client side, per cell: TTFT, TPOT and ITL (gaps between streamed chunks)
p50/p90/p99; acceptance sums the replies' `dflash` histograms (engine/reply_block.py).
Tokens a round come from each reply (our `dflash` block, llama.cpp's `timings`, SGLang's verify
count) or, for vLLM, from its /metrics spec-decode counters taken before and after each cell
(checks/adapters.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dflash_bench.checks import adapters
from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.client import Record
from dflash_bench.checks.receipt import percentiles, summary
from dflash_bench.checks.runner import NO_DFLASH, Context


@dataclass
class DecodeSettings:
    levels: tuple[int, ...] = (1, 4)
    tokens: int = 256
    reps: int = 3
    temperature: float = 0.0


def run(ctx: Context, s: DecodeSettings) -> None:
    caps = ctx.capabilities()
    modes = {"drafted": True, "plain": False} if caps.drafts else {"plain": None}
    if caps.refused:
        pass  # capabilities() filed the refusal as not run: drafted decode would be plain decode
    elif not caps.dflash:
        ctx.receipt.skip("decode_drafted", NO_DFLASH)
    probes = prompt_sets.probes()
    advance = ctx.task("decode", len(probes) * sum(s.levels) * s.reps * len(modes))
    single: dict = {role: {m: [] for m in modes} for role in probes}
    agg: dict = {role: {L: {m: [] for m in modes} for L in s.levels} for role in probes}
    rounds: dict = {role: {L: {m: [] for m in modes} for L in s.levels} for role in probes}
    first: dict[tuple[str, str], Record] = {}
    replies: dict = {role: {L: {m: [] for m in modes} for L in s.levels} for role in probes}
    ctx.plan("decode", [f"{role} x{level}" for role in probes for level in s.levels])
    for role, probe in probes.items():
        for level in s.levels:
            for rep in range(s.reps):
                for mode, draft in modes.items():
                    req = probe.request(draft=draft, max_tokens=s.tokens, temperature=s.temperature, stream=True)
                    before = ctx.client.spec_counters()
                    records, wall = ctx.send_many([req] * level, probe=role, level=level, rep=rep, mode=mode)
                    server_rounds = adapters.tokens_per_round(before, ctx.client.spec_counters())
                    advance(level)
                    for rec in records:
                        if rec.status != "ok":
                            ctx.receipt.fail("decode", f"{role} x{level} rep {rep} {mode}",
                                             f"request {rec.status}: {rec.error}")
                    agg[role][level][mode].append(sum(r.completion_tokens or 0 for r in records) / wall)
                    rounds[role][level][mode] += [r.tokens_per_round for r in records] if server_rounds is None \
                        else [server_rounds]
                    replies[role][level][mode] += [r for r in records if r.ok]
                    if level == 1:
                        single[role][mode].append(records[0].decode_tps)
                        first.setdefault((role, mode), records[0])
                    _aggregates(ctx, list(modes), single, agg, rounds, probes)
                    _latency(ctx, replies)
            ctx.reached(f"{role} x{level}")
        if caps.dflash and (role, "drafted") in first:
            ctx.expect_equal("drafted_equals_plain", probe.id, first[(role, "drafted")], first[(role, "plain")],
                             "drafted and plain replies")


def _aggregates(ctx: Context, modes: list[str], single: dict, agg: dict, rounds: dict, probes: dict) -> None:
    """The summaries after every measurement, so a run cut short keeps (and prints) what it measured."""
    ctx.receipt.aggregates.update(
        modes=modes,
        single_tps={r: {m: summary(v) for m, v in by.items()} for r, by in single.items()},
        aggregate_tps={r: {str(L): {m: summary(v) for m, v in by.items()} for L, by in lv.items()}
                       for r, lv in agg.items()},
        tokens_per_round={r: {str(L): {m: _median(v) for m, v in by.items()} for L, by in lv.items()}
                          for r, lv in rounds.items()},
        probes={role: p.id for role, p in probes.items()},
    )


def _latency(ctx: Context, replies: dict) -> None:
    """Per cell: TTFT, TPOT and ITL percentiles over its replies, and their rounds' acceptance."""
    latency: dict = {}
    acceptance: dict = {}
    for role, levels in replies.items():
        for level, by_mode in levels.items():
            for mode, recs in by_mode.items():
                if not recs:
                    continue
                latency.setdefault(role, {}).setdefault(str(level), {})[mode] = {
                    "ttft_seconds": percentiles(r.ttft for r in recs),
                    "tpot_seconds": percentiles(r.tpot for r in recs),
                    "itl_seconds": percentiles(gap for r in recs for gap in r.itl)}
                if any(r.acceptance_histogram for r in recs):
                    acceptance.setdefault(role, {}).setdefault(str(level), {})[mode] = _acceptance(recs)
    ctx.receipt.aggregates.update(latency=latency, acceptance=acceptance)


def _acceptance(recs: list[Record]) -> dict:
    """The replies' round counts summed: rounds by accepted drafts, and per draft position the share of
    the rounds that drafted it which accepted it (a round accepting k drafts accepted positions 1..k)."""
    hist = _sum([r.acceptance_histogram or [] for r in recs])
    drafted = _sum([r.drafted_by_depth or [] for r in recs])
    by_depth = [sum(hist[d + 1:]) / n if n else None for d, n in enumerate(drafted)]
    return {"histogram": hist, "rounds": sum(hist), "by_depth": by_depth}


def _sum(lists: list[list[int]]) -> list[int]:
    """Element-wise sum of lists of different lengths."""
    out: list[int] = []
    for values in lists:
        out.extend([0] * (len(values) - len(out)))
        for i, v in enumerate(values):
            out[i] += v
    return out


def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None
