"""Would one compiled function per GatedDeltaNet layer make a plain round cheaper on the host, and keep its bits?

usage: python3 tools/compile_probe.py [TARGET] [--backend auto|cpu|gpu] [--streams N] [--steps T]
(on the GPU machine: PYTHONPATH=/tmp/site:$PWD python3 tools/compile_probe.py /root/t9 --backend gpu)

A plain round on the H200 is host-bound: building the forward's graph in Python and MLX encoding it
are 85-93% of it (docs/profiles/round-split-h200.txt). This probe runs T one-row steps of N streams
of a qwen3_5 target twice from the same prompt: as the engine builds them, then with every
GatedDeltaNet layer's decode rows as one `mx.compile`d function of the rows and the streams' conv
tails and states (the engine's own layer: norm, stacked in_proj, conv, recurrence, gated norm,
out_proj, MLP), and prints
per step the median Python build and evaluation times of each, the first compiled step's time
(tracing and kernel compiles), whether the logits and states are bit-equal, and whether each way's
steps equal the rows of one decode window run as built (window == steps: what drafting needs if only
plain rounds were compiled; fused elementwise chains may round differently from separate kernels on
a GPU). Without TARGET it writes the `tiny` 9B-pattern fixture (8 layers) to a temporary folder.

On this CPU (gpu mode, tiny fixture, one stream) the compiled layers cut graph building from 2.04 to
0.95 ms in one run and from 2.58 to 1.74 ms in another (the CPU shared), with bit-equal logits; on the H200 an engine with such layers did not finish loading in 10 minutes
(docs/gpu-round-profile.md). Run alone there, the compiled layers kept every bit but made a step
slower: build 3.66 and eval 10.09 ms against 3.54 and 7.68 ms as built (docs/profiles/compile-probe-h200.txt),
so the engine does not compile its layers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine.cache import LinearCache, TargetState
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.targets import qwen3_5
from dflash_bench.engine.targets.base import Segment
from dflash_bench.engine.tiles import Layout
from dflash_bench.fixtures.big import write_big


def decode_layer(plain_layer: Callable, i: int, streams: int, x: mx.array, convs: list[mx.array],
                 states: list[mx.array]) -> tuple[mx.array, list[mx.array], list[mx.array]]:
    """The engine's layer i (`plain_layer`) over `streams` one-row decode segments, as a function of
    arrays alone: the segments' caches are stand-ins holding the conv tails and states given, read back
    after the layer moved them past the row."""
    caches = [LinearCache(conv=conv, state=state) for conv, state in zip(convs, states)]
    segments = [Segment([0], 0, TargetState([None] * i + [cache])) for cache in caches]
    x = plain_layer(i, x, segments, Layout.of([1] * streams, [False] * streams))
    return x, [c.conv for c in caches], [c.state for c in caches]


def compiled_layers(target: qwen3_5.HybridTarget, streams: int):
    """`target.layer` with its GatedDeltaNet layers compiled for one-row decode rounds of `streams`."""
    plain_layer, fns = target.layer, {}

    def layer(i: int, x: mx.array, segments: list[Segment], layout: Layout) -> mx.array:
        if not isinstance(target.mixers[i], qwen3_5.GatedDeltaNet) or any(
                seg.prefill or len(seg.tokens) != 1 for seg in segments):  # prompts and windows as built
            return plain_layer(i, x, segments, layout)
        if i not in fns:
            fns[i] = mx.compile(partial(decode_layer, plain_layer, i, streams))
        caches = [seg.state.layers[i] for seg in segments]
        x, tails, states = fns[i](x, [c.conv for c in caches], [c.state for c in caches])
        for seg, c, tail, state in zip(segments, caches, tails, states):
            c.redo, c.conv, c.state = None, tail, state
            c.window_start, c.length = seg.start, seg.start + 1
        return x

    return layer


def prefilled(target: qwen3_5.HybridTarget, streams: int) -> list:
    """Each stream's state after its 64-token prompt."""
    states = [target.new_state() for _ in range(streams)]
    for s, st in enumerate(states):
        out = target.forward([Segment(list(range(10 + s, 74 + s)), 0, st, [63], prefill=True)])
        mx.eval(out[0].logits, st.arrays())
        st.keep(64)
    return states


def window(target: qwen3_5.HybridTarget, rows: int) -> mx.array:
    """Stream 0's next `rows` tokens (those `run` feeds) as one decode window, as built: its logits."""
    st = prefilled(target, 1)[0]
    out = target.forward([Segment([5 + j for j in range(rows)], st.length, st, list(range(rows)))])
    mx.eval(out[0].logits)
    return out[0].logits


def run(target: qwen3_5.HybridTarget, streams: int, steps: int) -> tuple[list[float], list[float], list[mx.array]]:
    """T plain steps of `streams` streams after the same prompt: build and eval ms, and every output
    (per step: each stream's logits, then every state array)."""
    states = prefilled(target, streams)
    build, evals, outs = [], [], []
    for step in range(steps):
        t0 = time.perf_counter()
        got = target.forward([Segment([5 + step], st.length, st, [0]) for st in states])
        t1 = time.perf_counter()
        mx.eval([o.logits for o in got], [st.arrays() for st in states])
        t2 = time.perf_counter()
        for st in states:
            st.keep(st.length)
        build.append(1e3 * (t1 - t0))
        evals.append(1e3 * (t2 - t1))
        outs += [o.logits for o in got] + [a for st in states for a in st.arrays()]
    return build, evals, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?")
    parser.add_argument("--backend", default="gpu")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    path = args.target or write_big("qwen3_5-9b-4bit", Path(tempfile.mkdtemp()) / "target", "tiny")
    engine = Engine(path, None, Settings(parallel=args.streams, context=512, backend=args.backend, warm=False))
    target = engine.target
    assert isinstance(target, qwen3_5.HybridTarget), "the probe is for qwen3_5 targets"
    print(engine.startup_line(), flush=True)
    rows = min(args.steps, 16)
    as_window = window(target, rows)  # before the compiled layers: a window runs the built path either way
    results = {}
    for name in ("as built", "compiled"):
        if name == "compiled":
            target.layer = compiled_layers(target, args.streams)
        build, evals, outs = run(target, args.streams, args.steps)
        results[name] = outs
        print(f"{name}: first step {build[0] + evals[0]:.1f} ms; then build {statistics.median(build[1:]):.2f} ms, "
              f"eval {statistics.median(evals[1:]):.2f} ms a step ({args.streams} stream(s), median of "
              f"{args.steps - 1})", flush=True)
    equal = all(mx.array_equal(a, b).item() for a, b in zip(results["as built"], results["compiled"]))
    print(f"logits and states bit-equal over {args.steps} steps: {equal}", flush=True)
    per_step = args.streams * (1 + len(target.new_state().arrays()))
    for name, outs in results.items():  # stream 0's logits at each step beside the window's rows
        steps = [outs[j * per_step] for j in range(rows)]
        same = all(mx.array_equal(step[0], as_window[j]).item() for j, step in enumerate(steps))
        print(f"{name} steps equal a {rows}-row window's rows (window == steps): {same}", flush=True)


if __name__ == "__main__":
    main()
