"""qwen3_5's decode-window recurrence as one CUDA kernel, row-independent by construction.

What it computes: mlx-lm's `gated_delta_ops` (scalar gate per head, no mask) for several decode
windows (one per stream) in one launch. mlx-lm's version is a Python loop of a compiled one-row step:
on an H200 at Qwen3.5-9B's heads (16 key heads, 32 value heads of 128) it took 2.4 ms for one row
and 2.7 ms for 16, where this kernel takes 0.2 ms for either, and 1.2 ms against 5.5 ms for four
16-row windows, one launch against four calls (docs/gpu-round-profile.md: that loop, once per
stream, was most of a verify window's cost there).

Why a window's rows equal the same rows one at a time, bit for bit (what drafted == plain and
rollback need, targets/base.py): every thread owns `EPL` float32 elements of one (window, value
head, dv-row) of the state, keeps them in registers and walks its window's rows in order, doing for
each row exactly one step of the recurrence

    s = s * g;  kv = sum_dk s * k;  delta = (v - kv) * beta;  s = s + k * delta;  y = sum_dk s * q

in float32 with explicit round-to-nearest intrinsics (`__fmul_rn`, `__fadd_rn`, `__fsub_rn`, so
the compiler cannot contract a product and a sum into an FMA). Each sum over Dk has one fixed order:
a lane adds its EPL contiguous products in ascending order from 0, then an xor butterfly over the
LANES lanes (xor 1, 2, ..., LANES / 2) leaves the same bits in every lane. Nothing in a row's
arithmetic depends on how many rows its window has, where the row sits in it, or which other windows
share the launch, and the state round-trips through float32 memory exactly between launches. So a
row gives the same y and the same state after it alone, inside a window, in a prefix of one
(`GatedDeltaNet.redo_fn`) or beside other streams' windows. It differs from `gated_delta_ops` in the
last bits (another summation order, about 1e-7 relative), which is why on a CUDA GPU the window path
and the rollback both run this kernel (qwen3_5.py). tests/test_delta_kernel.py checks all of it on
a CUDA GPU; the engine's self-check (selfcheck.py) proves it again on the machine that serves.

Launch geometry: LANES = min(32, Dk) lanes per dv-row (Dk a multiple of 32, or a power of two below
32 with 32 // Dk dv-rows sharing a warp), EPL = Dk // LANES; the grid (in threads, as MLX's
`cuda_kernel` takes it) is (Dv * LANES, Hv, layers * windows) and a block gcd(Dv * LANES, 256) threads, so
there are no partial blocks or warps: no bounds check, and full-mask shuffles are valid. Inputs are
row-contiguous: y (rows, Hv, Dv), g and beta (rows, Hv), each window's state (Hv, Dv, Dk), and int32 offsets
(windows + 1) and limits (windows): window w owns rows offsets[w] .. offsets[w+1]-1 and walks the first
limits[w] of them (all of them in a forward; a rollback's kept count, a device value: `rollback`),
so the rows it walks are those of a launch of them alone. q, k and v are read where they lie
(`QKV`): row r's q heads (Hk x Dk, one after another) start at element r * qs + qo of the array q, its k
heads at r * ks + ko of k, its v heads (Hv x Dv) at r * vs + vo of v, the six from the int32 input
`layout`. So the forward hands over its normalized qk and the conv's rows as they are (`in_place`), where
over a verify window's rows q, k and v are strided views that a row-contiguous launch copied first.
Each q and k value is multiplied by its float32 scale from the input `sc` (q's, k's) as it is loaded
(`__fmul_rn`: the product a scaling launch would have stored; 1 and 1 where the caller scaled them), and y is
written in YT, rounded once from float32 (what a cast after the launch gives).
Value head hv reads key head hv // (Hv / Hk), what `mx.repeat(q, Hv // Hk, -2)` gives.
Every launch's (layer, window) pair picks its layer's arrays and its own state from its inputs (`source`): a
forward's launch is one layer's windows, each state an input of its own (a stacked input was a copy of every
stream's state a layer); a rollback (`rollback`) runs the same rows (`_BODY`) for every GatedDeltaNet layer of a
round in one launch, with one more step (`_TAIL`): each window's conv tail after its kept rows, copied by its
blocks' threads. So a kept count the host has not read costs one launch a round, not one a layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import accumulate

import mlx.core as mx

from dflash_bench.engine.baked_kernel import BakedKernel
from dflash_bench.engine.cuda_source import CONVERSIONS
from dflash_bench.engine.device_values import constant, off_pool

Window = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]  # q, k, v, g, beta, state

# `dl_pick(i, a0, a1, ..)` is a_i: a rollback's launch picks its layer's (and window's) arrays from its inputs.
_HEADER = CONVERSIONS + r"""
template <typename P> __device__ __forceinline__ P dl_pick(int, P only) { return only; }
template <typename P, typename... R> __device__ __forceinline__ P dl_pick(int i, P first, R... rest) {
  return i == 0 ? first : dl_pick(i - 1, rest...);
}
"""

# Template constants: Dk, Dv, Hk, Hv, LANES (ints), YT (y's dtype). The source avoids the substrings
# `_shape`, `_strides` and `_ndim`, which would make MLX add those kernel parameters.
_BODY = r"""
  constexpr int EPL = Dk / LANES;       // state elements per thread
  constexpr int RF = Hv / Hk;           // value heads per key head (mx.repeat along heads)
  const int hv = blockIdx.y;
  const int t = blockIdx.x * blockDim.x + threadIdx.x;   // 0 .. Dv*LANES-1 (exact: no tail)
  const int dv = t / LANES;
  const int lane = t % LANES;
  const int hk = hv / RF;

  const int lo = offsets[seg];
  const int hi = min(offsets[seg + 1], lo + limits[seg]);
  const long long qs = layout[0], qo = layout[1], ks = layout[2], ko = layout[3], vs = layout[4], vo = layout[5];
  const float qsc = SCp[0], ksc = SCp[1];  // q's and k's scales, 1 where the caller scaled them

  const long long sbase = ((long long)hv * Dv + dv) * Dk + lane * EPL;  // in the window's state
  float s[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    s[i] = cvt_to_f(SIp[sbase + i]);
  }

  for (int r = lo; r < hi; ++r) {
    const long long head = (long long)hk * Dk + lane * EPL;
    const long long qa = r * qs + qo + head;
    const long long ka = r * ks + ko + head;
    const long long gb = (long long)r * Hv + hv;
    const float gt = cvt_to_f(Gp[gb]);
    const float bt = cvt_to_f(Bp[gb]);
    const float vt = cvt_to_f(Vp[r * vs + vo + (long long)hv * Dv + dv]);
    float kk[EPL];
    float qq[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      kk[i] = __fmul_rn(cvt_to_f(Kp[ka + i]), ksc);
      qq[i] = __fmul_rn(cvt_to_f(Qp[qa + i]), qsc);
    }

    // decay, then kv = state . k
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      s[i] = __fmul_rn(s[i], gt);
      acc = __fadd_rn(acc, __fmul_rn(s[i], kk[i]));
    }
#pragma unroll
    for (int m = 1; m < LANES; m <<= 1) {
      acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, m));
    }
    const float delta = __fmul_rn(__fsub_rn(vt, acc), bt);

    // state += k * delta, then y = state . q
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      s[i] = __fadd_rn(s[i], __fmul_rn(kk[i], delta));
      out = __fadd_rn(out, __fmul_rn(s[i], qq[i]));
    }
#pragma unroll
    for (int m = 1; m < LANES; m <<= 1) {
      out = __fadd_rn(out, __shfl_xor_sync(0xffffffffu, out, m));
    }
    if (lane == 0) {
      Yp[gb * Dv + dv] = cvt_from_f<YT>(out);
    }
  }

#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    SOp[sbase + i] = s[i];
  }
"""


def _lanes(dk: int) -> int | None:
    """Lanes per dv-row: 32 for Dk a multiple of 32, Dk itself for a power of two below 32, else None."""
    if dk >= 32:
        return 32 if dk % 32 == 0 else None
    return dk if dk > 0 and dk & (dk - 1) == 0 else None


def fits(hk: int, hv: int, dk: int, dv: int) -> bool:
    """Whether the launch covers these heads: Hv a multiple of Hk, Dk as `_lanes` takes it, and each
    value head's Dv * LANES threads whole warps."""
    lanes = _lanes(dk)
    return hv % hk == 0 and lanes is not None and (dv * lanes) % 32 == 0


def unscaled() -> mx.array:
    """The kernel's scales for q and k as given (x * 1 is x), in device memory (device_values.constant)."""
    return constant((1.0, 1.0), mx.float32)


# A rollback's conv tails, copied by the same launch (`rollback`): window seg's SPAN rows of C conv inputs from
# row conv_at[seg] + limits[seg] of its layer's conv inputs (the rows ending at its last kept row), every thread
# of the window's blocks copying its share. A copy: the tail's bits are its inputs'.
_TAIL = r"""
  {
    const long long n = (long long)SPAN * C;
    const long long total = (long long)gridDim.y * gridDim.x * blockDim.x;
    const long long from = ((long long)conv_at[seg] + limits[seg]) * C;
    auto* COp = conv_out + (long long)blockIdx.z * n;
    for (long long i = (long long)blockIdx.y * gridDim.x * blockDim.x + t; i < n; i += total) {
      COp[i] = CIp[from + i];
    }
  }
"""
LAYER_INPUTS = ("q", "k", "v", "g", "beta", "sc")  # each layer's (and its conv inputs, "conv", with a tail)


def inputs(layers: int, windows: int, tail: bool) -> list[str]:
    """A launch's input names (`_launch`'s order): each layer's arrays, then each (layer, window)'s state, then
    what every layer shares (its windows lie alike in every layer)."""
    per_layer = (*LAYER_INPUTS, "conv") if tail else LAYER_INPUTS
    return ([f"{name}{i}" for i in range(layers) for name in per_layer]
            + [f"s{i}_{w}" for i in range(layers) for w in range(windows)]
            + ["offsets", "limits", "layout"] + (["conv_at"] if tail else []))


def outputs(tail: bool) -> list[str]:
    return ["y", "state_out"] + (["conv_out"] if tail else [])


def source(layers: int, windows: int, tail: bool) -> str:
    """A launch's source: blockIdx.z runs over layer-major (layer, window) pairs; each picks its layer's
    arrays and its own state (`dl_pick`), runs its window's rows (`_BODY`) and, with a tail (a rollback's),
    copies its conv tail (`_TAIL`). y goes to the layer's block of the first output, the new state to the
    pair's slot of the second."""

    def pick(index: str, names: list[str]) -> str:
        return f"dl_pick({index}, {', '.join(names)})"

    def of_layer(name: str) -> str:
        return pick("layer", [f"{name}{i}" for i in range(layers)])

    states = [f"s{i}_{w}" for i in range(layers) for w in range(windows)]
    conv = f"  const auto* CIp = {of_layer('conv')};\n" if tail else ""
    prologue = f"""
  constexpr int NW = {windows};
  const int seg = blockIdx.z % NW;
  const int layer = {"0" if layers == 1 else "blockIdx.z / NW"};
  const auto* Qp = {of_layer("q")};
  const auto* Kp = {of_layer("k")};
  const auto* Vp = {of_layer("v")};
  const auto* Gp = {of_layer("g")};
  const auto* Bp = {of_layer("beta")};
  const auto* SCp = {of_layer("sc")};
{conv}  const auto* SIp = {pick("(int)blockIdx.z", states)};
  auto* SOp = state_out + (long long)blockIdx.z * Hv * Dv * Dk;
  auto* Yp = y + (long long)layer * offsets[NW] * Hv * Dv;
"""
    return prologue + _BODY + (_TAIL if tail else "")


@lru_cache(maxsize=64)
def _kernel(layers: int, windows: int, tail: bool):
    """The launch for `layers` layers of `windows` windows each: a forward's (one layer, no tail) or a
    rollback's. Its inputs are named per layer and window, so each count is its own source, compiled at its
    first use: the warm-up's rounds reach every window count (warmup.py)."""
    name = f"dflash_delta_rollback_{layers}x{windows}" if tail else f"dflash_delta_window_{windows}"
    return BakedKernel(name, inputs(layers, windows, tail), outputs(tail), source(layers, windows, tail), _HEADER)


def _int32s(values: tuple[int, ...]) -> mx.array:
    """The kernel's copy of a launch's small int32 input (each window's first row and the end; the rows
    each window walks; a QKV layout), made once per value, in device memory (device_values.constant)."""
    return constant(values)


@lru_cache(maxsize=256)
def _options(heads: tuple[int, int, int, int], rows: int, layers: int, windows: int, dtype: mx.Dtype,
             tail: tuple[int, int, mx.Dtype] | None) -> dict:
    """A launch's template, geometry and outputs (module docstring), a function of its shapes alone, built
    once: a 9B round launches the kernel 24 times, and its Python is the host's. Outputs: every layer's y,
    the states (layers * windows * Hv, Dv, Dk) and, with a tail (span, channels, dtype), the conv tails
    (layers * windows * span, C): each (layer, window)'s part a run of whole leading rows (`_unstacked`)."""
    hk, dk, hv, dv = heads
    lanes = _lanes(dk)
    template = (("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv), ("LANES", lanes), ("YT", dtype))
    shapes, dtypes = [(layers * rows, hv, dv), (layers * windows * hv, dv, dk)], [dtype, mx.float32]
    if tail is not None:
        span, channels, conv_dtype = tail
        template += (("SPAN", span), ("C", channels))
        shapes.append((layers * windows * span, channels))
        dtypes.append(conv_dtype)
    return dict(template=template, grid=(dv * lanes, hv, layers * windows),
                threadgroup=(math.gcd(dv * lanes, 256), 1, 1), output_shapes=shapes, output_dtypes=dtypes)


@dataclass(frozen=True)
class QKV:
    """A launch's q, k and v where they lie (module docstring): the arrays the kernel reads them from
    (one array may serve twice), each row's element stride and offset in them, and the heads."""

    arrays: tuple[mx.array, mx.array, mx.array]
    layout: tuple[int, int, int, int, int, int]  # qs, qo, ks, ko, vs, vo
    heads: tuple[int, int, int, int]  # Hk, Dk, Hv, Dv
    scale: mx.array | None = None  # float32 (q's, k's) the kernel multiplies them by as it loads them; None: as given
    y_dtype: mx.Dtype | None = None  # what the launch writes y in (rounded once from float32); None: q's dtype

    @property
    def rows(self) -> int:
        return self.arrays[0].shape[0]

    def __getitem__(self, rows: slice) -> QKV:
        """A row range (a row range of a row-contiguous array is one, so the layout holds), an array that
        serves twice sliced once: what q[a:b], k[a:b] and v[a:b] would be."""
        taken: dict[int, mx.array] = {}
        return replace(self, arrays=tuple(taken.setdefault(id(x), x[rows]) for x in self.arrays))

    def views(self) -> tuple[mx.array, mx.array, mx.array]:
        """q, k (rows, Hk, Dk) and v (rows, Hv, Dv) in their own shapes, as mlx-lm's ops take them (views of
        `arrays`: each is row-contiguous with its layout's stride a row)."""
        hk, dk, hv, dv = self.heads
        qs, qo, ks, ko, vs, vo = self.layout

        def at(x: mx.array, stride: int, offset: int, h: int, d: int) -> mx.array:
            return x.reshape(x.shape[0], stride)[:, offset : offset + h * d].reshape(x.shape[0], h, d)

        q, k, v = self.arrays
        q, k, v = at(q, qs, qo, hk, dk), at(k, ks, ko, hk, dk), at(v, vs, vo, hv, dv)
        if self.scale is None:
            return q, k, v
        return q * self.scale[0], k * self.scale[1], v


def separate(q: mx.array, k: mx.array, v: mx.array) -> QKV:
    """q, k (rows, Hk, Dk) and v (rows, Hv, Dv), each its own row-contiguous array."""
    (_, hk, dk), (hv, dv) = q.shape, v.shape[1:]
    return QKV((q, k, v), (hk * dk, 0, hk * dk, 0, hv * dv, 0), (hk, dk, hv, dv))


def in_place(qk: mx.array, mixed: mx.array, v_at: int, hv: int, dv: int, scale: mx.array | None = None,
             y_dtype: mx.Dtype | None = None) -> QKV:
    """qwen3_5.py's decode rows as its forward leaves them: `qk` (rows, 2 * Hk, Dk), the normalized q heads
    then k heads, and `mixed` (rows, C), the conv's rows, whose columns from `v_at` are v's Hv x Dv heads.
    `scale` (float32 q's, k's) where qk is normed but not yet scaled: the kernel multiplies each value as it
    loads it, the float32 product the scaling would have stored (`__fmul_rn`), so no launch scales them first.
    `y_dtype`: y as the forward takes it (qwen3_5.py's gated norm: bf16 in the gpu mode), rounded once from
    float32 in the kernel, what a cast after it gives, so no cast is launched. A window's rollback launches
    the same rows (`QKV` slices keep both), so the same compiled kernel."""
    _, two_hk, dk = qk.shape
    hk = two_hk // 2
    return QKV((qk, qk, mixed), (two_hk * dk, 0, two_hk * dk, hk * dk, mixed.shape[1], v_at), (hk, dk, hv, dv),
               scale, y_dtype)


def delta_windows(windows: list[Window]) -> list[tuple[mx.array, mx.array]]:
    """Each window's (y, state after its last row), in one launch.

    A window is (q, k, v, g, beta, state): q and k (n, Hk, Dk) normalized as mlx-lm's `normalize_qk`
    leaves them, v (n, Hv, Dv), g and beta (n, Hv) (g from mlx-lm's `compute_g`), state (Hv, Dv, Dk),
    n >= 1. Every window has the same heads and dtypes. y is (n, Hv, Dv) in q's dtype; the state is
    float32."""
    starts = (0, *accumulate(w[0].shape[0] for w in windows))
    q, k, v, g, beta = (mx.concatenate([w[i] for w in windows]) if len(windows) > 1 else windows[0][i]
                        for i in range(5))
    y, states = delta_packed(separate(q, k, v), g, beta, [w[5] for w in windows], starts)
    return [(y[a:b], st) for st, (a, b) in zip(states, zip(starts, starts[1:]))]


def delta_packed(qkv: QKV, g: mx.array, beta: mx.array, states: list[mx.array],
                 starts: tuple[int, ...]) -> tuple[mx.array, list[mx.array]]:
    """`delta_windows` for windows already packed one after another: window i is rows
    starts[i] .. starts[i + 1] - 1 of q, k, v, g and beta, from states[i]. Returns every row's y (in
    the QKV's `y_dtype`) and each window's new state (a forward's decode segments pass their rows as
    they lie)."""
    assert states and len(starts) == len(states) + 1 and starts[0] == 0 and starts[-1] == qkv.rows
    assert all(a < b for a, b in zip(starts, starts[1:])), f"every window needs a row: {starts}"
    hk, dk, hv, dv = qkv.heads
    assert fits(hk, hv, dk, dv), f"no launch for {hk}/{hv} heads of {dk}/{dv}"
    y, new_states = _launch([(qkv, g, beta, states, None)], _int32s(tuple(starts)), _int32s((qkv.rows,) * len(states)))
    return y, _unstacked(new_states, len(states))


def _unstacked(out: mx.array, parts: int) -> list[mx.array]:
    """A launch output's `parts` (each window's state or conv tail, layer-major: whole leading rows each) as
    views from one call (`mx.split`: one node up to 10 parts, else MLX makes a slice a part itself): an integer
    index is a Gather, a copy launched per stream and layer, and the slices and squeezes built in Python here
    were 192 views of a 9B drafted round at one stream (48 of its forward's launches, 144 of its rollback's)
    for the host to build and evaluate, 48 now (the rollback's; a one-window launch's state is its output)."""
    return mx.split(out, parts) if parts > 1 else [out]


# One layer's part of a rollback: its windows' q, k and v where they lie, g and beta, each window's state before
# its rows, and the layer's conv inputs (every window's starting tail, then its rows, laid end to end).
Part = tuple[QKV, mx.array, mx.array, list[mx.array], mx.array]


def rollback(parts: list[Part], starts: tuple[int, ...], counts: mx.array, conv_starts: tuple[int, ...],
             span: int) -> list[tuple[list[mx.array], list[mx.array]]]:
    """A rollback to device counts of every layer's windows, in one launch: for each layer's windows packed as
    `delta_packed` takes them (window i is rows starts[i] .. starts[i + 1] - 1, from its states[i]), window i's
    state after its first counts[i] rows (`counts` int32 on the device, one a window), and its conv tail after
    them: the `span` rows of the layer's conv inputs (rows, C) from conv_starts[i] + counts[i].

    Every layer of a forward lays its windows alike, so they share the starts, the counts and the conv starts,
    and the launch runs each (layer, window) pair as the forward's launch runs a window: it walks counts[i] of
    window i's rows (`limits`), exactly as a launch of those rows alone does (module docstring), and leaves the
    state as it is at a count of 0: no mask over the rows and no operation beside the launch, whatever the
    counts are, which the host has not read. y past a window's count is left unwritten and is not returned; a
    tail is a copy. It is what qwen3_5.py's `redo_fn` needs for one window and `PackedRedo` for a round's
    windows in every GatedDeltaNet layer (cache.py's `keep_windows`): one launch a round, where one a layer was
    24 on a Qwen3.5-9B. Returns each layer's (states, tails), one a window."""
    first, windows = parts[0][0], len(parts[0][3])
    for qkv, _, _, states, conv in parts:
        assert (qkv.heads, qkv.rows, qkv.layout, qkv.y_dtype, len(states)) == (first.heads, first.rows, first.layout,
                                                                              first.y_dtype, windows)
        assert (conv.dtype, conv.shape[1]) == (parts[0][4].dtype, parts[0][4].shape[1]), "every layer's conv alike"
    _, states, tails = _launch(parts, _int32s(tuple(starts)), off_pool(counts.astype(mx.int32)), (tuple(conv_starts), span))
    states, tails = _unstacked(states, len(parts) * windows), _unstacked(tails, len(parts) * windows)
    return [(states[i * windows : (i + 1) * windows], tails[i * windows : (i + 1) * windows]) for i in range(len(parts))]


def _launch(parts: list[tuple[QKV, mx.array, mx.array, list[mx.array], mx.array | None]], offsets: mx.array,
            limits: mx.array, tail: tuple[tuple[int, ...], int] | None = None) -> list[mx.array]:
    """One launch over each part's (a layer's) windows `offsets` (windows + 1 row bounds, int32) of its packed
    rows, each walking its first `limits` rows (int32, one a window), from its own state: every row's y and the
    new states, stacked layer-major. Each window's state is an input of its own, where a stacked input was a
    copy of every stream's state a layer. With `tail` (each window's first row in the parts' conv inputs, the
    span), the rollback's launch: a third output, each window's conv tail after its `limits` rows."""
    first, windows = parts[0][0], len(parts[0][3])
    arrays = [a for qkv, g, beta, _, conv in parts
             for a in (*qkv.arrays, g, beta, unscaled() if qkv.scale is None else qkv.scale, *(() if tail is None else (conv,)))]
    arrays += [st for *_, states, _ in parts for st in states]
    arrays += [offsets, limits, _int32s(first.layout)]
    conv = parts[0][4]
    if tail is not None:
        arrays.append(_int32s(tail[0]))
    options = _options(first.heads, first.rows, len(parts), windows, first.y_dtype or first.arrays[0].dtype,
                       None if tail is None else (tail[1], conv.shape[1], conv.dtype))
    return _kernel(len(parts), windows, tail is not None)(inputs=arrays, **options)
