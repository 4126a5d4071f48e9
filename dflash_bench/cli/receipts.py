"""The receipt commands: compare, show, schema, table, report (they read receipts; none runs a check)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from dflash_bench.checks import compare as compare_mod
from dflash_bench.checks import tables
from dflash_bench.checks import schema as schema_mod
from dflash_bench.checks.receipt import Receipt, canonical_json, write_atomic
from dflash_bench.checks.schema import CompareDoc, ReceiptBase, TrainingReceipt, load_document
from dflash_bench.cli import app
from dflash_bench.cli.checks import Json
from dflash_bench.cli.checks import report as print_receipt
from dflash_bench.engine.errors import DFlashBenchError

PANEL = "Receipts"


def _receipts(paths: list[Path]) -> list[tuple[Path, Receipt]]:
    """Run receipts from files and folders (a folder's side files and other documents are skipped)."""
    files = [f for p in paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    out = []
    for f in files:
        if f.is_file() and schema_mod.document_kind(schema_mod.read_json(f)) != "receipt" and f not in paths:
            continue
        out.append((f, Receipt.load(f)))
    return out


def _fail(err: DFlashBenchError) -> typer.Exit:
    typer.echo(err.line(), err=True)
    return typer.Exit(1)


@app.command(rich_help_panel=PANEL)
def compare(receipts: Annotated[list[Path], typer.Argument(
                help="BEFORE AFTER (receipts or suite folders); or, with --trend or more than two, a series.")],
            noise: Annotated[float, typer.Option(help="Spread ((max-min)/median of reps) above which a cell is noisy.")]
            = 0.10,
            trend: Annotated[bool, typer.Option("--trend", help="A metric per row, a receipt per column, in the "
                                                "order they ran (start time): the trend across commits.")] = False,
            metric: Annotated[Optional[list[str]], typer.Option(help="--trend: metrics whose dotted name contains "
                                                                "this (repeatable; default: speed medians and "
                                                                "tokens a round).")] = None,
            markdown: Annotated[bool, typer.Option("--markdown", help="Print a Markdown table (a pull request "
                                                   "comment, a CI job summary).")] = False,
            same_tokens: Annotated[bool, typer.Option("--same-tokens", help="Fail (exit 1) when a request both "
                                                      "sides ran came back with other tokens: for a change meant "
                                                      "to keep the bits (a kernel's fusion, a launch rewritten).")]
            = False,
            json_out: Json = False,
            out: Annotated[Optional[Path], typer.Option(help="Also write the comparison as JSON here.")] = None):
    """Before/after tables with ratios (decode tok/s per probe and level, tokens a round, footprint, prefill; engine-speed's modes per probe and level, a drafted round over a plain one, and mlx-lm's tok/s on each side's machine, never judged); or a metric's trend over a series of receipts.

    Noisy: a cell whose spread, (max - min) / median of its reps, exceeds --noise in either run is marked * and left out of the ratios and of the verdict.

    Drop: a tok/s cell whose AFTER median is below BEFORE's by more than the larger of the two runs' own spreads (max - min); a cell with one rep on a side has no spread and is never called a drop. Tokens a round, footprint, a round over a plain one and mlx-lm's tok/s never fail; a pair with no kind in common is an error.

    Tokens: every request both sides ran (exactness, concurrent, decode, engine-speed receipts), paired by what it asked, is the same tokens or changed (its token hashes); receipts with token hashes and no speed cells compare by them alone.

    Exit 1 on a drop, on any verdict failure in AFTER's receipts (drafted != plain, concurrent != solo, ...) or, with --same-tokens, on a request whose tokens changed; 2 if a receipt on either side is incomplete, else 0. A trend only reports: exit 0.
    """
    if trend or len(receipts) > 2:
        from dflash_bench.checks import frames  # pandas: imported only by the commands that use it

        try:
            frame = frames.trend(_receipts(receipts), metric)
        except DFlashBenchError as err:
            raise _fail(err) from None
        if json_out:
            typer.echo(frame.to_json(orient="split", indent=2))
        elif markdown:
            typer.echo(frames.markdown(frame))
        else:
            tables.console().print(frames.frame_table(frame, "trend (receipts in the order they ran)"))
        raise typer.Exit(0)
    if len(receipts) != 2:
        raise typer.BadParameter("give BEFORE and AFTER, or a series with --trend")
    try:
        result = compare_mod.compare(receipts[0], receipts[1], noise, same_tokens)
    except DFlashBenchError as err:
        raise _fail(err) from None
    if out:
        write_atomic(out, canonical_json(result.to_dict()))
    if json_out:
        typer.echo(canonical_json(result.to_dict()), nl=False)
    elif markdown:
        typer.echo(compare_mod.markdown(result))
    else:
        tables.console().print(tables.compare_table(result))
    raise typer.Exit(result.exit_code)


@app.command(rich_help_panel=PANEL)
def show(receipt: Annotated[Path, typer.Argument(help="A receipt, or a folder of them.")], json_out: Json = False):
    """Print a receipt's table again (every receipt in a folder): run receipts of every kind, comparisons
    (`compare --out`) and training receipts (tools/train_drafter)."""
    paths = sorted(p for p in receipt.glob("*.json") if not p.name.endswith(".prefill-arrays.json")) \
        if receipt.is_dir() else [receipt]
    try:
        loaded = [(p, load_document(p)) for p in paths]
    except DFlashBenchError as err:
        raise _fail(err) from None
    for path, doc in loaded:
        if isinstance(doc, ReceiptBase):
            print_receipt(Receipt.from_dict(doc.model_dump(by_alias=True), str(path)), path, json_out)
        elif json_out:
            typer.echo(canonical_json(doc.model_dump(by_alias=True, exclude_unset=True)), nl=False)
        elif isinstance(doc, CompareDoc):
            tables.console().print(tables.compare_table(compare_mod.CompareResult.from_doc(doc)))
        elif isinstance(doc, TrainingReceipt):
            tables.console().print(tables.training(doc))
        else:
            tables.console().print(f"{path}: the prefill check's token arrays, sizes "
                                   f"{', '.join(doc.root)} (a side file of a prefill receipt)")


@app.command(rich_help_panel=PANEL)
def schema():
    """Print the JSON Schema of every file receipts/ holds (run receipts, comparisons, training receipts),
    versioned by its $id and schema_version (checks/schema.py says what each version added)."""
    typer.echo(json.dumps(schema_mod.json_schema(), indent=2, sort_keys=True))


@app.command(rich_help_panel=PANEL)
def table(receipts: Annotated[list[Path], typer.Argument(help="Receipts, or folders of them.")],
          records: Annotated[bool, typer.Option("--records", help="One row per request (or rep) instead of one "
                                                "per aggregate metric.")] = False,
          csv: Annotated[Optional[Path], typer.Option(help="Write the table as CSV here.")] = None,
          parquet: Annotated[Optional[Path], typer.Option(help="Write the table as Parquet here (the parquet "
                                                          "extra: pyarrow).")] = None):
    """Receipts as one pandas table: every aggregate metric (dotted name, value) or every record, each row
    with its receipt's path, kind, start time and commit; printed, or written with --csv / --parquet."""
    from dflash_bench.checks import frames  # pandas: imported only by the commands that use it

    try:
        loaded = _receipts(receipts)
        frame = frames.records_frame(loaded) if records else frames.aggregates_frame(loaded)
        frames.write(frame, csv, parquet)
    except DFlashBenchError as err:
        raise _fail(err) from None
    if csv or parquet:
        typer.echo(f"{len(frame)} rows x {len(frame.columns)} columns -> {', '.join(str(p) for p in (csv, parquet) if p)}")
    else:
        shown = frames.printable(frame) if records else frame
        tables.console().print(frames.frame_table(shown, "records" if records else "aggregates"))


@app.command(rich_help_panel=PANEL)
def report(receipts: Annotated[list[Path], typer.Argument(help="Receipts, or folders of them.")],
           out: Annotated[Path, typer.Option(help="Folder for the PNG plots and index.html.")] = Path("report")):
    """PNG plots (speedup by streams per probe, tokens a round, TTFT/ITL, planner predicted vs measured)
    and an HTML page embedding them; a plot the receipts hold no data for is named on the page, not drawn."""
    from dflash_bench.checks.report import write_report  # matplotlib loads only for this command

    try:
        plots = write_report(_receipts(receipts), out)
    except DFlashBenchError as err:
        raise _fail(err) from None
    for p in plots:
        typer.echo(f"{out / p.file}" if p.file else f"(no {p.name} plot: {p.caption})")
    typer.echo(f"{out / 'index.html'}")
