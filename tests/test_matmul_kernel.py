"""The decode-row matmul kernel (engine/matmul_kernel.py) and how the engine takes it.

On any machine: which weights the kernel takes, that its launch geometry depends on the weight's
shape alone, that the self-check offers it only where it can run (a CUDA GPU, bf16), and that
`linear` then sends the decode rows to one kernel call and each prompt chunk to MLX's own product.
Where g++ is (any machine): the kernel's CUDA source, run on the CPU by tests/cuda_emulator.py (its
tensor-core product emulated, every buffer ending at a no-access page), stays inside its buffers, writes
every row, computes the product and keeps each row of a call equal to the row alone.
On a CUDA GPU only (skipped elsewhere, `pytest -m gpu` runs them): the kernel computes the float32
product of the dequantized weights to bf16 accuracy; every row of a call of any row count (1..80)
is bit-equal to the same row in a call of one row, at 4 and 8 bits and bf16; a changed row changes
that row alone (so the comparison can fail); the self-check picks the kernel for the 9B fixture's
weights, and its engine drafts exactly what it decodes plainly.
"""

from __future__ import annotations

from itertools import accumulate

import cuda_emulator
import pytest
from gpu import ON_CUDA, on_cuda
from tiny_targets import canonical_weights, config_dict, reference_model, tiny_target

import mlx.core as mx

from dflash_bench.engine import matmul_kernel, matmul_source, selfcheck
from dflash_bench.engine.backend import FLOAT32_TENSORS
from dflash_bench.engine.target_config import parse_target_config
from dflash_bench.engine.targets import build_target
from dflash_bench.engine.tiles import Layout, Stacked, Weight, linear

CASES = {  # (in, out, bits, group): 9B-like 4-bit, 8-bit, the default model's bf16, a Q4_1-like 4-bit/32, a ragged split
    "q4-g64": (1024, 768, 4, 64), "q8-g64": (1024, 512, 8, 64), "bf16": (576, 192, 16, 0),
    "q4-g32": (576, 1536, 4, 32), "q4-ragged": (96 * 32, 40, 4, 32),
}


def weight(k: int, n: int, bits: int, group: int, seed: int) -> Weight:
    w = (mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05).astype(mx.bfloat16)
    if bits == 16:
        return Weight(w)
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    return Weight.packed(q, s.astype(mx.bfloat16), b.astype(mx.bfloat16), group, bits)


# -- everywhere ------------------------------------------------------------------------------------
def test_the_kernel_takes_whole_chunks_whole_groups_and_whole_column_tiles() -> None:
    assert matmul_kernel.fits(4096, 12288, 4, 64) and matmul_kernel.fits(576, 192, 16, 0)
    assert matmul_kernel.fits(576, 1536, 4, 32) and matmul_kernel.fits(1024, 512, 8, 64)
    assert not matmul_kernel.fits(4096, 12288, 3, 64)  # 3 bits: no layout
    assert not matmul_kernel.fits(4096, 12, 4, 64)  # 12 columns: not whole 8-column tiles
    assert not matmul_kernel.fits(4100, 64, 16, 0)  # not whole 8-value bf16 chunks
    assert not matmul_kernel.fits(4096, 64, 4, 16)  # a group smaller than a 32-value chunk


def test_the_geometry_is_a_function_of_the_weight_alone() -> None:
    """The reduction order of an output is set by NT and SPLITK, which the row count never touches;
    SPLITK leaves every lane of every warp at least one chunk."""
    for (k, n, bits, _) in CASES.values():
        g = matmul_kernel.geometry(k, n, bits)
        assert g == matmul_kernel.geometry(k, n, bits)
        assert g.nt in (1, 2) and n % (8 * g.nt) == 0 and g.split_k in (1, 2, 4, 8)
        assert 4 * g.split_k <= k // matmul_kernel.values_per_chunk(bits)
    assert matmul_kernel.geometry(4096, 248320, 4).split_k == 1  # a vocab-wide lm_head has blocks enough


def test_the_self_check_offers_the_kernel_only_where_it_runs() -> None:
    w = weight(*CASES["q4-g64"], seed=1)
    assert w.fits_kernel(mx.bfloat16) == ON_CUDA
    assert not w.fits_kernel(mx.float32)  # the cpu mode's float32 rows
    assert (selfcheck.KERNEL in selfcheck.tile_candidates(w, mx.bfloat16)) == ON_CUDA
    target, _ = tiny_target("llama", "small", layers=2, seed=3)  # float32: tiles everywhere
    verdict = selfcheck.check(target, fresh=True)
    assert verdict.passed and selfcheck.KERNEL not in verdict.tiles.values()
    assert not any(w.kernel for w in target.projections())


def test_linear_sends_decode_rows_to_one_kernel_call_and_chunks_to_mlx(monkeypatch) -> None:
    """With `kernel` set, the decode rows [0, decode_rows) are one kernel call and each prompt chunk's
    block one MLX call (here both stand-ins record their row counts)."""
    w = weight(64, 32, 16, 0, seed=2)
    w.kernel = True
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(Weight, "kernel_product",
                        lambda self, x, residual=None, norm=None, glu=False: calls.append(("kernel", x.shape[0])) or x @ self.w.T)
    monkeypatch.setattr(Weight, "tile", lambda self, x: calls.append(("mlx", x.shape[0])) or x @ self.w.T)
    layout = Layout.of([1, 16, 40, 5], [False, False, True, False])  # two decode segments, a chunk, a step
    x = mx.random.normal((layout.rows, 64)).astype(mx.bfloat16)
    out = linear(x, w, layout)
    assert calls == [("kernel", layout.decode_rows), ("mlx", 48)] and out.shape == (layout.rows, 32)
    calls.clear()
    linear(x[:32], w)  # no layout (the drafter, the logits): every row in one kernel call
    assert calls == [("kernel", 32)]


def test_a_stacked_weight_returns_contiguous_parts_for_decode_rows_and_splits_a_chunk(monkeypatch) -> None:
    """tiles.Stacked on the kernel: decode rows alone come back as one row-contiguous array a part (one
    launch, the widths passed down); a forward that also holds a prompt chunk splits one product's
    columns, as every weight not on the kernel does. Here the kernel is stood in for."""
    parts = [weight(64, n, 16, 0, seed=s) for n, s in ((32, 1), (16, 2), (16, 3))]
    stacked = Stacked(parts, stack=True)
    stacked.weights[0].kernel = True
    calls: list[tuple[int, tuple[int, ...]]] = []

    def product(self, x, widths=(), residual=None, norm=None, glu=False):
        calls.append((x.shape[0], widths))
        y = x @ self.w.T
        return [mx.contiguous(c) for c in mx.split(y, list(accumulate(widths[:-1])), axis=-1)] if widths else y

    monkeypatch.setattr(Weight, "kernel_product", product)
    monkeypatch.setattr(Weight, "tile", lambda self, x: x @ self.w.T)
    x = mx.random.normal((64, 64)).astype(mx.bfloat16)
    decode = Layout.of([1, 16], [False, False], tile=1)
    got = stacked(x[: decode.rows], decode)
    assert calls == [(17, (32, 16, 16))] and [g.shape for g in got] == [(17, 32), (17, 16), (17, 16)]
    calls.clear()
    mixed = Layout.of([16, 40], [False, True], tile=1)
    got = stacked(x[: mixed.rows], mixed)
    assert calls == [(16, ())] and [g.shape for g in got] == [(mixed.rows, 32), (mixed.rows, 16), (mixed.rows, 16)]
    assert not matmul_kernel.splits_output((32, 15, 17)) and not matmul_kernel.splits_output((8,) * 5)


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("case", [(128, (64, 32, 16, 16), 4, 64), (64, (16, 24), 16, 0)], ids=["q4-four-parts", "bf16-two-parts"])
def test_the_kernel_source_writes_parts_that_equal_the_columns_of_one_product(monkeypatch, case) -> None:
    """`parts`: each part of a call of 1, 5 and 17 rows equals its columns of the same call without
    parts, bit for bit (only where a column is written changes); each part is an output of the launch
    (no split and reshape of one flat output for the host to build)."""
    cuda_emulator.install_matmul(monkeypatch)
    k, widths, bits, group = case
    w = weight(k, sum(widths), bits, group, seed=3)
    x = mx.random.normal((17, k), key=mx.random.key(4)).astype(mx.bfloat16)
    for m in (1, 5, 17):
        whole = matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, bits, group)
        got = matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, bits, group, widths)
        assert matmul_kernel.launch(m, k, sum(widths), bits, group or 64, widths).options["output_shapes"] == [
            (m, width) for width in widths]
        lo = 0
        for part, width in zip(got, widths):
            assert part.shape == (m, width) and mx.array_equal(part, whole[:, lo : lo + width]).item(), (m, lo)
            lo += width


def residual_case(k: int, n: int, bits: int, group: int) -> tuple[Weight, mx.array, mx.array]:
    """A weight, 17 rows and a residual for them whose values span several binades, so the add rounds."""
    w = weight(k, n, bits, group, seed=12)
    x = mx.random.normal((17, k), key=mx.random.key(13)).astype(mx.bfloat16)
    scale = mx.power(2.0, mx.random.randint(-6, 6, (17, n), key=mx.random.key(14)).astype(mx.float32))
    residual = (mx.random.normal((17, n), key=mx.random.key(15)) * scale).astype(mx.bfloat16)
    return w, x, residual


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("case", [(128, 64, 4, 64), (64, 48, 8, 32), (64, 40, 16, 0)], ids=["q4", "q8", "bf16"])
def test_the_kernel_source_adds_a_residual_with_the_bits_of_the_product_then_the_add(monkeypatch, case) -> None:
    """`residual`: a decoder layer's residual add in the product's launch (tiles.linear) equals the
    product's launch and MLX's bf16 add after it, bit for bit, at 1, 5 and 17 rows: the product rounded to
    bf16 first, then the sum rounded once. The control adds the residual before the product's rounding
    (one rounding, not two) and differs somewhere, so the comparison can tell the two apart."""
    cuda_emulator.install_matmul(monkeypatch)
    k, n, bits, group = case
    w, x, residual = residual_case(k, n, bits, group)
    for m in (1, 5, 17):
        alone = matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, bits, group)
        fused = matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, bits, group, residual=residual[:m])
        assert mx.array_equal(fused, residual[:m] + alone).item(), m
    once = matmul_source.HEADER.replace("__nv_bfloat162 y = __floats2bfloat162_rn(a, b);",
                                         "__nv_bfloat162 y = {__float2bfloat16_rn(a + (RESID ? (float)r[0] : 0.0f)), "
                                         "__float2bfloat16_rn(b + (RESID ? (float)r[1] : 0.0f))};")
    once = once.replace("if constexpr (RESID != 0) {", "if constexpr (false) {")
    assert once.count("(float)r[0]") == 1
    monkeypatch.setattr(matmul_kernel, "_kernel", lambda parts=0: cuda_emulator.Emu(
        "dflash_rows_matmul", matmul_source.INPUTS, ["y"], matmul_source.source(0), cuda_emulator.emulated(once)))
    single = matmul_kernel.rows_matmul(x, w.w, w.scales, w.biases, bits, group, residual=residual)
    alone = matmul_kernel.rows_matmul(x, w.w, w.scales, w.biases, bits, group)
    assert not mx.array_equal(single, residual + alone).item()


def test_a_residual_is_added_to_every_row_a_layout_holds(monkeypatch) -> None:
    """tiles.linear with `residual`: the decode rows take it into their kernel call, each prompt chunk's
    block adds it after MLX's product; either way the rows are `residual + x @ W.T` (stand-ins here)."""
    w = weight(64, 32, 16, 0, seed=2)
    w.kernel = True
    calls: list[tuple[int, bool]] = []

    def product(self, x, residual=None, norm=None, glu=False):
        calls.append((x.shape[0], residual is not None))
        y = x @ self.w.T
        return y if residual is None else residual + y

    monkeypatch.setattr(Weight, "kernel_product", product)
    monkeypatch.setattr(Weight, "tile", lambda self, x: x @ self.w.T)
    layout = Layout.of([1, 16, 40, 5], [False, False, True, False])
    x = mx.random.normal((layout.rows, 64)).astype(mx.bfloat16)
    residual = mx.random.normal((layout.rows, 32)).astype(mx.bfloat16)
    got = linear(x, w, layout, residual)
    assert calls == [(layout.decode_rows, True)]
    assert mx.array_equal(got, residual + linear(x, w, layout)).item()
    w.kernel = False
    assert mx.array_equal(linear(x[:32], w, residual=residual[:32]), residual[:32] + x[:32] @ w.w.T).item()


# -- on a CUDA GPU ----------------------------------------------------------------------------------
def dequantized(w: Weight, bits: int, group: int) -> mx.array:
    return w.w.astype(mx.float32) if bits == 16 else mx.dequantize(
        w.w, w.scales.astype(mx.float32), w.biases.astype(mx.float32), group_size=group, bits=bits)


# -- on any machine with g++: the kernel's CUDA source, run by tests/cuda_emulator.py ------------------
@cuda_emulator.needs_gxx
@pytest.mark.parametrize("case", [(128, 64, 4, 64, 1, 1), (64, 48, 8, 32, 1, 1), (64, 40, 16, 0, 2, 1), (1024, 32, 4, 32, 8, 1),
                                  (2048, 16, 4, 64, 8, 2), (1024, 16, 8, 64, 8, 2)],
                         ids=["q4", "q8", "bf16-single-column-tiles", "q4-split-k", "q4-look-ahead", "q8-look-ahead"])
def test_the_kernel_source_run_on_a_cpu_stays_in_bounds_and_keeps_rows_alone(monkeypatch, case) -> None:
    """Calls of 1, 3, 17 and 70 rows (one to four row tiles a block, two blocks along the rows) against
    4-bit, 8-bit and bf16 weights, the input width split over 1, 2 or 8 warps, with and without
    weight loads a row-tiled call issues ahead (`look_ahead`): every element written, the product of
    the dequantized weights to bf16 accuracy, every row equal to the same row in a call of one row,
    and a row changed in the input changing that output row alone (so the comparison can fail); any
    access past a buffer's end would have faulted."""
    cuda_emulator.install_matmul(monkeypatch)
    k, n, bits, group, split, ahead = case
    assert matmul_kernel.fits(k, n, bits, group or 64)
    assert matmul_kernel.geometry(k, n, bits).split_k == split
    assert matmul_kernel.look_ahead(k, bits, split, tiles=2, column_tiles=2, normed=False) == ahead
    assert matmul_kernel.launch(1, k, n, bits, group or 64, ()).options["template"][4] == ("NT", 2 if n % 16 == 0 else 1)
    windows = matmul_kernel.launch(3, k, n, bits, group or 64, ()).options["template"][4]
    assert windows == ("NT", 2 if n % 16 == 0 else 1)  # too few columns for 4 tiles a warp
    w = weight(k, n, bits, group, seed=8)
    x = mx.random.normal((70, k), key=mx.random.key(9)).astype(mx.bfloat16)
    ref = x.astype(mx.float32) @ dequantized(w, bits, group).T
    got = rows_alone_and_right(lambda rows: matmul_kernel.rows_matmul(rows, w.w, w.scales, w.biases, bits, group), x, ref)
    changed = mx.array(x[:17])
    changed[2, 5] = changed[2, 5] + 1.0
    same = mx.all(matmul_kernel.rows_matmul(changed, w.w, w.scales, w.biases, bits, group) == got[:17], axis=1)
    assert same.tolist() == [i != 2 for i in range(17)]


def rows_alone_and_right(product, x: mx.array, ref: mx.array) -> mx.array:
    """Calls of 1, 3, 17 and 70 rows of x through `product`: every element written, the values `ref`'s rows' to
    bf16 accuracy, and rows 0, 2, 16 and 69 each equal to the row in a call of one row, bit for bit. Returns the
    70-row call's output."""
    alone = {i: product(x[i : i + 1]) for i in (0, 2, 16, 69)}
    for m in (1, 3, 17, 70):
        got = product(x[:m])
        assert got.shape == (m, ref.shape[1]) and bool(mx.all(mx.isfinite(got)).item()), f"{m} rows: elements left unwritten"
        err = (mx.linalg.norm(got.astype(mx.float32) - ref[:m]) / mx.linalg.norm(ref[:m])).item()
        assert err < 1e-2, (m, err)
        for i, row in alone.items():
            if i < m:
                assert mx.array_equal(got[i : i + 1], row).item(), (m, i)
    return got


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("case", [(1024, 64, 4, 32), (512, 96, 8, 64), (256, 32, 16, 0)], ids=["q4", "q8", "bf16"])
def test_the_kernel_source_at_four_column_tiles_a_warp_equals_two(monkeypatch, case) -> None:
    """`tiles_a_warp`: calls of several rows against a wide weight take 4 column tiles a warp, which changes
    which warp computes a column, never its sum: at 4 tiles every row of calls of 3, 17 and 40 rows equals
    the same call at 2 bit for bit (the weights here are narrow, so the rule is forced; what it picks for the
    9B's weights is checked beside)."""
    assert [matmul_kernel.tiles_a_warp(m, 4096, n, 4, False) for m, n in ((16, 24576), (16, 4096), (1, 24576), (16, 1024))] == [4, 4, 2, 2]
    assert matmul_kernel.tiles_a_warp(16, 576, 1536, 16, False) == 2  # the 135M model's MLP: too few columns
    # bf16 weights (the 9B drafter's fc) and 8-bit normed launches whose input width is split take 4 tiles only
    # past one row tile; 4-bit normed launches (the 9B's gate/up, split 2, and its lm_head) from one row on
    assert [matmul_kernel.tiles_a_warp(m, 32768, 4096, 16, False) for m in (1, 16, 17)] == [2, 2, 4]
    assert [matmul_kernel.tiles_a_warp(m, 4096, 24576, 8, True) for m in (1, 16, 17)] == [2, 2, 4]
    assert [matmul_kernel.tiles_a_warp(m, 4096, 24576, 4, True) for m in (1, 16, 17)] == [4, 4, 4]
    assert [matmul_kernel.tiles_a_warp(m, 4096, 248320, 4, True) for m in (1, 16, 17)] == [4, 4, 4]
    # 4-bit launches at 4 tiles load two iterations ahead unless normed; at 2 tiles or in bf16 one (a look-ahead
    # changes when loads are issued, not a sum)
    assert [matmul_kernel.look_ahead(4096, bits, 1, 1, nt, normed) for bits, nt, normed in
            ((4, 4, False), (4, 4, True), (4, 2, False), (16, 4, False))] == [2, 1, 1, 1]
    cuda_emulator.install_matmul(monkeypatch)
    k, n, bits, group = case
    w = weight(k, n, bits, group, seed=11)
    x = mx.random.normal((40, k), key=mx.random.key(12)).astype(mx.bfloat16)
    got = {}
    for nt in (2, 4):
        with monkeypatch.context() as patch:
            patch.setattr(matmul_kernel, "tiles_a_warp", lambda m, k, n, bits, normed: nt)
            matmul_kernel.launch.cache_clear()
            got[nt] = [matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, bits, group) for m in (3, 17, 40)]
            assert matmul_kernel.launch(17, k, n, bits, group or 64, ()).options["template"][4] == ("NT", nt)
        matmul_kernel.launch.cache_clear()  # no launch of the forced rule outlives the test
    for two, four in zip(got[2], got[4]):
        assert bool(mx.all(mx.isfinite(four)).item()) and mx.array_equal(two, four).item()


# -- on a CUDA GPU ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@on_cuda
def test_rows_of_any_call_equal_the_row_alone(case: tuple[int, int, int, int]) -> None:
    k, n, bits, group = case
    w = weight(k, n, bits, group, seed=4)
    x = mx.random.normal((80, k), key=mx.random.key(5)).astype(mx.bfloat16)
    alone = mx.concatenate([w.kernel_product(x[i : i + 1]) for i in range(80)])
    assert bool(mx.all(mx.isfinite(alone)).item())
    for m in (2, 3, 15, 16, 17, 31, 33, 48, 64, 65, 80):
        for start in sorted({0, 7, 80 - m}):
            if start + m <= 80:
                got = w.kernel_product(x[start : start + m])
                assert mx.array_equal(got, alone[start : start + m]).item(), (m, start)
    # the float32 product of the dequantized weights, to bf16 accuracy
    ref = x.astype(mx.float32) @ dequantized(w, bits, group).T
    err = (mx.linalg.norm(alone.astype(mx.float32) - ref) / mx.linalg.norm(ref)).item()
    assert err < 1e-2, err


@on_cuda
def test_parts_equal_the_columns_of_one_product() -> None:
    """On the device: a stacked weight's parts (qwen3_5's in_proj widths, scaled down) equal the columns
    of the same launch without parts, bit for bit, at 1, 16 and 33 rows."""
    widths = (256, 128, 32, 32)
    w = weight(1024, sum(widths), 4, 64, seed=10)
    x = mx.random.normal((33, 1024), key=mx.random.key(11)).astype(mx.bfloat16)
    for m in (1, 16, 33):
        whole = w.kernel_product(x[:m])
        lo = 0
        for part, width in zip(w.kernel_product(x[:m], widths), widths):
            assert mx.array_equal(part, whole[:, lo : lo + width]).item(), (m, lo)
            lo += width


@on_cuda
def test_a_residual_in_the_launch_equals_the_product_then_mlxs_add() -> None:
    """On the device: the kernel's residual add has the bits of its product then MLX's own bf16 add, at
    1, 16 and 17 rows of a 4-bit, an 8-bit and a bf16 weight (what the layers' fused adds rely on)."""
    for k, n, bits, group in (CASES["q4-g64"], CASES["q8-g64"], CASES["bf16"]):
        w, x, residual = residual_case(k, n, bits, group)
        for m in (1, 16, 17):
            fused = w.kernel_product(x[:m], residual=residual[:m])
            assert mx.array_equal(fused, residual[:m] + w.kernel_product(x[:m])).item(), (bits, m)


@on_cuda
def test_a_changed_row_changes_that_row_alone() -> None:
    """The negative control: the comparison above sees a difference the test makes itself."""
    w = weight(*CASES["q4-g64"], seed=6)
    x = mx.random.normal((16, 1024), key=mx.random.key(7)).astype(mx.bfloat16)
    y = mx.array(x)
    y[5, 3] = y[5, 3] + 1.0
    a, b = w.kernel_product(x), w.kernel_product(y)
    same = mx.all(a == b, axis=1).tolist()
    assert same == [i != 5 for i in range(16)]


@on_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_the_self_check_picks_the_kernel_in_gpu_mode_and_windows_equal_steps(family: str) -> None:
    """Every weight the kernel fits takes it, and the model check (window == steps, packed == alone)
    passes with it, for each family in bf16."""
    cfg = config_dict(family, "small", 4, False)
    weights = {name: w if name.endswith(FLOAT32_TENSORS) else w.astype(mx.bfloat16)
               for name, w in canonical_weights(reference_model(cfg, 8)).items()}
    target = build_target(parse_target_config(cfg), weights, mx.bfloat16)
    verdict = selfcheck.check(target, fresh=True)
    assert verdict.passed, verdict.line()
    assert any(w.kernel for w in target.projections()) and "the row kernel" in verdict.line()
    for w in target.projections():
        assert w.kernel == w.fits_kernel(mx.bfloat16), selfcheck.weight_key(w)


def emulated_target(monkeypatch, tmp_path):
    """The 9B-shaped tiny target in gpu mode with every projection on the row kernel, its CUDA source run by
    tests/cuda_emulator.py, and a state after a 32-token prompt."""
    from dflash_bench.engine import tiles
    from dflash_bench.engine.targets import Segment
    from dflash_bench.engine.engine import Engine, Settings
    from dflash_bench.fixtures.big import write_big

    target = Engine(write_big("qwen3_5-9b-4bit", tmp_path / "t", "tiny"), None,
                    Settings(context=256, chunk=32, backend="gpu")).target
    base = target.new_state()
    target.forward([Segment(list(range(40, 72)), 0, base, [], prefill=True)])
    base.keep(32)
    cuda_emulator.install_matmul(monkeypatch)
    monkeypatch.setattr(tiles, "available", lambda dtype: dtype == mx.bfloat16)
    for w in target.projections():
        w.kernel = w.fits_kernel(target.dtype)
    assert all(w.kernel for w in target.projections())
    return target, base


@cuda_emulator.needs_gxx
def test_a_forward_on_the_kernels_parts_equals_one_on_column_slices(monkeypatch, tmp_path) -> None:
    """The 9B-shaped tiny target in gpu mode with every projection on the row kernel (its CUDA source
    run by tests/cuda_emulator.py): a decode step of one stream and a 5-row window of another, through
    the stacked weights' parts (qwen3_5's in_proj qkv/z/b/a, gated attention's q/k/v, each MLP's
    gate/up), give the logits and taps of the same forward on one product's column slices, bit for bit. Each
    MLP's gate/up is one launch of their SwiGLU (tests/test_matmul_glu.py), in both forwards."""
    from dflash_bench.engine import tiles
    from dflash_bench.engine.targets import Segment

    target, base = emulated_target(monkeypatch, tmp_path)
    widths = []
    parts = matmul_kernel.rows_matmul
    monkeypatch.setattr(tiles, "rows_matmul", lambda *a, **kw: widths.append("glu" if kw["glu"] else a[-1]) or parts(*a, **kw))

    def run() -> list[mx.array]:
        segs = [Segment([7], 32, base.snapshot(32), [0], want_taps=True),
                Segment(list(range(200, 205)), 32, base.snapshot(32), list(range(5)), want_taps=True)]
        return [a.astype(mx.float32) for o in target.forward(segs, (1, 5)) for a in (o.logits, o.taps)]

    on_parts = run()
    assert len([w for w in widths if w and w != "glu"]) == target.config.num_layers  # a mixer's a layer
    assert widths.count("glu") == target.config.num_layers  # an MLP's a layer
    monkeypatch.setattr(tiles, "splits_output", lambda widths: False)
    assert all(mx.array_equal(a, b).item() for a, b in zip(on_parts, run()))
