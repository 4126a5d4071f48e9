"""Fixed-shape arithmetic: the reason a decode row's bits never depend on what shares its forward.

Two regimes share a forward (targets/base.py):
- decode rows (a stream's pending token plus its drafts, or a plain one-row step) are
  row-independent: a row's bits do not depend on how many rows share its forward or which, so a
  window of B rows equals B single steps. Projections and attention below hold that for them;
- prompt rows run in chunks that start at multiples of the chunk size from position 0, and a
  prompt row is only ever computed inside that same chunk, so its rows need only be a deterministic
  function of the chunk (its rows, its stream's earlier keys and state), never of other segments.
  So a chunk's projections run in one matmul call per weight over the chunk's own block of rows
  (`Layout`), and its attention and recurrence in one call each (dense.py, qwen3_5.py): 16x fewer
  calls than tiles for a 256-row chunk, which is what a GPU forward is bound by (kernel launches).

BLAS (OpenBLAS on Linux, cuBLAS on CUDA) picks a kernel by the shape of each call, so a row of
`x @ W.T` computed among 1, 5 or 40 rows can differ in its last bits. Two rules make every row
independent of its company (the measurement that set them is below; tests/test_rows.py proves
them):

- every projection runs in tiles of a fixed row count per weight (`row_tile`), each tile its own
  matmul call (a batched matmul over a broadcast weight would fold the tiles back into one call);
- attention multiplies `QUERY_TILE` queries by `KEY_TILE` keys at absolute key positions, masks with
  exact zeros, and reduces over key tiles in a fixed order, so trailing masked tiles add exact zeros.

On one processor OpenBLAS sent products of at most 64^3 multiply-adds to a "small matrix" kernel in
which, at 16 rows, a row's bits depended on its position in the tile; at 8 rows they did not. So
`row_tile`'s default runs a product that small in tiles of 8 rows, and attention (64-key tiles,
head dims of 64-256) always does. That rule was measured on one machine: another core type, BLAS
build or device can break it, so the engine proves it where it runs (selfcheck.py) and sets each
weight's `tile_rows` and each attention layer's path to what passed there.
MLX's own CPU ops (rms_norm, rope, softmax, exp, sums, elementwise) are row-wise and bit-stable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Literal

import mlx.core as mx

from dflash_bench.engine.backend import on_cuda
from dflash_bench.engine.fused import swiglu
from dflash_bench.engine.matmul_kernel import Rope, available, fits, rows_matmul, splits_output
from dflash_bench.engine.row_ids import row_ids

ROW_TILE = 16
SMALL_TILE = 8
QUERY_TILE = SMALL_TILE
SMALL_PRODUCT = 64**3
KEY_TILE = 64
AttentionPath = Literal["tiled", "elementwise"]  # `attention`'s two ways of multiplying a tile
Norm = tuple[mx.array, float]  # an RMS norm's weights and epsilon, applied to a product's rows (`linear`)


def pad_rows(x: mx.array, multiple: int = ROW_TILE) -> mx.array:
    """Pad the first axis with zero rows up to a multiple of `multiple`."""
    extra = (-x.shape[0]) % multiple
    if extra == 0:
        return x
    return mx.concatenate([x, mx.zeros((extra, *x.shape[1:]), dtype=x.dtype)])


# MLX 0.32.4's CUDA quantized matmul over many rows (its qmm_sm80 kernel) loads two 64-input tiles
# of every row before its loop, and a third in the loop's first step, whatever number of tiles the
# rows have: with fewer than 192 inputs it reads up to 128 values past each weight and input row,
# past the buffer's end for the last rows. Where nothing is mapped there the launch faults ("an
# illegal memory access"), depending on what the allocator last released: a GPU core dump of
# tests/test_attention_kernel.py's engine test caught it there (README, the GPU tests). Such a
# weight (only test fixtures are that narrow) is dequantized for each call on a CUDA GPU instead.
QMM_MIN_INPUTS = 192


class Weight:
    """A projection's weight: float32 (or bf16) `(out, in)`, or an MLX affine-quantized triple.

    `Weight(w, bits)` quantizes a float matrix (the drafter's `--drafter-bits`); `Weight.packed`
    keeps a checkpoint's own packed triple (the engine's gpu mode), so nothing is dequantized.
    `tile_rows` is the row count of each decode matmul call against it: None takes `row_tile`'s
    default; the engine's self-check sets what it proved on this machine (selfcheck.py). `kernel`
    (set by the self-check where it proved it, on a CUDA GPU) sends all decode rows to one call of
    the row-independent kernel instead (matmul_kernel.py).
    """

    tile_rows: int | None = None
    kernel: bool = False

    def __init__(self, w: mx.array, bits: int = 0, group_size: int = 64):
        self.out_features, self.in_features = w.shape
        self.bits = bits
        self.group_size = group_size
        self.scales: mx.array | None = None
        self.biases: mx.array | None = None
        if bits:
            self.w, self.scales, self.biases = mx.quantize(w, group_size=group_size, bits=bits)
        else:
            self.w = w

    @classmethod
    def packed(cls, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> "Weight":
        """A checkpoint's packed uint32 `(out, in * bits / 32)` with its per-group scales and biases."""
        self = cls.__new__(cls)
        self.out_features, self.in_features = w.shape[0], w.shape[1] * 32 // bits
        self.bits, self.group_size = bits, group_size
        self.w, self.scales, self.biases = w, scales, biases
        return self

    @classmethod
    def joined(cls, parts: list["Weight"], rows: Callable[[list[mx.array]], mx.array]) -> "Weight":
        """One weight whose every array (the matrix; a packed one's scales and biases too) is `rows` of the parts'
        same arrays: output rows stacked, interleaved or reordered (`stacked`, `interleaved`, `reordered`)."""
        first = parts[0]
        if not first.bits:
            return Weight(rows([p.w for p in parts]))
        return Weight.packed(*(rows([getattr(p, name) for p in parts]) for name in ("w", "scales", "biases")),
                             first.group_size, first.bits)

    @classmethod
    def stacked(cls, parts: list["Weight"]) -> "Weight":
        """Weights that multiply the same rows as one: their output rows one after another."""
        return cls.joined(parts, mx.concatenate)

    @classmethod
    def interleaved(cls, gate: "Weight", up: "Weight") -> "Weight":
        """An MLP's gate and up projections as one weight whose output rows alternate them (gate 0, up 0, gate 1,
        ..): the row kernel's SwiGLU launch finds each pair's two columns in one thread (`SwiGLU`)."""
        return cls.joined([gate, up], lambda ab: mx.stack(ab, axis=1).reshape(2 * ab[0].shape[0], *ab[0].shape[1:]))

    def reordered(self, order: list[int]) -> "Weight":
        """A copy with its output rows in `order`: a layer's q and k for the launch that turns them
        (matmul_kernel.head_rows)."""
        index = mx.array(order, dtype=mx.int32)
        return self.joined([self], lambda a: a[0][index])

    def leading(self, rows: int) -> "Weight":
        """Its first `rows` output rows, as views of its arrays: what a stacked weight's leading parts alone
        multiply by."""
        return self.row_range(0, rows)

    def row_range(self, start: int, stop: int) -> "Weight":
        """Output rows start .. stop - 1, as views of its arrays (whole rows of a row-major array are row-contiguous,
        so a kernel launch takes them as they are): one layer's part of a weight stacked over layers."""
        if not self.bits:
            out = Weight(self.w[start:stop])
        else:
            out = Weight.packed(self.w[start:stop], self.scales[start:stop], self.biases[start:stop], self.group_size,
                                self.bits)
        out.kernel, out.tile_rows = self.kernel, self.tile_rows
        return out

    def stacks_with(self, other: "Weight") -> bool:
        """Whether `other` can share one stacked weight with this one: same input width, packing and dtype."""
        return self.in_features == other.in_features and self.kind == other.kind

    def rows(self, ids: mx.array) -> mx.array:
        """Rows `ids` as a float matrix (an embedding lookup): a packed table dequantizes only those."""
        if not self.bits:
            return self.w[ids]
        return mx.dequantize(self.w[ids], self.scales[ids], self.biases[ids], group_size=self.group_size, bits=self.bits)

    def astype(self, dtype: mx.Dtype) -> "Weight":
        """A float weight in `dtype`; a packed one keeps its uint32 and holds its scales and biases in it."""
        if not self.bits:
            return Weight(self.w.astype(dtype))
        return Weight.packed(self.w, self.scales.astype(dtype), self.biases.astype(dtype), self.group_size, self.bits)

    def tile(self, x: mx.array) -> mx.array:
        if self.bits and self.in_features < QMM_MIN_INPUTS and on_cuda():
            w = mx.dequantize(self.w, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
            return x @ w.T
        if self.bits:
            return mx.quantized_matmul(
                x, self.w, self.scales, self.biases, transpose=True, group_size=self.group_size, bits=self.bits
            )
        return x @ self.w.T

    def fits_kernel(self, dtype: mx.Dtype) -> bool:
        """Whether the row kernel can take this weight here: a CUDA GPU, bf16 rows, bf16 weights or
        scales, and shapes its launch covers (matmul_kernel.py)."""
        held = self.scales if self.bits else self.w
        return (available(dtype) and held.dtype == mx.bfloat16
                and fits(self.in_features, self.out_features, self.bits or 16, self.group_size))

    def kernel_product(self, x: mx.array, parts: tuple[int, ...] = (), residual: mx.array | None = None,
                       norm: Norm | None = None, glu: bool = False, rope: Rope | None = None) -> mx.array | list[mx.array]:
        """`x @ W.T` for any number of bf16 rows in one call of the row-independent kernel; with `parts`
        (column widths), one row-contiguous array a part; with `residual`, `residual + x @ W.T` in the
        same launch, the bits of the product then the add; with `norm`, the product of x RMS-normed, the
        norm in the same launch; with `glu` (an `interleaved` weight), the SwiGLU of each gate and up; with
        `rope` (a layer's q/k/v in `parts`, q and k `reordered`), its queries and keys turned at their positions
        (matmul_kernel.rows_matmul)."""
        return rows_matmul(x, self.w, self.scales, self.biases, self.bits or 16, self.group_size, parts,
                           residual=residual, norm=norm, glu=glu, rope=rope)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.w, self.scales, self.biases) if a is not None]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def kind(self) -> str:
        """What decides the kernel besides the shape: the input dtype, and the packing if any."""
        dtype = str((self.scales if self.bits else self.w).dtype).removeprefix("mlx.core.")
        return f"{self.bits}-bit/{self.group_size} {dtype}" if self.bits else dtype

    @property
    def rows_per_call(self) -> int:
        """The row count of every decode matmul call against this weight."""
        return self.tile_rows or row_tile(self.in_features, self.out_features)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class Stacked:
    """Projections of the same rows: one stacked weight and one matmul call where `stack` asks for it
    (the gpu mode, whose decode forward pays per call: docs/gpu-round-profile.md), else one call each.

    A column's product does not depend on the columns beside it, but the row kernel's reduction order
    is set by the weight's shape (matmul_kernel.geometry), so a stacked weight's bits are its own: the
    self-check proves the stacked weight, and every row, decode or prompt, goes through it."""

    def __init__(self, parts: list[Weight], stack: bool):
        self.widths = tuple(p.out_features for p in parts)
        joined = stack and len(parts) > 1 and all(parts[0].stacks_with(p) for p in parts[1:])
        self.weights = (Weight.stacked(parts),) if joined else tuple(parts)

    @classmethod
    def of(cls, weight: Weight, widths: tuple[int, ...]) -> "Stacked":
        """Parts of `widths` whose stacked weight is `weight` as it is (e.g. a view of a larger one: a drafter's
        every layer's k, v and q in one array, drafters/dflash.py)."""
        out = cls.__new__(cls)
        out.widths, out.weights = tuple(widths), (weight,)
        return out

    def leading(self, parts: int) -> "Stacked":
        """Its first `parts` parts alone: on a stacked weight its leading output rows, views of its arrays. A
        launch of that shape has its own reduction order (matmul_kernel.geometry), so its bits may differ from
        the stacked weight's: only a drafter uses it (its absorb's k and v), where the target decides every token."""
        out = Stacked.__new__(Stacked)
        out.widths = self.widths[:parts]
        if len(self.weights) == 1 and len(self.widths) > 1:
            out.weights = (self.weights[0].leading(sum(out.widths)),)
        else:
            out.weights = self.weights[:parts]
        return out

    @property
    def one_launch(self) -> bool:
        """Whether its parts are one row-kernel launch (one stacked weight on the kernel), which then norms the
        rows of a `norm` handed to it itself; otherwise the parts share one MLX norm of the rows (`__call__`)."""
        return len(self.weights) == 1 and self.weights[0].kernel

    def __call__(self, x: mx.array, layout: Layout | None = None, norm: Norm | None = None) -> list[mx.array]:
        """Each part's product of `x` (RMS-normed first with `norm`: `linear`), in the parts' order. Decode
        rows alone on the row kernel come back as a row-contiguous array a part: column slices of one product
        would be strided over several rows (a verify window's), and each reshape and kernel after would copy
        them (docs/gpu-round-profile.md: 222 strided copies in a 9B drafted round against 16 in a plain one)."""
        if len(self.weights) == 1 and len(self.widths) > 1:
            stacked = self.weights[0]
            if stacked.kernel and splits_output(self.widths) and (layout is None or not layout.blocks):
                return stacked.kernel_product(x, self.widths, norm=norm)  # (no blocks: x is the decode rows)
            return mx.split(linear(x, stacked, layout, norm=norm), list(accumulate(self.widths[:-1])), axis=-1)
        if norm is not None and len(self.weights) > 1:  # the parts share one norm of x
            x, norm = mx.fast.rms_norm(x, *norm), None
        return [linear(x, w, layout, norm=norm) for w in self.weights]


class SwiGLU:
    """An MLP's gate and up projections and the SwiGLU of their products (engine/fused.py's `swiglu`).

    Where `stack` asks for one weight (the gpu mode), gate and up are one weight whose rows alternate them
    (`Weight.interleaved`), and decode rows on the row kernel take one launch that writes the SwiGLU of each pair
    (matmul_kernel.rows_matmul's `glu`) where the products and the SwiGLU were two launches a layer
    (docs/gpu-round-profile.md: a decode forward pays per launch). A column's sum depends on the weight's shape
    alone (matmul_kernel.geometry), which interleaving keeps, so the products have the stacked weight's bits, and
    the launch's SwiGLU is MLX's compiled one. Prompt chunks, and a weight off the kernel, take the product of the
    same weight, its even and odd columns, and the fused SwiGLU."""

    def __init__(self, gate: Weight, up: Weight, stack: bool):
        joined = stack and gate.stacks_with(up) and gate.out_features == up.out_features
        self.weights = (Weight.interleaved(gate, up),) if joined else (gate, up)

    def __call__(self, x: mx.array, layout: Layout | None = None, norm: Norm | None = None) -> mx.array:
        """swiglu(x @ gate.T, x @ up.T) for `x` RMS-normed first with `norm` (`linear`), in `layout`'s calls."""
        if len(self.weights) == 2:
            if norm is not None:  # the two products share one norm of x
                x, norm = mx.fast.rms_norm(x, *norm), None
            return swiglu(*(linear(x, w, layout) for w in self.weights))
        return linear(x, self.weights[0], layout, norm=norm, glu=True)


def pairs(y: mx.array) -> mx.array:
    """The SwiGLU of an interleaved gate and up product's column pairs (`SwiGLU`): even columns gate, odd up."""
    return swiglu(y[:, 0::2], y[:, 1::2])


def row_tile(in_features: int, out_features: int) -> int:
    """The default row count of every matmul call against a weight of this shape (the rule measured
    on one processor; selfcheck.py proves or replaces it per weight)."""
    return ROW_TILE if ROW_TILE * in_features * out_features > SMALL_PRODUCT else SMALL_TILE


@dataclass(frozen=True)
class Layout:
    """Where each segment's rows sit in a forward's packed rows, and which rows share a matmul call.

    Decode segments come first, packed in order and padded to whole ROW_TILEs: they run in
    `row_tile` tiles, so a row's bits never depend on its company. Where every projection runs the
    row kernel (matmul_kernel.py: any row count, each row alone by construction) the decode rows are
    not padded (`tile` 1): padding there would only add a zero block and a concatenation a layer.
    Each prompt chunk then takes its own block of whole ROW_TILEs, one call per weight: the call's
    shape depends on the chunk's row count alone, and no other segment's rows share it.
    """

    spans: tuple[tuple[int, int], ...]  # each segment's rows, in the segments' order
    blocks: tuple[tuple[int, int], ...]  # the prompt chunks' blocks, one call each
    decode_rows: int  # rows [0, decode_rows) run in tiles
    rows: int

    @classmethod
    def of(cls, lengths: list[int], prompt: list[bool], tile: int = ROW_TILE) -> "Layout":
        spans: list[tuple[int, int]] = [(0, 0)] * len(lengths)
        pos = 0
        for i, n in enumerate(lengths):
            if not prompt[i]:
                spans[i], pos = (pos, pos + n), pos + n
        decode_rows = pos = -(-pos // tile) * tile
        blocks = []
        for i, n in enumerate(lengths):
            if prompt[i]:
                spans[i] = (pos, pos + n)
                blocks.append((pos, pos + -(-n // ROW_TILE) * ROW_TILE))
                pos = blocks[-1][1]
        return cls(tuple(spans), tuple(blocks), decode_rows, pos)

    def pack(self, parts: list[mx.array]) -> mx.array:
        """Each segment's rows (in the segments' order) into one array laid out as `spans`, zeros between."""
        return self.place(list(zip((a for a, _ in self.spans), parts)))

    def join(self, decoded: mx.array | None, prompts: list[mx.array]) -> mx.array:
        """The decode segments' rows as one block (`decoded` rows, in order) and each prompt chunk's rows
        (in the segments' order), laid out as `spans`, zeros between."""
        starts = [a for a, _ in self.spans if a >= self.decode_rows]
        return self.place(([(0, decoded)] if decoded is not None else []) + list(zip(starts, prompts)))

    def place(self, pieces: list[tuple[int, mx.array]]) -> mx.array:
        """Row blocks at their first rows into `rows` rows, zeros between them and after."""
        out, cursor = [], 0
        for a, part in sorted(pieces, key=lambda item: item[0]):
            if a > cursor:
                out.append(mx.zeros((a - cursor, *part.shape[1:]), dtype=part.dtype))
            out.append(part)
            cursor = a + part.shape[0]
        if self.rows > cursor:
            out.append(mx.zeros((self.rows - cursor, *pieces[0][1].shape[1:]), dtype=pieces[0][1].dtype))
        return mx.concatenate(out) if len(out) > 1 else out[0]

    def calls(self, tile: int) -> list[tuple[int, int]]:
        """The row ranges of one weight's matmul calls: decode tiles of `tile` rows, then each block."""
        return [(a, a + tile) for a in range(0, self.decode_rows, tile)] + list(self.blocks)


def linear(x: mx.array, weight: Weight | mx.array, layout: Layout | None = None,
           residual: mx.array | None = None, norm: Norm | None = None, glu: bool = False) -> mx.array:
    """`x @ W.T` for `x` of shape (R, in): one call per row tile, or per `layout` (decode tiles, then
    one call per prompt chunk's block). R is a multiple of ROW_TILE, except for the row kernel, which
    takes any number of decode rows. With `residual` (R, out): `residual + x @ W.T`, a decoder layer's
    residual add, which the row kernel does in its own launch (matmul_kernel.rows_matmul, the same bits).
    With `norm` (weights, epsilon): the product of x RMS-normed, which the row kernel does in its own launch
    for decode rows (its own arithmetic, the same whatever else the forward holds: rows_matmul), and
    `mx.fast.rms_norm` does before any other product (the bits of the norm then the product; a norm's rows
    are each its own, so a prompt chunk's block is normed alone). With `glu` (an interleaved gate and up:
    `SwiGLU`), the SwiGLU of each column pair: in the decode rows' kernel launch, after MLX's product (`pairs`)
    everywhere else."""
    if not isinstance(weight, Weight):
        weight = Weight(weight)
    if norm is not None and not weight.kernel:
        x, norm = mx.fast.rms_norm(x, *norm), None
    rows = x.shape[0]
    if weight.kernel:
        if layout is None or not layout.blocks:  # decode rows alone: every row in one kernel call
            return weight.kernel_product(x, residual=residual, norm=norm, glu=glu)

        def kernel(a: int, b: int) -> mx.array:  # rows [a, b) in one kernel call, the residual's and the norm's in it
            return weight.kernel_product(x[a:b], residual=None if residual is None else residual[a:b], norm=norm,
                                         glu=glu)

        def block(a: int, b: int) -> mx.array:  # a prompt chunk's block: MLX's norm and product, then the add
            y = weight.tile(x[a:b] if norm is None else mx.fast.rms_norm(x[a:b], *norm))
            y = pairs(y) if glu else y
            return y if residual is None else residual[a:b] + y

        parts = [kernel(0, layout.decode_rows)] if layout.decode_rows else []
        parts += [block(a, b) for a, b in layout.blocks]
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]
    if rows % ROW_TILE:
        raise ValueError(f"linear takes a multiple of {ROW_TILE} rows, got {rows}")
    tile = weight.rows_per_call
    calls = layout.calls(tile) if layout is not None else [(a, a + tile) for a in range(0, rows, tile)]
    out = weight.tile(x) if len(calls) == 1 else mx.concatenate([weight.tile(x[a:b]) for a, b in calls])
    out = pairs(out) if glu else out
    return out if residual is None else residual + out


def key_mask(
    q_pos: mx.array, k_start: int, k_rows: int, k_len: int | mx.array, causal: bool = True, window: int | None = None
) -> mx.array:
    """Which keys each query sees, shaped (query tiles, key tiles, QUERY_TILE, KEY_TILE).

    Keys sit at absolute positions k_start .. k_start + k_rows - 1; a key is seen when its position is
    below `k_len`, not after the query (causal), and within `window` positions of it (sliding).
    Built once per segment and reused by every layer of the same kind.
    """
    nq, nk = q_pos.shape[0] // QUERY_TILE, k_rows // KEY_TILE
    kpos = (mx.arange(k_rows, dtype=mx.int32) + k_start).reshape(nk, 1, KEY_TILE)
    qp = q_pos.reshape(nq, 1, QUERY_TILE, 1)
    seen = kpos < k_len
    if causal:
        seen = seen & (kpos <= qp)
    if window is not None:
        seen = seen & (qp - kpos < window)
    return seen


def attention(
    q: mx.array, k: mx.array, v: mx.array, seen: mx.array, *, scale: float, path: AttentionPath = "tiled"
) -> mx.array:
    """Attention of one stream's query rows over its keys, row-independent by construction.

    q: (Hq, Rq, d) with Rq a multiple of QUERY_TILE; k, v: (Hkv, Lk, d) with Lk a multiple of
    KEY_TILE; `seen` from `key_mask`. Returns (Hq, Rq, d). The `tiled` path multiplies each
    (query tile, key tile) pair with one fixed-shape batched matmul; `elementwise` forms the same
    products with MLX's own broadcast multiply and sum (no BLAS or GEMM kernel to pick a shape-
    dependent algorithm), for a machine where the self-check finds the tiled path row-dependent.
    """
    hq, rq, d = q.shape
    hkv, lk, _ = k.shape
    group = hq // hkv
    nq, nk = rq // QUERY_TILE, lk // KEY_TILE
    if rq % QUERY_TILE or lk % KEY_TILE:
        raise ValueError(f"attention takes tiles of {QUERY_TILE} queries and {KEY_TILE} keys, got {rq} and {lk}")
    qt = (q * scale).reshape(hkv, group, nq, 1, QUERY_TILE, d)
    kt = k.reshape(hkv, 1, 1, nk, KEY_TILE, d).swapaxes(-1, -2)
    vt = v.reshape(hkv, 1, 1, nk, KEY_TILE, d)
    e, total = softmax_parts(scores_of(qt, kt, path), seen)
    return merge(weighted_of(e, vt, path), total).reshape(hq, rq, d)


def scores_of(qt: mx.array, kt: mx.array, path: AttentionPath) -> mx.array:
    """Query tiles (..., QUERY_TILE, d) times transposed key tiles (..., d, KEY_TILE): one fixed-shape
    gemm per pair on the tiled path, MLX's broadcast multiply and sum on the elementwise one."""
    if path == "tiled":
        return qt @ kt
    return mx.sum(qt[..., :, None, :] * kt.swapaxes(-1, -2)[..., None, :, :], axis=-1)


def weighted_of(e: mx.array, vt: mx.array, path: AttentionPath) -> mx.array:
    """Weight tiles (..., QUERY_TILE, KEY_TILE) times value tiles (..., KEY_TILE, d), as `scores_of`."""
    if path == "tiled":
        return e @ vt
    return mx.sum(e[..., :, :, None] * vt[..., None, :, :], axis=-2)


def softmax_parts(products: mx.array, seen: mx.array) -> tuple[mx.array, mx.array]:
    """Products (hkv, group, query tiles, key tiles, QUERY_TILE, KEY_TILE) to the unnormalized
    weights and their totals, reduced within a key tile, then over key tiles (axis 3) in order, so
    trailing masked tiles add exact zeros."""
    scores = mx.where(seen, products, -math.inf)
    top = mx.max(mx.max(scores, axis=-1, keepdims=True), axis=3, keepdims=True)
    top = mx.maximum(top, -1e30)  # a padded query row with nothing to see stays finite
    e = mx.exp(scores - top)
    total = mx.sum(mx.sum(e, axis=-1, keepdims=True), axis=3)  # (hkv, group, nq, QUERY_TILE, 1)
    return e, total


def merge(weighted: mx.array, total: mx.array) -> mx.array:
    """Each key tile's weighted values summed over key tiles (axis 3) in order, then normalized."""
    return mx.sum(weighted, axis=3) / mx.maximum(total, 1e-30)


def query_positions(start: int | mx.array, n: int) -> mx.array:
    """Absolute positions of n query rows from `start` (a device value where the host does not know it yet:
    cache.py's keep_at), padded to whole query tiles (pads repeat start)."""
    pad = (-n) % QUERY_TILE
    if isinstance(start, mx.array):
        return row_ids(n, zeros=pad) + start
    return mx.concatenate([mx.arange(start, start + n, dtype=mx.int32), mx.full((pad,), start, dtype=mx.int32)])


def pad_queries(q: mx.array) -> mx.array:
    """(H, n, d) queries padded with zero rows to whole query tiles."""
    return pad_rows(q.swapaxes(0, 1), QUERY_TILE).swapaxes(0, 1)
