"""Decode attention's CUDA source: the header, pass 1 (`PARTIAL`, its per-variant body from `partial_source`) and
pass 2 (`COMBINE`). How its arithmetic keeps every row's bits its own, and the launches that run it, are
attention_kernel.py's; this module holds the text alone (no MLX), as matmul_source.py does for the row kernel.
"""

from __future__ import annotations

from dflash_bench.engine.cuda_source import CONVERSIONS

HEADER = CONVERSIONS + r"""

template <typename T, int N> struct alignas(N * sizeof(T)) da_pack { T v[N]; };

// N consecutive elements at p as floats, in loads of 16 bytes (or of all N where that is less).
template <typename T, int N>
__device__ __forceinline__ void da_load(const T* p, float* out) {
  constexpr int W = (N * sizeof(T) >= 16) ? 16 / (int)sizeof(T) : N;
#pragma unroll
  for (int i = 0; i < N / W; ++i) {
    const da_pack<T, W> pk = reinterpret_cast<const da_pack<T, W>*>(p)[i];
#pragma unroll
    for (int t = 0; t < W; ++t) {
      out[i * W + t] = cvt_to_f(pk.v[t]);
    }
  }
}

// A chunk of 32 keys into shared rows of pitch DP, in 16-byte loads: key i's D elements from row(i), or none
// where row(i) is null (no row of the launch sees that key, so it stays unstaged).
template <typename T, int D, int DP, int NT, typename Row>
__device__ __forceinline__ void da_stage_rows(T* dst, Row row) {
  constexpr int VEC = 16 / (int)sizeof(T);
  constexpr int PIECES = 32 * D / VEC;
#pragma unroll
  for (int u = 0; u < (PIECES + NT - 1) / NT; ++u) {
    const int idx = threadIdx.x + u * NT;
    if (PIECES % NT == 0 || idx < PIECES) {
      const int key = idx / (D / VEC);
      const int piece = idx % (D / VEC);
      const T* src = row(key);
      if (src != nullptr) *reinterpret_cast<uint4*>(dst + key * DP + piece * VEC) = reinterpret_cast<const uint4*>(src)[piece];
    }
  }
}

// A chunk of 32 keys, 32 * D contiguous elements at src.
template <typename T, int D, int DP, int NT>
__device__ __forceinline__ void da_stage(T* dst, const T* src) {
  da_stage_rows<T, D, DP, NT>(dst, [src](int key) { return src + (long long)key * D; });
}

// The chunk from c0, its keys before `start` from the cache and the rest from a block's own rows (key start + i
// at row row0 + i of `blk`, none past its n rows). The same values land where the cache would have held them had
// the block been written there first.
template <typename T, int D, int DP, int NT>
__device__ __forceinline__ void da_stage_split(T* dst, const T* cache, const T* blk, int c0, int start, int n, int row0) {
  da_stage_rows<T, D, DP, NT>(dst, [=](int key) -> const T* {
    const int at = c0 + key;
    return at < start ? cache + (long long)at * D : at - start < n ? blk + (long long)(row0 + at - start) * D : nullptr;
  });
}
"""

# Pass 1. Template constants: T (K/V dtype; q arrives float32), D, G (q heads per kv head), HQ, HKV, RB (rows a block),
# NW (warps), QPW (pairs a warp), P (PARTITION), CAUSAL (0: a row sees its whole segment, a drafter's block),
# WINDOW (keys a row sees back from its own position, itself included; 0: all), BLOCK (1: a segment's keys from its
# start on come from the input `blk`, (2, HKV, rows, D): `decode_attention`'s `block`). `{select}` picks segment
# `seg`'s cache pointers.
# The source avoids the substrings `_shape`, `_strides` and `_ndim`, which would add MLX parameters.
PARTIAL = r"""
  constexpr int C = 32;
  constexpr int VEC = 16 / (int)sizeof(T);
  constexpr int DP = D + VEC;  // shared row pitch: 16 bytes of padding keep lanes' rows off one bank
  constexpr int E = D / 32;    // output elements a lane
  constexpr int NT = NW * 32;
  constexpr bool SPLIT = 2 * C * DP * (int)sizeof(T) > 36 * 1024;  // V reuses K's buffer after the scores
  __shared__ __align__(16) T kbuf[C * DP];
  __shared__ __align__(16) T vown[SPLIT ? VEC : C * DP];
  __shared__ float weights[NW][QPW][C];
  const T* vbuf = SPLIT ? kbuf : vown;
  const float NEG_INF = __int_as_float(0xff800000);

  const int hk = blockIdx.y % HKV;
  const int rg = blockIdx.y / HKV;
  const int seg = blockIdx.z;
  const int pmax = meta[0];
  const int rows_all = meta[1];
  const int* sm = meta + 2 + rows_all + 4 * seg;
  const int row0 = sm[0], start = sm[1], n = sm[2], cap = sm[3];
  const int r_lo = rg * RB;
  if (r_lo >= n) return;
  const int rows = min(RB, n - r_lo);
  // one past the last key a row here sees: its own position (causal), else its block's last
  const int k_last = start + (CAUSAL ? r_lo + rows : n);
  const T* kp;
  const T* vp;
{select}
  kp += (long long)hk * cap * D;
  vp += (long long)hk * cap * D;
  const T* bk = {block_k};
  const T* bv = {block_v};
  // a chunk of K or V rows from c0 (from `cache`, and with BLOCK the keys from the segment's start on from `blk`)
  int c0 = 0;
  auto stage = [&](T* dst, const T* cache, const T* blk) {
    if constexpr (BLOCK != 0) {
      da_stage_split<T, D, DP, NT>(dst, cache, blk, c0, start, n, row0);
    } else {
      da_stage<T, D, DP, NT>(dst, cache + (long long)c0 * D);
    }
  };
  const float sc = scale[0];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  bool live[QPW];
  int pos[QPW];  // the last key the row sees
  int low[QPW];  // the first (its window's), 0 without one
  long long pair[QPW];  // (global row, q head), the index of q's and out's rows
  float m[QPW], l[QPW], acc[QPW][E];
#pragma unroll
  for (int i = 0; i < QPW; ++i) {
    const int qi = warp + NW * i;
    const int r = qi / G;
    live[i] = qi < rows * G;
    pos[i] = CAUSAL ? start + r_lo + r : start + n - 1;
    low[i] = WINDOW ? start + r_lo + r - WINDOW + 1 : 0;
    pair[i] = (long long)(row0 + r_lo + r) * HQ + hk * G + qi % G;
  }

{partitions} {
  const int k_lo = part * P;
  const int k_end = min(k_lo + P, k_last);
  if (k_lo >= k_end) break;
  // the first chunk any row here sees: the first row's window starts lowest
  const int c_lo = WINDOW ? max(k_lo, (start + r_lo - WINDOW + 1) / C * C) : k_lo;
#pragma unroll
  for (int i = 0; i < QPW; ++i) {
    m[i] = NEG_INF;
    l[i] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[i][e] = 0.0f;
  }

  for (c0 = c_lo; c0 < k_end; c0 += C) {
    stage(kbuf, kp, bk);
    if constexpr (!SPLIT) stage(vown, vp, bv);
    __syncthreads();

    // scores: lane j holds key c0 + j, summed over d in ascending order
    float s[QPW];
#pragma unroll
    for (int i = 0; i < QPW; ++i) s[i] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; d += VEC) {
      float kk[VEC];
      da_load<T, VEC>(kbuf + lane * DP + d, kk);
#pragma unroll
      for (int i = 0; i < QPW; ++i) {
        if (live[i] && c0 <= pos[i] && c0 + C > low[i]) {
          float qq[VEC];
          da_load<float, VEC>(q + pair[i] * D + d, qq);
#pragma unroll
          for (int t = 0; t < VEC; ++t) s[i] = __fmaf_rn(qq[t], kk[t], s[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < QPW; ++i) {
      if (live[i] && c0 <= pos[i] && c0 + C > low[i]) {
        const bool seen = c0 + lane <= pos[i] && c0 + lane >= low[i];
        const float x = seen ? __fmul_rn(s[i], sc) : NEG_INF;
        float top = x;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
        const float mn = fmaxf(m[i], top);
        const float alpha = expf(__fsub_rn(m[i], mn));  // 0 at the row's first chunk (m = -inf)
        const float w = seen ? expf(__fsub_rn(x, mn)) : 0.0f;
        float sum = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
        l[i] = __fadd_rn(__fmul_rn(l[i], alpha), sum);
        m[i] = mn;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[i][e] = __fmul_rn(acc[i][e], alpha);
        weights[warp][i][lane] = w;
      }
    }
    if constexpr (SPLIT) {
      __syncthreads();
      stage(kbuf, vp, bv);
      __syncthreads();
    } else {
      __syncwarp();
    }

    // weighted values: lane owns elements lane*E .. lane*E+E-1, keys in ascending order
#pragma unroll 2
    for (int j = 0; j < C; ++j) {
      float vv[E];
      da_load<T, E>(vbuf + j * DP + lane * E, vv);
#pragma unroll
      for (int i = 0; i < QPW; ++i) {
        if (live[i] && c0 + j <= pos[i] && c0 + j >= low[i]) {
          const float w = weights[warp][i][j];
#pragma unroll
          for (int e = 0; e < E; ++e) acc[i][e] = __fmaf_rn(w, vv[e], acc[i][e]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < QPW; ++i) {
    if (live[i] && k_lo <= pos[i]) {
      const long long o = pair[i] * pmax + part;
      if (lane == 0) {
        ml[2 * o] = m[i];
        ml[2 * o + 1] = l[i];
      }
#pragma unroll
      for (int e = 0; e < E; ++e) part_out[o * D + lane * E + e] = acc[i][e];
    }
  }
}
{combine}"""

# A one-pass launch's end (`partial_source`'s `onepass`): after its block has walked every partition and written
# each one's partials as pass 1 does, each warp combines its own (row, head) pairs with pass 2's arithmetic, a lane
# its own elements: partitions 0 .. p / P in ascending order, max first, then the rescaled sums, and the division.
# Lane 0's (max, sum) stores are the warp's to read after `__syncwarp`; a lane's elements are its own stores.
ONEPASS_COMBINE = r"""
  __syncwarp();
#pragma unroll
  for (int i = 0; i < QPW; ++i) {
    if (!live[i]) continue;
    const int parts = meta[2 + pair[i] / HQ] / P + 1;
    const long long base = pair[i] * pmax;
    float top = ml[2 * base];
    for (int j = 1; j < parts; ++j) top = fmaxf(top, ml[2 * (base + j)]);
    float total = 0.0f;
    float sum[E];
#pragma unroll
    for (int e = 0; e < E; ++e) sum[e] = 0.0f;
    for (int j = 0; j < parts; ++j) {
      const float w = expf(__fsub_rn(ml[2 * (base + j)], top));
      total = __fadd_rn(total, __fmul_rn(ml[2 * (base + j) + 1], w));
#pragma unroll
      for (int e = 0; e < E; ++e) sum[e] = __fadd_rn(sum[e], __fmul_rn(part_out[(base + j) * D + lane * E + e], w));
    }
#pragma unroll
    for (int e = 0; e < E; ++e) out[pair[i] * D + lane * E + e] = cvt_from_f<T>(__fdiv_rn(sum[e], total));
  }
"""

# Pass 2. Template constants: T (out dtype), D, P. One thread per output element (d, q head, row).
COMBINE = r"""
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  const int h = blockIdx.y;
  const int row = blockIdx.z;
  const int pmax = meta[0];
  const int parts = meta[2 + row] / P + 1;  // the partitions holding a key <= the row's position
  const long long base = ((long long)row * gridDim.y + h) * pmax;
  float top = ml[2 * base];
  for (int i = 1; i < parts; ++i) top = fmaxf(top, ml[2 * (base + i)]);
  float total = 0.0f;
  float sum = 0.0f;
  for (int i = 0; i < parts; ++i) {
    const float w = expf(__fsub_rn(ml[2 * (base + i)], top));
    total = __fadd_rn(total, __fmul_rn(ml[2 * (base + i) + 1], w));
    sum = __fadd_rn(sum, __fmul_rn(part_out[(base + i) * D + d], w));
  }
  out[((long long)row * gridDim.y + h) * D + d] = cvt_from_f<T>(__fdiv_rn(sum, total));
"""


def partial_inputs(segments: int, block: bool = False, joint: bool = False, layered: bool = False) -> list[str]:
    """Pass 1's input names for `segments` caches, two arrays each or one `joint` array each (and the block's
    rows, `blk`; and with `layered`, the joint arrays' layer, `layer`)."""
    caches = [f"kv{i}" for i in range(segments)] if joint else [
        *(f"k{i}" for i in range(segments)), *(f"v{i}" for i in range(segments))]
    names = ["q", "meta", "scale", *caches]
    return names + ["blk"] * block + ["layer"] * layered


def partial_source(segments: int, block: bool = False, joint: bool = False, layered: bool = False,
                   onepass: bool = False) -> str:
    """Pass 1's body for `segments` caches: segment i's pointers are inputs k{i} and v{i}, or with `joint` the
    input kv{i} (2, Hkv, capacity, D) and its values Hkv * capacity * D elements on; with `layered`, kv{i} is every
    layer's (2 * layers, Hkv, capacity, D: stacked_cache.py's) and the launch's layer (the input `layer`) is read at
    its offset; with `block`, its keys and values from its start on are rows of `blk` (a kv head's K rows, then its
    V rows half a block on). With `onepass`, a block walks every partition (not the grid's one) and then combines
    them (`ONEPASS_COMBINE`): the launch's output `out` is pass 2's."""
    if layered and not joint:
        raise ValueError("a layered launch reads joint caches")
    pick = "kp = kv{i}; vp = kv{i} + (long long)HKV * cap * D;" if joint else "kp = k{i}; vp = v{i};"
    if layered:
        pick = "kp = kv{i} + (long long)layer[0] * 2 * HKV * cap * D; vp = kp + (long long)HKV * cap * D;"
    cases = "\n".join(f"    case {i}: {pick.format(i=i)} break;" for i in range(segments))
    body = PARTIAL.replace("{select}", f"  switch (seg) {{\n{cases}\n    default: return;\n  }}")
    body = body.replace("{partitions}", "  for (int part = 0; part < pmax; ++part)" if onepass else
                        "  for (int part = blockIdx.x; part == blockIdx.x; ++part)")
    body = body.replace("{combine}", ONEPASS_COMBINE if onepass else "")
    if not block:
        return body.replace("{block_k}", "nullptr").replace("{block_v}", "nullptr")
    return (body.replace("{block_k}", "blk + (long long)hk * rows_all * D")
            .replace("{block_v}", "blk + (long long)(HKV + hk) * rows_all * D"))


def partial_name(segments: int, block: bool, joint: bool, layered: bool = False, onepass: bool = False) -> str:
    """Pass 1's kernel name for a source variant (tests/cuda_emulator.py names its stand-ins alike)."""
    return f"dflash_attention_partial_{segments}{'_block' if block else ''}{'_joint' if joint else ''}" + (
        "_layered" if layered else "") + ("_onepass" if onepass else "")


def partial_outputs(onepass: bool = False) -> list[str]:
    """Pass 1's output names: the partials, after the rows' attention itself (`out`) in a one-pass launch."""
    return ["out"] * onepass + ["ml", "part_out"]
