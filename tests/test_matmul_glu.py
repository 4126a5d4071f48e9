"""An MLP's gate and up products and their SwiGLU in one row-kernel launch (engine/matmul_kernel.py's `glu`,
tiles.SwiGLU).

Anywhere: an interleaved weight's rows alternate gate and up; tiles.SwiGLU sends a forward's decode rows to one
`glu` launch and each prompt chunk to MLX's product and the fused SwiGLU of its column pairs, and off the gpu mode
keeps two products (stand-ins for the kernel; integer values, so every product is exact on any BLAS).
Where g++ is (any machine): the kernel's CUDA source, run on the CPU by tests/cuda_emulator.py, writes at column j
of each row the SwiGLU of the same launch's columns 2j and 2j + 1 without `glu`, every row written, normed or not;
and the source includes none of MLX's device headers (engine/kernel_cache.py could not compile it).
On a CUDA GPU only: the launch equals the two products then MLX's compiled SwiGLU (engine/fused.py), bit for bit,
and the header's SwiGLU equals MLX's for every bf16 gate.
"""

from __future__ import annotations

import cuda_emulator
import numpy as np
import pytest
from gpu import on_cuda
from test_matmul_kernel import weight
from test_matmul_norm import norm_case

import mlx.core as mx

from dflash_bench.engine import matmul_kernel, matmul_source
from dflash_bench.engine.fused import swiglu
from dflash_bench.engine.tiles import Layout, Stacked, SwiGLU, Weight


def small_integers(shape: tuple[int, ...], seed: int) -> mx.array:
    """bf16 values in -2..2: their products and sums are exact in float32, in any order a BLAS takes."""
    return mx.random.randint(-2, 3, shape, key=mx.random.key(seed)).astype(mx.bfloat16)


# -- anywhere --------------------------------------------------------------------------------------
def test_an_interleaved_weight_alternates_gate_and_up_rows() -> None:
    """Packed (scales and biases with their rows) and bf16: output row 2j is the gate's row j, 2j + 1 the up's."""
    for bits, group in ((4, 64), (16, 0)):
        gate, up = weight(128, 24, bits, group, seed=1), weight(128, 24, bits, group, seed=2)
        joined = Weight.interleaved(gate, up)
        assert joined.shape == (48, 128) and (joined.bits, joined.group_size) == (gate.bits, gate.group_size)
        for name in ("w", "scales", "biases") if gate.bits else ("w",):
            got = getattr(joined, name)
            assert mx.array_equal(got[0::2], getattr(gate, name)).item() and mx.array_equal(got[1::2], getattr(up, name)).item()


def test_swiglu_sends_decode_rows_to_one_glu_launch_and_pairs_a_chunks_columns(monkeypatch) -> None:
    """tiles.SwiGLU on the kernel: decode rows alone are one launch with `glu` (its norm passed down); a forward
    that also holds a prompt chunk adds the chunk's MLX product, whose even and odd columns take the fused
    SwiGLU. Either way each row is swiglu(x @ gate.T, x @ up.T). Off the gpu mode, two weights and two products.
    The kernel is stood in for (its SwiGLU that of the column pairs)."""
    gate, up = Weight(small_integers((16, 32), 1)), Weight(small_integers((16, 32), 2))
    pair = SwiGLU(gate, up, stack=True)
    (joined,) = pair.weights
    joined.kernel = True
    calls: list[tuple[str, int, bool]] = []

    def product(self, x, parts=(), residual=None, norm=None, glu=False):
        calls.append(("kernel", x.shape[0], glu))
        y = x @ self.w.T
        return swiglu(y[:, 0::2], y[:, 1::2]) if glu else y

    monkeypatch.setattr(Weight, "kernel_product", product)
    monkeypatch.setattr(Weight, "tile", lambda self, x: calls.append(("mlx", x.shape[0], False)) or x @ self.w.T)
    x = small_integers((64, 32), 3)
    want = swiglu(x @ gate.w.T, x @ up.w.T)
    decode = Layout.of([1, 16], [False, False], tile=1)
    assert mx.array_equal(pair(x[: decode.rows], decode), want[: decode.rows]).item()
    assert calls == [("kernel", 17, True)]
    calls.clear()
    mixed = Layout.of([16, 40], [False, True], tile=1)
    got = pair(x[: mixed.rows], mixed)
    assert calls == [("kernel", 16, True), ("mlx", 48, False)] and mx.array_equal(got, want[: mixed.rows]).item()
    apart = SwiGLU(gate, up, stack=False)
    assert apart.weights == (gate, up) and mx.array_equal(apart(x[:32]), want[:32]).item()
    # the control: the pairs the other way round (up's SwiGLU times gate) are not the rows
    assert not mx.array_equal(swiglu(x @ up.w.T, x @ gate.w.T), want).item()


# -- on any machine with g++: the kernel's CUDA source, run by tests/cuda_emulator.py ------------------
def pair_glu(y: mx.array, swap: bool = False, device: bool = False) -> mx.array:
    """The header's `mm_glu` of each column pair of the bf16 product y (M, N), by a launch of its own: gate 2j,
    up 2j + 1 (`swap`: the other way round, the control's); run by the emulator (its stand-ins for libcu++'s exp
    and abs), or with `device` by MLX on a CUDA GPU."""
    m, n = y.shape
    body = f"""
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < {m * n // 2}) out[i] = mm_glu(float(y[2 * i + {int(swap)}]), float(y[2 * i + {1 - int(swap)}]));
"""
    if device:
        kernel = mx.fast.cuda_kernel("pair_glu", ["y"], ["out"], body, header=matmul_source.HEADER)
    else:
        kernel = cuda_emulator.Emu("pair_glu", ["y"], ["out"], body, cuda_emulator.emulated(matmul_source.HEADER))
    return kernel(inputs=[y], grid=(m * n // 2, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(m, n // 2)],
                  output_dtypes=[mx.bfloat16])[0]


def test_the_kernel_source_includes_no_header_only_mlx_has() -> None:
    """engine/kernel_cache.py compiles our sources with NVRTC and the CUDA and libcu++ headers on disk; MLX's device
    headers (`mlx/backend/cuda/device/...`) exist only inside its library, so a source including one would fail
    that compile and every process would compile the kernel again (session 52's SwiGLU included two)."""
    for source in (matmul_source.HEADER, matmul_source.ROPE_HEADER, *(matmul_source.source(p) for p in range(4)),
                   matmul_source.source(0, rope=True)):
        assert '#include "mlx/' not in source


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("case", [(128, 64, 4, 64), (64, 48, 8, 32), (64, 32, 16, 0), (1024, 32, 4, 32)],
                         ids=["q4", "q8", "bf16", "q4-split-k"])
def test_the_kernel_source_writes_each_column_pairs_swiglu(monkeypatch, case) -> None:
    """`glu` at 1, 5 and 17 rows, without and with the launch's norm: an (M, N / 2) output whose column j is
    `mm_glu` of columns 2j and 2j + 1 of the same launch without `glu`, every element written (the emulator's
    outputs start as NaN). The control pairs the columns the other way round and differs."""
    cuda_emulator.install_matmul(monkeypatch)
    k, n, bits, group = case
    w = weight(k, n, bits, group, seed=30)
    x, norm = norm_case(k, 17)
    for how in (None, norm):
        for m in (1, 5, 17):
            whole = matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, bits, group, norm=how)
            got = matmul_kernel.rows_matmul(x[:m], w.w, w.scales, w.biases, bits, group, norm=how, glu=True)
            assert got.shape == (m, n // 2) and bool(mx.all(mx.isfinite(got)).item())
            assert mx.array_equal(got, pair_glu(whole)).item(), (how is not None, m)
        assert not mx.array_equal(got, pair_glu(whole, swap=True)).item()


def test_glu_takes_neither_parts_nor_a_residual() -> None:
    w = weight(64, 32, 16, 0, seed=31)
    x = mx.zeros((1, 64), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="glu"):
        matmul_kernel.rows_matmul(x, w.w, w.w, w.w, 16, 0, parts=(16, 16), glu=True)
    with pytest.raises(ValueError, match="glu"):
        matmul_kernel.rows_matmul(x, w.w, w.w, w.w, 16, 0, residual=mx.zeros((1, 32), dtype=mx.bfloat16), glu=True)


# -- on a CUDA GPU ---------------------------------------------------------------------------------
@on_cuda
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 64), (16, 0)], ids=["q4", "q8", "bf16"])
def test_a_glu_launch_equals_the_two_products_then_mlxs_compiled_swiglu(bits: int, group: int) -> None:
    """On the device: an interleaved gate/up launch with `glu` equals the stacked weight's two parts (the launch
    before it) and engine/fused.py's compiled SwiGLU of them, bit for bit, at 1, 16, 17 and 33 rows, normed or
    not, with products spanning several binades (so the sigmoid meets both signs and large magnitudes). The
    control: the SwiGLU of up and gate the other way round differs."""
    k, n = 1024, 768
    gate, up = weight(k, n, bits, group, seed=40), weight(k, n, bits, group, seed=41)
    stacked = Stacked([gate, up], stack=True).weights[0]
    joined = Weight.interleaved(gate, up)
    x, norm = norm_case(k, 33)
    x = x * 8
    for how in (None, norm):
        for m in (1, 16, 17, 33):
            g, u = stacked.kernel_product(x[:m], (n, n), norm=how)
            got = joined.kernel_product(x[:m], norm=how, glu=True)
            assert mx.array_equal(got, swiglu(g, u)).item(), (how is not None, m)
    assert not mx.array_equal(got, swiglu(u, g)).item()


def bits(a: mx.array) -> mx.array:
    """A bf16 array's bit patterns (equal NaNs compare equal)."""
    return a.view(mx.uint16)


@on_cuda
def test_mm_glu_equals_mlxs_compiled_swiglu_for_every_bf16_gate() -> None:
    """On the device: the header's `mm_glu` (its own sigmoid, written out from MLX's functor) of each of the 65,536
    bf16 bit patterns as a gate, with ups of both signs and several magnitudes, equals engine/fused.py's compiled
    SwiGLU (MLX's own Sigmoid and Multiply), bit for bit. The control swaps gate and up."""
    gate = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(mx.bfloat16)[None]
    for value in (1.0, -3.0, 0.3, 1e30):
        up = mx.full(gate.shape, value, dtype=mx.bfloat16)
        pairs = mx.stack([gate, up], axis=-1).reshape(1, -1)
        got, want = pair_glu(pairs, device=True), swiglu(gate, up)
        differ = np.flatnonzero(np.array(bits(got)) != np.array(bits(want)))
        assert differ.size == 0, (value, differ.size, [hex(int(g)) for g in differ[:8]])  # a gate's pattern is its index
    assert not mx.array_equal(bits(pair_glu(pairs, swap=True, device=True)), bits(want)).item()
