"""`dflash-bench selfcheck [TARGET]`: prove the row rule for TARGET on this machine (engine/selfcheck.py)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from dflash_bench.checks import selfcheck, tables
from dflash_bench.checks.lifecycle import receipt_run
from dflash_bench.checks.receipt import Receipt, canonical_json
from dflash_bench.cli import app
from dflash_bench.cli.checks import Json, Out, default_out
from dflash_bench.engine.errors import DFlashBenchError


@app.command("selfcheck")
def selfcheck_cmd(
    target: Annotated[str, typer.Argument(help="Target checkpoint ('default', a .gguf, or a directory).")] = "default",
    backend: Annotated[str, typer.Option(help="Engine mode to prove: auto (what serve uses here), cpu (float32) or gpu "
                                              "(packed weights, bf16).")] = "auto",
    cached: Annotated[bool, typer.Option("--cached", help="Take the verdict the engine cached at an earlier load, "
                                                          "if any (default: run it fresh).")] = False,
    out: Out = None,
    json_out: Json = False,
) -> None:
    """Prove that a decode row's bits do not depend on the rows beside it, for every projection shape,
    attention and recurrence of TARGET on this machine's device and BLAS; print each path's verdict and
    the tiles chosen. Exit 0 when every path has an exact configuration, 1 when one has none (the server
    would then serve without drafting)."""
    settings = selfcheck.SelfcheckSettings(target=target, backend=backend, cached=cached)
    receipt = Receipt.new("selfcheck", sys.argv, settings.__dict__)
    path = out or default_out("selfcheck")
    console = tables.console(stderr=True)
    with receipt_run(receipt, path, expected=(DFlashBenchError, ValueError)) as run, console.status("self-check"):
        selfcheck.run(settings, receipt)
    if receipt.incomplete_reason:
        console.print(receipt.incomplete_reason)
    if json_out:
        print(canonical_json(receipt.to_dict()), end="")
    elif receipt.records:
        tables.console().print(selfcheck.table(receipt))
    console.print(f"receipt: {path}")
    raise typer.Exit(run.code)
