"""MLX's own `qmv` against our decode-row kernel on a CUDA GPU: is it row-independent, and what does it cost?

usage (on the GPU machine, from the repo root): PYTHONPATH=/tmp/site:$PWD python3 tools/qmv_probe.py

MLX's CUDA `quantized_matmul` runs `qmv` at 1 row (on sm_90) and `gather_qmm` runs the same kernel
below 8 rows, one warp an output per row, so a row's bits could not depend on the rows beside it; if
that held and it were fast at several rows, the decode rows could use it instead of our kernel
(engine/matmul_kernel.py). For each 4-bit weight shape of Qwen3.5-9B this checks the bits (every row
alone through `qmv`, 1-row gathers, gathers of 7) and times, per call in a chain of 200 independent
calls, the Python build and the evaluation of each path. The H200's output is
docs/profiles/qmv-probe-h200.txt.
"""
import time
import dflash_bench  # noqa: F401
import mlx.core as mx
from dflash_bench.engine.matmul_kernel import rows_matmul

def per_op(f, x, n=200):
    for _ in range(2):
        mx.synchronize(); t0 = time.perf_counter()
        ys = [f(x) for _ in range(n)]
        t1 = time.perf_counter(); mx.eval(ys); mx.synchronize(); t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / n, 1e6 * (t2 - t1) / n

for k, n in [(4096, 4096), (4096, 12288), (12288, 4096), (4096, 24576), (4096, 8192)]:
    w = mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    mx.eval(q, s, b)
    x16 = mx.random.normal((16, k)).astype(mx.bfloat16); mx.eval(x16)
    qmv1 = lambda x: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)
    def gathered(x):
        r = x.shape[0]
        return mx.gather_qmm(x[:, None, :], q, s, b, lhs_indices=mx.arange(r, dtype=mx.uint32),
                             rhs_indices=mx.zeros((r,), dtype=mx.uint32), transpose=True, group_size=64, bits=4)[:, 0, :]
    ours = lambda x: rows_matmul(x, q, s, b, 4, 64)
    # bits: qmv 1 row vs each gathered row, alone vs in company of 7
    alone = mx.concatenate([qmv1(x16[i:i + 1]) for i in range(16)])
    g7 = mx.concatenate([gathered(x16[a:a + 7]) for a in (0, 7)] + [gathered(x16[14:16])])
    g1 = mx.concatenate([gathered(x16[i:i + 1]) for i in range(16)])
    mx.eval(alone, g7, g1)
    eq = lambda a, c: bool(mx.array_equal(a, c).item())
    print(f"K{k} N{n}: qmv1==gather1 {eq(alone, g1)}  gather1==gather7 {eq(g1, g7)}  qmm16==qmv1 {eq(qmv1(x16), alone)}", flush=True)
    for name, f, m in [("qmv M1", qmv1, 1), ("gather M1", gathered, 1), ("gather M7", gathered, 7),
                       ("ours M1", ours, 1), ("ours M7", ours, 7), ("ours M16", ours, 16), ("mlx qmm M16", qmv1, 16)]:
        bld, ev = per_op(f, x16[:m])
        print(f"  {name:12s} build {bld:6.1f} us  eval {ev:7.1f} us per op", flush=True)
