"""A layer's RMS norm in its projection's row-kernel launch (engine/matmul_kernel.py's `norm`, tiles.linear's).

Where g++ is (any machine): the kernel's CUDA source, run on the CPU by tests/cuda_emulator.py, norms each row
alone (every row of a call equal to the row alone, bit for bit; the values MLX's norm then the product's to
bf16 accuracy; a changed row changing that row alone), alike for a stacked weight's parts and any column tiles
a warp; a decode row's normed launches do not see a prompt chunk beside them in a forward. Anywhere: `linear`
hands the norm to decode rows' launches and norms everything else with MLX first. On a CUDA GPU only: rows
alone equal rows together with the norm in the launch, and its values.
"""

from __future__ import annotations

import cuda_emulator
import pytest
from gpu import on_cuda
from test_matmul_kernel import CASES, dequantized, emulated_target, rows_alone_and_right, weight

import mlx.core as mx

from dflash_bench.engine import matmul_kernel
from dflash_bench.engine.tiles import Layout, Stacked, Weight, linear


def norm_case(k: int, m: int = 70) -> tuple[mx.array, tuple[mx.array, float]]:
    """m rows whose scales span a few binades (so each row's own scale matters) and an RMS norm's weights."""
    scale = mx.power(2.0, mx.random.randint(-3, 4, (m, 1), key=mx.random.key(21)).astype(mx.float32))
    x = (mx.random.normal((m, k), key=mx.random.key(22)) * scale).astype(mx.bfloat16)
    return x, ((1 + 0.3 * mx.random.normal((k,), key=mx.random.key(23))).astype(mx.bfloat16), 1e-6)


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("case", [(128, 64, 4, 64), (64, 48, 8, 32), (64, 40, 16, 0), (1024, 32, 4, 32)],
                         ids=["q4", "q8", "bf16", "q4-split-k"])
def test_the_kernel_source_norms_each_row_in_its_launch(monkeypatch, case) -> None:
    """`norm`: a layer's RMS norm in its projection's launch. Calls of 1, 3, 17 and 70 rows (one to four row
    tiles a block, two blocks; the input width over 1 or 8 warps, whose squares are added in warp order):
    every element written, the values MLX's norm then the product's to bf16 accuracy, every row equal to
    the row in a call of one row, bit for bit, and a row changed in the input changing that output row
    alone. Controls: other norm weights change every row (the launch reads them), and without the norm
    the rows' values are not the normed ones (the scale is applied)."""
    cuda_emulator.install_matmul(monkeypatch)
    k, n, bits, group = case
    w = weight(k, n, bits, group, seed=20)
    x, norm = norm_case(k)
    ref = mx.fast.rms_norm(x.astype(mx.float32), norm[0].astype(mx.float32), norm[1]) @ dequantized(w, bits, group).T

    def product(rows: mx.array, how: tuple[mx.array, float] | None = norm) -> mx.array:
        return matmul_kernel.rows_matmul(rows, w.w, w.scales, w.biases, bits, group, norm=how)

    got = rows_alone_and_right(product, x, ref)
    changed = mx.array(x[:17])
    changed[2, 5] = changed[2, 5] * 4.0 + 1.0
    assert mx.all(product(changed) == got[:17], axis=1).tolist() == [i != 2 for i in range(17)]
    other = (norm[0] * 1.5, norm[1])
    assert not bool(mx.any(mx.all(product(x[:17], other) == got[:17], axis=1)).item())
    plain = product(x[:17], None).astype(mx.float32)
    assert (mx.linalg.norm(plain - ref[:17]) / mx.linalg.norm(ref[:17])).item() > 0.1


@cuda_emulator.needs_gxx
def test_the_kernel_source_norms_a_stacked_weights_parts_and_any_column_tiles_alike(monkeypatch) -> None:
    """A normed launch's parts equal the columns of the same normed launch without parts, and its rows at 4
    column tiles a warp equal those at 2, bit for bit, at 1, 5, 8, 9 and 17 rows: the squares are summed in an
    order set by the input width's split, which neither the parts nor the column tiles touch. (A call of up to 8 rows
    skips its row tile's upper half; the test above holds such calls' rows equal to the same rows in calls of 17
    and 70 rows, which do not.)"""
    cuda_emulator.install_matmul(monkeypatch)
    widths = (64, 32, 16, 16)
    w = weight(512, sum(widths), 4, 64, seed=24)
    x, norm = norm_case(512, 17)
    got = {}
    for nt in (2, 4):
        with monkeypatch.context() as patch:
            patch.setattr(matmul_kernel, "tiles_a_warp", lambda m, k, n, bits, normed: nt)
            matmul_kernel.launch.cache_clear()
            got[nt] = [matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, 4, 64, norm=norm) for m in (1, 5, 8, 9, 17)]
            parts = [matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, 4, 64, widths, norm=norm) for m in (1, 5, 8, 9, 17)]
        matmul_kernel.launch.cache_clear()
        for whole, split in zip(got[nt], parts):
            lo = 0
            for part, width in zip(split, widths):
                assert mx.array_equal(part, whole[:, lo : lo + width]).item(), (nt, lo)
                lo += width
    for two, four in zip(got[2], got[4]):
        assert bool(mx.all(mx.isfinite(four)).item()) and mx.array_equal(two, four).item()


def test_linear_norms_decode_rows_in_the_launch_and_chunks_before_mlxs_product(monkeypatch) -> None:
    """tiles.linear with `norm`: decode rows hand it to their kernel call, with or without a prompt chunk
    in the forward (its block normed alone by `mx.fast.rms_norm`, then MLX's product); a weight not on the
    kernel and several unstacked parts norm the rows with `mx.fast.rms_norm` first, once (stand-ins here:
    the kernel's norm as MLX's)."""
    w = weight(64, 32, 16, 0, seed=2)
    w.kernel = True
    calls: list[tuple[int, bool]] = []

    def product(self, x, residual=None, norm=None, glu=False):
        calls.append((x.shape[0], norm is not None))
        return (x if norm is None else mx.fast.rms_norm(x, *norm)) @ self.w.T

    monkeypatch.setattr(Weight, "kernel_product", product)
    monkeypatch.setattr(Weight, "tile", lambda self, x: x @ self.w.T)
    x = mx.random.normal((64, 64)).astype(mx.bfloat16)
    norm = (mx.random.normal((64,)).astype(mx.bfloat16), 1e-5)
    normed = mx.fast.rms_norm(x, *norm)
    assert mx.array_equal(linear(x[:5], w, norm=norm), normed[:5] @ w.w.T).item() and calls == [(5, True)]
    calls.clear()
    layout = Layout.of([1, 16, 40], [False, False, True])
    assert mx.array_equal(linear(x, w, layout, norm=norm), linear(normed, w, layout)).item()
    assert calls == [(layout.decode_rows, True), (layout.decode_rows, False)]
    w.kernel = False
    assert mx.array_equal(linear(x[:16], w, norm=norm), normed[:16] @ w.w.T).item()
    norms = []
    rms_norm = mx.fast.rms_norm
    monkeypatch.setattr(mx.fast, "rms_norm", lambda *a: norms.append(1) or rms_norm(*a))
    apart = Stacked([weight(64, 16, 16, 0, seed=s) for s in (3, 4)], stack=False)
    got = apart(x[:16], norm=norm)
    assert len(norms) == 1 and all(mx.array_equal(g, normed[:16] @ p.w.T).item() for g, p in zip(got, apart.weights))


@on_cuda
def test_a_norm_in_the_launch_keeps_rows_alone_and_the_norms_values() -> None:
    """On the device: a 4-bit, an 8-bit and a bf16 launch with the rows' RMS norm in it (`norm`) gives every row
    of calls of 1..17 rows the bits of the row alone, and MLX's norm then the product's values to bf16 accuracy."""
    for k, n, bits, group in (CASES["q4-g64"], CASES["q8-g64"], CASES["bf16"]):
        w = weight(k, n, bits, group, seed=25)
        x, norm = norm_case(k, 17)
        ref = mx.fast.rms_norm(x.astype(mx.float32), norm[0].astype(mx.float32), norm[1]) @ dequantized(w, bits, group).T
        alone = mx.concatenate([w.kernel_product(x[i : i + 1], norm=norm) for i in range(17)])
        for m in range(1, 18):
            assert mx.array_equal(w.kernel_product(x[:m], norm=norm), alone[:m]).item(), (bits, m)
        err = (mx.linalg.norm(alone.astype(mx.float32) - ref) / mx.linalg.norm(ref)).item()
        assert err < 1e-2, (bits, err)


@cuda_emulator.needs_gxx
def test_a_decode_rows_normed_launches_do_not_see_a_prompt_chunk_beside_them(monkeypatch, tmp_path) -> None:
    """The 9B-shaped tiny target in gpu mode with every projection on the row kernel (its CUDA source run by
    tests/cuda_emulator.py), the layers' norms in the launches: a decode step's logits and taps alone equal the
    same step's in a forward that also runs another stream's prompt chunk (whose block MLX norms alone:
    tiles.linear), bit for bit. The control norms every row with MLX first, as a forward holding a chunk would
    if the chunk's norm took the decode rows along, and differs."""
    from dflash_bench.engine.targets import Segment

    target, base = emulated_target(monkeypatch, tmp_path)

    def step(chunk: bool) -> list[mx.array]:
        segs = [Segment([7], 32, base.snapshot(32), [0], want_taps=True)]
        if chunk:
            segs.append(Segment(list(range(100, 120)), 0, target.new_state(), [19], prefill=True))
        out = target.forward(segs, (1, 5))[0]
        return [out.logits.astype(mx.float32), out.taps.astype(mx.float32)]

    alone = step(False)
    assert all(mx.array_equal(a, b).item() for a, b in zip(alone, step(True)))
    product = Weight.kernel_product
    monkeypatch.setattr(Weight, "kernel_product", lambda self, x, *a, norm=None, **kw: product(
        self, x if norm is None else mx.fast.rms_norm(x, *norm), *a, **kw))
    assert not mx.array_equal(alone[0], step(True)[0]).item()
