"""The `dflash-bench` command line: one Typer app, one module per command group.

Exit codes: 0 passed, 1 a check failed (or a refusal), 2 incomplete, 130 interrupted.
"""

from __future__ import annotations

import typer

import dflash_bench  # noqa: F401  (loads OpenBLAS before any mlx import)
from dflash_bench.checks.receipt import named_revision

app = typer.Typer(
    name="dflash-bench",
    help="Exactness checks and benchmarks for DFlash speculative decoding, with a bundled MLX engine.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

@app.callback()
def _root() -> None:
    """Exactness checks and benchmarks for DFlash speculative decoding, with a bundled MLX engine."""
    try:
        named_revision()
    except ValueError as e:
        typer.echo(f"dflash-bench: {e}", err=True)
        raise typer.Exit(1) from None


# Each command module registers its commands on `app` when imported.
from dflash_bench.cli import inspect as _inspect  # noqa: E402,F401
from dflash_bench.cli import fixture as _fixture  # noqa: E402,F401
from dflash_bench.cli import checks as _checks  # noqa: E402,F401
from dflash_bench.cli import receipts as _receipts  # noqa: E402,F401
from dflash_bench.cli import serve as _serve  # noqa: E402,F401
from dflash_bench.cli import engine_speed as _engine_speed  # noqa: E402,F401
from dflash_bench.cli import plan as _plan  # noqa: E402,F401
from dflash_bench.cli import selfcheck as _selfcheck  # noqa: E402,F401


def main() -> None:
    app()
