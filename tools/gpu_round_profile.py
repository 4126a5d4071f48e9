"""Where a decode round's time goes: the engine's forward on one checkpoint, timed whole and op by op.

usage: python3 tools/gpu_round_profile.py TARGET OUT.json [--backend gpu|cpu] [--context 1024]

Made for the GPU machine (its findings: docs/gpu-round-profile.md), it runs anywhere MLX does. Every figure is
the median of several timed calls after warm-up, each call evaluated alone (mx.eval, then
mx.synchronize), so the per-op figures include one launch's overhead each, as the engine pays it:
- the whole target forward at `--context` keys: a plain step (1 row), a 16-row window, 4 streams of
  1 row and 4 streams of 16 rows (what one round costs at 1 and 4 streams, plain and drafted);
- per distinct projection weight: `tiles.linear` at 16 rows (the engine's decode tile) and the same
  product at 1 row (what a one-token step of mlx-lm multiplies);
- one attention layer's decode attention (`tiles.attention`) at 1 and 16 query rows;
- qwen3_5's decode recurrence, the one the layer runs here (`GatedDeltaNet.recurrence`: the CUDA
  kernel on a CUDA GPU, `gated_delta_ops` elsewhere), at 1 and 16 rows and for 4 streams of 16;
- mlx-lm's own model on the same files, one token after a `--context`-token prompt (its cache grows
  by one key a call), for qwen3_5, qwen3 and llama checkpoint folders.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g

from dflash_bench.engine import backend as backends
from dflash_bench.engine import selfcheck
from dflash_bench.engine.cache import TargetState, tiles_for
from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.targets import build_target
from dflash_bench.engine.targets.base import Segment, Target
from dflash_bench.engine.targets.dense import SelfAttention
from dflash_bench.engine.targets.qwen3_5 import RECURRENCES, GatedDeltaNet
from dflash_bench.engine.tiles import ROW_TILE, attention, key_mask, linear, pad_queries, query_positions

REPS, WARM = 10, 3


def timed(fn, reps: int = REPS) -> float:
    """Median milliseconds of `fn()` evaluated alone, after warm-up calls."""
    for _ in range(WARM):
        mx.eval(fn())
    mx.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def prefilled(target: Target, n: int, seed: int) -> TargetState:
    state = target.new_state()
    tokens = mx.random.randint(0, target.config.vocab_size, (n,), key=mx.random.key(seed)).tolist()
    for a in range(0, n, 256):
        target.forward([Segment(tokens[a : a + 256], a, state, prefill=True)])
        state.keep(min(n, a + 256))
        mx.eval(state.arrays())
    return state


def forwards(target: Target, context: int) -> dict[str, float]:
    """One round's target forward: streams x rows, each stream at `context` keys (fresh snapshots)."""
    bases = [prefilled(target, context, s) for s in range(4)]
    out = {}
    for streams, rows in ((1, 1), (1, 16), (4, 1), (4, 16)):
        def one() -> list[mx.array]:
            segs = [Segment([7] * rows, context, b.snapshot(context), list(range(rows))) for b in bases[:streams]]
            return [o.logits for o in target.forward(segs)]
        out[f"{streams} x {rows} rows"] = timed(one)
    return out


def projections(target: Target) -> dict[str, dict[str, float]]:
    out = {}
    for w in {selfcheck.weight_key(w): w for w in target.projections()}.values():
        x16 = mx.random.normal((ROW_TILE, w.in_features)).astype(target.dtype)
        out[selfcheck.weight_key(w)] = {"16 rows (tile)": timed(lambda: linear(x16, w)),
                                        "1 row": timed(lambda: w.tile(x16[:1])),
                                        "weight MB": w.nbytes / 1e6}
    return out


def attention_ms(a: SelfAttention, context: int, dtype: mx.Dtype) -> dict[str, float]:
    keys = tiles_for(context + 16)
    k = mx.random.normal((a.kv_heads, keys, a.head_dim)).astype(dtype)
    v = mx.random.normal((a.kv_heads, keys, a.head_dim)).astype(dtype)
    out = {}
    for rows in (1, 16):
        q = mx.random.normal((a.heads, rows, a.head_dim)).astype(dtype)
        seen = key_mask(query_positions(context, rows), 0, keys, context + rows)
        out[f"{rows} rows, {a.path}"] = timed(lambda: attention(pad_queries(q), k, v, seen, scale=a.scale, path=a.path))
    return out


def recurrence_ms(m: GatedDeltaNet) -> dict[str, float | str]:
    def window(rows: int) -> tuple[mx.array, ...]:
        return (mx.random.normal((rows, m.hk, m.dk)), mx.random.normal((rows, m.hk, m.dk)),
                mx.random.normal((rows, m.hv, m.dv)), compute_g(m.A_log, mx.random.normal((rows, m.hv)), m.dt_bias),
                mx.sigmoid(mx.random.normal((rows, m.hv))), mx.zeros((m.hv, m.dv, m.dk)))

    run, out = RECURRENCES[m.recurrence], {"recurrence": m.recurrence}
    for rows in (1, 16):
        one = [window(rows)]
        out[f"{rows} rows"] = timed(lambda: [a for pair in run(one) for a in pair])
    four = [window(16) for _ in range(4)]
    out["4 streams of 16 rows"] = timed(lambda: [a for pair in run(four) for a in pair])
    return out


def mlx_lm_step(path: Path, context: int) -> dict[str, float]:
    """mlx-lm's forward of one token after a `context`-token prompt, on its own loading of the files."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, 1000, (1, context), key=mx.random.key(0))
    for a in range(0, context, 256):
        mx.eval(model(prompt[:, a : a + 256], cache=cache))
    token = mx.array([[7]])
    return {"1 token": timed(lambda: model(token, cache=cache))}  # the cache grows by a key a call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--backend", default="gpu")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    mode = backends.resolve(args.backend)
    loaded = load_target(args.target, mode.dtype, packed=not mode.dequantizes)
    target = build_target(loaded.config, loaded.weights, mode.dtype)
    verdict = selfcheck.check(target)
    report: dict = {"target": str(loaded.path), "backend": mode.name, "context": args.context,
                    "device": verdict.machine["device"], "mlx": mx.__version__, "selfcheck": verdict.line()}

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1), flush=True)

    report["forward_ms"] = forwards(target, args.context)
    save()
    report["projection_ms"] = projections(target)
    mixers = target.mixer_layers()
    attn = next(m for m in mixers if isinstance(m, SelfAttention))
    report["attention_ms_one_layer"] = attention_ms(attn, args.context, mode.dtype)
    report["layers"] = {"attention": sum(isinstance(m, SelfAttention) for m in mixers),
                        "recurrent": sum(isinstance(m, GatedDeltaNet) for m in mixers)}
    if rec := next((m for m in mixers if isinstance(m, GatedDeltaNet)), None):
        report["recurrence_ms_one_layer"] = recurrence_ms(rec)
    save()
    if loaded.path.is_dir():
        try:
            report["mlx_lm_ms"] = mlx_lm_step(loaded.path, args.context)
        except Exception as err:  # a reference figure only: the engine's own figures stand without it
            report["mlx_lm_ms"] = {"error": f"{type(err).__name__}: {err}"}
    save()


if __name__ == "__main__":
    main()
