"""Per-head RMSNorm and RoPE of a layer's q and k rows, as one CUDA launch: a drafter's, and a target's decode rows.

On a GPU a round is the host's: each operation costs it several microseconds to build and encode
(docs/gpu-round-profile.md). A drafter's block pass took five operations a layer before this launch (the q and
k norms, their two RoPEs, the queries' float32 cast) and an absorb two a layer and stream (the k norm and RoPE);
with it a pass takes one a layer (`queries_and_keys`), and an absorb one a layer for every stream's keys
(`keys`), or one for every layer's where one product made them all (`layer_keys`). A target's attention layer
(targets/dense.py) on the kernel path takes the same launch for its decode rows: its q and k norms (none for
llama), the two RoPEs at each row's position, the stack of keys and values and the queries' float32 cast, about
six operations a layer, become one.

What it computes for a row r and head h of x (rows, H, D), as the unfused chain did and rounding where it
rounded: n = x * rsqrt(mean(x^2) + eps) * w in float32, rounded to bf16 (`mx.fast.rms_norm`'s output), or x
itself without a norm; then the half-split rotation of the first R values at the row's own position p
(`mx.fast.rope` with dims R, traditional=False, scale 1), rounded to bf16 again; values from R on (qwen3_5's
partial rotary) pass as normed. The rotation is the arithmetic of MLX's CUDA RoPE kernel (MLX 0.32), written as
that kernel writes it: inv_freq = exp2(-(j / (R/2)) * log2(theta)) on the device, with log2(theta)
the host's `log2f` as MLX takes it, the angle p * inv_freq, then x1 * cos - x2 * sin and x1 * sin + x2 * cos with
each first product fused into an fma, as MLX's build contracts them (written as intrinsics, so no compiler can
contract them otherwise: left to NVRTC, 2 of 270,336 elements differed on an H100); so a layer without q/k norms
(llama) gives `mx.fast.rope`'s bits, and a target's decode rows keep the tokens they had before this launch
(tests/test_norm_rope_kernel.py's GPU test holds the rotation to MLX's bit for bit). The sum of squares is each
lane's ascending fmas over its elements, then an xor butterfly (the same bits in every lane): a norm's bits are
this kernel's, not `mx.fast.rms_norm`'s. A row's bits depend on its own values and position alone, so rows launched
together equal rows launched alone: what a drafter needs (determinism; the target decides every token), and
what a target's decode rows need (a window's rows equal single steps, base.py), where a prompt chunk's rows
keep MLX's own norm and RoPE (a prompt row is always computed in a chunk: lanes.py).

Queries come out in float32 (what attention_kernel.py reads; the bf16 value widened, as its cast did) in
(rows, H, D); keys in bf16 as (2, H, rows, D) with the value rows copied beside them, the layout of the joint
K/V cache (cache.py's `JointCache`), so a write is one scatter, not one for keys and one for values.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from functools import lru_cache

import mlx.core as mx
import numpy as np

from dflash_bench.engine.baked_kernel import BakedKernel
from dflash_bench.engine.cuda_source import ROTATION
from dflash_bench.engine.device_values import constant

KEYS_INPUTS = ["x", "v", "w", "positions", "log2_theta", "eps"]
LAYER_KEYS_INPUTS = ["x", "w", "positions", "log2_theta", "eps"]
QK_INPUTS = ["q", "k", "v", "qw", "kw", "positions", "log2_theta", "eps"]
QK_PLAIN_INPUTS = ["q", "k", "v", "positions", "log2_theta"]  # a layer without q/k norms

# One warp turns one (row, head): its lane j takes elements j, j + 32, .. below D / 2 and their partners.
_HEADER = ROTATION + r"""

// element j of a row: normed (x * inv * w, rounded to bf16, `mx.fast.rms_norm`'s output), or as it is without a norm
template <bool NORM>
__device__ __forceinline__ float nr_normed(const __nv_bfloat16* row, const __nv_bfloat16* w, int j, float inv) {
  if constexpr (NORM) {
    return __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(__bfloat162float(row[j]), inv),
                                                          __bfloat162float(w[j]))));
  } else {
    return __bfloat162float(row[j]);
  }
}

// one (row, head) of D elements: normed over all D (NORM), its first R turned (pairs j, j + R / 2), the rest as normed
template <int D, int R, bool NORM, typename O>
__device__ __forceinline__ void nr_turn(const __nv_bfloat16* row, const __nv_bfloat16* w, float p,
                                        float log2_theta, float eps, O* out) {
  constexpr int HALF = D / 2, RH = R / 2;
  const int lane = threadIdx.x & 31;
  float inv = 1.0f;
  if constexpr (NORM) {
    float ss = 0.0f;
    for (int j = lane; j < HALF; j += 32) {
      const float a = __bfloat162float(row[j]), b = __bfloat162float(row[j + HALF]);
      ss = __fmaf_rn(a, a, ss);
      ss = __fmaf_rn(b, b, ss);
    }
    for (int o = 1; o < 32; o <<= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, o));
    inv = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(ss, float(D)), eps)));
  }
  for (int j = lane; j < RH; j += 32) {
    const float x1 = nr_normed<NORM>(row, w, j, inv), x2 = nr_normed<NORM>(row, w, j + RH, inv);
    nr_rotate<RH>(j, x1, x2, p, log2_theta, out + j, out + j + RH);
  }
  for (int j = R + lane; j < D; j += 32) nr_store(out + j, nr_normed<NORM>(row, w, j, inv));
}

// a value row as it is, beside its key (the cache holds both in one array: stacked_cache.py's, a drafter's)
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
  nr_turn<D, D, true>(x + ((size_t)r * H + h) * D, w, float(positions[r]), log2_theta[0], eps[0], out + ((size_t)h * rows + r) * D);
  nr_copy<D>(v + ((size_t)r * H + h) * D, out + ((size_t)(H + h) * rows + r) * D);
"""

# every layer's keys alone (a drafter's absorb on the row kernel: one product of every layer's weights), with their
# values: x (rows, L * S), layer l's columns from l * S its H keys then its H values (then what else its product
# made: its queries); w (L, D), layer l's norm weights; grid (32 * rows, H, L) threads, threadgroup (32, 1, 1); out
# (2 * L, H, rows, D) bf16, layer l's keys at 2l and values at 2l + 1, as a state of every layer holds them
# (stacked_cache.py). A (row, head)'s arithmetic is `_KEYS`'s (`nr_turn`, `nr_copy`) whatever the layer's offset.
_LAYER_KEYS = r"""
  const int h = blockIdx.y, r = blockIdx.x, rows = gridDim.x, l = blockIdx.z;
  const __nv_bfloat16* row = x + (size_t)r * L * S + (size_t)l * S;
  nr_turn<D, D, true>(row + (size_t)h * D, w + (size_t)l * D, float(positions[r]), log2_theta[0], eps[0],
                      out + (((size_t)2 * l * H + h) * rows + r) * D);
  nr_copy<D>(row + (size_t)(H + h) * D, out + (((size_t)(2 * l + 1) * H + h) * rows + r) * D);
"""

# queries and keys of the same rows (a drafter's block pass layer, a target's decode rows), with the values: grid
# (32 * rows, HQ + HKV, 1); q_out (rows, HQ, D) float32, kv_out (2, HKV, rows, D) bf16. Query head h of row r starts at
# r * HQ * QH + h * QH of q (QH = D, or 2 * D where a gated layer's q rows hold each head's gate after it: qwen3_5).
# `{qw}`, `{kw}`, `{eps}` and `{norm}` are the variant's (`qk_source`): a layer without q/k norms (llama) takes no weights.
_QK = r"""
  const int h = blockIdx.y, r = blockIdx.x, rows = gridDim.x;
  const float p = float(positions[r]);
  if (h < HQ) {
    nr_turn<D, R, {norm}>(q + (size_t)r * HQ * QH + (size_t)h * QH, {qw}, p, log2_theta[0], {eps},
                          q_out + ((size_t)r * HQ + h) * D);
  } else {
    const int g = h - HQ;
    nr_turn<D, R, {norm}>(k + ((size_t)r * HKV + g) * D, {kw}, p, log2_theta[0], {eps}, kv_out + ((size_t)g * rows + r) * D);
    nr_copy<D>(v + ((size_t)r * HKV + g) * D, kv_out + ((size_t)(HKV + g) * rows + r) * D);
  }
"""


def qk_source(norm: bool) -> str:
    """The joint launch's body with q/k norms (their weights and epsilon its inputs) or without (no such inputs)."""
    fill = ({"norm": "true", "qw": "qw", "kw": "kw", "eps": "eps[0]"} if norm
            else {"norm": "false", "qw": "nullptr", "kw": "nullptr", "eps": "0.0f"})
    body = _QK
    for name, text in fill.items():
        body = body.replace("{" + name + "}", text)
    return body


def fits(head_dim: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes these rows: bf16 (the gpu mode's activations), an even head dim."""
    return dtype == mx.bfloat16 and head_dim % 2 == 0


@lru_cache(maxsize=1)
def _keys_kernel():
    return BakedKernel("dflash_norm_rope_keys", KEYS_INPUTS, ["out"], _KEYS, _HEADER)


@lru_cache(maxsize=1)
def _layer_keys_kernel():
    return BakedKernel("dflash_norm_rope_layer_keys", LAYER_KEYS_INPUTS, ["out"], _LAYER_KEYS, _HEADER)


@lru_cache(maxsize=2)
def _qk_kernel(norm: bool = True):
    name = "dflash_norm_rope_qk" if norm else "dflash_rope_qk"
    return BakedKernel(name, QK_INPUTS if norm else QK_PLAIN_INPUTS, ["q_out", "kv_out"], qk_source(norm), _HEADER)


@lru_cache(maxsize=1)
def _log2f():
    """The C library's `log2f`, which MLX's RoPE applies to its float base on the host
    (`std::log2` of its base); None where there is no C library to load (its float64 value rounded stands in)."""
    path = ctypes.util.find_library("m")
    if path is None:
        return None
    fn = ctypes.CDLL(path).log2f
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def log2_theta(theta: float) -> float:
    """log2 of the RoPE base as MLX takes it: the base rounded to float32, then the host's `log2f`."""
    base = float(np.float32(theta))
    fn = _log2f()
    return float(fn(base)) if fn is not None else float(np.float32(math.log2(base)))


@lru_cache(maxsize=16)
def device_log2_theta(theta: float) -> mx.array:
    """`log2_theta` in device memory (device_values.constant), worked out once a theta (each layer's launch asks)."""
    return constant((log2_theta(theta),), mx.float32)


def _eps(eps: float) -> mx.array:
    """The norm's epsilon, in device memory (device_values.constant)."""
    return constant((eps,), mx.float32)


def heads_of(x: mx.array, d: int, stride: int | None = None) -> tuple[int, int, int]:
    """(rows, heads, d) of rows x (rows, heads * stride) as a projection leaves them, a head every `stride` values
    (d unless a gated layer's gate follows each head): the launch reads them flat, so no reshape (an operation a
    GPU round pays for: docs/gpu-round-profile.md)."""
    rows, width = x.shape
    stride = stride or d
    if width % stride:
        raise ValueError(f"rows of {width} values are not whole heads of {stride}")
    return rows, width // stride, d


def keys(k: mx.array, v: mx.array, w: mx.array, positions: mx.array, theta: float, eps: float) -> mx.array:
    """Key rows k (rows, H * D) bf16, each (row, head) normed by w (D,) and turned at its row's position
    (int32, rows), with their value rows v (rows, H * D) as they are: bf16 (2, H, rows, D), keys then values,
    what one cache write takes."""
    rows, heads, d = heads_of(k, w.shape[0])
    (out,) = _keys_kernel()(
        inputs=[k, v, w, positions, device_log2_theta(theta), _eps(eps)],
        template=[("H", heads), ("D", d)],
        grid=(32 * rows, heads, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(2, heads, rows, d)],
        output_dtypes=[mx.bfloat16],
    )
    return out


def layer_keys(x: mx.array, w: mx.array, positions: mx.array, theta: float, eps: float, heads: int) -> mx.array:
    """Every layer's keys and values from one product of every layer's weights: x (rows, L * S) bf16, layer l's
    `heads` key heads then its value heads from column l * S, each key (row, head) normed by w[l] (w: L, D) and
    turned at its row's position (int32, rows), as `keys` does each layer's: bf16 (2 * L, heads, rows, D), layer l's
    keys at 2l and values at 2l + 1, what a state of every layer's keys and values takes in one write."""
    layers, d = w.shape
    rows, width = x.shape
    if width % layers or width // layers < 2 * heads * d:
        raise ValueError(f"rows of {width} values do not hold {layers} layers' {heads} key and value heads of {d}")
    (out,) = _layer_keys_kernel()(
        inputs=[x, w, positions, device_log2_theta(theta), _eps(eps)],
        template=[("H", heads), ("D", d), ("L", layers), ("S", width // layers)],
        grid=(32 * rows, heads, layers),
        threadgroup=(32, 1, 1),
        output_shapes=[(2 * layers, heads, rows, d)],
        output_dtypes=[mx.bfloat16],
    )
    return out


def queries_and_keys(q: mx.array, k: mx.array, v: mx.array, qw: mx.array | None, kw: mx.array | None,
                     positions: mx.array, theta: float, eps: float, *, head_dim: int | None = None,
                     rope_dims: int | None = None, gated: bool = False) -> tuple[mx.array, mx.array]:
    """The same rows' queries q (rows, HQ * D), keys k and values v (rows, HKV * D), bf16, in one launch: the
    queries as float32 (rows, HQ, D), the keys and values as `keys` gives them.

    A target's attention layer (targets/dense.py) may have no q/k norms (llama: qw and kw None, `head_dim` given),
    turn only the first `rope_dims` of each head's D values (qwen3_5's partial rotary; the rest pass as normed),
    and be `gated`: q rows (rows, HQ * 2D), each head's D queries followed by its D gate values, which stay where
    they are (the layer reads them as a view)."""
    if (qw is None) != (kw is None):
        raise ValueError("q and k norms come together: both weights or neither")
    d = head_dim if head_dim is not None else qw.shape[0]
    if qw is not None and (qw.shape[0] != d or kw.shape[0] != d):
        raise ValueError(f"norm weights of {qw.shape[0]} and {kw.shape[0]} values for heads of {d}")
    r = d if rope_dims is None else rope_dims
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"rope_dims {r} must be even, from 2 to the head dim {d}")
    qh = 2 * d if gated else d
    rows, hq, _ = heads_of(q, d, qh)
    hkv = heads_of(k, d)[1]
    norm = qw is not None
    tail = [qw, kw, positions, device_log2_theta(theta), _eps(eps)] if norm else [positions, device_log2_theta(theta)]
    q_out, kv_out = _qk_kernel(norm)(
        inputs=[q, k, v, *tail],
        template=[("HQ", hq), ("HKV", hkv), ("D", d), ("R", r), ("QH", qh)],
        grid=(32 * rows, hq + hkv, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(rows, hq, d), (2, hkv, rows, d)],
        output_dtypes=[mx.float32, mx.bfloat16],
    )
    return q_out, kv_out
