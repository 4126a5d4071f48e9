"""selfcheck: the row rule proven for a target on this machine, as a receipt (engine/selfcheck.py).

The engine runs the same check at load; this command runs it fresh (unless asked to read the
cache), in the mode `serve` would use here or the one named, and records every path's verdict,
the tiles and attention paths chosen, and the machine it was proven on.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from dflash_bench.checks.receipt import Receipt
from dflash_bench.engine import backend as backends
from dflash_bench.engine import selfcheck
from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.targets import build_target

CHECK = "row_rule"


@dataclass(frozen=True)
class SelfcheckSettings:
    target: str = "default"
    backend: str = "auto"
    cached: bool = False


def run(s: SelfcheckSettings, receipt: Receipt) -> selfcheck.Verdict:
    mode = backends.resolve(s.backend)
    loaded = load_target(s.target, mode.dtype, packed=not mode.dequantizes)
    target = build_target(loaded.config, loaded.weights, mode.dtype)
    verdict = selfcheck.check(target, fresh=not s.cached)
    receipt.server = {"engine": "dflash-bench (in process)", "target": str(loaded.path),
                      "target_sha256": loaded.weights_sha256, "backend": mode.name}
    receipt.environment["selfcheck"] = verdict.as_dict()
    receipt.records = [{"path": p.path, "passed": p.passed, "choice": p.choice, "detail": p.detail} for p in verdict.paths]
    receipt.aggregates = {"passed": verdict.passed, "seconds": verdict.seconds, "cached": verdict.cached,
                          "tiles": verdict.tiles, "attention": verdict.attention, "line": verdict.line()}
    for p in verdict.failures:
        receipt.fail(CHECK, p.path, f"{p.path}: {p.detail}")
    return verdict


def table(r: Receipt) -> Table:
    a = r.aggregates
    t = Table(title=a.get("line", "self-check"))
    for col in ("path", "result", "chosen", "what differed"):
        t.add_column(col)
    for rec in r.records:
        t.add_row(rec["path"], "[green]exact[/]" if rec["passed"] else "[red]FAILED[/]", rec["choice"], rec["detail"])
    return t
