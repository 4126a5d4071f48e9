"""One decode step of a checkpoint, ours (gpu mode) against mlx-lm's: Python graph build, the host's
encoding of the graph, and the wait for the device; and the operations the step asks for.

usage (on the GPU machine, from the repo root): PYTHONPATH=/tmp/site:$PWD python3 tools/build_eval_split.py TARGET

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
evaluation).
"""

from __future__ import annotations

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


if __name__ == "__main__":
    served = Engine(sys.argv[1], None, Settings(parallel=4, context=4096, backend="gpu", warm=False))
    ours(served)
    mlx_lm(served)
    print("done", flush=True)
