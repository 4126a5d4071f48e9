"""Decode-row projections as one CUDA kernel, row-independent by construction.

A decode forward multiplies a few rows (1 for a plain step, 16 for a verify window, up to 16 per
stream) by every weight. MLX's CUDA matmuls pick their kernel by the row count (a 16-row quantized
product even lands on a kernel compiled at first use: docs/gpu-round-profile.md), so a row's bits
depend on its company, which is why tiles.py runs decode rows in fixed tiles and the self-check
proves each tile. This kernel makes the tiles unnecessary: any number of rows, one launch.

How a row's result stays the same whatever shares its launch (what drafted == plain needs):
- rows run in 16-row tensor-core tiles (`mma.sync` m16n8k16, bf16 in, float32 accumulate); a
  tile's rows past the call's row count are zeros, and an output row of an MMA depends only on its
  own row of A. Every tile of a launch does the same instructions, so a row's bits do not depend
  on which tile or tile row it sits in, nor on the row count;
- the reduction over the input width has one fixed order, set by the weight's shape alone: lane t of
  a warp owns every fourth 16-byte chunk of a weight row from its warp's start, its MMAs accumulate
  the chunks in ascending order, and the block's warps (a split of the input width) are added in
  warp order through shared memory;
- the launch geometry (`Geometry`) is a function of the weight's shape, never of the row count;
  more rows only add tiles (`MT` a block, then more blocks along y).

Weights: an MLX affine-quantized triple (4 or 8 bits, groups of 32..128: mlx-lm's layout, value j of
a uint32 at bits j * bits) or a plain bf16 matrix. A quantized value is dequantized in registers to
bf16 for the MMA: at 8 bits as `q * scale + bias` in float32 (one fused multiply-add) rounded to bf16;
at 4 bits two at once in bf16x2 arithmetic (`mm_pair4`: the nibbles as the exact bf16 128 + q, minus
128, then one fma that rounds once), about a third of the instructions, which is what a 1-row call
was short of (docs/gpu-round-profile.md). Either is the same function of the weights for every call,
so it is part of the weight, not of the row. The MMA's k order inside a chunk is a permutation of the
chunk's values that A and B share (lane t's values 4s..4s+3 of its chunk sit in the MMA's k slots 2t,
2t+1, 2t+8, 2t+9 of step s; at 4 bits the nibble pairs (0,4) (1,5) of a word feed step 2w and (2,6)
(3,7) step 2w + 1, and x's values are permuted to match), so it is a plain dot product over the chunk.
Loading PIPE iterations' weights ahead of their math (`look_ahead`) changes when loads are issued,
not what is summed in which order.

A stacked weight's launch (tiles.Stacked) can write its output as one row-contiguous array a part
(`parts`): where each column lands, never how it is summed, so the parts equal the columns of the
unsplit product bit for bit (tests/test_matmul_kernel.py, on the device and under the emulator).
A layer's output and down projections add the residual stream in their launch (`residual`): each
output is rounded to bf16 as before, then added to its residual value and rounded once, the bits of
MLX's bf16 add of the two arrays, one launch a layer fewer each (tests/test_matmul_kernel.py).
A layer's RMS norm before its projection rides in the projection's launch too (`norm`): each value of x is
multiplied by the norm's weight there (rounded to bf16) as it is loaded, the row's squares are summed as they
are loaded, in an order set by the weight's shape (each lane its chunks, then a warp's lanes, then the warps
in order), and each output's float32 sum is scaled by the row's 1 / sqrt(mean + eps). The kernel's own
arithmetic, not MLX's norm's bits, but again a function of the row alone. A launch of one row tile whose upper
half holds no row (a plain step's one row, up to 8 of a verify window's) skips that half's squares and weighting:
those rows are not written, and an MMA's output row depends on its own row of A alone, so no written bit moves.

Only the decode rows take this path, and only on a CUDA GPU (tiles.py `linear`); prompt chunks keep
MLX's own kernels (their bits need only be a function of the chunk: tiles.py). The engine's
self-check proves the kernel where it runs (selfcheck.py); tests/test_matmul_kernel.py checks it on
a CUDA GPU.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import mlx.core as mx

from dflash_bench.engine.backend import on_cuda
from dflash_bench.engine.baked_kernel import BakedKernel
from dflash_bench.engine.cuda_source import ROTATION
from dflash_bench.engine.device_values import constant

MMA_ROWS = 16  # rows of one tensor-core tile
MAX_TILES = 4  # row tiles a block carries (64 rows read the weights once)
MAX_PARTS = 4  # separate outputs a launch can write (qwen3_5's in_proj: qkv, z, b, a)
TARGET_WARPS = 2048  # enough warps in flight to keep the H200's memory busy (132 SMs)

_HEADER = r"""
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"

__device__ __forceinline__ uint32_t mm_pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Two 4-bit values at once: (v >> 0) & 0x000F000F | 0x43004300 is the bf16 pair (128 + q_a, 128 + q_b)
// of nibbles 0 and 4 of v; minus 128 is exact, and one bf16x2 fma rounds q * scale + bias once.
__device__ __forceinline__ uint32_t mm_pair4(uint32_t v, __nv_bfloat162 s2, __nv_bfloat162 b2) {
  uint32_t raw = (v & 0x000F000Fu) | 0x43004300u;
  __nv_bfloat162 q = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&raw), __float2bfloat162_rn(128.0f));
  __nv_bfloat162 r = __hfma2(q, s2, b2);
  return *reinterpret_cast<uint32_t*>(&r);
}

// Two neighbouring outputs as bf16, rounded once from their float sums; with RESID, each then added to its
// residual value as MLX adds two bf16 arrays (the float sum of the two, rounded once: exact before rounding
// for bf16 operands), so `residual + product` in one launch has the bits of the product and an add.
template <int RESID>
__device__ __forceinline__ __nv_bfloat162 mm_out(float a, float b, const __nv_bfloat16* r) {
  __nv_bfloat162 y = __floats2bfloat162_rn(a, b);
  if constexpr (RESID != 0) {
    const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(r);
    y = __floats2bfloat162_rn(__bfloat162float(x.x) + __bfloat162float(y.x), __bfloat162float(x.y) + __bfloat162float(y.y));
  }
  return y;
}

// With GLU, columns 2j and 2j + 1 are an MLP's gate j and up j (tiles.SwiGLU interleaves their weight rows): each
// rounded to bf16 as a product is, then engine/fused.py's `sigmoid(gate) * gate * up` as MLX's compiled kernel runs
// it on GPU, MLX's own functors each rounding to bf16 (mlx/backend/cuda/device/*_ops.cuh), so the one output has the
// bits of the two products and the fused SwiGLU after them.
__device__ __forceinline__ __nv_bfloat16 mm_glu(float g, float u) {
  const __nv_bfloat16 gate = __float2bfloat16_rn(g), up = __float2bfloat16_rn(u);
  const __nv_bfloat16 s = mlx::core::cu::Sigmoid{}(gate);
  const __nv_bfloat16 sg = mlx::core::cu::Multiply{}(s, gate);
  return mlx::core::cu::Multiply{}(sg, up);
}

// A row's squares, added in the order of its values (x's eight bf16 values of a 16-byte load, low half first).
__device__ __forceinline__ float mm_squares(uint4 v, float s) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(words[i] << 16), hi = __uint_as_float(words[i] & 0xFFFF0000u);
    s = __fmaf_rn(hi, hi, __fmaf_rn(lo, lo, s));
  }
  return s;
}

// x's eight values times the norm's weights at the same places, each product rounded to bf16 once.
__device__ __forceinline__ uint4 mm_weighted(uint4 v, uint4 w) {
  const uint32_t a[4] = {v.x, v.y, v.z, v.w}, b[4] = {w.x, w.y, w.z, w.w};
  uint32_t r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 p = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a[i]), *reinterpret_cast<const __nv_bfloat162*>(&b[i]));
    r[i] = *reinterpret_cast<const uint32_t*>(&p);
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

__device__ __forceinline__ void mm_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""

# With `rope` (`rows_matmul`): the launch's header starts with ROTATION and `mm_head_pair`, and its store writes a layer's
# q, k and v columns (P1, P2 split N) as the attention takes them (q_out (M, HQ, D) float32, kv_out (2, HKV, M, D)
# bf16), each q and k column pair turned at its row's position (`rope_order`).
_ROPE_HEADER = ROTATION + r"""
// A column pair (c, c + 1) of one row's head, rounded to bf16 as a product is, into its place: turned where c < R
// (the pair holds the head's values c / 2 and c / 2 + R / 2: `rope_order`), as they are from R on (a value's head:
// R 0). O is float for queries (the bf16 value widened), bf16 for keys and values.
template <int R, typename O>
__device__ __forceinline__ void mm_head_pair(O* head, int c, float a, float b, float p, float log2_theta) {
  const float x1 = __bfloat162float(__float2bfloat16_rn(a)), x2 = __bfloat162float(__float2bfloat16_rn(b));
  if (c < R) {
    nr_rotate<R / 2>(c / 2, x1, x2, p, log2_theta, head + c / 2, head + c / 2 + R / 2);
  } else {
    nr_store(head + c, x1);
    nr_store(head + c + 1, x2);
  }
}
"""

_ROPE_STORE = r"""
            {  // rope: column col of q, k or v (P1, P2 split N) at rows r0 and r0 + 8, into q_out or kv_out
              const int which = col < P1 ? 0 : col < P2 ? 1 : 2;
              const int at = col - (which == 0 ? 0 : which == 1 ? P1 : P2);
              const int h = at / D, c = at % D;
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int r = m0 + i * 16 + grp + 8 * e;
                if (r >= M) continue;
                const float p = float(positions[r]);
                if (which == 0) mm_head_pair<R>(q_out + ((size_t)r * HQ + h) * D, c, v[2 * e], v[2 * e + 1], p, log2_theta[0]);
                else if (which == 1) mm_head_pair<R>(kv_out + ((size_t)h * M + r) * D, c, v[2 * e], v[2 * e + 1], p, log2_theta[0]);
                else mm_head_pair<0>(kv_out + ((size_t)(HKV + h) * M + r) * D, c, v[2 * e], v[2 * e + 1], p, log2_theta[0]);
              }
              continue;
            }"""

# Template constants: K, N (the weight's in and out widths), BITS (4, 8, or 16 for bf16 weights),
# G (group size; unused at 16), NT (8-column MMA tiles a warp), SPLITK (warps a block, splitting K),
# MT (16-row tiles a block), PIPE (iterations whose weight loads are issued before their math), P1 <=
# P2 <= P3 (where the output's parts start: `rows_matmul`'s `parts`, N where there are fewer), RESID
# (1: the input `residual`, (M, N), is added to the output: `rows_matmul`'s `residual`), NORM (1: the rows are
# RMS-normed with the input `norm`'s (K,) weights and epsilon EPS, a float's bits: `rows_matmul`'s `norm`), GLU (1:
# the output is (M, N / 2), the SwiGLU of each column pair: `rows_matmul`'s `glu`); with `rope`, HQ, HKV (query and
# key heads), D (the head dim) and R (its rotary dims). The source avoids `_shape`, `_strides` and `_ndim` (MLX would
# add them).
_SOURCE = r"""
  constexpr int PER_WORD = BITS == 16 ? 2 : 32 / BITS;   // values in a uint32
  constexpr int VPT = 4 * PER_WORD;                       // values in a 16-byte chunk
  constexpr int STEPS = VPT / 4;                          // MMA k-steps a chunk feeds
  constexpr int C = K / VPT;                              // chunks along a weight row
  constexpr int WORDS = K / PER_WORD;                     // uint32 a weight row
  constexpr int GROUPS = BITS == 16 ? 1 : K / G;
  constexpr int ITERS = (C + 4 * SPLITK - 1) / (4 * SPLITK);
  constexpr uint32_t MASK = BITS == 16 ? 0u : (1u << BITS) - 1u;
  static_assert(ITERS % PIPE == 0, "PIPE divides ITERS");

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int grp = lane >> 2;
  const int t = lane & 3;
  const int n0 = blockIdx.x * (8 * NT);
  const int m0 = blockIdx.y * (16 * MT);
  const int M = rows[0];
  const uint32_t* wq = reinterpret_cast<const uint32_t*>(w);

  float acc[MT][NT][4];
  float ss[MT][2];  // with NORM: the squares of rows grp and grp + 8 of each tile, over this lane's chunks
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    ss[i][0] = ss[i][1] = 0.0f;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
  }

  for (int it0 = 0; it0 < ITERS; it0 += PIPE) {
    // the weight words, scales and biases of PIPE iterations, loaded before their math
    uint4 q[PIPE][NT];
    float sc[PIPE][NT], bi[PIPE][NT];
#pragma unroll
    for (int p = 0; p < PIPE; ++p) {
      const int c = ((it0 + p) * SPLITK + warp) * 4 + t;
      const bool live = c < C;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int n = n0 + j * 8 + grp;
        q[p][j] = live ? __ldg(reinterpret_cast<const uint4*>(wq + (size_t)n * WORDS + (size_t)c * 4)) : make_uint4(0u, 0u, 0u, 0u);
        sc[p][j] = bi[p][j] = 0.0f;
        if constexpr (BITS != 16) {
          if (live) {
            const int gi = n * GROUPS + (c * VPT) / G;
            sc[p][j] = (float)scales[gi];
            bi[p][j] = (float)biases[gi];
          }
        }
      }
    }
#pragma unroll
    for (int p = 0; p < PIPE; ++p) {
      const int c = ((it0 + p) * SPLITK + warp) * 4 + t;
      const bool live = c < C;
      uint32_t b[NT][STEPS][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint32_t words[4] = {q[p][j].x, q[p][j].y, q[p][j].z, q[p][j].w};
        if constexpr (BITS == 16) {
#pragma unroll
          for (int s = 0; s < STEPS; ++s) {
            b[j][s][0] = words[2 * s];
            b[j][s][1] = words[2 * s + 1];
          }
        } else if constexpr (BITS == 4) {
          const __nv_bfloat162 s2 = __float2bfloat162_rn(sc[p][j]);
          const __nv_bfloat162 b2 = __float2bfloat162_rn(bi[p][j]);
#pragma unroll
          for (int wi = 0; wi < 4; ++wi)
#pragma unroll
            for (int u = 0; u < 4; ++u) b[j][2 * wi + u / 2][u & 1] = mm_pair4(words[wi] >> (4 * u), s2, b2);
        } else {
#pragma unroll
          for (int s = 0; s < STEPS; ++s) {
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int jv = 4 * s + e;
              const uint32_t qv = (words[jv / PER_WORD] >> (BITS * (jv % PER_WORD))) & MASK;
              v[e] = __fmaf_rn((float)qv, sc[p][j], bi[p][j]);
            }
            b[j][s][0] = mm_pack(v[0], v[1]);
            b[j][s][1] = mm_pack(v[2], v[3]);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int r0 = m0 + i * 16 + grp;
        const int r1 = r0 + 8;
#pragma unroll
        for (int h = 0; h < STEPS / 2; ++h) {
          uint4 xa = make_uint4(0u, 0u, 0u, 0u);
          uint4 xb = make_uint4(0u, 0u, 0u, 0u);
          if (live && r0 < M) xa = *reinterpret_cast<const uint4*>(x + (size_t)r0 * K + (size_t)c * VPT + h * 8);
          if (live && r1 < M) xb = *reinterpret_cast<const uint4*>(x + (size_t)r1 * K + (size_t)c * VPT + h * 8);
          if constexpr (NORM != 0) {  // the rows' squares as they come, then x times the norm's weights there
            const uint4 nw = live ? *reinterpret_cast<const uint4*>(norm + (size_t)c * VPT + h * 8) : make_uint4(0u, 0u, 0u, 0u);
            ss[i][0] = mm_squares(xa, ss[i][0]);
            xa = mm_weighted(xa, nw);
            if (MT > 1 || m0 + 8 < M) {  // one row tile: its upper half's squares and weights where it has rows
              ss[i][1] = mm_squares(xb, ss[i][1]);
              xb = mm_weighted(xb, nw);
            }
          }
          if constexpr (BITS == 4) {  // x's values in the nibble pairs' order: (0,4) (1,5) | (2,6) (3,7)
            xa = make_uint4(__byte_perm(xa.x, xa.z, 0x5410), __byte_perm(xa.x, xa.z, 0x7632),
                            __byte_perm(xa.y, xa.w, 0x5410), __byte_perm(xa.y, xa.w, 0x7632));
            xb = make_uint4(__byte_perm(xb.x, xb.z, 0x5410), __byte_perm(xb.x, xb.z, 0x7632),
                            __byte_perm(xb.y, xb.w, 0x5410), __byte_perm(xb.y, xb.w, 0x7632));
          }
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            mm_mma(acc[i][j], xa.x, xb.x, xa.y, xb.y, b[j][2 * h][0], b[j][2 * h][1]);
            mm_mma(acc[i][j], xa.z, xb.z, xa.w, xb.w, b[j][2 * h + 1][0], b[j][2 * h + 1][1]);
          }
        }
      }
    }
  }

  // With NORM, each row's scale: its squares summed over a warp's four lanes (t), then over the warps in warp
  // order, then 1 / sqrt(mean + eps); a function of the row and the weight's shape alone.
  float inv[MT][2];
  if constexpr (NORM != 0) {
    __shared__ float sq[SPLITK * MT * 16];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = ss[i][e];
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
        if (t == 0) sq[(warp * MT + i) * 16 + e * 8 + grp] = v;
      }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float total = sq[i * 16 + e * 8 + grp];
        for (int s = 1; s < SPLITK; ++s) total = __fadd_rn(total, sq[(s * MT + i) * 16 + e * 8 + grp]);
        inv[i][e] = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(total, float(K)), __int_as_float(EPS))));
      }
  }

  // The warps' partial sums, added in warp order: red = w0; red += w1; ...; out = red + w_last.
  __shared__ float red[MT * NT * 4 * 32];
  for (int s = 0; s < SPLITK; ++s) {
    if (warp == s) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          float v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int at = ((i * NT + j) * 4 + e) * 32 + lane;
            v[e] = s == 0 ? acc[i][j][e] : __fadd_rn(red[at], acc[i][j][e]);
            if (s < SPLITK - 1) red[at] = v[e];
          }
          if (s == SPLITK - 1) {
            if constexpr (NORM != 0) {  // the product of the weighted rows, times each row's scale
              v[0] = __fmul_rn(v[0], inv[i][0]);
              v[1] = __fmul_rn(v[1], inv[i][0]);
              v[2] = __fmul_rn(v[2], inv[i][1]);
              v[3] = __fmul_rn(v[3], inv[i][1]);
            }
            const int col = n0 + j * 8 + 2 * t;{rope_store}
            if constexpr (GLU != 0) {  // columns col, col + 1 (a gate and its up) as one value, at column col / 2
              const int r0 = m0 + i * 16 + grp;
              if (r0 < M) {glu_out}[(size_t)r0 * (N / 2) + col / 2] = mm_glu(v[0], v[1]);
              if (r0 + 8 < M) {glu_out}[(size_t)(r0 + 8) * (N / 2) + col / 2] = mm_glu(v[2], v[3]);
              continue;
            }
            // column col of its part (columns [lo, hi): P1..P3 split N) at row r: that part's output, row-contiguous,
            // at r * (hi - lo) + col - lo (`source` puts in the part's own output, or y + M * lo where one holds all)
            const int lo = col < P1 ? 0 : col < P2 ? P1 : col < P3 ? P2 : P3;
            const int hi = col < P1 ? P1 : col < P2 ? P2 : col < P3 ? P3 : N;
            __nv_bfloat16* part = {part} + (col - lo);
            const int r0 = m0 + i * 16 + grp;
            if (r0 < M) *reinterpret_cast<__nv_bfloat162*>(part + (size_t)r0 * (hi - lo)) = mm_out<RESID>(v[0], v[1], residual + (size_t)r0 * N + col);
            if (r0 + 8 < M) *reinterpret_cast<__nv_bfloat162*>(part + (size_t)(r0 + 8) * (hi - lo)) = mm_out<RESID>(v[2], v[3], residual + (size_t)(r0 + 8) * N + col);
          }
        }
    }
    __syncthreads();
  }
"""


@dataclass(frozen=True)
class Geometry:
    """A weight's launch shape: 8 * nt output columns a block, split_k warps along the input width.

    A function of the weight's shape alone (`geometry`), so the reduction order of every output is
    fixed per weight, whatever the row count."""

    nt: int
    split_k: int


def available(dtype: mx.Dtype) -> bool:
    """Whether the kernel can run here: bf16 activations (the gpu mode) on a CUDA GPU."""
    return dtype == mx.bfloat16 and on_cuda()


def values_per_chunk(bits: int) -> int:
    """Input values in one 16-byte load of a weight row: 32 at 4 bits, 16 at 8, 8 for bf16."""
    return 128 // bits


def fits(in_features: int, out_features: int, bits: int, group_size: int) -> bool:
    """Whether the kernel takes this weight: 4, 8 or 16 (bf16) bits, whole 16-byte chunks along the
    input, whole 8-column tiles out, and (quantized) groups of whole chunks."""
    if bits not in (4, 8, 16) or out_features % 8:
        return False
    chunk = values_per_chunk(bits)
    if in_features % chunk:
        return False
    return bits == 16 or (group_size % chunk == 0 and in_features % group_size == 0)


@lru_cache(maxsize=None)
def geometry(in_features: int, out_features: int, bits: int) -> Geometry:
    """Two column tiles a warp where the columns allow; then split the input width over enough warps
    for about TARGET_WARPS in flight, each warp keeping at least one chunk per lane."""
    nt = 2 if out_features % 16 == 0 else 1
    blocks = out_features // (8 * nt)
    chunks = in_features // values_per_chunk(bits)
    split = 1
    while split < 8 and blocks * split < TARGET_WARPS and 4 * split * 2 <= chunks:
        split *= 2
    return Geometry(nt, split)


def look_ahead(in_features: int, bits: int, split_k: int, tiles: int, column_tiles: int, normed: bool) -> int:
    """Iterations a warp loads before their math (`PIPE`): only when its loads are issued, so any value
    gives the same bits. Measured alone (tools/row_kernel_variants.py, docs/gpu-round-profile.md): 4 for
    8-bit weights; 2 for launches of several row tiles (the H200) and for 4-bit weights at 4 column tiles a
    warp without a norm in the launch (an H100, session 47: a verify window's 16 rows of the 9B's down 24.1 ->
    21.1 us, lm_head 377.1 -> 295.4 without its norm; with the norm, as gate/up and the lm_head run, 2 moved
    nothing, and in a round timeline's launches the normed gate/up took 5% longer); else 1. It must divide
    the iterations."""
    iterations = -(-(in_features // values_per_chunk(bits)) // (4 * split_k))
    wide = bits == 4 and column_tiles == 4 and not normed
    want = 4 if bits == 8 else 2 if tiles > 1 or wide else 1
    while iterations % want:
        want //= 2
    return want


INPUTS = ["x", "w", "scales", "biases", "rows", "residual", "norm"]
ROPE_INPUTS = INPUTS + ["positions", "log2_theta"]


def outputs(parts: int, rope: bool = False) -> list[str]:
    """The launch's output names: one (`y`), or one a part (`y0`..) where a stacked weight's launch writes its
    parts apart, or a layer's queries and keys with values (`rope`)."""
    if rope:
        return ["q_out", "kv_out"]
    return [f"y{i}" for i in range(parts)] if parts else ["y"]


def source(parts: int, rope: bool = False) -> str:
    """The kernel body writing one output, or `parts` outputs (a column's part picked by P1..P3), or with `rope`
    a layer's queries and keys (`_ROPE_STORE`). The stores a variant never takes (GLU is 0 in a launch of parts
    or rope, and rope's store returns first) name its last output, so that they still compile."""
    names = outputs(parts, rope)
    body = _SOURCE.replace("{glu_out}", names[-1]).replace("{rope_store}", _ROPE_STORE if rope else "")
    if rope:
        return body.replace("{part}", names[-1])
    if not parts:
        return body.replace("{part}", "y + (size_t)M * lo")
    pick = names[-1]
    for bound, name in reversed(list(zip(("P1", "P2", "P3"), names[:-1]))):
        pick = f"col < {bound} ? {name} : {pick}"
    return body.replace("{part}", f"({pick})")


@lru_cache(maxsize=None)
def _kernel(parts: int = 0, rope: bool = False):
    """The launch object for one output, for `parts` outputs (each part count is its own source), or for a layer's
    turned queries and keys (`rope`)."""
    if rope:
        return BakedKernel("dflash_rows_matmul_rope", ROPE_INPUTS, outputs(0, True), source(0, True),
                           _ROPE_HEADER + _HEADER)
    return BakedKernel(f"dflash_rows_matmul{f'_{parts}parts' if parts else ''}", INPUTS, outputs(parts), source(parts),
                       _HEADER)


def rope_order(head_dim: int, rope_dims: int) -> list[int]:
    """Where a head's values sit in a `rope` launch's weight rows: column 2i holds value i and 2i + 1 value
    i + rope_dims / 2 (the pairs RoPE turns together, in one thread of the launch), then the values from rope_dims
    on in order."""
    half = rope_dims // 2
    return [v for i in range(half) for v in (i, i + half)] + list(range(rope_dims, head_dim))


def head_rows(heads: int, head_dim: int, rope_dims: int) -> list[int]:
    """A q or k weight's output rows as a `rope` launch takes them: each head's in `rope_order`."""
    order = rope_order(head_dim, rope_dims)
    return [h * head_dim + c for h in range(heads) for c in order]


def in_order(rows: list[int]) -> list[int]:
    """Where each value of a `head_rows` product lies: the gather that puts its heads' values back in order."""
    return sorted(range(len(rows)), key=rows.__getitem__)


@dataclass(frozen=True)
class Rope:
    """A `rope` launch's turn (`rows_matmul`): each row's position (int32, rows), log2 of the RoPE base in device
    memory (targets/norm_rope_kernel.py's `device_log2_theta`), and the layer's heads: queries, keys and values, the
    head dim and its rotary dims."""

    positions: mx.array
    log2_theta: mx.array
    heads: tuple[int, int, int, int]  # HQ, HKV, D, R


def splits_output(widths: tuple[int, ...]) -> bool:
    """Whether a launch can write these column widths (summing to N) as separate parts: at most
    MAX_PARTS, each of whole column pairs (a thread writes two neighbouring columns)."""
    return 1 < len(widths) <= MAX_PARTS and all(w % 2 == 0 and w > 0 for w in widths)


@dataclass(frozen=True)
class KernelCall:
    """One call shape's launch arguments (`launch`), built once: a decode round makes a call per weight,
    and the host's time building each is part of the round's (docs/gpu-round-profile.md)."""

    rows: mx.array  # the row count, the kernel's input `rows`
    options: dict  # template, grid, threadgroup, output shapes and dtypes


def tiles_a_warp(m: int, k: int, n: int, bits: int, normed: bool) -> int:
    """8-column MMA tiles a warp computes for m rows (`normed`: the launch RMS-norms its rows). Each warp
    loads its rows of x for every chunk, and at one row only a few lanes do; a verify window's 16 rows cost
    every lane 8 loads a chunk against 2 of weights at the geometry's 2 tiles, so several rows take 4 tiles a
    warp where that still leaves half of TARGET_WARPS in flight. On the H200
    (docs/profiles/matmul-kernel-probe-h200.log, 2026-12-04) that made 16 rows of the 9B's projections 8-21%
    faster (its lm_head 0.591 -> 0.479 ms) and 64 rows 35-46% faster, while weights too narrow for it (the 9B's
    k/v alone, the 135M model's) were as fast or slower at 4. At one row tile (1-16 rows), measured alone on an
    H100: 4-bit launches with the norm in them take 4 tiles from one row on, since their upper half's norm is
    skipped where it holds no row (16 rows of the 9B's normed gate/up 40.2 us against 51.0 at 2 tiles, one row
    35.3 against 42.8; its GatedDeltaNet in_proj 22.1 / 19.9 against 26.9 / 23.0; the lm_head 355.7 / 311.8
    against 480.2 / 349.8: docs/profiles/row-kernel-variants-norm-h100-48.txt; before that skip, 4 tiles were the
    slower for normed launches with a split input width, 62.4 against 51.1 us for 16 rows of gate/up); other
    launches keep the geometry's tiles at one row, and bf16 weights at up to 16 rows (the 9B drafter's fc 112.1
    against 119.8 us at 16 rows, down 46.1 against 49.0: docs/profiles/row-kernel-variants-h100-46.txt; at 64
    rows 4 tiles are 1.4-1.6x faster), as do 8-bit normed launches with a split input width (not measured).
    Which warp computes a column never enters its sum (the split of the input width, `SPLITK`, and each lane's
    chunks set that), so the bits are the geometry's. 8 and 16 tiles a warp were slower at 1 and 16 rows on an
    H100 (docs/profiles/row-kernel-variants-h100-47.txt), even where the kernel dequantized a k-step pair of
    fragments at a time so that nothing spilled: fewer warps with more loads each, not registers, is what
    costs there."""
    g = geometry(k, n, bits)
    wide = g.nt == 2 and n % 32 == 0 and n // 32 * g.split_k >= TARGET_WARPS // 2
    if m <= MMA_ROWS and not (normed and bits == 4) and (m == 1 or bits == 16 or normed and g.split_k > 1):
        return g.nt
    return 4 if wide else g.nt


def float_bits(value: float) -> int:
    """A float32's bits as an int (a template constant; the source reads it back with `__int_as_float`)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


@lru_cache(maxsize=4096)
def launch(m: int, k: int, n: int, bits: int, group_size: int, parts: tuple[int, ...], residual: bool = False,
           eps: float | None = None, glu: bool = False, rope: tuple[int, int, int, int] | None = None) -> KernelCall:
    """The launch of `rows_matmul` for m rows of a (n, k) weight (rows RMS-normed first where `eps` is given; the
    SwiGLU of its column pairs out where `glu`; a layer's turned queries and keys with values where `rope` gives
    its heads, HQ, HKV, D, R): a function of the shapes alone."""
    g = geometry(k, n, bits)
    normed = eps is not None
    nt = tiles_a_warp(m, k, n, bits, normed)
    tiles = min(MAX_TILES, -(-m // MMA_ROWS))
    starts = list(accumulate(parts[:-1])) if parts else []
    template = (("K", k), ("N", n), ("BITS", bits), ("G", group_size if bits != 16 else 1),
                ("NT", nt), ("SPLITK", g.split_k), ("MT", tiles), ("PIPE", look_ahead(k, bits, g.split_k, tiles, nt, normed)),
                *zip(("P1", "P2", "P3"), starts + [n] * (MAX_PARTS - 1 - len(starts))), ("RESID", int(residual)),
                ("NORM", int(normed)), ("EPS", float_bits(eps) if normed else 0), ("GLU", int(glu)))
    shapes, dtypes = [(m, width) for width in parts] or [(m, n // 2 if glu else n)], [mx.bfloat16] * max(1, len(parts))
    if rope is not None:
        hq, hkv, d, _ = rope
        template += tuple(zip(("HQ", "HKV", "D", "R"), rope))
        shapes, dtypes = [(m, hq, d), (2, hkv, m, d)], [mx.float32, mx.bfloat16]
    options = dict(template=template, grid=(n // (8 * nt) * 32 * g.split_k, -(-m // (MMA_ROWS * tiles)), 1),
                   threadgroup=(32 * g.split_k, 1, 1), output_shapes=shapes, output_dtypes=dtypes)
    return KernelCall(constant((m,)), options)


def rows_matmul(x: mx.array, w: mx.array, scales: mx.array | None, biases: mx.array | None, bits: int,
                group_size: int, parts: tuple[int, ...] = (), residual: mx.array | None = None,
                norm: tuple[mx.array, float] | None = None, glu: bool = False,
                rope: Rope | None = None) -> mx.array | list[mx.array]:
    """`x @ W.T` for bf16 rows x (M, K): W packed (N, K * bits / 32) uint32 with bf16 scales and
    biases (N, K / group_size), or a bf16 (N, K) matrix with `bits` 16. Returns (M, N) bf16, or with
    `parts` (column widths summing to N, `splits_output`) one row-contiguous (M, width) array a part, each
    an output of the launch: a stacked weight's products (tiles.Stacked), which a column slice of (M, N)
    would leave strided for every later reshape and kernel to copy (and a split of one flat output costs the
    host a split and a reshape a part). Where a column is written, never how it is summed.

    With `residual` (M, N) bf16, `residual + x @ W.T` in the same launch, bit for bit the product
    then MLX's add (`mm_out`): a decoder layer's two residual adds, one launch each a layer before
    (docs/gpu-round-profile.md: a decode forward pays per launch). Elementwise, so a row's bits stay
    its own.

    With `norm` (weights (K,) bf16, epsilon), the product of the rows RMS-normed: each row's x times the
    weights (each product rounded to bf16) goes into the product, and its float32 sums are scaled by
    1 / sqrt(mean(x^2) + eps), the row's squares summed as the launch loads them (`mm_squares`) in an order
    set by the weight's shape. So a layer's norm before its projection is no launch of its own; the values
    are the norm-then-product's to bf16 accuracy, not its bits, and a row's bits are its own as before.

    With `glu`, W's rows alternate an MLP's gate and up rows (tiles.SwiGLU) and the launch returns (M, N / 2): each
    pair's two products rounded to bf16, then engine/fused.py's `swiglu` of them with MLX's own functors (`mm_glu`),
    the bits of the products and MLX's compiled SwiGLU after them, one launch where there were two.

    With `rope` (a layer's q, k and v weight rows, `parts` their widths, q's and k's rows of each head in
    `rope_order`), the launch returns what targets/norm_rope_kernel.py's `queries_and_keys` would of the three
    parts (a layer without q/k norms): queries (M, HQ, D) float32 and keys with values (2, HKV, M, D) bf16, each
    q and k pair rounded to bf16 as a part is, then turned at its row's position with the same device function
    (cuda_source.ROTATION), so the same bits in one launch where there were two."""
    m, k = x.shape
    if residual is not None and parts:
        raise ValueError("rows_matmul adds a residual to a whole output, not to parts")
    if glu and (parts or residual is not None):
        raise ValueError("rows_matmul's glu writes one output and adds no residual")
    if rope is not None and (glu or residual is not None or len(parts) != 3):
        raise ValueError("rows_matmul's rope takes a layer's three parts, q, k and v, and adds no residual")
    call = launch(m, k, w.shape[0], bits, group_size, parts, residual is not None, None if norm is None else norm[1],
                  glu, None if rope is None else rope.heads)
    if bits == 16:
        scales = biases = w  # unread: the launch still takes four arrays (w itself: a slice would be an operation)
    resid = x if residual is None else residual  # unread where RESID is 0
    inputs = [x, w, scales, biases, call.rows, resid, x if norm is None else norm[0]]
    if rope is not None:
        return list(_kernel(0, True)(inputs=inputs + [rope.positions, rope.log2_theta], **call.options))
    ys = _kernel(len(parts))(inputs=inputs, **call.options)
    return list(ys) if parts else ys[0]
