"""`dflash-bench engine-speed`: the engine's decode speed in one process, beside mlx-lm."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from dflash_bench.checks import engine_speed, tables
from dflash_bench.checks.lifecycle import receipt_run
from dflash_bench.checks.receipt import Receipt, canonical_json
from dflash_bench.cli import app
from dflash_bench.cli.checks import Json, Out, default_out, ints, numbers
from dflash_bench.engine.backend import BACKENDS
from dflash_bench.engine.defaults import chosen_drafter
from dflash_bench.engine.errors import DFlashBenchError


@app.command("engine-speed")
def engine_speed_cmd(
    target: Annotated[str, typer.Argument(help="Target checkpoint ('default', a .gguf, or a directory).")] = "default",
    drafter: Annotated[Optional[str], typer.Option(help="Drafter folder or shipped name ('dflash', 'dflash2'; default: the target's shipped v1 drafter).")] = None,
    levels: Annotated[str, typer.Option(help="Stream counts, comma-separated.")] = "1,4",
    tokens: Annotated[int, typer.Option(help="Tokens each stream decodes (ignore_eos).")] = 64,
    reps: Annotated[int, typer.Option(help="Repetitions of each cell.")] = 2,
    drafter_bits: Annotated[str, typer.Option(help="Drafter precisions to measure (0 = float, 4 = 4-bit copies).")] = "0,4",
    mlx_lm: Annotated[bool, typer.Option(help="Also decode with mlx-lm from the same files (generate_step at 1 stream, "
                                               "its batched loop at more; for a GGUF target, mlx-lm's model on the weights we load from it).")] = True,
    backend: Annotated[str, typer.Option(help="Engine mode: auto (the one serve would use here), cpu (float32) or gpu "
                                              "(packed quantized weights, bf16).")] = "auto",
    sampled: Annotated[str, typer.Option(help="Temperatures above 0 at which each mode decodes once more, untimed, at every "
                                              "level: each drafted stream must equal plain's stream of its seed ('' for none).")] = "0.7",
    out: Out = None,
    json_out: Json = False,
) -> None:
    """Plain and drafted decode at each level in one process, in serve's mode, and mlx-lm on the same files (ratios)."""
    bits = numbers(drafter_bits, "--drafter-bits", int, 0)
    temperatures = numbers(sampled, "--sampled", float, 0) if sampled.strip() else ()
    if 0 in temperatures:
        raise typer.BadParameter(f"--sampled {sampled!r}: the timed reps are greedy; expected temperatures above 0")
    if backend not in ("auto", *BACKENDS):
        raise typer.BadParameter(f"--backend is {backend!r}, expected auto, {' or '.join(BACKENDS)}")
    try:
        drafter = chosen_drafter(target, drafter)
    except DFlashBenchError as err:
        typer.echo(err.line(), err=True)
        raise typer.Exit(1) from None
    settings = engine_speed.SpeedSettings(
        target=target, drafter=drafter,
        levels=ints(levels, "--levels"), tokens=tokens, reps=reps, drafter_bits=bits, mlx_lm=mlx_lm,
        backend=backend, sampled=temperatures,
    )
    receipt = Receipt.new("engine-speed", sys.argv, settings.__dict__)
    path = out or default_out("engine-speed")
    console = tables.console(stderr=True)
    with receipt_run(receipt, path) as run, console.status("engine-speed") as status:
        engine_speed.run(settings, receipt, progress=lambda m: status.update(m))
    if receipt.incomplete_reason:
        console.print(receipt.incomplete_reason)
    if json_out:
        print(canonical_json(receipt.to_dict()), end="")
    else:
        tables.console().print(tables.render(receipt))
        console.print(f"receipt: {path}")
    raise typer.Exit(run.code)
