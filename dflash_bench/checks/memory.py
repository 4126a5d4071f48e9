"""plan --check: load the engine in this process, fill the planned streams, compare the peak with the plan.

The load is the plan's worst moment: every stream's prompt fills the context but for `max_tokens`
(enough to reach a few decode windows), and all streams start in the same round, so their prompt
chunks run packed in one forward a round and their last ones, the largest working sets, run together
while the caches hold the most a prompt pass grows them to.

Measured: MLX's peak (`mx.get_peak_memory`: what the planner prices) and, on the CPU, the process's
peak RSS while serving, predicted as the plan plus what the process holds beside MLX's arrays once
loaded (interpreter, libraries, tokenizer, BLAS buffers: measured, not priced), so that comparison
also catches MLX's buffer cache growing. Loading frees its own buffers (a packed drafter's
dequantization: about 160 MB), which glibc keeps in the heap and later hands to MLX: so the heap is
trimmed before the measure beside MLX, and on Linux the peak-RSS mark is reset then
(`/proc/self/clear_refs`), else both would count those buffers. On a GPU, MLX's arrays are device
memory and RSS is the host's (the CUDA context, libraries, and during the load whatever host pages
the weights pass through), so the verdict there is MLX's peak alone; the RSS figures are recorded
beside it, not judged.

Beside the totals it records what was held, measured from the arrays themselves: the target's and
the drafter's weights and the largest per-stream target and drafter states, next to the plan's terms
for them, so a miss can be traced to a term; and the drafter's added footprint (the plan with and
without it, and its measured weights and context caches).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
from rich.table import Table

from dflash_bench.checks.receipt import Receipt
from dflash_bench.engine.constants import MIB
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.planner import Plan
from dflash_bench.engine.request import Request, token_sha
from dflash_bench.engine.tiles import Weight

TOLERANCE = 0.10
PROGRESS_EVERY = 32  # rounds between progress lines on stderr (the progress bar draws only on a terminal)


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
    """The peak resident set since the last `reset_peak_rss` (Linux VmHWM), else since the start."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def release_freed_heap() -> None:
    """Hand the heap's freed pages back to the OS (glibc's malloc_trim; elsewhere nothing), so RSS
    counts live memory only."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Start the peak-RSS mark from now (Linux: clear_refs 5); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def prompt_ids(length: int, stream: int, vocab: int) -> list[int]:
    """A deterministic prompt of ordinary token ids (memory does not depend on which ids)."""
    span = max(vocab - 1000, 1)
    return [500 + (stream * 7919 + k * 104729) % span for k in range(length)]


def on_gpu() -> bool:
    """Whether MLX's arrays live in device memory (its default device is a GPU)."""
    return mx.default_device().type == mx.DeviceType.gpu


def _prompt_phase(plan: Plan, name: str) -> int:
    """A term's bytes during the prompt pass (exact for held terms: what the chunks grow them to)."""
    return sum(t.prompt for t in plan.terms if t.name == name)


def run(plan: Plan, target: str, drafter: str | None, s: CheckSettings, receipt: Receipt,
        advance: Callable[[int], None] = lambda n: None) -> None:
    """Fill the plan's streams and record predicted against measured into `receipt`."""
    i = plan.inputs
    rss_base = rss_bytes()
    mx.reset_peak_memory()
    started = time.perf_counter()
    engine = Engine(target, drafter, Settings(i.parallel, i.context, i.prompt_cache_gib, i.drafter_bits, i.chunk,
                                              backend=i.backend.name))
    load_seconds = time.perf_counter() - started
    receipt.environment["selfcheck"] = engine.selfcheck.as_dict() if engine.selfcheck else None
    load_peak = mx.get_peak_memory()
    release_freed_heap()
    beside_mlx = rss_bytes() - mx.get_active_memory() - mx.get_cache_memory()  # interpreter, libraries, tokenizer
    rss_peak_scope = "serving (reset once loaded)" if reset_peak_rss() else "the process's life, loading included"
    prompt_len = i.context - s.max_tokens
    requests = [Request(prompt_ids(prompt_len, j, i.target.vocab_size), max_tokens=s.max_tokens, ignore_eos=True,
                        seed=j, id=f"stream-{j}") for j in range(i.parallel)]
    handles = [engine.submit(r) for r in requests]
    state = {"target": 0, "drafter": 0}  # the largest stream's, when every prompt pass is done
    started, prefill_done = time.perf_counter(), None
    while engine.status().busy:
        engine.step()
        advance(1)
        now = engine.status()
        # how far it got, kept current: a run cut short (Ctrl-C, a time limit) still says it
        receipt.aggregates["progress"] = {
            "rounds": now.rounds, "seconds": time.perf_counter() - started, "load_seconds": load_seconds,
            "prompt_tokens_done": sum(st.pos for st in now.streams), "mlx_peak_bytes": mx.get_peak_memory()}
        if now.rounds % PROGRESS_EVERY == 0:
            print(f"plan --check: {json.dumps(receipt.aggregates['progress'])}", file=sys.stderr, flush=True)
        if prefill_done is None and all(st.prefill_done for st in now.streams):
            prefill_done = time.perf_counter() - started
            for st in now.streams:
                state["target"] = max(state["target"], st.target_state_bytes)
                state["drafter"] = max(state["drafter"], st.drafter_state_bytes)
    run_seconds = time.perf_counter() - started
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
    target_weights = sum(a.nbytes for w in loaded.weights.values()
                         for a in (w.arrays() if isinstance(w, Weight) else [w])) if loaded else 0
    drafter_weights = engine.drafter.nbytes if engine.drafter else 0
    held = {  # measured from the arrays (states when every prompt pass is done), beside the plan's terms
        "target_weights": {"planned_bytes": _prompt_phase(plan, "target weights"), "measured_bytes": target_weights},
        "target_state_per_stream": {"planned_bytes": _prompt_phase(plan, "attention K/V")
                                    + _prompt_phase(plan, "GatedDeltaNet state"), "measured_bytes": state["target"]},
    }
    if i.drafter:
        held["drafter_weights"] = {"planned_bytes": _prompt_phase(plan, "drafter weights"),
                                   "measured_bytes": drafter_weights}
        held["drafter_state_per_stream"] = {"planned_bytes": _prompt_phase(plan, "drafter context K/V"),
                                            "measured_bytes": state["drafter"]}
    comparison = {"mlx": {"predicted_bytes": predicted, "measured_bytes": mlx_peak, "error": predicted / mlx_peak - 1}}
    process_cmp = {"predicted_bytes": process, "measured_bytes": rss_peak, "error": process / rss_peak - 1}
    if on_gpu():
        receipt.warn("plan", "process", "on a GPU MLX's arrays are device memory: the host RSS comparison is "
                                        "recorded (measured.process_rss_on_gpu), not judged")
    else:
        comparison["process"] = process_cmp
    receipt.aggregates.update(
        plan=plan.to_dict(),
        measured={"mlx_peak_bytes": mlx_peak, "mlx_load_peak_bytes": load_peak, "mlx_cache_bytes_after": mlx_cache,
                  "rss_peak_bytes": rss_peak, "rss_peak_scope": rss_peak_scope, "rss_before_load_bytes": rss_base,
                  "rss_beside_mlx_after_load_bytes": beside_mlx, "load_seconds": load_seconds,
                  "run_seconds": run_seconds, "prefill_seconds": prefill_done, "rounds": engine.status().rounds,
                  "device": str(mx.default_device()), "backend": engine.backend.name,
                  "process_rss_on_gpu": process_cmp if on_gpu() else None},
        held=held,
        drafter={"plan_added_bytes": plan.drafter_added_bytes,
                 "plan_without_drafter_bytes": plan.without_drafter.total_bytes,
                 "planned_held_bytes": _prompt_phase(plan, "drafter weights")
                 + i.parallel * _prompt_phase(plan, "drafter context K/V"),
                 "measured_held_bytes": drafter_weights + i.parallel * state["drafter"]} if i.drafter else None,
        comparison={**comparison, "tolerance": s.tolerance},
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
            t.add_row(label, f"{c[what]['predicted_bytes'] / MIB:,.1f}", f"{c[what]['measured_bytes'] / MIB:,.1f}",
                      f"{c[what]['error']:+.1%}")
    held = r.aggregates.get("held") or {}
    if held:
        t.add_section()
    for name, h in held.items():
        err = f"{h['planned_bytes'] / h['measured_bytes'] - 1:+.1%}" if h["measured_bytes"] else "-"
        t.add_row(f"held: {name.replace('_', ' ')}", f"{h['planned_bytes'] / MIB:,.1f}",
                  f"{h['measured_bytes'] / MIB:,.1f}", err, style="dim")
    if d := r.aggregates.get("drafter"):
        t.add_section()
        t.add_row("the drafter adds (plan with it less plan without)", f"{d['plan_added_bytes'] / MIB:,.1f}", "",
                  "", style="cyan")
        t.add_row("the drafter holds (weights + every stream's context K/V after the prompt)",
                  f"{d['planned_held_bytes'] / MIB:,.1f}",
                  f"{d['measured_held_bytes'] / MIB:,.1f}",
                  f"{d['planned_held_bytes'] / max(d['measured_held_bytes'], 1) - 1:+.1%}", style="cyan")
    return t
