"""plan --check: load the engine in this process, fill the planned streams, compare the peak with the plan.

The load is the plan's worst moment: every stream's prompt fills the context but for `max_tokens`
(enough to reach a decode window), and all streams start in the same round, so their last prompt
chunks, the largest working sets, run together while the caches hold the most a prompt pass grows
them to. Measured: MLX's peak (what the planner prices) and the process's peak RSS, predicted as the
plan plus what the process holds beside MLX's arrays once loaded (interpreter, libraries, tokenizer,
BLAS buffers: measured, not priced), so the RSS comparison also catches MLX's buffer cache growing.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from rich.table import Table

from dflash_bench.checks.receipt import Receipt
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.planner import Plan
from dflash_bench.engine.request import Request, token_sha

TOLERANCE = 0.10


@dataclass
class CheckSettings:
    max_tokens: int  # each stream's reply: reaches a decode window past the prompt
    tolerance: float = TOLERANCE


def rss_bytes() -> int:
    """The process's resident set now (Linux /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def prompt_ids(length: int, stream: int, vocab: int) -> list[int]:
    """A deterministic prompt of ordinary token ids (memory does not depend on which ids)."""
    span = max(vocab - 1000, 1)
    return [500 + (stream * 7919 + k * 104729) % span for k in range(length)]


def run(plan: Plan, target: str, drafter: str | None, s: CheckSettings, receipt: Receipt,
        advance: Callable[[int], None] = lambda n: None) -> None:
    """Fill the plan's streams and record predicted against measured into `receipt`."""
    i = plan.inputs
    rss_base = rss_bytes()
    mx.reset_peak_memory()
    started = time.perf_counter()
    engine = Engine(target, drafter, Settings(i.parallel, i.context, i.prompt_cache_gib, i.drafter_bits, i.chunk))
    load_seconds = time.perf_counter() - started
    load_peak = mx.get_peak_memory()
    beside_mlx = rss_bytes() - mx.get_active_memory() - mx.get_cache_memory()  # interpreter, libraries, tokenizer
    prompt_len = i.context - s.max_tokens
    requests = [Request(prompt_ids(prompt_len, j, i.target.vocab_size), max_tokens=s.max_tokens, ignore_eos=True,
                        seed=j, id=f"stream-{j}") for j in range(i.parallel)]
    handles = [engine.submit(r) for r in requests]
    while engine.lanes.busy:
        engine.step()
        advance(1)
    results = [h.result() for h in handles]
    mlx_peak, rss_peak, mlx_cache = mx.get_peak_memory(), peak_rss_bytes(), mx.get_cache_memory()
    loaded = engine.loaded
    receipt.server.update(
        engine="bundled (in-process)", target=loaded.config.name if loaded else target, drafter=engine.drafter_kind,
        target_weights_sha256=loaded.weights_sha256 if loaded else None, startup_line=engine.startup_line(),
        peak_bytes=mlx_peak,
    )
    for r, res in zip(requests, results):
        st = res.stats
        receipt.records.append({
            "id": r.id, "prompt_tokens": st.prompt_tokens, "cached_tokens": st.cached_tokens,
            "completion_tokens": len(res.tokens), "token_sha": token_sha(res.tokens), "finish": res.finish,
            "rounds": st.rounds, "tokens_per_round": st.tokens_per_round, "prefill_seconds": st.prefill_seconds,
            "decode_seconds": st.decode_seconds, "error": res.error,
        })
        if res.finish != "length":
            receipt.fail("plan", r.id, f"{r.id} finished with {res.finish!r} ({res.error}), not after max_tokens")
    predicted, process = plan.total_bytes, plan.total_bytes + beside_mlx
    receipt.aggregates.update(
        plan=plan.to_dict(),
        measured={"mlx_peak_bytes": mlx_peak, "mlx_load_peak_bytes": load_peak, "mlx_cache_bytes_after": mlx_cache,
                  "rss_peak_bytes": rss_peak, "rss_before_load_bytes": rss_base,
                  "rss_beside_mlx_after_load_bytes": beside_mlx, "load_seconds": load_seconds,
                  "rounds": engine.lanes.rounds},
        comparison={
            "mlx": {"predicted_bytes": predicted, "measured_bytes": mlx_peak, "error": predicted / mlx_peak - 1},
            "process": {"predicted_bytes": process, "measured_bytes": rss_peak, "error": process / rss_peak - 1},
            "tolerance": s.tolerance,
        },
    )
    for what, c in receipt.aggregates["comparison"].items():
        if what == "tolerance":
            continue
        if abs(c["error"]) > s.tolerance:
            receipt.fail("plan", what, f"{what}: predicted {c['predicted_bytes']:,} B, measured "
                                       f"{c['measured_bytes']:,} B ({c['error']:+.1%}, beyond ±{s.tolerance:.0%})")
        elif c["error"] < 0:
            receipt.warn("plan", what, f"{what}: the plan is {-c['error']:.1%} under the measured peak")


def table(r: Receipt) -> Table:
    """Predicted against measured, from a plan --check receipt (what `show` prints for kind "plan")."""
    c = r.aggregates.get("comparison", {})
    t = Table(title=f"plan --check: predicted vs measured peak (tolerance ±{c.get('tolerance', 0):.0%})")
    for col in ("peak", "predicted MiB", "measured MiB", "error"):
        t.add_column(col, justify="left" if col == "peak" else "right")
    for what, label in (("mlx", "MLX peak (the plan)"), ("process", "process RSS (plan + what loading left beside MLX)")):
        if what in c:
            t.add_row(label, f"{c[what]['predicted_bytes'] / 2**20:,.1f}", f"{c[what]['measured_bytes'] / 2**20:,.1f}",
                      f"{c[what]['error']:+.1%}")
    return t
