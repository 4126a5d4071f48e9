"""One decode step of a checkpoint, ours (gpu mode) against mlx-lm's: Python graph build vs evaluation.

usage (on the GPU machine, from the repo root): PYTHONPATH=/tmp/site:$PWD python3 tools/build_eval_split.py DIR

DIR is an mlx-lm-loadable checkpoint (`fixture qwen3_5-9b-4bit DIR`). After a 256-token prompt, each
engine's one-row step (1 and 4 streams) is built in Python and then evaluated on its own, no
pipelining, median of 5 after 3 warm steps: the forward's own cost, apart from what the engine's
rounds (lanes.py) or mlx-lm's `generate_step` add around it. The H200's output is
docs/profiles/build-eval-split-h200.txt.
"""
import sys, time
import dflash_bench  # noqa: F401
import mlx.core as mx
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.targets.base import Segment
path = sys.argv[1]
eng = Engine(path, None, Settings(parallel=4, context=4096, backend="gpu"))
t = eng.target
ids = list(range(100, 400))
sts = [t.new_state() for _ in range(4)]
for st in sts:
    o = t.forward([Segment(ids[:256], 0, st, [255], prefill=True)]); mx.eval(o[0].logits, st.arrays()); st.keep(256)
def ours(n):
    segs = [Segment([7], st.length, st, [0]) for st in sts[:n]]
    a = time.perf_counter(); o = t.forward(segs); b = time.perf_counter()
    mx.eval([x.logits for x in o], [st.arrays() for st in sts[:n]]); c = time.perf_counter()
    for st in sts[:n]: st.keep(st.length)
    return 1e3 * (b - a), 1e3 * (c - b)
for n in (1, 4):
    res = [ours(n) for _ in range(8)][3:]
    print(f"ours {n} streams: build {sorted(r[0] for r in res)[2]:.2f} ms eval {sorted(r[1] for r in res)[2]:.2f} ms", flush=True)
del eng, t, sts
from mlx_lm.utils import load_model
from mlx_lm.models.cache import make_prompt_cache
model, _ = load_model(__import__("pathlib").Path(path))
for n in (1, 4):
    cache = make_prompt_cache(model)
    x = mx.array([ids[:256]] * n)
    mx.eval(model(x, cache=cache)); mx.eval([c.state for c in cache])
    res = []
    for _ in range(8):
        y = mx.array([[7]] * n)
        a = time.perf_counter(); out = model(y, cache=cache); b = time.perf_counter()
        mx.eval(out, [c.state for c in cache]); c = time.perf_counter()
        res.append((1e3 * (b - a), 1e3 * (c - b)))
    res = res[3:]
    print(f"mlx-lm {n} streams: build {sorted(r[0] for r in res)[2]:.2f} ms eval {sorted(r[1] for r in res)[2]:.2f} ms", flush=True)
print("done", flush=True)
