"""`dflash-bench fixture KIND DIR`: random checkpoints in the real published layouts.

The small kinds are tiny (fixtures/small.py); `qwen3_5-9b-4bit` and `dflash-9b` are Qwen3.5-9B's shapes in
the MLX 4-bit layout and its DFlash drafter's, written block by block (fixtures/big.py; `--preset
tiny` writes the same layout at small sizes).
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from dflash_bench.cli import app
from dflash_bench.fixtures import big
from dflash_bench.fixtures.small import FIXTURE_KINDS, TARGET_KINDS, write_fixture, write_random_like

# Typer turns an Enum into a choice: an unknown kind is a usage error (exit 2) naming the choices.
FixtureKind = Enum("FixtureKind", {k: k for k in FIXTURE_KINDS + big.KINDS}, type=str)
TargetKind = Enum("TargetKind", {k: k for k in TARGET_KINDS}, type=str)
Preset = Enum("Preset", {k: k for k in big.PRESETS}, type=str)


@app.command()
def fixture(
    kind: FixtureKind = typer.Argument(..., help="What to write."),
    out_dir: Path = typer.Argument(..., metavar="DIR", help="Folder to write into (created if missing)."),
    seed: int = typer.Option(0, help="Random seed: the same seed writes byte-identical files."),
    target: TargetKind = typer.Option("llama", help="The target fixture a drafter is made for (drafters only)."),
    like: Path = typer.Option(None, help="dflash only: copy this drafter's config.json (a real layout, e.g. the "
                                          "shipped one) and write random weights of its shapes."),
    preset: Preset = typer.Option("9b", help="qwen3_5-9b-4bit and dflash-9b only: the shapes (9b, or tiny: the "
                                             "same layout at small sizes)."),
) -> None:
    """Write a random checkpoint (targets: HF, GGUF, MLX 4-bit; drafters: DFlash, DFlash2; Qwen3.5-9B's
    shapes at 4 bits and its DFlash drafter's) and print the path to load: the folder, or the .gguf file."""
    if kind.value in big.KINDS:
        typer.echo(str(big.write_big(kind.value, out_dir, preset.value, seed)))
        return
    if like is not None:
        if kind.value not in ("dflash", "dflash2"):
            raise typer.BadParameter(f"--like goes with a drafter kind, not {kind.value!r}")
        typer.echo(str(write_random_like(like, out_dir, seed=seed)))
        return
    typer.echo(str(write_fixture(kind.value, out_dir, seed=seed, target=target.value)))
