"""The device's timeline over decode rounds: how long it is busy a round, and how long it waits between kernels.

usage (on the GPU machine): python3 tools/round_timeline.py TARGET --drafter DRAFTER [--streams S] [--rounds R]
                                [--warm W] [--writes as-is|held|synced] [--out TRACE_DIR] [--ops-per-graph N]
                                [--drafter-bits B]
       python3 tools/round_timeline.py --report TRACE.json [--rounds R]

round_split.py times a round from the host: where a drafted round's `read` waits, the device is behind, but
not whether its kernels are long or it idles between them. round_kernels.py (Nsight Compute) runs each kernel
alone, so it gives each kernel's time and no gaps. This records the kernels as they ran, in the engine's own
order and overlap, with CUPTI through PyTorch's profiler in the same process as MLX (the GPU machine's python3
holds PyTorch; CUPTI's kernel records cover every kernel of the process, MLX's too). The engine serves TARGET
with DRAFTER as engine-speed does (gpu mode, warmed; TARGET `default` is the default model; `--drafter-bits 4`
its drafter as 4-bit copies, engine-speed's `--drafter-bits`); on engine-speed's
code probe S plain and then S drafted requests (one by default) decode a few warm rounds each, then R rounds under
the profiler, each `Engine.step` marked. Per mode:
the rounds' wall time from the host's marks, the device's busy time (the union of kernel intervals) and idle
time inside the same span, the idle time split by gap length (a gap under 10 us is a launch's own latency;
longer ones wait on the host), kernels a round, and the kernel kinds by busy time. The device runs a round's
work behind its host round (lanes.py queues the next round before reading the last), so the span is from the
first marked step's start to the start of the step after the last, and the kernels counted are those starting in it.
The host's phases are marked too (the target's forward, the drafter's pass and absorb, the rollback's keep, MLX's
`async_eval` and `eval`, and the read of a round's choices: round_split.PHASES), so each stretch of device idle
time is put to what the host was doing then: idle while the host is in `async_eval` is MLX encoding work it has not handed over
yet (its CUDA backend hands the device graphs of up to MLX_MAX_OPS_PER_BUFFER operations: the engine's
backend.CUDA_GRAPH_LIMITS unless the environment or `--ops-per-graph` names another), idle
in a forward or a drafter pass is Python building a graph with nothing queued before it. The host's CUDA API calls
a round are summed by name (CUPTI's runtime and driver records): MLX instantiates a CUDA graph whose shape its cache
has not seen and only updates one it has (mlx/backend/cuda/device.cpp's `commit`), and the two differ in cost; each
instantiation is listed with its round and host phase. The longest launches are listed with their grids, and
the longest of MLX's own kernels (copies, gathers) apart. Each mode's report ends with the GPU's clocks over its
profiled rounds (tools/gpu_clocks.py: nvidia-smi's samples), to read its launches' times against the alone
timings' (tools/row_kernel_variants.py prints its own).

`--writes` tests why a round meets new graphs (docs/gpu-round-profile.md, session 45): MLX's slice update and
scatter, the attention caches' writes (engine/cache.py), copy the whole cache first unless MLX may donate its
buffer, which it may only where nothing else holds the cache, and the round before, still running on the device,
holds it until it ends: so whether a write is one node or two turns on timing. `held` keeps each write's input
referenced until the cache's next write (never donated: a copy every write, every round alike); `synced` waits for
the device before each round (every write donated, the rounds no longer overlapping the host's build).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from gpu_clocks import ClockLog
from round_kernels import kernel_kind

ROUND = "dflash_bench_round"
WARM_ROUNDS = 6
OUTSIDE = "outside any mark"
# the host phases' marks: round_split.PHASES' labels (not imported here: round_split imports MLX, which reads
# MLX_MAX_OPS_PER_BUFFER when it starts, and `main` sets that first)
PHASE_LABELS = ("forward", "drafter", "keep", "async_eval", "eval", "read")
NAMES = {ROUND: "the round, in no phase"}  # what a report calls a mark


@dataclass(frozen=True)
class Interval:
    name: str
    start: float  # us
    end: float  # us
    grid: tuple[int, ...] = ()  # a kernel's grid, where the trace gives it


@dataclass(frozen=True)
class Timeline:
    rounds: int
    wall_ms: float  # a round, from the host's marks
    busy_ms: float  # a round: the union of the kernels' intervals
    kernels: float  # a round
    gaps_ms: dict[str, float]  # idle ms a round by gap length
    kinds: list[tuple[str, float, float]]  # (kind, busy ms a round, launches a round), most busy first


GAP_BINS = ((10.0, "< 10 us"), (100.0, "10-100 us"), (float("inf"), ">= 100 us"))
CALL_CATEGORIES = ("cuda_runtime", "cuda_driver")  # the categories PyTorch's profiler gives CUDA API calls


def read_trace(path: str) -> tuple[list[Interval], list[Interval], list[Interval], list[Interval]]:
    """The kernels, the marked rounds, the marked host phases and the host's CUDA runtime and driver API calls of a
    Chrome trace PyTorch's profiler wrote (CUPTI records every thread's calls, MLX's too: the host's side of handing
    work over, graph instantiations or updates, launches, allocations, waits)."""
    events = json.loads(Path(path).read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    kernels, rounds, phases, calls = [], [], [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = Interval(e.get("name", ""), float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e.get("cat") == "kernel":
            kernels.append(replace(span, grid=tuple(e.get("args", {}).get("grid", ()))))
        elif e.get("cat") in CALL_CATEGORIES:
            calls.append(span)
        elif str(e.get("cat", "")).startswith("gpu_"):  # the GPU track's echo of a host mark
            continue
        elif span.name == ROUND:
            rounds.append(span)
        elif span.name in PHASE_LABELS:
            phases.append(span)
    return kernels, sorted(rounds, key=lambda r: r.start), phases, calls


def calls_by_name(calls: list[Interval], rounds: list[Interval], count: int | None = None) -> list[tuple[str, float, float]]:
    """(name, ms a round, calls a round) of the API calls that start in `summarize`'s span, most time first: whether a
    round pays graph instantiations where another pays updates shows here, not in the kernels."""
    count, lo, hi = span(rounds, count)
    spent, made = collections.Counter(), collections.Counter()
    for c in calls:
        if lo <= c.start < hi:
            spent[c.name] += c.end - c.start
            made[c.name] += 1
    return [(name, us / count / 1e3, made[name] / count) for name, us in spent.most_common()]


def describe_calls(calls: list[tuple[str, float, float]], top: int = 12) -> str:
    return "\n".join(["  the host's CUDA API calls a round:"]
                     + [f"  {ms:8.3f} ms {n:7.1f}x {name}" for name, ms, n in calls[:top]])


def instantiations(calls: list[Interval], rounds: list[Interval], marks: list[Interval],
                   count: int | None = None) -> list[tuple[int, str, float]]:
    """(round, innermost host mark, ms) of each `cudaGraphInstantiate` in `summarize`'s span, rounds counted from 0:
    whether MLX meets graphs its cache has not seen at every round, at some, or only after a request starts
    shows in which rounds they fall, and what the host was doing says which of the round's graphs it was."""
    count, lo, hi = span(rounds, count)
    pieces = host_pieces(marks + list(rounds))
    found = []
    for c in sorted(calls, key=lambda c: c.start):
        if c.name != "cudaGraphInstantiate" or not lo <= c.start < hi:
            continue
        at = max(i for i, r in enumerate(rounds[: count + 1]) if r.start <= c.start)
        phase = next((p.name for p in pieces if p.start <= c.start < p.end), OUTSIDE)
        found.append((at, NAMES.get(phase, phase), (c.end - c.start) / 1e3))
    return found


def longest(kernels: list[Interval], rounds: list[Interval], top: int = 8, count: int | None = None,
            mlx_only: bool = False) -> list[Interval]:
    """The `top` longest kernel launches that start in `summarize`'s span, longest first: a kind's busy time a round
    says how much, not whether it is many short launches or a few long ones (a copy of a whole cache, say).
    `mlx_only`: MLX's own kernels alone, not this engine's (`custom_kernel`s), whose longest are the wide products
    every round runs; a drafted 9B round's copies took 0.76 ms against a plain one's 0.19 at the same launch count
    (docs/gpu-round-profile.md, session 46), and which copies those are shows only here."""
    _, lo, hi = span(rounds, count)
    return sorted((k for k in kernels if lo <= k.start < hi and not (mlx_only and "custom_kernel" in k.name)),
                  key=lambda k: k.start - k.end)[:top]


def describe_longest(found: list[Interval], what: str = "launches") -> str:
    return "\n".join([f"  the longest {what}:"] + [
        f"  {(k.end - k.start) / 1e3:8.3f} ms grid {'x'.join(map(str, k.grid)) or '?':>12} {kernel_kind(k.name)}"
        for k in found])


def describe_instantiations(found: list[tuple[int, str, float]]) -> str:
    if not found:
        return "  graph instantiations: none"
    return "  graph instantiations (round, host phase, ms): " + ", ".join(f"{r} {p} {ms:.2f}" for r, p, ms in found)


def span(rounds: list[Interval], count: int | None) -> tuple[int, float, float]:
    """The first `count` marked rounds (all but the last where None: its start ends the span): their count and
    the span from the first one's start to the start of the one after them."""
    count = len(rounds) - 1 if count is None else count
    if count < 1 or len(rounds) < count + 1:
        raise ValueError(f"need {count + 1} marked rounds, got {len(rounds)}")
    return count, rounds[0].start, rounds[count].start


def summarize(kernels: list[Interval], rounds: list[Interval], count: int | None = None) -> Timeline:
    """The first `count` marked rounds (`span`) and the kernels that start inside their span."""
    count, lo, hi = span(rounds, count)
    inside = sorted((k for k in kernels if lo <= k.start < hi), key=lambda k: k.start)
    busy, end = 0.0, None
    gaps, per_kind, launches = collections.Counter(), collections.Counter(), collections.Counter()
    for k in inside:
        if end is None or k.start > end:  # a busy stretch begins, after the device sat idle (but at the first)
            if end is not None:
                gaps[next(label for limit, label in GAP_BINS if k.start - end < limit)] += k.start - end
            busy += k.end - k.start
            end = k.end
        elif k.end > end:  # overlaps the stretch and runs past it
            busy += k.end - end
            end = k.end
        kind = kernel_kind(k.name)
        per_kind[kind] += k.end - k.start
        launches[kind] += 1
    return Timeline(count, (hi - lo) / count / 1e3, busy / count / 1e3, len(inside) / count,
                    {label: gaps[label] / count / 1e3 for _, label in GAP_BINS},
                    [(kind, us / count / 1e3, launches[kind] / count) for kind, us in per_kind.most_common()])


def host_pieces(marks: list[Interval]) -> list[Interval]:
    """The host's timeline as consecutive pieces, each named for the innermost mark open over it. Marks of one
    thread nest (a child ends by its parent's end; a child running past it is cut there), so a sweep with a
    stack of open marks finds the innermost one at every instant; time in no mark has no piece."""
    pieces, stack, at = [], [], 0.0
    for m in sorted(marks, key=lambda m: (m.start, -m.end)):
        while stack and stack[-1].end <= m.start:
            done = stack.pop()
            if done.end > at:
                pieces.append(Interval(done.name, at, done.end))
            at = max(at, done.end)
        if stack and m.start > at:
            pieces.append(Interval(stack[-1].name, at, m.start))
        stack.append(Interval(m.name, m.start, min(m.end, stack[-1].end) if stack else m.end))
        at = m.start
    while stack:
        done = stack.pop()
        if done.end > at:
            pieces.append(Interval(done.name, at, done.end))
        at = max(at, done.end)
    return pieces


def idle_by_phase(kernels: list[Interval], rounds: list[Interval], marks: list[Interval],
                  count: int | None = None) -> dict[str, float]:
    """Idle ms a round over `summarize`'s span, by the innermost host mark open while the device idled (the round's
    own mark where no phase was: `ROUND`; OUTSIDE where none was), most first."""
    count, lo, hi = span(rounds, count)
    idle, at = [], lo
    for k in sorted(kernels, key=lambda k: k.start):
        if k.end <= at or k.start >= hi:
            continue
        if k.start > at:
            idle.append((at, k.start))
        at = max(at, k.end)
    if at < hi:
        idle.append((at, hi))
    pieces = host_pieces(marks + list(rounds))
    spent = collections.Counter()
    i = 0
    for start, end in idle:
        while i < len(pieces) and pieces[i].end <= start:
            i += 1
        at, j = start, i
        while at < end:
            if j < len(pieces) and pieces[j].start < end:
                piece = pieces[j]
                if piece.start > at:
                    spent[OUTSIDE] += piece.start - at
                spent[piece.name] += min(end, piece.end) - max(at, piece.start)
                at = min(end, piece.end)
                j += 1
            else:
                spent[OUTSIDE] += end - at
                at = end
    return {name: us / count / 1e3 for name, us in spent.most_common()}


def describe_idle(spent: dict[str, float]) -> str:
    return "  idle while the host was in: " + ", ".join(f"{NAMES.get(n, n)} {ms:.2f} ms" for n, ms in spent.items())


def describe(mode: str, t: Timeline, top: int = 15) -> str:
    idle = t.wall_ms - t.busy_ms
    lines = [f"== {mode}: {t.rounds} rounds, {t.wall_ms:.2f} ms a round; the device busy {t.busy_ms:.2f} ms "
             f"({100 * t.busy_ms / t.wall_ms:.0f}%), idle {idle:.2f} ms, {t.kernels:.0f} kernels a round; idle by gap: "
             + ", ".join(f"{label} {ms:.2f} ms" for label, ms in t.gaps_ms.items())]
    lines += [f"  {ms:8.3f} ms {n:7.1f}x {kind}" for kind, ms, n in t.kinds[:top]]
    return "\n".join(lines)


def report(mode: str, kernels: list[Interval], rounds: list[Interval], phases: list[Interval], calls: list[Interval],
           count: int | None) -> tuple[Timeline, str]:
    """One trace's summary and its report: the device's time by kind, its idle time by host phase, the host's CUDA
    calls, the graph instantiations, the longest launches and the longest of MLX's own (what `run` prints for each
    mode and `--report` for a trace written before)."""
    t = summarize(kernels, rounds, count)
    return t, "\n".join([describe(mode, t), describe_idle(idle_by_phase(kernels, rounds, phases, count)),
                          describe_calls(calls_by_name(calls, rounds, count)),
                          describe_instantiations(instantiations(calls, rounds, phases, count)),
                          describe_longest(longest(kernels, rounds, count=count)),
                          describe_longest(longest(kernels, rounds, count=count, mlx_only=True),
                                           "launches of MLX's own kernels")])


WRITES = ("as-is", "held", "synced")


@contextlib.contextmanager
def held_writes():
    """Each attention cache write's input (engine/cache.py's `placed`, and a dense target's every-layer and one-layer
    writes: engine/stacked_cache.py's `Stack.write` and `Stack.write_layer`) kept referenced by the cache until its
    next write, so MLX copies it into a new buffer at every write, never donating it (module docstring)."""
    import mlx.core as mx

    from dflash_bench.engine.cache import AttentionCache
    from dflash_bench.engine.stacked_cache import Stack

    placed, write, write_layer = AttentionCache.placed, Stack.write, Stack.write_layer

    def holding(self, caches, start, xs, rows):
        self.held_input = tuple(mx.array(c) for c in caches)  # the same array, a second reference
        return placed(self, caches, start, xs, rows)

    def holding_stack(self, start, kv, index):
        self.held_input = mx.array(self._kv)
        return write(self, start, kv, index)

    def holding_layer(self, layer, start, kv, index):
        self.flush()  # (the pending rows' write holds its own input)
        self.held_input = mx.array(self._kv)
        return write_layer(self, layer, start, kv, index)

    AttentionCache.placed, Stack.write, Stack.write_layer = holding, holding_stack, holding_layer
    try:
        yield
    finally:
        AttentionCache.placed, Stack.write, Stack.write_layer = placed, write, write_layer


def record(engine, prompt: list[int], draft: bool, rounds: int, trace: Path, streams: int = 1,
           warm: int = WARM_ROUNDS, synced: bool = False) -> str:
    """`warm` rounds of `streams` requests, then `rounds` + 1 marked rounds under the profiler, the trace to `trace`;
    `synced`: each round starts once the device has finished the one before. Returns the GPU's clocks over the
    marked rounds (tools/gpu_clocks.py)."""
    import mlx.core as mx
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from dflash_bench.engine.request import Request
    from round_split import around_phases

    def marked(fn, label: str):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            with record_function(label):
                return fn(*args, **kwargs)
        return call

    for seed in range(streams):
        engine.submit(Request(prompt, max_tokens=(warm + rounds + 4) * 17, ignore_eos=True, seed=seed,
                              draft=draft))
    with ClockLog() as clocks:  # sampling from the warm rounds on, so that it runs by the marked ones
        for _ in range(warm):
            if synced:
                mx.synchronize()
            engine.step()
        mx.synchronize()
        with around_phases(engine, marked), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.monotonic()
            for _ in range(rounds + 1):
                if synced:
                    mx.synchronize()
                with record_function(ROUND):
                    engine.step()
            mx.synchronize()
            torch.cuda.synchronize()
            end = time.monotonic()
    prof.export_chrome_trace(str(trace))
    while engine.lanes.busy:
        engine.step()
    return clocks.describe(start, end)


def run(target: str, drafter: str, rounds: int, out: Path, streams: int = 1, warm: int = WARM_ROUNDS,
        writes: str = "as-is", drafter_bits: int = 0) -> None:
    import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)

    from dflash_bench.engine.engine import Engine, Settings
    from round_split import probe_ids

    engine = Engine(target, drafter, Settings(parallel=max(4, streams), context=4096, backend="gpu",
                                              drafter_bits=drafter_bits))
    print(engine.startup_line(), flush=True)
    print(f"{streams} stream(s); MLX's CUDA graphs: {engine.graph_limits or 'not CUDA'}; cache writes {writes}; "
          f"drafter {f'{drafter_bits}-bit copies' if drafter_bits else 'as loaded'}", flush=True)
    prompt = probe_ids(engine).get("code", list(range(100, 356)))
    out.mkdir(parents=True, exist_ok=True)
    got = {}
    for mode in ("plain", "drafted"):
        trace = out / f"round-timeline-{mode}.json"
        with held_writes() if writes == "held" else contextlib.nullcontext():
            clocks = record(engine, prompt, mode == "drafted", rounds, trace, streams, warm, writes == "synced")
        kernels, marks, phases, calls = read_trace(str(trace))
        if not kernels:
            raise SystemExit(f"{trace} holds no kernel records: CUPTI did not see the engine's launches")
        got[mode], text = report(mode, kernels, marks, phases, calls, rounds)
        print(text, f"  {clocks} (the profiled rounds)", sep="\n", flush=True)
    print(f"drafted / plain: a round {got['drafted'].wall_ms / got['plain'].wall_ms:.2f}x, "
          f"the device's busy time {got['drafted'].busy_ms / got['plain'].busy_ms:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?")
    parser.add_argument("--drafter")
    parser.add_argument("--streams", type=int, default=1, help="requests decoding together in each mode (1)")
    parser.add_argument("--rounds", type=int, help="marked rounds to profile (16), or to report (all but the last)")
    parser.add_argument("--warm", type=int, default=WARM_ROUNDS, help=f"rounds before the profile ({WARM_ROUNDS})")
    parser.add_argument("--writes", choices=WRITES, default="as-is", help="the cache writes as they are, held, "
                        "or every round after the device's last (module docstring)")
    parser.add_argument("--out", default="round-timeline", help="where the traces go")
    parser.add_argument("--report", metavar="TRACE", help="summarize a trace this tool wrote")
    parser.add_argument("--ops-per-graph", type=int, help="MLX_MAX_OPS_PER_BUFFER for this run (read when MLX starts)")
    parser.add_argument("--drafter-bits", type=int, default=0, help="the drafter's matrices as copies of these bits "
                        "(0 keeps them as loaded), as engine-speed's --drafter-bits")
    args = parser.parse_args()
    if args.ops_per_graph:
        os.environ["MLX_MAX_OPS_PER_BUFFER"] = str(args.ops_per_graph)  # before run() imports MLX
    if args.report:
        print(report(Path(args.report).stem, *read_trace(args.report), args.rounds)[1])
    elif args.target and args.drafter:
        run(args.target, args.drafter, args.rounds or 16, Path(args.out), args.streams, args.warm, args.writes,
            args.drafter_bits)
    else:
        parser.error("give TARGET and --drafter, or --report TRACE")


if __name__ == "__main__":
    sys.exit(main())
