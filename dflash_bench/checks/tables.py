"""Rich tables for each receipt kind (what a run prints, and what `show` reprints) and for compare."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from dflash_bench.checks.compare import CompareResult
from dflash_bench.checks.receipt import Receipt

MARK = {True: Text("equal", style="green"), False: Text("DIFFER", style="bold red"),
        None: Text("unverified", style="yellow")}


def num(value, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def stat(s: dict | None, digits: int = 1) -> str:
    """'median (±spread%)' for a summary with several values, the median alone for one."""
    if not s or s.get("median") is None:
        return "—"
    text = num(s["median"], digits)
    if s.get("n", 0) > 1 and s.get("spread") is not None:
        text += f" ±{s['spread']:.0%}"
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


def exactness(r: Receipt) -> Table:
    t = Table(title="drafted vs draft:false (greedy, ignore_eos)")
    t.add_column("prompt", no_wrap=True)
    for col in ("kind", "prompt tok", "drafted sha", "plain sha", "result", "first diff", "evidence",
                "tok/round drafted", "plain", "answer"):
        t.add_column(col)
    for row in r.aggregates.get("prompts", []):
        known = row.get("known_answer")
        t.add_row(row["prompt_id"], row["kind"], num(row.get("prompt_tokens")), row.get("drafted_sha") or "—",
                  row.get("plain_sha") or "—", MARK[row.get("equal")], num(row.get("first_diff")),
                  row.get("evidence") or "—", num(row.get("drafted_tokens_per_round"), 2), num(row.get("plain_tokens_per_round"), 2),
                  "—" if known is None else Text("right" if known else "wrong", style="green" if known else "red"))
    return t


def concurrent(r: Receipt) -> Table:
    t = Table(title="concurrent equals solo (alone); solo drafted equals draft:false (serial)")
    for col in ("temperature", "streams", "equal", "failed", "unverified", "aggregate tok/s", "tok/round"):
        t.add_column(col)
    for c in r.aggregates.get("cells", []):
        t.add_row(num(c["temperature"]), f"x{c['level']}", num(c["equal"]), num(c["failed"]), num(c["unverified"]),
                  stat(c.get("aggregate_tps")), stat(c.get("tokens_per_round"), 2))
    for c in r.aggregates.get("serial", []):
        t.add_row(num(c["temperature"]), "serial", num(c["equal"]), num(c["failed"]), num(c["unverified"]), "", "")
    return t


def resume(r: Receipt) -> Table:
    t = Table(title="resumed equals fresh")
    for col in ("step", "prompt", "prompt tok", "cached tok", "token sha", "tok/round", "status"):
        t.add_column(col)
    for s in r.aggregates.get("steps", []):
        t.add_row(s["step"], s["prompt_id"], num(s.get("prompt_tokens")), num(s.get("cached_tokens")),
                  s.get("token_sha") or "—", num(s.get("tokens_per_round"), 2), s["status"])
    return t


def cancel(r: Receipt) -> Table:
    t = Table(title="after each step, both probes equal their references; memory back at baseline")
    for col in ("step", "code probe", "chat probe", "active memory", "note"):
        t.add_column(col)
    for s in r.aggregates.get("steps", []):
        probes = s.get("probes", [])
        cells = [Text(p) if isinstance(p, str) else MARK[p.get("equal")] for p in probes] + ["—"] * (2 - len(probes))
        t.add_row(s["step"], *cells[:2], gb(s.get("memory_bytes")), s.get("note") or "")
    return t


def decode(r: Receipt) -> Table:
    a = r.aggregates
    modes = a.get("modes", [])
    t = Table(title="decode tok/s (median ±spread of reps)")
    t.add_column("metric")
    for m in modes:
        t.add_column(m)
    if modes == ["drafted", "plain"]:
        t.add_column("drafted/plain")
    def row(label: str, by_mode: dict, digits: int = 1, is_stat: bool = True) -> None:
        cells = [stat(by_mode.get(m), digits) if is_stat else num(by_mode.get(m), digits) for m in modes]
        if modes == ["drafted", "plain"]:
            d, p = by_mode.get("drafted"), by_mode.get("plain")
            d, p = (d or {}).get("median") if is_stat else d, (p or {}).get("median") if is_stat else p
            cells.append(f"{d / p:.2f}x" if d and p else "—")
        t.add_row(label, *cells)
    for role, by_mode in a.get("single_tps", {}).items():
        row(f"single stream {role}", by_mode)
    for role, levels in a.get("aggregate_tps", {}).items():
        for level, by_mode in levels.items():
            row(f"aggregate {role} x{level}", by_mode)
    for role, levels in a.get("tokens_per_round", {}).items():
        for level, by_mode in levels.items():
            row(f"tokens a round {role} x{level}", by_mode, 2, is_stat=False)
    t.add_row("peak footprint", gb(r.server.get("peak_memory_bytes")), *[""] * (len(t.columns) - 2))
    return t


def prefill(r: Receipt) -> Table:
    sizes = r.aggregates.get("sizes", {})
    arrays = r.aggregates.get("arrays", {})
    modes = sorted({m for by in sizes.values() for m in by})
    t = Table(title="cold prefill: tok/s (seconds), medians of rounds")
    t.add_column("tokens")
    for m in modes:
        t.add_column(m)
    t.add_column("array sha")
    for size, by_mode in sizes.items():
        cells = [f"{stat(by_mode[m]['tps'])} ({stat(by_mode[m]['seconds'], 3)})" if m in by_mode else "—"
                 for m in modes]
        t.add_row(num(arrays.get(size, {}).get("tokens", size)), *cells, arrays.get(size, {}).get("token_sha", ""))
    t.add_row("peak footprint", gb(r.server.get("peak_memory_bytes")), *[""] * len(modes))
    return t


def stress(r: Receipt) -> Table:
    a = r.aggregates
    c, lat, rss, mem = a.get("counts", {}), a.get("latency", {}), a.get("rss", {}), a.get("memory", {})
    t = Table(title="stress: load with random hang-ups; probes unchanged, memory back at baseline")
    for col in ("measure", "value"):
        t.add_column(col)
    errors = ", ".join(f"{k} {v}" for k, v in sorted((c.get("errors") or {}).items())) or "none"
    t.add_row("requests sent / planned", f"{num(c.get('sent'))} / {num(c.get('planned'))}")
    t.add_row("completed / dropped by the client", f"{num(c.get('completed'))} / {num(c.get('dropped'))} "
              f"({num(c.get('drops_planned'))} hang-ups planned)")
    t.add_row("errors", errors)
    t.add_row("5xx", Text(num(c.get("http_5xx")), style="bold red" if c.get("http_5xx") else ""))
    for key, label in (("ttft_seconds", "TTFT s (streamed)"), ("total_seconds", "total s")):
        p = lat.get(key) or {}
        t.add_row(f"{label} p50 / p90 / p99", f"{num(p.get('p50'), 3)} / {num(p.get('p90'), 3)} / "
                  f"{num(p.get('p99'), 3)} (n {num(p.get('n'))})")
    t.add_row("server RSS before / peak / after", f"{gb(rss.get('before_bytes'))} / {gb(rss.get('peak_bytes'))} / "
              f"{gb(rss.get('after_bytes'))} ({rss.get('source', '—')})")
    t.add_row("active memory baseline / after", f"{gb(mem.get('baseline_bytes'))} / {gb(mem.get('after_bytes'))}")
    for row in a.get("probes", []):
        t.add_row(f"probe {row['prompt_id']}", Text.assemble(f"{row.get('reference') or '—'} -> "
                                                             f"{row.get('after') or '—'} ", MARK[row.get("equal")]))
    return t


def suite(r: Receipt) -> Table:
    t = Table(title="suite")
    for col in ("check", "receipt", "result", "exit"):
        t.add_column(col)
    for c in r.aggregates.get("checks", []):
        t.add_row(c["kind"], c["receipt"], c["result"], num(c["exit_code"]))
    return t


BY_KIND = {"exactness": exactness, "concurrent": concurrent, "resume": resume, "cancel": cancel,
           "decode": decode, "prefill": prefill, "stress": stress, "suite": suite}


def plan(r: Receipt) -> Table:
    """plan --check receipts: their table lives with the check (imported only when shown: it loads MLX)."""
    from dflash_bench.checks import memory

    return memory.table(r)


BY_KIND["plan"] = plan


def selfcheck(r: Receipt) -> Table:
    """selfcheck receipts: their table lives with the check."""
    from dflash_bench.checks import selfcheck as check

    return check.table(r)


BY_KIND["selfcheck"] = selfcheck


def render(r: Receipt) -> Group:
    """The receipt's header, its kind's table and its verdict."""
    parts = [header(r)]
    if r.kind in BY_KIND:
        parts.append(BY_KIND[r.kind](r))
    parts.append(verdict(r))
    return Group(*parts)


def compare_table(result: CompareResult) -> Group:
    t = Table(title="before / after (median ±spread of reps; * noisy, left out of ratios)")
    for col in ("metric", "row", "mode", "before", "after", "ratio", "note"):
        t.add_column(col)
    for c in result.cells:
        digits = 2 if c.section == "tokens per round" else 3 if "seconds" in c.section else 1
        fmt = gb if c.section == "peak footprint" else (lambda s, d=digits: stat(s, d))
        before = fmt(c.before["median"] if c.before and fmt is gb else c.before)
        after = fmt(c.after["median"] if c.after and fmt is gb else c.after)
        if c.noisy:
            before, after = before + "*", after + "*"
        ratio = Text(f"{c.ratio:.2f}x", style="bold red" if c.drop else "") if c.ratio is not None else Text("—")
        t.add_row(c.section, c.row, c.mode, before, after, ratio, c.note)
    lines = [t]
    lines += [Text(f"AFTER failed: {f['receipt']}: {f['message']}", style="red") for f in result.failures]
    lines += [Text(f"incomplete: {line}", style="yellow") for line in result.incomplete]
    verdict_text = {0: ("no drop beyond the runs' spread; AFTER has no failures", "green"),
                    1: ("FAILED: a drop beyond the runs' spread or a failure in AFTER", "bold red"),
                    2: ("incomplete receipts: see above", "yellow")}[result.exit_code]
    lines.append(Text(verdict_text[0], style=verdict_text[1]))
    return Group(*lines)
