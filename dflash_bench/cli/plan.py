"""`dflash-bench plan TARGET [--drafter DIR] [--parallel N] [--context C] [--prompt-cache-gib G] [--memory-gib M]`.

Prices every term of serving from the two config.json files alone (no weight is read) and says how
many streams of `--context` tokens fit, and what the drafter adds (the plan without it beside);
`--json` prints the plan as JSON. `--backend` is the engine mode priced (backend.py): by default
the one MLX's default device gets (gpu on a GPU). `--check` then loads the engine in this process in
that mode, fills the planned streams and compares the plan with the measured peak, writing a
receipt (exit 0 within the tolerance, 1 beyond it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from dflash_bench.checks import memory, tables
from dflash_bench.checks.lifecycle import receipt_run
from dflash_bench.checks.receipt import Receipt, canonical_json, utc_stamp
from dflash_bench.checks.runner import make_progress
from dflash_bench.cli import app
from dflash_bench.engine import backend as backends
from dflash_bench.engine.constants import GIB, MIB
from dflash_bench.engine.defaults import chosen_drafter
from dflash_bench.engine.errors import DFlashBenchError
from dflash_bench.engine.planner import (
    Plan,
    PlanInputs,
    admit,
    backend_memory_bytes,
    plan,
    read_configs,
)


def _mib(n: int) -> str:
    return f"{n / MIB:,.1f}" if n else "-"


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:,.1f} MiB"


def plan_table(p: Plan) -> Group:
    """Every term in MiB, each stream term in both phases, then the totals and the verdict."""
    i = p.inputs
    t = Table(title=f"plan: {i.target.name or i.target.family}"
                    f"{f' + {i.drafter.kind}' if i.drafter else ''}, {i.parallel} x {i.context} tokens, "
                    f"{i.backend.name}")
    for col, just in (("term", "left"), ("counts", "left"), ("prompt pass MiB", "right"), ("decoding MiB", "right"),
                      ("detail", "left")):
        t.add_column(col, justify=just)
    counts = {"weights": "once", "shared": "once", "stream": f"x {i.parallel}", "load": "at load"}
    for term in p.terms:
        t.add_row(term.name, counts[term.scope], _mib(term.prompt), _mib(term.decode), term.detail,
                  style="cyan" if term.drafter else None)
    t.add_section()
    t.add_row("a stream", "", _mib(p.stream_prompt_bytes), _mib(p.stream_decode_bytes), "priced at the larger phase")
    t.add_row("total", "", _mib(p.total_bytes), "", f"{p.total_bytes / GIB:.2f} GiB", style="bold")
    lines = [t]
    if i.drafter:
        lines.append(Text(f"the drafter adds {_size(p.drafter_added_bytes)}: {_size(p.without_drafter.total_bytes)} "
                          f"without it", style="cyan"))
    if i.memory_bytes is not None:
        verdict = "fits" if p.fits else "does not fit"
        lines.append(Text(f"{verdict} in {i.memory_bytes / GIB:.2f} GiB; {p.streams_fit} streams of {i.context} "
                          f"tokens fit", style="green" if p.fits else "red"))
    return Group(*lines)


@app.command("plan", rich_help_panel="Checks")
def plan_command(
    target: Annotated[str, typer.Argument(help="A checkpoint folder, a .gguf, a config.json, or 'default'.")] = "default",
    drafter: Annotated[Optional[str], typer.Option(help="Drafter folder or its config.json (default: the target's "
                                                        "shipped drafter, if any, as serve loads; 'none': no drafter).")] = None,
    no_drafter: Annotated[bool, typer.Option("--no-drafter", help="Price the target alone.")] = False,
    parallel: Annotated[int, typer.Option(min=1, help="Streams served at once.")] = 1,
    context: Annotated[int, typer.Option(min=2, help="Tokens a stream holds (prompt plus reply).")] = 4096,
    prompt_cache_gib: Annotated[float, typer.Option("--prompt-cache-gib", min=0, help="Prompt cache budget.")] = 0.0,
    memory_gib: Annotated[Optional[float], typer.Option("--memory-gib", min=0,
                                                        help="Memory the backend may use (default: MLX's limit).")] = None,
    drafter_bits: Annotated[int, typer.Option(help="Drafter matrices' bits (0 keeps them float).")] = 0,
    backend: Annotated[str, typer.Option(help="The engine mode priced and, with --check, run: auto (the default "
                                              "device's), cpu (float32 weights and activations) or gpu "
                                              "(packed quantized weights, bf16).")] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    check: Annotated[bool, typer.Option(help="Load the engine, fill the streams, compare with the measured peak.")] = False,
    max_tokens: Annotated[Optional[int], typer.Option(help="--check: each reply's tokens (default: a drafter block "
                                                           "plus one, or 8).")] = None,
    tolerance: Annotated[float, typer.Option(help="--check: the largest |predicted / measured - 1| that passes.")] = 0.10,
    out: Annotated[Optional[Path], typer.Option(help="--check receipt path (default receipts/plan-<UTC stamp>.json).")] = None,
):
    """Price serving N streams of C tokens from config.json files alone; --check measures it."""
    try:
        drafter = chosen_drafter(target, drafter, no_drafter)
        mode = backends.resolve(backend)
        tcfg, dcfg = read_configs(target, drafter)
        memory_bytes = int(memory_gib * GIB) if memory_gib is not None else backend_memory_bytes()
        inputs = PlanInputs(tcfg, dcfg, parallel, context, prompt_cache_gib, drafter_bits if dcfg else 0,
                            memory_bytes, mode)
        p = plan(inputs)
    except (DFlashBenchError, ValueError) as err:
        typer.echo(err.line() if isinstance(err, DFlashBenchError) else f"plan: {err}", err=True)
        raise typer.Exit(1) from None
    if not check:
        if json_out:
            typer.echo(canonical_json(p.to_dict()), nl=False)
        else:
            tables.console().print(plan_table(p))
        raise typer.Exit(0 if p.fits is not False else 1)
    _check(p, target, drafter, max_tokens, tolerance, out, json_out)


def _check(p: Plan, target: str, drafter: str | None, max_tokens: int | None, tolerance: float, out: Path | None,
           json_out: bool) -> None:
    i = p.inputs
    tokens = max_tokens or ((i.drafter.block_size + 1) if i.drafter else 8)
    if tokens >= i.context:
        typer.echo(f"plan: --max-tokens {tokens} leaves no prompt in a context of {i.context}", err=True)
        raise typer.Exit(1)
    decision = admit(i)
    if decision.refused_reason:
        typer.echo(f"plan --check: {decision.line()}", err=True)
        raise typer.Exit(1)
    settings = {"target": target, "drafter": drafter, "parallel": i.parallel, "context": i.context,
                "prompt_cache_gib": i.prompt_cache_gib, "drafter_bits": i.drafter_bits, "memory_bytes": i.memory_bytes,
                "backend": i.backend.name, "max_tokens": tokens, "prompt_tokens": i.context - tokens,
                "tolerance": tolerance, "chunk": i.chunk}
    receipt = Receipt.new("plan", list(sys.argv), settings)
    path = out or Path("receipts") / f"plan-{utc_stamp()}.json"
    progress = make_progress()
    with receipt_run(receipt, path) as run:
        with progress:
            task = progress.add_task("plan --check rounds", total=None)
            memory.run(p, target, drafter, memory.CheckSettings(tokens, tolerance), receipt,
                       lambda n: progress.advance(task, n))
    if json_out:
        typer.echo(canonical_json(receipt.to_dict()), nl=False)
    else:
        console = tables.console()
        console.print(plan_table(p))
        console.print(memory.table(receipt))
        for f in receipt.failures:
            console.print(f"failed: {f['message']}", style="red")
        for w in receipt.warnings:
            console.print(f"warning: {w['message']}", style="yellow")
        console.print(f"receipt: {path}", style="dim")
    raise typer.Exit(run.code)
