"""Where a launch's small inputs and weights live, and what a row-kernel launch pays for it (CuPy, no MLX).

usage (GPU machine, repo root): python3 tools/placement_probe.py [--gather | --only-gather]

Why: in the engine's round timelines the row kernel's launches run 1.5-3x their alone times (the 9B's o 28 us
against 8.9 at one row: docs/gpu-round-profile.md), about 15-25 us more a launch whatever its size. The alone
timings (tools/row_kernel_variants.py) keep every input in device memory (cudaMalloc). MLX 0.32's CUDA allocator
does not: an array of at most 8 bytes (the kernel's row count, `matmul_kernel.launch`'s one int32) comes from a
small pool of managed memory advised `cudaMemAdviseSetAccessedBy` the device, so an array the host wrote stays in
host memory and every read of it from the GPU crosses the bus; a larger array the host made (weights `mx.load`
read) is managed memory without advice, moved to the device at its first GPU touch. This tool times the engine's
kernel at the weight's geometry (as row_kernel_variants.py builds and times it) on the 9B's 4-bit products at 1 and
16 rows with the row count placed as each of those, and with the weights host-written managed memory:

- `device`: every input cudaMalloc'd (row_kernel_variants.py's timing);
- `rows pool`: the row count in managed memory advised AccessedBy the device and written by the host (MLX's small
  pool for a host-made array of at most 8 bytes);
- `rows managed`: the row count in a 16-byte managed allocation written by the host, no advice (an array of more
  than 8 bytes the host made), moved to the device by the warm-up launches before the timing;
- `weights managed`: the weights host-written managed memory (MLX's load of a checkpoint), the row count in device
  memory.

Then each launch alone (events around it, the median of 30, one weight copy), where before every launch the host
writes the row count again, as the engine makes a round's small arrays (positions, a window's drafts) on the host:
`device` (an upload by cudaMemcpy, what a device array needs), `pool rewritten` (the small pool: the host's write
stays in host memory) and `managed rewritten` (a 16-byte managed allocation: the host's write moves its page back to
the host, and the launch's read faults it over again).

With `--gather` (or `--only-gather`, the gather alone), MLX's own small kernels: one row's gather (an embedding lookup of one token: 4,096 bf16 values, 16 blocks of
256 threads) with the token id in device memory and in the small pool, timed as above, to price what a round's
host-made token ids and cache indices (MLX puts them in the pool) cost the kernels that read them.

Each placement's output must equal the `device` one's bit for bit (placement never enters a sum).
"""

from __future__ import annotations

import ctypes
import sys
import time

import cupy as cp
import numpy as np
from gpu_clocks import ClockLog
from row_kernel_variants import (SHAPES, Kernel, bf16, emit, engine_source, finish, geometry, graph_us, module, timed,
                                 weights)

ADVISE_ACCESSED_BY = 5  # cudaMemAdviseSetAccessedBy (CUDA's enum)
POOL_SIZE = 4 * 16384  # MLX's small pool: 4 pages of 16 KB


def host_written(values: np.ndarray, nbytes: int, accessed_by: bool) -> tuple[cp.ndarray, cp.cuda.MemoryPointer]:
    """`values` in a fresh managed allocation of `nbytes` written by the host (as MLX's loads and host-made arrays
    are), advised AccessedBy device 0 first where asked (MLX's small pool): the array and its allocation."""
    mem = cp.cuda.malloc_managed(nbytes)
    if accessed_by:
        cp.cuda.runtime.memAdvise(mem.ptr, nbytes, ADVISE_ACCESSED_BY, 0)
    ctypes.memmove(mem.ptr, values.ctypes.data, values.nbytes)
    return cp.ndarray(values.shape, values.dtype, memptr=mem), mem


def managed_weights(w: tuple) -> tuple:
    """A weight triple copied into host-written managed memory, one allocation an array."""
    return tuple(None if a is None else host_written(cp.asnumpy(a), a.nbytes, False)[0] for a in w)


def rewritten(kern: Kernel, w: tuple, x: cp.ndarray, m: int, rows: cp.ndarray, upload: bool, launches: int = 30) -> float:
    """Median µs of one launch timed alone, the host writing the row count into `rows` before each (by cudaMemcpy
    where `upload`, else a store of the host's into its managed memory)."""
    y = cp.empty((m, kern.n), dtype=cp.uint16)
    count = np.array([m], dtype=np.int32)
    out = []
    for i in range(launches + 3):
        cp.cuda.Device().synchronize()
        if upload:
            rows.set(count)
        else:
            ctypes.memmove(rows.data.ptr, count.ctypes.data, count.nbytes)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        kern(x, w, m, rows, y)
        b.record()
        b.synchronize()
        if i >= 3:
            out.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return float(np.median(out))


GATHER = r"""
extern "C" __global__ void take(const int* ids, const unsigned short* table, unsigned short* out, int width) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < width) out[i] = table[(size_t)ids[0] * width + i];
}
"""


def gather_costs(table: list[str], launches: int = 60, reps: int = 7) -> None:
    """One row's gather with its id in device memory and in the small pool (module docstring), median µs a launch
    from CUDA-graph replays."""
    take = cp.RawKernel(GATHER, "take")
    width, rows = 4096, 32768
    emb = cp.asarray(np.random.default_rng(1).integers(0, 2**16, size=(rows, width), dtype=np.uint16))
    out = cp.empty(width, dtype=cp.uint16)
    token = np.array([12345], dtype=np.int32)
    pool, _ = host_written(token, POOL_SIZE, True)
    for label, ids in (("id device", cp.asarray(token)), ("id pool", pool)):
        def launch(_: int, ids: cp.ndarray = ids) -> None:
            take((width // 256,), (256,), (ids, emb, out, np.int32(width)))

        launch(0)
        cp.cuda.Device().synchronize()
        ok = bool((out == emb[12345]).all())
        us = graph_us(launch, launches, reps, warm=1)
        emit(table, f"gather 1 row  {label:16s} {'PASS' if ok else 'FAIL'} {us:8.1f} us")


def main() -> int:
    header, engine = engine_source()
    shapes = [] if "--only-gather" in sys.argv else SHAPES[:5]
    wanted = []
    for _, k, n, bits, group in shapes:
        nt, split = geometry(k, n, bits)
        wanted += [("engine", (k, n, bits, group, nt, split, mt, 1)) for mt in (1, 4)]
    mod = module({"engine": engine}, header, wanted) if wanted else None
    rng = np.random.default_rng(0)
    fails, table = 0, []
    with ClockLog() as clocks:
        begun = time.monotonic()
        for name, k, n, bits, group in shapes:
            nt, split = geometry(k, n, bits)
            kern = Kernel(mod, "engine", k, n, bits, group, nt, split, 1)
            w = weights(k, n, bits, group, rng)
            wbytes = sum(a.nbytes for a in w if a is not None)
            copies = [w] + [weights(k, n, bits, group, np.random.default_rng(9 + c))
                            for c in range(max(0, min(12, -(-2 * 60 * 2**20 // wbytes)) - 1))]
            mcopies = [managed_weights(c) for c in copies]
            x = bf16(rng.standard_normal((16, k), dtype=np.float32))
            for m in (1, 16):
                count = np.array([m], dtype=np.int32)
                pool, _ = host_written(count, POOL_SIZE, True)
                small, _ = host_written(np.array([m, 0, 0, 0], dtype=np.int32), 16, False)
                places = {"device": (cp.asarray(count), copies), "rows pool": (pool, copies),
                          "rows managed": (small, copies), "weights managed": (cp.asarray(count), mcopies)}
                base = None
                for label, (rows, ws) in places.items():
                    y = cp.full((m, n), 0x7FC0, dtype=cp.uint16)
                    kern(cp.asarray(x[:m]), ws[0], m, rows, y)
                    out = cp.asnumpy(y)
                    base = out if base is None else base
                    ok = bool((out == base).all())
                    fails += not ok
                    us = timed(kern, ws, m, k, rows=rows)
                    line = (f"{name:12s} M{m:<3d} {label:16s} {'PASS' if ok else 'FAIL'} {us:8.1f} us  "
                            f"{wbytes / us / 1e3:5.0f} GB/s")
                    emit(table, line)
                for label, rows, upload in (("device rewritten", cp.asarray(count), True),
                                            ("pool rewritten", pool, False), ("managed rewritten", small, False)):
                    us = rewritten(kern, copies[0], cp.asarray(x[:m]), m, rows, upload)
                    emit(table, f"{name:12s} M{m:<3d} {label:18s} alone {us:8.1f} us")
        if "--gather" in sys.argv or "--only-gather" in sys.argv:
            gather_costs(table)
        ended = time.monotonic()
    return finish(table, clocks.describe(begun, ended), fails)


if __name__ == "__main__":
    sys.exit(main())
