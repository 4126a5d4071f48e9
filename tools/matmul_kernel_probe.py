"""The decode-row matmul kernel on a CUDA GPU: right, row-independent, and how fast against MLX.

usage (on the GPU machine, from the repo root): PYTHONPATH=/tmp/site:$PWD python3 tools/matmul_kernel_probe.py

For each weight shape (Qwen3.5-9B's projections at 4 bits, the default model's in bf16, an 8-bit
case): the relative error against a float32 product of the dequantized weights; whether every row
of calls with 1..80 rows equals the same row computed alone (bit for bit); and the time a call at
1, 16 and 64 rows (and at 16 and 64 with the weight geometry's column tiles a warp instead of
`tiles_a_warp`'s, the same bits) next to MLX's own `quantized_matmul` at 1 row (above one row it compiles a
kernel at first use, for minutes) or `x @ w.T` at each (bf16), on the same arrays, as the
median over timed batches of calls, each batch rotating over enough weight copies to overflow the
L2 cache.
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx

from dflash_bench.engine import matmul_kernel
from dflash_bench.engine.matmul_kernel import fits, geometry, rows_matmul

L2_BYTES = 60 * 2**20
SHAPES = [  # (name, in, out, bits, group)
    ("9b gate/up", 4096, 12288, 4, 64),
    ("9b down", 12288, 4096, 4, 64),
    ("9b q (gated)", 4096, 8192, 4, 64),
    ("9b o", 4096, 4096, 4, 64),
    ("9b k/v", 4096, 1024, 4, 64),
    ("9b lm_head", 4096, 248320, 4, 64),
    ("9b o 8-bit", 4096, 4096, 8, 64),
    ("135m up bf16", 576, 1536, 16, 0),
    ("135m down bf16", 1536, 576, 16, 0),
    ("135m q bf16", 576, 576, 16, 0),
    ("135m kv bf16", 576, 192, 16, 0),
    ("135m lm_head bf16", 576, 49152, 16, 0),
    ("135m up q4/32", 576, 1536, 4, 32),
]


def make(k: int, n: int, bits: int, group: int):
    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    if bits == 16:
        return w, None, None
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return q, s.astype(mx.bfloat16), b.astype(mx.bfloat16)


def ours(x, wt, bits, group):
    return rows_matmul(x, wt[0], wt[1], wt[2], bits, group)


def theirs(x, wt, bits, group):
    if bits == 16:
        return x @ wt[0].T
    return mx.quantized_matmul(x, wt[0], wt[1], wt[2], transpose=True, group_size=group, bits=bits)


def timed(fn, xs, copies, bits, group, reps=7) -> float:
    """Median ms a call, over batches of len(copies) calls (one per weight copy)."""
    out = [fn(xs[i % len(xs)], c, bits, group) for i, c in enumerate(copies)]
    mx.eval(out)
    samples = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        out = [fn(xs[i % len(xs)], c, bits, group) for i, c in enumerate(copies)]
        mx.eval(out)
        mx.synchronize()
        samples.append((time.perf_counter() - t0) * 1e3 / len(copies))
    return statistics.median(samples)


def main() -> int:
    print("device", mx.default_device(), "cuda", mx.cuda.is_available())
    fails = 0
    rows_out = []
    for name, k, n, bits, group in SHAPES:
        try:
            assert fits(k, n, bits, group), "does not fit"
            g = geometry(k, n, bits)
            wt = make(k, n, bits, group)
            wbytes = sum(a.nbytes for a in wt if a is not None)
            # correctness against float32
            x = (mx.random.normal((64, k))).astype(mx.bfloat16)
            wf = wt[0].astype(mx.float32) if bits == 16 else mx.dequantize(wt[0], wt[1].astype(mx.float32), wt[2].astype(mx.float32), group_size=group, bits=bits)
            ref = x.astype(mx.float32) @ wf.T
            got = ours(x, wt, bits, group).astype(mx.float32)
            err = (mx.linalg.norm(got - ref) / mx.linalg.norm(ref)).item()
            finite = bool(mx.all(mx.isfinite(got)).item())
            # row independence: every row of an M-row call equals that row alone
            xs = (mx.random.normal((80, k))).astype(mx.bfloat16)
            alone = mx.concatenate([ours(xs[i : i + 1], wt, bits, group) for i in range(80)])
            mx.eval(alone)
            same = True
            for m in (1, 2, 3, 15, 16, 17, 31, 33, 48, 64, 65, 80):
                for start in (0, 80 - m):
                    part = ours(xs[start : start + m], wt, bits, group)
                    same &= bool(mx.array_equal(part, alone[start : start + m]).item())
            # timing
            copies = [wt] + [make(k, n, bits, group) for _ in range(max(0, min(15, -(-2 * L2_BYTES // wbytes)) - 1))]
            times = {}
            for m in (1, 16, 64):
                xm = [(mx.random.normal((m, k))).astype(mx.bfloat16) for _ in range(4)]
                # MLX's quantized product above one row compiles a kernel at first use (minutes): time it at 1
                theirs_ms = timed(theirs, xm, copies, bits, group) if (m == 1 or bits == 16) else float("nan")
                times[m] = (timed(ours, xm, copies, bits, group), theirs_ms)
                if m > 1:  # the same call at the geometry's column tiles a warp
                    tiles_a_warp = matmul_kernel.tiles_a_warp
                    matmul_kernel.tiles_a_warp = lambda m, k, n, bits, normed: geometry(k, n, bits).nt
                    matmul_kernel.launch.cache_clear()
                    times[-m] = (timed(ours, xm, copies, bits, group), float("nan"))
                    matmul_kernel.tiles_a_warp = tiles_a_warp
                    matmul_kernel.launch.cache_clear()
            ok = err < 2e-2 and finite and same
            fails += not ok
            t = "  ".join(f"M{m} {a:.3f}/{b:.3f}ms" if m > 0 else f"(M{-m} at nt{g.nt} {a:.3f})"
                          for m, (a, b) in times.items())
            gbs = wbytes / (times[1][0] * 1e-3) / 1e9
            rows_out.append(f"{name:18s} nt{g.nt} sk{g.split_k} err {err:.1e} rows {'PASS' if same else 'FAIL'}  {t}  ours@1 {gbs:.0f} GB/s")
        except Exception as e:  # one shape's failure must not hide the others
            fails += 1
            rows_out.append(f"{name:18s} ERROR {type(e).__name__}: {str(e)[:300]}")
        print(rows_out[-1], flush=True)
    print("\nshape              geometry  error  rows  ours/MLX per call")
    print("\n".join(rows_out))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
