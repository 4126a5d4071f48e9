"""Decode-row projections as one CUDA kernel, row-independent by construction.

A decode forward multiplies a few rows (1 for a plain step, 16 for a verify window, up to 16 per
stream) by every weight. MLX's CUDA matmuls pick their kernel by the row count (a 16-row quantized
product even lands on a kernel compiled at first use: docs/gpu-round-profile.md), so a row's bits
depend on its company, which is why tiles.py runs decode rows in fixed tiles and the self-check
proves each tile. This kernel makes the tiles unnecessary: any number of rows, one launch.

The CUDA source, and how its arithmetic keeps a row's bits its own whatever shares its launch, is
matmul_source.py; this module picks a weight's launch (`geometry`, `tiles_a_warp`, `look_ahead`: functions of
the shapes alone) and makes the call (`rows_matmul`).

Only the decode rows take this path, and only on a CUDA GPU (tiles.py `linear`); prompt chunks keep
MLX's own kernels (their bits need only be a function of the chunk: tiles.py). The engine's
self-check proves the kernel where it runs (selfcheck.py); tests/test_matmul_kernel.py checks it on
a CUDA GPU.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate

import mlx.core as mx

from dflash_bench.engine.backend import on_cuda
from dflash_bench.engine.baked_kernel import BakedKernel, bind
from dflash_bench.engine.device_values import constant
from dflash_bench.engine.matmul_source import HEADER, INPUTS, ROPE_HEADER, ROPE_INPUTS, outputs, source

MMA_ROWS = 16  # rows of one tensor-core tile
MAX_TILES = 4  # row tiles a block carries (64 rows read the weights once)
MAX_PARTS = 4  # separate outputs a launch can write (qwen3_5's in_proj: qkv, z, b, a)
TARGET_WARPS = 2048  # enough warps in flight to keep the H200's memory busy (132 SMs)


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


@lru_cache(maxsize=None)
def _kernel(parts: int = 0, rope: bool = False):
    """The launch object for one output, for `parts` outputs (each part count is its own source), or for a layer's
    turned queries and keys (`rope`)."""
    if rope:
        return BakedKernel("dflash_rows_matmul_rope", ROPE_INPUTS, outputs(0, True), source(0, True),
                           ROPE_HEADER + HEADER)
    return BakedKernel(f"dflash_rows_matmul{f'_{parts}parts' if parts else ''}", INPUTS, outputs(parts), source(parts),
                       HEADER)


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


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One call shape's launch arguments (`launch`), built once: a decode round makes a call per weight,
    and the host's time building each is part of the round's (docs/gpu-round-profile.md)."""

    rows: mx.array  # the row count, the kernel's input `rows`
    options: dict  # template, grid, threadgroup, output shapes and dtypes
    bindings: dict = field(default_factory=dict)  # a launch object's call with these constants, and the rest (`run`)

    def run(self, kernel, inputs: list[mx.array]) -> list[mx.array]:
        """`kernel` (a `_kernel` launch object) called on `inputs` with these options: its kernel object for these
        constants is looked up once a call shape and launch object (baked_kernel.bind), where a call with them
        hashed the constants' tuple to find it again (a decode forward makes about 120 such calls)."""
        made = self.bindings.get(kernel)
        if made is None:
            options = dict(self.options)
            template = options.pop("template")
            made = self.bindings[kernel] = (bind(kernel, template, [a.dtype for a in inputs], options["output_dtypes"]),
                                         options)
        call, options = made
        return call(inputs=inputs, **options)


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
        return list(call.run(_kernel(0, True), inputs + [rope.positions, rope.log2_theta]))
    ys = call.run(_kernel(len(parts)), inputs)
    return list(ys) if parts else ys[0]
