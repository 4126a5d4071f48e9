"""Rich tables for each receipt kind (what a run prints, and what `show` reprints) and for compare."""

from __future__ import annotations

import os

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from dflash_bench.checks import aggregates as agg
from dflash_bench.checks.compare import VERDICT, CompareResult, digits
from dflash_bench.checks.receipt import BadReceipt, Receipt
from dflash_bench.checks.schema import TrainingReceipt
from dflash_bench.checks.tokens import summary_line as token_summary

MARK = {True: Text("equal", style="green"), False: Text("DIFFER", style="bold red"),
        None: Text("unverified", style="yellow")}


CI_WIDTH = 200  # columns when printing to a pipe or a CI log: wide enough for every table's headers


def console(stderr: bool = False) -> Console:
    """A console for tables: the terminal's width, or CI_WIDTH when not a terminal (rich would cut to 80
    columns and abbreviate exactness's headers to "pro…", "dra…"); COLUMNS, when set, still wins."""
    out = Console(stderr=stderr)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, width=CI_WIDTH)
    return out


def num(value, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def stat(s: agg.Summary | dict | None, digits: int = 1) -> str:
    """'median (±spread%)' for a summary with several values, the median alone for one."""
    if isinstance(s, dict):
        s = agg.Summary.model_validate(s)
    if s is None or s.median is None:
        return "—"
    text = num(s.median, digits)
    if s.n > 1 and s.spread is not None:
        text += f" ±{s.spread:.0%}"
    return text


def gb(value) -> str:
    """Bytes as GB (MB below one GB), as the seed PR's footprint columns."""
    if value is None:
        return "—"
    return f"{value / 1e9:.2f} GB" if value >= 1e9 else f"{value / 1e6:.1f} MB"


def header(r: Receipt) -> Text:
    server = r.server or {}
    state = Text("complete", style="green") if r.complete else Text(f"INCOMPLETE: {r.incomplete_reason}", style="bold red")
    where = server.get("url") or server.get("engine") or "no server"
    text = Text.assemble((r.kind, "bold"), "  ", (where, "cyan"), "  managed" if server.get("managed") else "",
                         "  ", state)
    if server.get("startup_line"):
        text.append(f"\n{server['startup_line']}", style="dim")
    for label, side in (("engine", server), ("plain server", server.get("plain"))):
        adapter = (side or {}).get("adapter")
        if adapter:
            where = f"{side.get('url')}: " if side is not server else ""
            text.append(f"\n{label}: {where}{adapter.get('engine')} ({adapter.get('detected_from')}); "
                        f"evidence: {adapter.get('evidence') or 'none'}", style="dim")
    return text


def verdict(r: Receipt) -> Group:
    lines = [Text("PASSED", style="bold green") if r.passed else
             Text("FAILED" if r.failures else "NOT PASSED", style="bold red" if r.failures else "bold yellow")]
    for label, entries, style in (("failed", r.failures, "red"), ("unverified", r.unverified, "yellow"),
                                  ("warning", r.warnings, "dim")):
        lines += [Text(f"  {label}: {e['message']}", style=style) for e in entries]
    lines += [Text(f"  not run: {e['check']}: {e['reason']}", style="yellow") for e in r.not_run]
    return Group(*lines)


def exactness(a: agg.ExactnessAggregates, r: Receipt) -> Table:
    t = Table(title="drafted vs draft:false (greedy, ignore_eos)")
    t.add_column("prompt", no_wrap=True)
    for col in ("kind", "prompt tok", "drafted sha", "plain sha", "result", "first diff", "evidence",
                "tok/round drafted", "plain", "answer"):
        t.add_column(col)
    for row in a.prompts:
        known = row.known_answer
        t.add_row(row.prompt_id, row.kind, num(row.prompt_tokens), row.drafted_sha or "—", row.plain_sha or "—",
                  MARK[row.equal], num(row.first_diff), row.evidence or "—", num(row.drafted_tokens_per_round, 2),
                  num(row.plain_tokens_per_round, 2),
                  "—" if known is None else Text("right" if known else "wrong", style="green" if known else "red"))
    return t


def concurrent(a: agg.ConcurrentAggregates, r: Receipt) -> Table:
    t = Table(title="concurrent equals solo (alone); solo drafted equals draft:false (serial)")
    for col in ("temperature", "streams", "equal", "failed", "unverified", "aggregate tok/s", "tok/round"):
        t.add_column(col)
    for c in a.cells:
        t.add_row(num(c.temperature), f"x{c.level}", num(c.equal), num(c.failed), num(c.unverified),
                  stat(c.aggregate_tps), stat(c.tokens_per_round, 2))
    for c in a.serial:
        t.add_row(num(c.temperature), "serial", num(c.equal), num(c.failed), num(c.unverified), "", "")
    return t


def resume(a: agg.ResumeAggregates, r: Receipt) -> Table:
    t = Table(title="resumed equals fresh")
    for col in ("step", "prompt", "prompt tok", "cached tok", "token sha", "tok/round", "status"):
        t.add_column(col)
    for s in a.steps:
        t.add_row(s.step, s.prompt_id, num(s.prompt_tokens), num(s.cached_tokens), s.token_sha or "—",
                  num(s.tokens_per_round, 2), s.status)
    return t


def cancel(a: agg.CancelAggregates, r: Receipt) -> Table:
    t = Table(title="after each step, both probes equal their references; memory back at baseline")
    for col in ("step", "code probe", "chat probe", "active memory", "note"):
        t.add_column(col)
    for s in a.steps:
        cells = [Text(p) if isinstance(p, str) else MARK[p.equal] for p in s.probes] + ["—"] * (2 - len(s.probes))
        t.add_row(s.step, *cells[:2], gb(s.memory_bytes), s.note or "")
    return t


def decode(a: agg.DecodeAggregates, r: Receipt) -> Group:
    modes = a.modes
    paired = modes == ["drafted", "plain"]
    t = Table(title="decode tok/s (median ±spread of reps)")
    t.add_column("metric")
    for m in modes:
        t.add_column(m)
    if paired:
        t.add_column("drafted/plain")

    def row(label: str, by_mode: dict, digits: int = 1) -> None:
        """A row of summaries (tok/s) or of plain numbers (tokens a round), with the drafted/plain ratio."""
        cells = [stat(v, digits) if isinstance(v, agg.Summary) else num(v, digits)
                 for v in (by_mode.get(m) for m in modes)]
        if paired:
            d, p = (v.median if isinstance(v, agg.Summary) else v for v in (by_mode.get("drafted"), by_mode.get("plain")))
            cells.append(f"{d / p:.2f}x" if d and p else "—")
        t.add_row(label, *cells)

    for role, by_mode in a.single_tps.items():
        row(f"single stream {role}", by_mode)
    for role, levels in a.aggregate_tps.items():
        for level, by_mode in levels.items():
            row(f"aggregate {role} x{level}", by_mode)
    for role, levels in a.tokens_per_round.items():
        for level, by_mode in levels.items():
            row(f"tokens a round {role} x{level}", by_mode, 2)
    t.add_row("peak footprint", gb(r.server.get("peak_memory_bytes")), *[""] * (len(t.columns) - 2))
    parts: list = [t]
    if a.latency:
        parts.append(latency(a))
    if a.acceptance:
        parts.append(acceptance(a))
    return Group(*parts)


def _pct(p: agg.Percentiles, scale: float = 1000.0, digits: int = 1) -> str:
    """p50 / p90 / p99, by default seconds shown as milliseconds."""
    return " / ".join(num(v * scale if v is not None else None, digits) for v in (p.p50, p.p90, p.p99))


def latency(a: agg.DecodeAggregates) -> Table:
    t = Table(title="client-side latency, ms p50 / p90 / p99 (vLLM bench's TTFT, TPOT, ITL)")
    for col in ("probe", "streams", "mode", "TTFT", "TPOT", "ITL", "chunks"):
        t.add_column(col)
    for role, levels in a.latency.items():
        for level, by_mode in levels.items():
            for mode, lat in by_mode.items():
                t.add_row(role, f"x{level}", mode, _pct(lat.ttft_seconds), _pct(lat.tpot_seconds),
                          _pct(lat.itl_seconds), num(lat.itl_seconds.n))
    return t


def acceptance(a: agg.DecodeAggregates) -> Table:
    t = Table(title="drafted rounds by accepted drafts (histogram), and acceptance by draft position")
    for col in ("probe", "streams", "rounds", "accepted 0, 1, 2, ...", "acceptance by position 1, 2, ..."):
        t.add_column(col)
    for role, levels in a.acceptance.items():
        for level, by_mode in levels.items():
            for acc in by_mode.values():
                t.add_row(role, f"x{level}", num(acc.rounds), " ".join(map(str, acc.histogram)),
                          " ".join("—" if d is None else f"{d:.2f}" for d in acc.by_depth))
    return t


def prefill(a: agg.PrefillAggregates, r: Receipt) -> Table:
    modes = sorted({m for by in a.sizes.values() for m in by})
    t = Table(title="cold prefill: tok/s (seconds), medians of rounds")
    t.add_column("tokens")
    for m in modes:
        t.add_column(m)
    t.add_column("array sha")
    for size, by_mode in a.sizes.items():
        cells = [f"{stat(by_mode[m].tps)} ({stat(by_mode[m].seconds, 3)})" if m in by_mode else "—" for m in modes]
        array = a.arrays.get(size)
        t.add_row(num(array.tokens if array else size), *cells, (array.token_sha or "") if array else "")
    t.add_row("peak footprint", gb(r.server.get("peak_memory_bytes")), *[""] * len(modes))
    return t


def stress(a: agg.StressAggregates, r: Receipt) -> Table:
    c, rss, mem = a.counts, a.rss, a.memory
    t = Table(title="stress: load with random hang-ups; probes unchanged, memory back at baseline")
    for col in ("measure", "value"):
        t.add_column(col)
    errors = ", ".join(f"{k} {v}" for k, v in sorted(c.errors.items())) or "none"
    t.add_row("requests sent / planned", f"{num(c.sent)} / {num(c.planned)}")
    t.add_row("completed / dropped by the client", f"{num(c.completed)} / {num(c.dropped)} "
              f"({num(c.drops_planned)} hang-ups planned)")
    t.add_row("errors", errors)
    t.add_row("5xx", Text(num(c.http_5xx), style="bold red" if c.http_5xx else ""))
    for key, label in (("ttft_seconds", "TTFT s (streamed)"), ("total_seconds", "total s")):
        p = a.latency.get(key) or agg.Percentiles()
        t.add_row(f"{label} p50 / p90 / p99", f"{_pct(p, 1.0, 3)} (n {num(p.n)})")
    t.add_row("server RSS before / peak / after", f"{gb(rss.get('before_bytes'))} / {gb(rss.get('peak_bytes'))} / "
              f"{gb(rss.get('after_bytes'))} ({rss.get('source', '—')})")
    t.add_row("active memory baseline / after", f"{gb(mem.get('baseline_bytes'))} / {gb(mem.get('after_bytes'))}")
    for row in a.probes:
        t.add_row(f"probe {row.prompt_id}", Text.assemble(f"{row.reference or '—'} -> {row.after or '—'} ",
                                                          MARK[row.equal]))
    return t


def suite(a: agg.SuiteAggregates, r: Receipt) -> Table:
    t = Table(title="suite")
    for col in ("check", "receipt", "result", "exit"):
        t.add_column(col)
    for c in a.checks:
        t.add_row(c.kind, c.receipt, c.result, num(c.exit_code))
    return t


def engine_speed(a: agg.EngineSpeedAggregates, r: Receipt) -> Table:
    """Each of our modes per probe and level: tok/s, beside mlx-lm at the level (its own row in receipts
    written before mlx-lm ran at every level), what a round costs against a plain one, the 1 -> N scaling
    and drafted == plain; below, each mode's weights a round reads at least, their ratio to a plain round's in the
    round/plain round column (what that ratio would be at one speed a byte). Old receipts leave the newer parts empty."""
    mode = r.server.get("backend") if r.server else None
    title = "engine speed (tok/s; medians of reps" + (f"; {mode} mode)" if mode else ")")
    sampled = sorted({t for modes in a.probes().values() for cells in modes.values() if isinstance(cells, dict)
                      for c in cells.values() for t in c.equals_plain_sampled}, key=float)
    caption = [a.mlx_lm_note] if a.mlx_lm_note else []
    if sampled:
        caption.append(f"= plain: the greedy reps' tokens, and each stream's at T {', '.join(sampled)} (one untimed pass)")
    t = Table(title=title, caption="; ".join(caption) or None)
    cols = ("probe", "mode", "streams", "aggregate tok/s", "stream tok/s", "mlx-lm tok/s", "ours/mlx-lm",
            "ms a round", "round/plain round", "tokens/round", "1->N", "= plain", "spread")
    for col in cols:
        t.add_column(col, justify="left" if col in ("probe", "mode") else "right")
    for probe, modes in a.probes().items():
        ref = modes.get("mlx-lm")
        for mode, cells in modes.items():
            if isinstance(cells, agg.MlxLmCell):
                t.add_row(probe, "mlx-lm generate", "1", "", num(cells.stream_tok_s.median, 2), "",
                          f"{cells.ours_over_mlx_lm:.2f}", *[""] * 6)
                continue
            if mode == "mlx-lm":
                continue
            for streams, c in cells.items():
                theirs = ref.get(streams) if isinstance(ref, dict) else None
                per_round = c.seconds_per_round.median if c.seconds_per_round else None
                same = plain_verdict(c)
                t.add_row(probe, mode, streams, num(c.aggregate_tok_s.median, 2), num(c.stream_tok_s.median, 2),
                          num(theirs.aggregate_tok_s.median, 2) if theirs else "—", times(c.over_mlx_lm),
                          num(per_round * 1e3 if per_round is not None else None, 2), times(c.round_over_plain),
                          num(c.tokens_per_round.median, 3), times(c.scaling), same or "",
                          f"{c.aggregate_tok_s.spread or 0:.1%}")
    if a.peak_bytes is not None:
        t.add_row("peak footprint", "", "", gb(a.peak_bytes), *[""] * 9)
    plain_bytes = a.weight_bytes.get("plain")
    for mode, size in a.weight_bytes.items():  # beside round/plain round: that ratio at one speed a byte
        if size is not None:
            t.add_row("weights a round reads (at least)", mode, "", gb(size), *[""] * 4,
                      times(size / plain_bytes if plain_bytes else None), *[""] * 4)
    if a.first_request_seconds is not None:
        for mode, seconds in (a.ready_seconds or {"": a.load_seconds}).items():
            t.add_row("ready after", mode, "", f"{seconds:.1f} s", *[""] * 9)
        t.add_row("first request", "", "", f"{a.first_request_seconds:.2f} s", *[""] * 9)
    return t


def plain_verdict(c: agg.SpeedCell) -> Text | None:
    """A drafted cell's "= plain": equal where its greedy tokens and its sampled ones (each temperature's) were
    plain's, else DIFFER naming where; None for a plain cell."""
    if c.equals_plain is None:
        return None
    failed = ([] if c.equals_plain else ["greedy"]) + [f"T {t}" for t, ok in c.equals_plain_sampled.items() if not ok]
    return MARK[True] if not failed else Text(f"DIFFER ({', '.join(failed)})", style="bold red")


def times(value: float | None) -> str:
    """A ratio as '1.23x', or a dash where it was not measured."""
    return "—" if value is None else f"{value:.2f}x"


def plan(a: agg.PlanAggregates, r: Receipt) -> Table:
    """plan --check receipts: their table lives with the check (imported only when shown: it loads MLX)."""
    from dflash_bench.checks import memory

    return memory.table(r)


def selfcheck(a: agg.SelfcheckAggregates, r: Receipt) -> Table:
    """selfcheck receipts: their table lives with the check."""
    from dflash_bench.checks import selfcheck as check

    return check.table(r)


BY_KIND = {"exactness": exactness, "concurrent": concurrent, "resume": resume, "cancel": cancel,
           "decode": decode, "prefill": prefill, "stress": stress, "suite": suite, "plan": plan,
           "engine-speed": engine_speed, "selfcheck": selfcheck}


def render(r: Receipt) -> Group:
    """The receipt's header, its kind's table and its verdict. A receipt whose aggregates break the
    contract (a bug in a writer) still shows its header and verdict, and says what broke."""
    parts: list = [header(r)]
    try:
        typed = r.typed()
    except BadReceipt as err:
        parts.append(Text(f"no table: {err}", style="yellow"))
    else:
        parts.append(BY_KIND[r.kind](typed.aggregates, r))
    parts.append(verdict(r))
    return Group(*parts)


def training(doc: TrainingReceipt) -> Group:
    """A training receipt (tools/train_drafter): each drafter's held-out loss, tokens a round, acceptance."""
    evals = doc.evaluations()
    kinds = sorted({k for e in evals.values() for k in e.tokens_per_round_by_kind})
    t = Table(title=f"{doc.what}: held-out measurements")
    for col in ("drafter", "loss", "sequences", "tok/round", "acceptance by row 1, 2, ...", *kinds):
        t.add_column(col)
    for name, e in evals.items():
        t.add_row(name, num(e.loss, 3), num(e.sequences), num(e.tokens_per_round, 3),
                  " ".join(f"{x:.2f}" for x in e.acceptance_by_row),
                  *[num(e.tokens_per_round_by_kind.get(k), 2) for k in kinds])
    head = Text.assemble(("training", "bold"), "  ", doc.date, "  ", (doc.git_revision or "no revision", "cyan"))
    return Group(head, Text(doc.command, style="dim"), t)


def compare_table(result: CompareResult) -> Group:
    t = Table(title="before / after (median ±spread of reps; * noisy, left out of ratios)")
    for col in ("metric", "row", "mode", "before", "after", "ratio", "note"):
        t.add_column(col)
    for c in result.cells:
        fmt = gb if c.section == "peak footprint" else (lambda s, d=digits(c.section): stat(s, d))
        before = fmt(c.before.median if c.before and fmt is gb else c.before)
        after = fmt(c.after.median if c.after and fmt is gb else c.after)
        if c.noisy:
            before, after = before + "*", after + "*"
        ratio = Text(f"{c.ratio:.2f}x", style="bold red" if c.drop else "") if c.ratio is not None else Text("—")
        t.add_row(c.section, c.row, c.mode, before, after, ratio, c.note)
    lines = [t] if result.cells else []
    if result.tokens:
        changed = result.changed_tokens
        lines.append(Text(token_summary(result.tokens), style="bold red" if changed and result.same_tokens else ""))
        if changed:
            tt = Table(title="requests whose tokens changed (token_sha before -> after)")
            for col in ("receipt", "request", "before", "after"):
                tt.add_column(col)
            for r in changed:
                tt.add_row(r.kind, r.request, r.before, r.after)
            lines.append(tt)
    lines += [Text(f"AFTER failed: {f['receipt']}: {f['message']}", style="red") for f in result.failures]
    lines += [Text(f"incomplete: {line}", style="yellow") for line in result.incomplete]
    style = {0: "green", 1: "bold red", 2: "yellow"}[result.exit_code]
    lines.append(Text(VERDICT[result.exit_code], style=style))
    return Group(*lines)
