"""The CUDA source of matmul_kernel.py's decode-row projections.

One launch for any number of rows, each row's bits its own; matmul_kernel.py picks each launch's template
constants and says where the kernel runs.

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
"""

from dflash_bench.engine.cuda_source import ROTATION

HEADER = r"""
#include <cuda/std/cmath>

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
// it on the GPU, so the one output has the bits of the two products and the fused SwiGLU after them. MLX's sigmoid
// functor on a bf16 x is `1 / (1 + exp(abs(x)))`, or 1 minus that where x >= 0, with libcu++'s bf16 exp and abs, and
// MLX's device headers define each mixed integer-and-bf16 step as float arithmetic rounded to bf16 once; its
// multiply of two bf16 values is cuda_bf16's `*`, `__hmul`. Written out here, not included: those headers exist only
// inside MLX's library, so engine/kernel_cache.py's own compile of this source could not find them
// (tests/test_matmul_glu.py proves the bits on a GPU, for every bf16 gate).
__device__ __forceinline__ __nv_bfloat16 mm_sigmoid(__nv_bfloat16 x) {
  const float e = __bfloat162float(cuda::std::exp(cuda::std::abs(x)));
  const __nv_bfloat16 y = __float2bfloat16(1.0f / __bfloat162float(__float2bfloat16(1.0f + e)));
  return __bfloat162float(x) < 0.0f ? y : __float2bfloat16(1.0f - __bfloat162float(y));
}

__device__ __forceinline__ __nv_bfloat16 mm_glu(float g, float u) {
  const __nv_bfloat16 gate = __float2bfloat16_rn(g), up = __float2bfloat16_rn(u);
  return __hmul(__hmul(mm_sigmoid(gate), gate), up);
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
ROPE_HEADER = ROTATION + r"""
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

ROPE_STORE = r"""
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
BODY = r"""
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
    a layer's queries and keys (`ROPE_STORE`). The stores a variant never takes (GLU is 0 in a launch of parts
    or rope, and rope's store returns first) name its last output, so that they still compile."""
    names = outputs(parts, rope)
    body = BODY.replace("{glu_out}", names[-1]).replace("{rope_store}", ROPE_STORE if rope else "")
    if rope:
        return body.replace("{part}", names[-1])
    if not parts:
        return body.replace("{part}", "y + (size_t)M * lo")
    pick = names[-1]
    for bound, name in reversed(list(zip(("P1", "P2", "P3"), names[:-1]))):
        pick = f"col < {bound} ? {name} : {pick}"
    return body.replace("{part}", f"({pick})")
