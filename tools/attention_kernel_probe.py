"""Probe decode attention on a CUDA GPU: our kernel (engine/targets/attention_kernel.py) against the path it
replaces (`tiles.attention` once per segment, as dense.py runs it), and its exactness.

Run from the repo root on the GPU machine (about 30-60 s on an H200, most of it NVRTC compiles and the
float64 reference):

    PYTHONPATH=/tmp/site:$PWD python3 tools/attention_kernel_probe.py

For each head shape (Qwen3.5-9B's full-attention layers, qwen3's, SmolLM2-135M's) at 1,024 and 4,096
keys a stream and each layout (segments x rows), it prints: the kernel's ms and the per-segment tiled
path's ms (medians of 20 calls after 3 warm-ups, each call bracketed by `mx.eval` and
`mx.synchronize`), the kernel's largest error against a float64 reference (relative to the largest
output), and two bit-exact checks: each segment's window equals its rows launched one at a time (with
junk in the cache after each step's row), and segments launched together equal each alone. A case that
raises prints its error and the probe goes on.
"""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable

import numpy as np

import mlx.core as mx

from dflash_bench.engine.cache import GROW, tiles_for
from dflash_bench.engine.targets.attention_kernel import Rows, decode_attention
from dflash_bench.engine.tiles import attention, key_mask, pad_queries, query_positions

SHAPES = {"qwen3.5-9b 16/4x256": (16, 4, 256), "qwen3 32/8x128": (32, 8, 128), "smollm2 9/3x64": (9, 3, 64)}
CONTEXTS = (1024, 4096)
LAYOUTS = ((1, 1), (1, 16), (4, 16), (8, 1))  # (segments, rows each)
DTYPE = mx.bfloat16


def timed(fn: Callable[[], mx.array | list[mx.array]], warm: int = 3, reps: int = 20) -> float:
    """Median ms of `reps` calls after `warm`, each bracketed by eval and synchronize."""
    times = []
    for i in range(warm + reps):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        if i >= warm:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make(heads: tuple[int, int, int], context: int, layout: tuple[int, int], seed: int) -> list[Rows]:
    """Each stream's last `rows` rows end at `context` keys; caches sized as AttentionCache grows them."""
    hq, hkv, d = heads
    segments, rows = [], layout[1]
    keys = iter(mx.random.split(mx.random.key(seed), 3 * layout[0]))
    for i in range(layout[0]):
        start = context - rows - 7 * i  # streams at slightly different positions
        cap = tiles_for(start + rows) + GROW
        q = mx.random.normal((rows, hq, d), key=next(keys)).astype(DTYPE)
        k = mx.random.normal((hkv, cap, d), key=next(keys)).astype(DTYPE)
        v = mx.random.normal((hkv, cap, d), key=next(keys)).astype(DTYPE)
        segments.append((q, k, v, start))
    mx.eval([x for s in segments for x in s[:3]])
    return segments


def tiled_path(segments: list[Rows], scale: float) -> Callable[[], list[mx.array]]:
    """dense.py's per-segment decode path (masks built beforehand, as a segment caches them per layer)."""
    masks = [key_mask(query_positions(start, q.shape[0]), 0, tiles_for(start + q.shape[0]), start + q.shape[0])
             for q, _, _, start in segments]
    mx.eval(masks)

    def run() -> list[mx.array]:
        outs = []
        for (q, k, v, start), seen in zip(segments, masks):
            kr = tiles_for(start + q.shape[0])
            outs.append(attention(pad_queries(q.transpose(1, 0, 2)), k[:, :kr], v[:, :kr], seen, scale=scale)[:, : q.shape[0]])
        return outs

    return run


def reference_error(segments: list[Rows], got: mx.array, scale: float) -> float:
    """Largest |kernel - float64 reference| over the largest |reference|."""
    want = []
    for q, k, v, start in segments:
        q64, k64, v64 = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
        n, hq, d = q64.shape
        hkv, keys = k64.shape[0], start + n
        s = np.einsum("nkgd,kld->nkgl", q64.reshape(n, hkv, hq // hkv, d), k64[:, :keys]) * scale
        after = np.arange(keys)[None, :] > start + np.arange(n)[:, None]  # (rows, keys): keys past each row
        s = np.where(after[:, None, None, :], -np.inf, s)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        want.append(np.einsum("nkgl,kld->nkgd", w, v64[:, :keys]).reshape(n, hq, d))
    ref = np.concatenate(want)
    return float(np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - ref).max() / np.abs(ref).max())


def window_equals_steps(segments: list[Rows], scale: float) -> str:
    """Each segment's rows one at a time (junk in the cache after each row) against the whole launch."""
    n = segments[0][0].shape[0]
    if n == 1:
        return "n/a"
    whole = decode_attention(segments, scale)
    cursor = 0
    for q, k, v, start in segments[:2]:
        junk = mx.random.normal(k.shape, key=mx.random.key(start)).astype(k.dtype) * 8
        positions = mx.arange(k.shape[1])[None, :, None]
        for t in range(q.shape[0]):
            seen = positions <= start + t
            step = decode_attention([(q[t : t + 1], mx.where(seen, k, junk), mx.where(seen, v, junk), start + t)], scale)
            if not mx.array_equal(step, whole[cursor + t : cursor + t + 1]).item():
                return f"FAIL row {t}"
        cursor += q.shape[0]
    return "PASS"


def together_equals_alone(segments: list[Rows], got: mx.array, scale: float) -> str:
    if len(segments) == 1:
        return "n/a"
    alone = mx.concatenate([decode_attention([s], scale) for s in segments])
    return "PASS" if mx.array_equal(alone, got).item() else "FAIL"


def main() -> None:
    start_all = time.perf_counter()
    info = mx.device_info()
    print(f"device {mx.default_device()} ({info.get('device_name', '?')}), MLX {mx.__version__}, "
          f"cuda {mx.cuda.is_available()}, {DTYPE}")
    print(f"{'shape':<22}{'keys':>6}{'SxR':>6}{'kernel ms':>11}{'tiled ms':>10}{'speedup':>9}{'max rel err':>13}"
          f"{'window==steps':>15}{'together==alone':>17}")
    for name, heads in SHAPES.items():
        scale = heads[2] ** -0.5
        for context in CONTEXTS:
            for layout in LAYOUTS:
                label = f"{name:<22}{context:>6}{f'{layout[0]}x{layout[1]}':>6}"
                try:
                    segments = make(heads, context, layout, seed=context + layout[0] * 100 + layout[1])
                    got = decode_attention(segments, scale)
                    mx.eval(got)
                    kernel_ms = timed(lambda: decode_attention(segments, scale))
                    tiled_ms = timed(tiled_path(segments, scale))
                    error = reference_error(segments, got, scale)
                    steps = window_equals_steps(segments, scale)
                    alone = together_equals_alone(segments, got, scale)
                    print(f"{label}{kernel_ms:>11.3f}{tiled_ms:>10.3f}{tiled_ms / kernel_ms:>8.1f}x{error:>13.2e}"
                          f"{steps:>15}{alone:>17}", flush=True)
                except Exception as err:  # a failing case is reported, and the probe goes on
                    print(f"{label}  ERROR {type(err).__name__}: {err}", flush=True)
                    traceback.print_exc(limit=3)
    print(f"total {time.perf_counter() - start_all:.1f} s")


if __name__ == "__main__":
    main()
