"""concurrent: a stream's reply does not depend on what runs beside it.

Stream i of a level always sends the same request (prompt i of the pool, seed base+i), so every
concurrent reply has one solo reply to equal ("alone"); with --serial every solo drafted reply must
also equal the same request with `"draft": false` (in two-server mode, --plain-url, the same request
to the plain server: checks/pair.py). Aggregate tok/s per level comes for free.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.client import Record, Request
from dflash_bench.checks.receipt import summary
from dflash_bench.checks.runner import NO_DFLASH, NO_HASH, Context


@dataclass
class ConcurrentSettings:
    levels: tuple[int, ...] = (1, 4)
    tokens: int = 256
    reps: int = 3
    temperatures: tuple[float, ...] = (0.0, 0.7)
    alone: bool = True
    serial: bool = True
    seed: int = 1234


def stream_requests(s: ConcurrentSettings, temperature: float, count: int, draft: bool | None) -> list[Request]:
    """The requests streams 0..count-1 send: the probes, then the known-answer prompts, in turn."""
    probes = prompt_sets.probes()
    pool = [probes["code"], probes["chat"], *prompt_sets.known_answers()]
    return [pool[i % len(pool)].request(draft=draft, max_tokens=s.tokens, temperature=temperature,
                                        seed=s.seed + i, stream=True) for i in range(count)]


def run(ctx: Context, s: ConcurrentSettings) -> None:
    caps = ctx.capabilities()
    draft = True if caps.dflash else None
    if s.alone and not caps.hashes:
        ctx.receipt.skip("concurrent_equals_solo", NO_HASH)
    if s.serial and not caps.refused and not (caps.drafts and caps.hashes):  # a refusal is filed once, by capabilities()
        ctx.receipt.skip("solo_drafted_equals_plain", NO_DFLASH if not caps.dflash else NO_HASH)
    alone = s.alone and caps.hashes
    serial = s.serial and caps.drafts and caps.hashes
    widest = max(s.levels)
    solo_count = widest * len(s.temperatures) * ((alone or serial) + serial)
    advance = ctx.task("concurrent", solo_count + sum(s.levels) * s.reps * len(s.temperatures))
    cells: list[dict] = []
    serial_cells: list[dict] = []
    ctx.receipt.aggregates.update(cells=cells, serial=serial_cells)  # filled as it goes: a cut-short run keeps them
    ctx.plan("concurrent_equals_solo", [f"T={t} x{level}" for t in s.temperatures for level in s.levels])
    if serial:
        ctx.plan("solo_drafted_equals_plain", [f"T={t} serial" for t in s.temperatures])
    for temperature in s.temperatures:
        solo: list[Record] = []
        if alone or serial:
            for i, req in enumerate(stream_requests(s, temperature, widest, draft)):
                solo.append(ctx.send(req, phase="solo", temperature=temperature, stream_index=i))
                advance()
        if serial:
            serial_cell = {"temperature": temperature, "equal": 0, "failed": 0, "unverified": 0}
            serial_cells.append(serial_cell)
            for i, req in enumerate(stream_requests(s, temperature, widest, False)):
                plain = ctx.send_plain(req, phase="solo-plain", temperature=temperature, stream_index=i)
                advance()
                _count(serial_cell, ctx.expect_equal("solo_drafted_equals_plain", f"T={temperature} stream {i}",
                                                     solo[i], plain, "solo drafted and draft:false replies"))
            ctx.reached(f"T={temperature} serial")
        for level in s.levels:
            cell = {"temperature": temperature, "level": level, "equal": 0, "failed": 0, "unverified": 0,
                    "aggregate_tps": summary([]), "tokens_per_round": summary([])}
            cells.append(cell)
            rates, rounds = [], []
            for rep in range(s.reps):
                records, wall = ctx.send_many(stream_requests(s, temperature, level, draft), phase="concurrent",
                                              temperature=temperature, level=level, rep=rep)
                advance(level)
                rates.append(sum(r.completion_tokens or 0 for r in records) / wall if wall > 0 else None)
                rounds += [r.tokens_per_round for r in records]
                for i, rec in enumerate(records):
                    if rec.status != "ok":
                        ctx.receipt.fail("concurrent_equals_solo", f"T={temperature} x{level} rep {rep} stream {i}",
                                         f"request {rec.status}: {rec.error}")
                    elif alone:
                        _count(cell, ctx.expect_equal("concurrent_equals_solo",
                                                      f"T={temperature} x{level} rep {rep} stream {i}",
                                                      rec, solo[i], "concurrent and solo replies"))
                cell["aggregate_tps"] = summary(rates)
                cell["tokens_per_round"] = summary(rounds)
            ctx.reached(f"T={temperature} x{level}")


def _count(cell: dict, cmp) -> None:
    key = {True: "equal", False: "failed", None: "unverified"}[cmp.equal]
    cell[key] += 1
