"""One decode step of a checkpoint, ours (gpu mode) against mlx-lm's: Python graph build, the host's
encoding of the graph, and the wait for the device; and the operations the step asks for.

usage (on the GPU machine, from the repo root): PYTHONPATH=/tmp/site:$PWD python3 tools/build_eval_split.py TARGET
       [--profile]

TARGET is any target the engine loads (`fixture qwen3_5-9b-4bit DIR`, `default`); mlx-lm's model runs on the same
weights (checks/mlx_lm_speed.py's `load`, which builds it on the engine's for a GGUF). After a 256-token prompt, each
engine's one-row step (1 and 4 streams) is built in Python, handed to `mx.async_eval` (which returns
once the host has encoded every operation for the device) and then waited for, no pipelining, median
of 5 after 3 warm steps: the forward's own cost, apart from what the engine's rounds (lanes.py) or
mlx-lm's `generate_step` add around it. A pipelined loop (lanes.py's lookahead, mlx-lm's
`generate_step`) overlaps the next step's build with this one's wait, never with its encoding, so
build + encode is the floor of a step on a host-bound machine. Then the step's operations by
primitive (`mx.export_to_dot` of the same graph; views left out, as in tools/forward_ops.py).

The H200's output is docs/profiles/build-eval-split-h200.txt (its first run split only build and
evaluation). On an H100 in session 51 the default model's one-row step built in 6.98 ms against mlx-lm's 1.58,
with 278 operations against 516 (211 of ours `mx.fast.cuda_kernel` launches), where a CPU builds the same forward
in 0.9 ms with every launch a ready array: `--profile` then splits our build: Python's profile of 20 builds (a
`cuda_kernel` call is a nanobind function, not a C function to cProfile, so its time is its caller's own: the
engine calls each variant's kernel object, `BakedKernel.bound`, from matmul_kernel.py's `run` and attention_kernel.py's
`Call`), beside `mx.quantized_matmul` and an add on the same rows (what mlx-lm's layers call instead); then an
empty kernel's call and evaluation by its source's size (`source_sweep`). (Until session 56 it also replayed each
launch through `BakedKernel.__call__`, which the engine's launches no longer pass through: it found none.)
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.checks import mlx_lm_speed
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.targets.base import Segment
from forward_ops import VIEWS, census  # tools/, the script's own folder
IDS = list(range(100, 400))


def timed(step) -> tuple[float, float, float]:
    """(build, encode, wait) ms of one step: `step()` builds the graph and returns (outputs, after),
    `after()` runs once it is evaluated."""
    a = time.perf_counter()
    outputs, after = step()
    b = time.perf_counter()
    mx.async_eval(outputs)
    c = time.perf_counter()
    mx.eval(outputs)
    d = time.perf_counter()
    after()
    return 1e3 * (b - a), 1e3 * (c - b), 1e3 * (d - c)


def report(who: str, streams: int, step) -> None:
    for _ in range(3):
        timed(step)
    runs = [timed(step) for _ in range(5)]
    build, encode, wait = (statistics.median(r[i] for r in runs) for i in range(3))
    outputs, after = step()
    counts = census(outputs)
    mx.eval(outputs)
    after()
    ops = {k: n for k, n in counts.items() if k not in VIEWS}
    top = ", ".join(f"{k} {n}" for k, n in sorted(ops.items(), key=lambda kv: -kv[1])[:12])
    print(f"{who} {streams} streams: build {build:.2f} ms, encode {encode:.2f} ms, wait {wait:.2f} ms; "
          f"{sum(ops.values())} operations ({top})", flush=True)


def ours(engine: Engine) -> None:
    target = engine.target
    states = [target.new_state() for _ in range(4)]
    for st in states:
        out = target.forward([Segment(IDS[:256], 0, st, [255], prefill=True)])
        mx.eval(out[0].logits, st.arrays())
        st.keep(256)
    for n in (1, 4):
        def step(n=n):
            outs = target.forward([Segment([7], st.length, st, [0]) for st in states[:n]])
            return [o.logits for o in outs] + [a for st in states[:n] for a in st.arrays()], \
                lambda: [st.keep(st.length) for st in states[:n]]
        report("ours", n, step)


def mlx_lm(engine: Engine) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    model = mlx_lm_speed.load(engine.loaded)
    for n in (1, 4):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([IDS[:256]] * n), cache=cache))
        mx.eval([c.state for c in cache])

        def step(n=n, cache=cache):
            out = model(mx.array([[7]] * n), cache=cache)
            return [out] + [a for c in cache for a in c.state if isinstance(a, mx.array)], lambda: None
        report("mlx-lm", n, step)


def per_call_us(call, reps: int = 200) -> float:
    """Median over 5 runs of `reps` calls of `call` (its arrays built, never evaluated), in us a call."""
    runs = []
    for _ in range(5):
        a = time.perf_counter()
        for _ in range(reps):
            call()
        runs.append((time.perf_counter() - a) / reps)
    return 1e6 * statistics.median(runs)


def profile(engine: Engine) -> None:
    """Where our step's build goes (module docstring): Python's own profile, then each launch replayed."""
    target = engine.target
    state = target.new_state()
    out = target.forward([Segment(IDS[:256], 0, state, [255], prefill=True)])
    mx.eval(out[0].logits, state.arrays())
    state.keep(256)

    def step():
        outs = target.forward([Segment([7], state.length, state, [0])])
        return outs

    def finish(outs):
        mx.eval([o.logits for o in outs], state.arrays())
        state.keep(state.length)

    for _ in range(3):
        finish(step())
    prof = cProfile.Profile()
    for _ in range(20):
        prof.enable()
        outs = step()
        prof.disable()
        finish(outs)
    print("our step's build, 20 builds under cProfile (tottime: a function's own time, its nanobind calls included):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    x = mx.zeros((1, 576), dtype=mx.bfloat16)
    w, scales, biases = mx.quantize(mx.zeros((576, 576), dtype=mx.bfloat16), group_size=32, bits=4)
    mx.eval(x, w, scales, biases)
    qmm = per_call_us(lambda: mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=32, bits=4))
    add = per_call_us(lambda: x + x)
    print(f"  mx.quantized_matmul (1 x 576 by 576 x 576, 4-bit): {qmm:.1f} us a call; an add: {add:.1f} us", flush=True)
    source_sweep()


def source_sweep() -> None:
    """What a launch costs by its source's size alone: a kernel of an empty body whose header is that many bytes of
    comment, its call (build) and its share of 200 such launches evaluated at once (encode and the device), beside
    200 adds: MLX builds a launch's whole source at each call and hashes it at each evaluation
    (mlx/backend/cuda/custom_kernel.cpp upstream), so a long source could cost at both."""
    x = mx.zeros((16,), dtype=mx.float32)
    mx.eval(x)

    def evaluated_us(call) -> float:
        runs = []
        for _ in range(5):
            outs = [call() for _ in range(200)]
            a = time.perf_counter()
            mx.eval(outs)
            runs.append((time.perf_counter() - a) / 200)
        return 1e6 * statistics.median(runs)

    add = lambda: x + 1.0  # noqa: E731
    mx.eval(add())
    print(f"  200 adds: {per_call_us(add):.1f} us a call, {evaluated_us(add):.1f} us each evaluated", flush=True)
    for size in (0, 4096, 16384, 65536):
        header = ("// " + "x" * 76 + "\n") * (size // 80)
        kernel = mx.fast.cuda_kernel(name=f"probe_size_{size}", input_names=["x"], output_names=["y"], source="",
                                     header=header)

        def call(kernel=kernel):
            return kernel(inputs=[x], output_shapes=[(16,)], output_dtypes=[mx.float32], grid=(16, 1, 1),
                          threadgroup=(16, 1, 1))[0]

        mx.eval(call())  # compiled once, before timing
        print(f"  an empty body with {len(header)} bytes of header: {per_call_us(call):.1f} us a call, "
              f"{evaluated_us(call):.1f} us each of 200 evaluated", flush=True)


if __name__ == "__main__":
    served = Engine(sys.argv[1], None, Settings(parallel=4, context=4096, backend="gpu", warm=False))
    ours(served)
    mlx_lm(served)
    if "--profile" in sys.argv[2:]:
        profile(served)
    print("done", flush=True)
