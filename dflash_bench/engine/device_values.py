"""Arrays our kernels read, placed in the GPU's own memory.

MLX 0.32's CUDA allocator puts an array where its maker asks for it: a GPU operation's output of more than 8 bytes
in device memory (cudaMallocAsync), but an array the host made or loaded (a launch's row count, a layout of ints,
a checkpoint's tensors) in managed memory, and one of at most 8 bytes in a small pool of managed memory advised
AccessedBy the device, which the host's write leaves in host memory. A kernel's read of such an array crosses the
bus. On an H100 (tools/placement_probe.py, docs/profiles/placement-probe-h100-49.txt), the row kernel's launch for
the 9B's o projection at one row took 8.8 us with its row count in device memory and 22.5 us with it in the small
pool (21.2 us in a host-made 16-byte managed allocation the launches had touched): about 13 us a launch whatever
its size, what the engine's rounds had shown as launches taking 1.5-3x their alone times (docs/gpu-round-profile.md).
The checkpoint's large matrices moved to the device at first use and read as fast as device memory there.

So on a CUDA GPU a launch's constants are made once and copied to the device by one GPU operation (`constant`),
padded to more than the pool's 8 bytes (each kernel reads only the values it is given the count of), and the
loaded weights are copied there once at load (`placed`, `place`): `mx.full` of an array is a copy (MLX's Full
primitive copies its input into a new buffer, and an input still held elsewhere is never donated), so every bit
is the array's own. Off CUDA (the CPU backend: tests, the cpu mode) there is one memory and nothing is copied.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from dflash_bench.engine.backend import on_cuda

POOL_BYTES = 8  # MLX's CUDA allocator serves arrays of at most this many bytes from its managed small pool


def placed(a: mx.array) -> mx.array:
    """An exact copy of `a` made by the GPU (device memory where it is more than POOL_BYTES), lazily; `a` itself off
    CUDA. The caller evaluates it while still holding `a`: MLX donates a buffer only nothing else holds, and a
    donated buffer would be `a`'s own memory again."""
    return mx.full(a.shape, a, dtype=a.dtype) if on_cuda() else a


def place(arrays: list[mx.array]) -> list[mx.array]:
    """`placed` copies of `arrays`, evaluated while the originals are held (one at a time: a checkpoint's
    largest tensor is the most this adds to a load's peak)."""
    out = []
    for a in arrays:
        copy = placed(a)
        mx.eval(copy)
        out.append(copy)
    return out


def padding(count: int, itemsize: int) -> int:
    """How many zeros take `count` values of `itemsize` bytes past POOL_BYTES (none where they are past it already):
    each kernel reads the values it is told of, never the zeros."""
    return max(0, POOL_BYTES // itemsize + 1 - count)


def off_pool(a: mx.array) -> mx.array:
    """A GPU operation's small output (a rollback's kept count at one stream) with zeros after it where it would fit
    the pool, by one more operation (`mx.concatenate` writes a new buffer, in device memory past POOL_BYTES); `a`
    itself where it is larger."""
    extra = padding(a.size, a.itemsize)
    return mx.concatenate([a, mx.zeros((extra,), dtype=a.dtype)]) if extra else a


@lru_cache(maxsize=1024)
def constant(values: tuple[int | float, ...], dtype: mx.Dtype = mx.int32) -> mx.array:
    """A launch's small input (`values`, then zeros past POOL_BYTES: `padding`) in device memory, made once per
    value."""
    padded = list(values) + [0] * padding(len(values), mx.array(0, dtype=dtype).itemsize)
    (out,) = place([mx.array(padded, dtype=dtype)])
    return out


def per_round(values: list[int], dtype: mx.Dtype = mx.int32) -> mx.array:
    """A small input the host makes for one round (a forward's layout), copied to device memory by the round's own
    graph: one copy reads the host's values across the bus once, where each launch reading them would (module
    docstring). Lazy (the round's graph runs the copy, no evaluation here): `mx.concatenate` of two slices writes a
    new buffer, so nothing is donated (`off_pool`'s, where the values would fit the small pool). The same values, and
    on CUDA zeros after them where they would fit the pool."""
    src = mx.array(list(values), dtype=dtype)
    if not on_cuda():
        return src
    return off_pool(src) if src.nbytes <= POOL_BYTES else mx.concatenate([src[:1], src[1:]])
