"""A drafter's per-head RMSNorm and RoPE of its q and k rows, as one CUDA launch.

On a GPU a drafted round is the host's: each operation costs it about 25 us to build and encode, and the
drafter's pass and absorb are most of what a drafted round adds to a plain one (docs/gpu-round-profile.md,
job K's round split). A block pass's attention took five operations a layer before its launch (the q and k
norms, their two RoPEs, the queries' float32 cast) and an absorb two a layer and stream (the k norm and
RoPE); with this kernel it takes one a layer (`queries_and_keys`), and an absorb one a layer for every
stream's keys (`keys`).

What it computes for a row r and head h of x (rows, H, D), as the unfused chain did and rounding where it
rounded: n = x * rsqrt(mean(x^2) + eps) * w in float32, rounded to bf16 (`mx.fast.rms_norm`'s output);
then the half-split rotation at the row's own position p (`mx.fast.rope`, traditional=False, scale 1):
element j < D/2 and its partner j + D/2 turn by p * inv_freq[j], inv_freq[j] = theta^(-2j/D), rounded to
bf16 again. The sum of squares is each lane's ascending fmas over its elements, then an xor butterfly
(the same bits in every lane). The device's own sinf/cosf are not MLX's, so the bits are this kernel's,
not the chain's: a drafter needs only determinism (the target decides every token), and a row's bits
depend on its own values and position alone, so rows launched together equal rows launched alone.

Queries come out in float32 (what attention_kernel.py reads; the bf16 value widened, as its cast did) in
(rows, H, D); keys in bf16 as (2, H, rows, D) with the value rows copied beside them, the layout of the drafter's
joint K/V cache (cache.py's `JointCache`), so a write is one scatter, not one for keys and one for values.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from dflash_bench.engine.baked_kernel import BakedKernel
from dflash_bench.engine.device_values import constant, place

KEYS_INPUTS = ["x", "v", "w", "positions", "inv_freq", "eps"]
QK_INPUTS = ["q", "k", "v", "qw", "kw", "positions", "inv_freq", "eps"]

# One warp turns one (row, head): its lane j takes elements j, j + 32, .. below D / 2 and their partners.
_HEADER = r"""
__device__ __forceinline__ void nr_store(float* p, float v) { *p = __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ void nr_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <int D, typename O>
__device__ __forceinline__ void nr_turn(const __nv_bfloat16* row, const __nv_bfloat16* w, float p,
                                        const float* inv_freq, float eps, O* out) {
  constexpr int HALF = D / 2;
  const int lane = threadIdx.x & 31;
  float ss = 0.0f;
  for (int j = lane; j < HALF; j += 32) {
    const float a = __bfloat162float(row[j]), b = __bfloat162float(row[j + HALF]);
    ss = __fmaf_rn(a, a, ss);
    ss = __fmaf_rn(b, b, ss);
  }
  for (int o = 1; o < 32; o <<= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
  const float inv = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(ss, float(D)), eps)));
  for (int j = lane; j < HALF; j += 32) {
    const float a = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(__bfloat162float(row[j]), inv),
                                                                   __bfloat162float(w[j]))));
    const float b = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(__bfloat162float(row[j + HALF]), inv),
                                                                   __bfloat162float(w[j + HALF]))));
    const float angle = __fmul_rn(p, inv_freq[j]);
    const float c = cosf(angle), s = sinf(angle);
    nr_store(out + j, __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    nr_store(out + j + HALF, __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
  }
}

// a value row as it is, beside its key (the cache holds both in one array: drafters/dflash.py's JointCache)
template <int D>
__device__ __forceinline__ void nr_copy(const __nv_bfloat16* row, __nv_bfloat16* out) {
  for (int j = threadIdx.x & 31; j < D; j += 32) out[j] = row[j];
}
"""

# Rows run along the grid's x (a block a row: 2^31 - 1 of them, where y and z stop at 65,535, and an absorb takes
# a whole prompt chunk's rows), heads along y.
# keys alone (an absorb's), with their values: grid (32 * rows, H, 1) threads, threadgroup (32, 1, 1); out
# (2, H, rows, D) bf16, the keys then the values
_KEYS = r"""
  const int h = blockIdx.y, r = blockIdx.x, rows = gridDim.x;
  nr_turn<D>(x + ((size_t)r * H + h) * D, w, float(positions[r]), inv_freq, eps[0], out + ((size_t)h * rows + r) * D);
  nr_copy<D>(v + ((size_t)r * H + h) * D, out + ((size_t)(H + h) * rows + r) * D);
"""

# queries and keys of the same rows (a block pass's layer), with the values: grid (32 * rows, HQ + HKV, 1); q_out
# (rows, HQ, D) float32, kv_out (2, HKV, rows, D) bf16
_QK = r"""
  const int h = blockIdx.y, r = blockIdx.x, rows = gridDim.x;
  const float p = float(positions[r]);
  if (h < HQ) {
    nr_turn<D>(q + ((size_t)r * HQ + h) * D, qw, p, inv_freq, eps[0], q_out + ((size_t)r * HQ + h) * D);
  } else {
    const int g = h - HQ;
    nr_turn<D>(k + ((size_t)r * HKV + g) * D, kw, p, inv_freq, eps[0], kv_out + ((size_t)g * rows + r) * D);
    nr_copy<D>(v + ((size_t)r * HKV + g) * D, kv_out + ((size_t)(HKV + g) * rows + r) * D);
  }
"""


def fits(head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes these rows: bf16 (the gpu mode's activations), an even head dim."""
    return dtype == mx.bfloat16 and head_dim % 2 == 0


@lru_cache(maxsize=1)
def _keys_kernel():
    return BakedKernel("dflash_norm_rope_keys", KEYS_INPUTS, ["out"], _KEYS, _HEADER)


@lru_cache(maxsize=1)
def _qk_kernel():
    return BakedKernel("dflash_norm_rope_qk", QK_INPUTS, ["q_out", "kv_out"], _QK, _HEADER)


@lru_cache(maxsize=16)
def _inv_freq(head_dim: int, theta: float) -> mx.array:
    """theta^(-2j/D) for j < D/2 in float32, computed once in float64, in device memory (device_values)."""
    return place([mx.array((theta ** (-2.0 * np.arange(head_dim // 2) / head_dim)).astype(np.float32))])[0]


def _eps(eps: float) -> mx.array:
    """The norm's epsilon, in device memory (device_values.constant)."""
    return constant((eps,), mx.float32)


def heads_of(x: mx.array, w: mx.array) -> tuple[int, int, int]:
    """(rows, heads, D) of rows x (rows, heads * D) as a projection leaves them, D the norm weights' length: the
    launch reads them flat, so no reshape (an operation a GPU round pays for: docs/gpu-round-profile.md)."""
    rows, width = x.shape
    d = w.shape[0]
    if width % d:
        raise ValueError(f"rows of {width} values are not whole heads of {d}")
    return rows, width // d, d


def keys(k: mx.array, v: mx.array, w: mx.array, positions: mx.array, theta: float, eps: float) -> mx.array:
    """Key rows k (rows, H * D) bf16, each (row, head) normed by w (D,) and turned at its row's position
    (int32, rows), with their value rows v (rows, H * D) as they are: bf16 (2, H, rows, D), keys then values,
    what one cache write takes."""
    rows, heads, d = heads_of(k, w)
    (out,) = _keys_kernel()(
        inputs=[k, v, w, positions, _inv_freq(d, theta), _eps(eps)],
        template=[("H", heads), ("D", d)],
        grid=(32 * rows, heads, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(2, heads, rows, d)],
        output_dtypes=[mx.bfloat16],
    )
    return out


def queries_and_keys(q: mx.array, k: mx.array, v: mx.array, qw: mx.array, kw: mx.array, positions: mx.array,
                     theta: float, eps: float) -> tuple[mx.array, mx.array]:
    """The same rows' queries q (rows, HQ * D), keys k and values v (rows, HKV * D), bf16, in one launch: the
    queries as float32 (rows, HQ, D), the keys and values as `keys` gives them."""
    rows, hq, d = heads_of(q, qw)
    hkv = heads_of(k, kw)[1]
    q_out, kv_out = _qk_kernel()(
        inputs=[q, k, v, qw, kw, positions, _inv_freq(d, theta), _eps(eps)],
        template=[("HQ", hq), ("HKV", hkv), ("D", d)],
        grid=(32 * rows, hq + hkv, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(rows, hq, d), (2, hkv, rows, d)],
        output_dtypes=[mx.float32, mx.bfloat16],
    )
    return q_out, kv_out
