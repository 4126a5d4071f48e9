"""Receipts as pandas DataFrames: `dflash-bench table` (CSV, Parquet) and `compare`'s trend over a series.

Two shapes, both long so that receipts of different kinds and versions stack without a schema per
column: the records (one row per request or rep, labels flattened to `labels.<name>` columns) and the
aggregates (one row per numeric leaf, named by its dotted path, e.g.
`single_tps.code.drafted.median`). Each row carries the receipt's path, kind, start time and git
commit, which is what orders a series (`trend`).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from rich.table import Table

from dflash_bench.checks.receipt import Receipt
from dflash_bench.checks.tables import num
from dflash_bench.engine.errors import DFlashBenchError


class MissingExtra(DFlashBenchError):
    """An output format needs an optional dependency that is not installed."""

# Per-request columns too long for a table (the ids, the text, every chunk's time): kept in the receipt.
BULKY = ("token_ids", "text", "chunk_times", "chunk_tokens", "acceptance_histogram", "acceptance_by_depth",
         "drafted_by_depth", "stream_tok_s", "token_sha", "tokens_per_round_values")
# The metrics a trend shows by default: each speed summary's median, and tokens a round.
TREND_DEFAULT = ("tps.", "_tps.", "tok_s.", "tokens_per_round.")


def _meta(path: Path, r: Receipt) -> dict:
    git = (r.tool or {}).get("git") or {}
    return {"receipt": str(path), "kind": r.kind, "started_at": r.started_at, "commit": git.get("commit"),
            "dirty": git.get("dirty"), "complete": r.complete}


def _leaves(value, prefix: str = ""):
    """(dotted path, number) for every numeric leaf; lists of numbers are left out (values of reps,
    histograms: the summary beside them carries what a table needs)."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _leaves(inner, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, bool):
        yield prefix, int(value)
    elif isinstance(value, (int, float)):
        yield prefix, value


def records_frame(receipts: list[tuple[Path, Receipt]]) -> pd.DataFrame:
    """One row per record of every receipt, its labels as `labels.<name>` columns."""
    frames = []
    for path, r in receipts:
        if not r.records:
            continue
        rows = [{k: v for k, v in rec.items() if k not in BULKY} for rec in r.records]
        frame = pd.json_normalize(rows)
        for key, value in reversed(_meta(path, r).items()):
            frame.insert(0, key, value)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


PRINTED = ("kind", "prompt_id", "status", "completion_tokens", "ttft", "tpot", "elapsed", "tokens_per_round")


def printable(records: pd.DataFrame) -> pd.DataFrame:
    """The records' columns a terminal has room for: what identifies a request, its labels, its timings
    (--csv and --parquet keep every column)."""
    labels = [c for c in records.columns if c.startswith("labels.")]
    keep = [c for c in PRINTED[:2] if c in records] + labels + [c for c in PRINTED[2:] if c in records]
    return records[keep]


def aggregates_frame(receipts: list[tuple[Path, Receipt]]) -> pd.DataFrame:
    """One row per numeric leaf of every receipt's aggregates (and its peak footprint)."""
    rows = []
    for path, r in receipts:
        meta = _meta(path, r)
        leaves = list(_leaves(r.aggregates))
        if r.server.get("peak_memory_bytes") is not None:
            leaves.append(("peak_memory_bytes", r.server["peak_memory_bytes"]))
        rows += [{**meta, "metric": metric, "value": float(value)} for metric, value in leaves]
    return pd.DataFrame(rows, columns=[*_meta(Path(), Receipt("", [], {})), "metric", "value"])


def trend(receipts: list[tuple[Path, Receipt]], metrics: list[str] | None = None) -> pd.DataFrame:
    """A metric per row, a receipt per column, the receipts in the order they ran (start time, then
    path): the medians of the speed summaries and tokens a round unless `metrics` (substrings of the
    dotted names) picks others. Columns are named by the short commit and the start time."""
    frame = aggregates_frame(receipts)
    if frame.empty:
        return frame
    names = frame["metric"]
    if metrics:
        keep = names.apply(lambda m: any(part in m for part in metrics))
    else:
        keep = names.apply(lambda m: any(part in m for part in TREND_DEFAULT)) & (
            names.str.endswith(".median") | names.str.startswith("tokens_per_round."))
    frame = frame[keep].sort_values(["started_at", "receipt"], kind="stable")
    frame["run"] = frame.apply(lambda row: f"{(row['commit'] or 'no-git')[:8]}{'+' if row['dirty'] else ''} "
                                           f"{row['started_at'] or ''}", axis=1)
    order = list(dict.fromkeys(frame["run"]))
    wide = frame.pivot_table(index="metric", columns="run", values="value", aggfunc="first", sort=False)
    return wide[order]


def write(frame: pd.DataFrame, csv: Path | None, parquet: Path | None) -> None:
    """CSV always works; Parquet needs pyarrow (the `parquet` extra)."""
    if csv:
        frame.to_csv(csv, index=False)
    if parquet:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise MissingExtra("--parquet needs pyarrow: pip install 'dflash-bench[parquet]'") from None
        frame.to_parquet(parquet, index=False)


def markdown(frame: pd.DataFrame, digits: int = 2) -> str:
    """A GitHub-flavoured Markdown table (pandas' to_markdown needs tabulate, which is not a dependency)."""
    index = frame.index.name or ""
    head = [index, *map(str, frame.columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in frame.iterrows():
        cells = ["—" if pd.isna(v) else f"{v:,.{digits}f}" if isinstance(v, float) else str(v) for v in row]
        lines.append("| " + " | ".join([str(name), *cells]) + " |")
    return "\n".join(lines)


def frame_table(frame: pd.DataFrame, title: str, digits: int = 2) -> Table:
    """A DataFrame as a rich table: its index (when named) then its columns."""
    t = Table(title=title)
    named = frame.index.name is not None
    for col in ([frame.index.name] if named else []) + [str(c) for c in frame.columns]:
        t.add_column(col)
    for name, row in frame.iterrows():
        cells = ["—" if pd.isna(v) else num(float(v), digits) if isinstance(v, float) else str(v) for v in row]
        t.add_row(*([str(name)] if named else []), *cells)
    return t
