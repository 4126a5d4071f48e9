"""What one operation costs the host and the device on a GPU: chains of one operation each.

usage (on the GPU machine, from the repo root): PYTHONPATH=/tmp/site:$PWD python3 tools/encode_probe.py

A decode step on a GPU is thousands of small operations (docs/gpu-round-profile.md), so what one
costs decides what a change to the forward saves. For each kind, a chain of 400 dependent calls on
one row of 4096 (bf16; a 4096 x 4096 4-bit weight for the products) is built in Python, handed to
`mx.async_eval` (which returns once the host has encoded every operation for the device) and waited
for; per operation, median of 3 after one warm chain: build, encode, and the wait left after the
encoding (the device's time a call, where the calls depend on each other, less what ran while the
host encoded). The H200's output is docs/profiles/encode-probe-h200.txt.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine.matmul_kernel import rows_matmul


def chain(name: str, op: Callable[[mx.array], mx.array], x: mx.array, n: int = 400) -> None:
    runs = []
    for _ in range(4):
        mx.synchronize()
        a = time.perf_counter()
        y = x
        for _ in range(n):
            y = op(y)
        b = time.perf_counter()
        mx.async_eval(y)
        c = time.perf_counter()
        mx.eval(y)
        runs.append((b - a, c - b, time.perf_counter() - c))
    build, encode, wait = (1e6 * statistics.median(r[i] for r in runs[1:]) / n for i in range(3))
    print(f"{name:28s} build {build:6.2f} us  encode {encode:6.2f} us  wait {wait:6.2f} us per op", flush=True)


def copied(cache: mx.array, rows: mx.array, start: int) -> mx.array:
    """`rows` written into `cache` at a host offset along its positions, as a plain step writes (a slice update)."""
    cache[..., start : start + rows.shape[-2], :] = rows
    return cache


def main() -> None:
    x = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    ones = mx.ones((4096,), dtype=mx.bfloat16)
    q, s, b = mx.quantize(mx.random.normal((4096, 4096)).astype(mx.bfloat16) * 0.02, group_size=64, bits=4)
    x16 = mx.broadcast_to(x, (16, 4096)) + 0
    mx.eval(x, ones, q, s, b, x16)
    chain("add (1x4096 bf16)", lambda y: y + 1, x)
    chain("multiply by array", lambda y: y * ones, x)
    chain("astype f32->bf16 pair", lambda y: y.astype(mx.float32).astype(mx.bfloat16), x, 200)
    chain("rms_norm", lambda y: mx.fast.rms_norm(y, ones, 1e-6), x)
    chain("reshape+slice view then add", lambda y: (y.reshape(64, 64)[:, :].reshape(1, 4096)) + 1, x)
    chain("concatenate 2", lambda y: mx.concatenate([y[:, :2048], y[:, 2048:]], axis=1), x)
    chain("mlx quantized_matmul M1", lambda y: mx.quantized_matmul(y, q, s, b, transpose=True, group_size=64, bits=4), x)
    chain("ours rows_matmul M1", lambda y: rows_matmul(y, q, s, b, 4, 64), x)
    chain("ours rows_matmul M16", lambda y: rows_matmul(y, q, s, b, 4, 64), x16)
    chain("compiled elementwise", mx.compile(lambda y: (y * 2 + 1) * y), x)
    # what a drafted round asks for and a plain one does not (docs/gpu-round-profile.md: its queuing took 7.06 ms
    # against a plain round's 5.00 on the H200 in session 40): 16 rows scattered into a joint K/V cache at a
    # device length (cache.py's `placed`) against the copy at a host offset a plain step makes, and a kernel
    # launch of ~200 inputs (the GatedDeltaNet rollback's, every layer's arrays: delta_kernel.py's `rollback`)
    # against one of 2
    cache = mx.zeros((2, 4, 512, 256), dtype=mx.bfloat16)
    rows = mx.ones((2, 4, 16, 256), dtype=mx.bfloat16)
    at = mx.array(100, dtype=mx.int32)
    where = mx.broadcast_to((at + mx.arange(16, dtype=mx.int32)).reshape(1, 1, 16, 1), rows.shape)
    mx.eval(cache, rows, where)
    chain("scatter 16 rows, device at", lambda y: mx.put_along_axis(y, where, rows, axis=2), cache)
    chain("copy 16 rows, host offset", lambda y: copied(y, rows, 100), cache)
    for inputs in (2, 200):
        kernel = mx.fast.cuda_kernel(name=f"inputs_{inputs}", input_names=[f"a{i}" for i in range(inputs)],
                                     output_names=["out"], ensure_row_contiguous=True,
                                     source="const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                                            "if (i < 4096) out[i] = a0[i] + a1[i];\n")
        others = [mx.full((1, 4096), float(i), dtype=mx.bfloat16) for i in range(inputs - 1)]
        mx.eval(others)
        chain(f"kernel of {inputs} inputs", lambda y, k=kernel, o=others: k(
            inputs=[y, *o], grid=(4096, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(1, 4096)],
            output_dtypes=[mx.bfloat16])[0], x)
    chain("split 24, first part", lambda y: mx.split(mx.concatenate([y] * 24), 24)[0], x, 200)
    print("done", flush=True)


if __name__ == "__main__":
    main()
