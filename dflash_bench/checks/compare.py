"""compare BEFORE AFTER: the seed PR's before/after tables, from receipts, with ratios.

The rule (also in `dflash-bench compare --help`):
- a cell is noisy when either run's spread, (max - min) / median of its reps, exceeds --noise; a noisy
  cell is marked and left out of the ratios and of the verdict;
- a speed cell (tok/s) is a drop when AFTER's median is below BEFORE's by more than the larger of
  the two runs' own spreads (max - min); a cell with fewer than two reps on either side has no
  spread and is never called a drop;
- tokens per round, peak footprint, engine-speed's round over a plain round and mlx-lm's tok/s (the same
  weights through another engine on each side's machine: how far the machine moved) are shown with ratios
  but never fail;
- any verdict failure in AFTER's receipts (drafted != plain, concurrent != solo, ...) fails the comparison;
- every request both sides ran is paired by what it asked, and its tokens are the same or changed (checks/tokens.py:
  exactness, concurrent, decode and engine-speed receipts alike); with --same-tokens a changed one fails.
Exit codes: 1 on a drop, a failure in AFTER or (--same-tokens) a request whose tokens changed, 2 if a receipt on
either side is incomplete, else 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from dflash_bench.checks import aggregates as agg
from dflash_bench.checks import tokens as token_ids
from dflash_bench.checks.receipt import BadReceipt, Receipt, summary
from dflash_bench.checks.schema import COMPARE_SCHEMA, CompareDoc


@dataclass
class Cell:
    section: str
    row: str
    mode: str
    before: agg.Summary | None
    after: agg.Summary | None
    judged: bool
    noisy: bool = False
    ratio: float | None = None
    drop: bool = False
    note: str = ""

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(before=self.before.model_dump() if self.before else None,
                   after=self.after.model_dump() if self.after else None)
        return out


@dataclass
class CompareResult:
    before: list[str]
    after: list[str]
    noise: float
    cells: list[Cell] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    tokens: list[token_ids.TokenRow] = field(default_factory=list)
    same_tokens: bool = False  # a request whose tokens changed fails the comparison

    @property
    def drops(self) -> list[Cell]:
        return [c for c in self.cells if c.drop]

    @property
    def changed_tokens(self) -> list[token_ids.TokenRow]:
        return [r for r in self.tokens if r.changed]

    @property
    def exit_code(self) -> int:
        if self.failures or self.drops or (self.same_tokens and self.changed_tokens):
            return 1
        return 2 if self.incomplete else 0

    def to_dict(self) -> dict:
        return {"schema": COMPARE_SCHEMA, "schema_version": 1, "before": self.before, "after": self.after,
                "noise": self.noise, "cells": [c.to_dict() for c in self.cells], "failures": self.failures,
                "drops": [f"{c.section} {c.row} {c.mode}" for c in self.drops],
                "incomplete": self.incomplete, "tokens": [r.to_dict() for r in self.tokens],
                "tokens_changed": [f"{r.kind} {r.request}" for r in self.changed_tokens],
                "same_tokens": self.same_tokens, "exit_code": self.exit_code}

    @classmethod
    def from_doc(cls, doc: CompareDoc) -> CompareResult:
        """A comparison written earlier (`compare --out`), to show again."""
        cells = [Cell(**{f.name: getattr(c, f.name) for f in fields(Cell)}) for c in doc.cells]
        rows = [token_ids.TokenRow(r.kind, r.request, r.before, r.after) for r in doc.tokens]
        return cls(doc.before, doc.after, doc.noise, cells, doc.failures, doc.incomplete, rows, doc.same_tokens)


def load_side(path: Path, label: str) -> dict[str, tuple[Path, Receipt]]:
    """A receipt file, or a folder of them (a suite): {kind: (path, receipt)}."""
    path = Path(path)
    if path.is_dir():
        out: dict[str, tuple[Path, Receipt]] = {}
        for file in sorted(path.glob("*.json")):
            try:
                receipt = Receipt.load(file)
            except BadReceipt:
                continue  # side files (prefill arrays) live beside receipts
            if receipt.kind in out:
                raise BadReceipt(f"{label} folder {path} holds two {receipt.kind} receipts: "
                                 f"{out[receipt.kind][0].name} and {file.name}")
            out[receipt.kind] = (file, receipt)
        if not out:
            raise BadReceipt(f"{label} folder {path} holds no receipts")
        return out
    receipt = Receipt.load(path)
    return {receipt.kind: (path, receipt)}


def _single(value: float | None) -> agg.Summary | None:
    return agg.Summary.model_validate(summary([value])) if value is not None else None


def _pick(by_mode: dict, mode: str) -> tuple[agg.Summary | float | None, str]:
    """A side's cell for `mode`; a side without drafted numbers (no drafter) stands in with plain."""
    if mode in by_mode:
        return by_mode[mode], ""
    if mode == "drafted" and "plain" in by_mode:
        return by_mode["plain"], "plain"
    return None, ""


def _mode_cells(section: str, row: str, before: dict, after: dict, judged: bool, wrap=lambda v: v) -> list[Cell]:
    cells = []
    for mode in [m for m in ("drafted", "plain") if m in before or m in after]:
        b, b_note = _pick(before, mode)
        a, a_note = _pick(after, mode)
        note = "; ".join(f"{side} has no drafted run: its plain run stands in"
                         for side, n in (("before", b_note), ("after", a_note)) if n)
        cells.append(Cell(section, row, mode, wrap(b), wrap(a), judged, note=note))
    return cells


def _levels(b: dict, a: dict, role: str) -> list[str]:
    return sorted(set(b.get(role, {})) | set(a.get(role, {})), key=int)


def decode_cells(before: Receipt, after: Receipt) -> list[Cell]:
    b: agg.DecodeAggregates = before.typed().aggregates
    a: agg.DecodeAggregates = after.typed().aggregates
    cells = []
    for role in sorted(set(b.single_tps) | set(a.single_tps)):
        cells += _mode_cells("single-stream tok/s", role, b.single_tps.get(role, {}), a.single_tps.get(role, {}), True)
    for role in sorted(set(b.aggregate_tps) | set(a.aggregate_tps)):
        for level in _levels(b.aggregate_tps, a.aggregate_tps, role):
            cells += _mode_cells("aggregate tok/s", f"{role} x{level}", b.aggregate_tps.get(role, {}).get(level, {}),
                                 a.aggregate_tps.get(role, {}).get(level, {}), True)
    for role in sorted(set(b.tokens_per_round) | set(a.tokens_per_round)):
        for level in _levels(b.tokens_per_round, a.tokens_per_round, role):
            cells += _mode_cells("tokens per round", f"{role} x{level}",
                                 b.tokens_per_round.get(role, {}).get(level, {}),
                                 a.tokens_per_round.get(role, {}).get(level, {}), False, _single)
    cells.append(Cell("peak footprint", "decode", "-", _single(before.server.get("peak_memory_bytes")),
                      _single(after.server.get("peak_memory_bytes")), False))
    return cells


def prefill_cells(before: Receipt, after: Receipt) -> list[Cell]:
    b = before.typed().aggregates.sizes
    a = after.typed().aggregates.sizes
    cells = []
    for size in sorted(set(b) | set(a), key=int):
        for metric, judged in (("tps", True), ("seconds", False)):
            bm = {m: getattr(v, metric) for m, v in b.get(size, {}).items()}
            am = {m: getattr(v, metric) for m, v in a.get(size, {}).items()}
            cells += _mode_cells(f"prefill {'tok/s' if judged else 'seconds'}", size, bm, am, judged)
    cells.append(Cell("peak footprint", "prefill", "-", _single(before.server.get("peak_memory_bytes")),
                      _single(after.server.get("peak_memory_bytes")), False))
    return cells


def _by_level(cells: object) -> dict[str, agg.SpeedCell]:
    """A mode's cells by level; an older receipt's one-stream mlx-lm cell (MlxLmCell) has no levels."""
    return cells if isinstance(cells, dict) else {}


def engine_speed_cells(before: Receipt, after: Receipt) -> list[Cell]:
    """engine-speed: each probe's modes at each level, aggregate tok/s (judged) and a round's seconds over a
    plain round's (shown); then mlx-lm's tok/s on each side's machine, shown and never judged: the same
    weights through another engine, so a move in it is the machine's, which a reviewer reads ours against."""
    b = before.typed().aggregates.probes()
    a = after.typed().aggregates.probes()
    cells = []
    for probe in sorted(set(b) | set(a)):
        bp, ap = b.get(probe, {}), a.get(probe, {})
        modes = sorted(set(bp) | set(ap), key=lambda m: (m == "mlx-lm", m != "plain", m))
        for mode in modes:
            bm, am = _by_level(bp.get(mode)), _by_level(ap.get(mode))
            for level in sorted(set(bm) | set(am), key=int):
                bc, ac = bm.get(level), am.get(level)
                row = f"{probe} x{level}"
                if mode == "mlx-lm":
                    cells.append(Cell("mlx-lm tok/s, the machine (never judged)", row, mode,
                                      bc and bc.aggregate_tok_s, ac and ac.aggregate_tok_s, False))
                    continue
                cells.append(Cell("engine aggregate tok/s", row, mode, bc and bc.aggregate_tok_s,
                                  ac and ac.aggregate_tok_s, True))
                if mode != "plain":
                    cells.append(Cell("round / plain round", row, mode, _single(bc and bc.round_over_plain),
                                      _single(ac and ac.round_over_plain), False))
    return cells


# the receipt kinds `compare` builds cells from, each kind's builder; a pair with none in common is an error, not an
# empty table that passes
CELLS = {"decode": decode_cells, "prefill": prefill_cells, "engine-speed": engine_speed_cells}


def judge(cell: Cell, noise: float) -> None:
    """Sets the cell's ratio, noisy mark and drop flag by the rule in this module's docstring."""
    b, a = cell.before, cell.after
    if not b or not a or b.median is None or a.median is None:
        return
    spreads = [s.spread for s in (b, a) if s.spread is not None]
    if any(sp > noise for sp in spreads):
        cell.noisy = True
        cell.note = "; ".join(filter(None, [cell.note, f"noisy: spread {max(spreads):.0%} > {noise:.0%}"]))
        return
    if b.median:
        cell.ratio = a.median / b.median
    if not cell.judged:
        return
    if min(b.n, a.n) < 2:
        if a.median < b.median:
            cell.note = "; ".join(filter(None, [cell.note, "one rep: no spread to judge a drop"]))
        return
    allowed = max(b.max - b.min, a.max - a.min)
    if b.median - a.median > allowed:
        cell.drop = True
        cell.note = "; ".join(filter(None, [cell.note, f"drop beyond the runs' spread ({allowed:.4g})"]))


def compare(before_path: Path, after_path: Path, noise: float = 0.10, same_tokens: bool = False) -> CompareResult:
    before = load_side(before_path, "BEFORE")
    after = load_side(after_path, "AFTER")
    result = CompareResult([str(p) for p, _ in before.values()], [str(p) for p, _ in after.values()], noise,
                           same_tokens=same_tokens)
    shared = [kind for kind in CELLS if kind in before and kind in after]
    for kind in [k for k in before if k in after]:
        result.tokens += token_ids.rows(kind, before[kind][1], after[kind][1])
    if not shared and not result.tokens:
        raise BadReceipt(f"nothing to compare: BEFORE holds {', '.join(sorted(before))} and AFTER "
                         f"{', '.join(sorted(after))}; compare takes two of one kind, {', '.join(CELLS)} for speed "
                         "or any with token hashes")
    for kind in shared:
        result.cells += CELLS[kind](before[kind][1], after[kind][1])
    for cell in result.cells:
        judge(cell, noise)
    for side, receipts in (("BEFORE", before), ("AFTER", after)):
        for kind, (path, receipt) in receipts.items():
            if not receipt.complete:
                result.incomplete.append(f"{side} {kind} ({path.name}): {receipt.incomplete_reason}")
    for kind, (path, receipt) in after.items():
        result.failures += [dict(f, receipt=path.name) for f in receipt.failures]
    return result


VERDICT = {0: "no drop beyond the runs' spread; AFTER has no failures",
           1: "FAILED: a drop beyond the runs' spread, a failure in AFTER or (--same-tokens) changed tokens",
           2: "incomplete receipts: see above"}


def digits(section: str) -> int:
    """Decimals a section's values are shown with (the table and the Markdown alike)."""
    return 2 if section in ("tokens per round", "round / plain round") else 3 if "seconds" in section else 1


def _fmt(s: agg.Summary | None, section: str) -> str:
    if s is None or s.median is None:
        return "—"
    if section == "peak footprint":
        return f"{s.median / 1e9:.2f} GB"
    spread = f" ±{s.spread:.0%}" if s.n > 1 and s.spread is not None else ""
    return f"{s.median:,.{digits(section)}f}{spread}"


def markdown(result: CompareResult) -> str:
    """The before/after table and the verdict as Markdown, for a pull request comment or a CI job summary."""
    header = ["| metric | row | mode | before | after | ratio | note |", "|---|---|---|---|---|---|---|"]
    lines = header if result.cells else []  # (token hashes alone: no speed table)
    for c in result.cells:
        mark = "\\*" if c.noisy else ""
        ratio = "—" if c.ratio is None else f"**{c.ratio:.2f}x**" if c.drop else f"{c.ratio:.2f}x"
        lines.append(f"| {c.section} | {c.row} | {c.mode} | {_fmt(c.before, c.section)}{mark} | "
                     f"{_fmt(c.after, c.section)}{mark} | {ratio} | {c.note} |")
    if result.tokens:
        lines += ["", f"- {token_ids.summary_line(result.tokens)}",
                  *[f"  - changed: {r.kind} {r.request}: {r.before} -> {r.after}" for r in result.changed_tokens]]
    lines += ["", *[f"- AFTER failed: {f['receipt']}: {f['message']}" for f in result.failures],
              *[f"- incomplete: {line}" for line in result.incomplete], "", f"**{VERDICT[result.exit_code]}**"]
    return "\n".join(lines)
