"""tools/row_kernel_variants.py's `columns` variant of the row kernel (several column groups a block, each with
the engine's warps along the input width), run with the engine kernel's own source under tests/cuda_emulator.py:
it must give the engine kernel's bits, whatever the rows, bits, norm and residual, since which warp computes a
column never enters its sum. The GPU machine times it (the tool); this checks, on any CPU with g++, that the
variant is the same arithmetic, so a timing there compares like with like."""

from __future__ import annotations

import sys
from pathlib import Path

import cuda_emulator
import pytest
from test_matmul_kernel import weight

import mlx.core as mx

from dflash_bench.engine import matmul_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from row_kernel_variants import columns, engine_source  # noqa: E402  (tools/ is not a package)


def launch(body: str, header: str, x: mx.array, w, bits: int, group: int, colw: int, residual: mx.array | None,
           norm: tuple[mx.array, float] | None) -> mx.array:
    """One emulated launch of `body` with matmul_kernel.launch's constants and geometry, `colw` column groups a
    block (the same threads in all: a block holds colw times the warps, the grid a colw-th of the blocks)."""
    m, k = x.shape
    n = w.w.shape[0]
    call = matmul_kernel.launch(m, k, n, bits, group, (), residual is not None, None if norm is None else norm[1])
    opts = dict(call.options)
    threads = opts["threadgroup"][0]
    if colw > 1:
        opts["template"] = (*opts["template"], ("COLW", colw))
        opts["threadgroup"] = (threads * colw, 1, 1)
    kernel = cuda_emulator.Emu(f"rows_c{colw}", matmul_kernel.INPUTS, ["y"], body, cuda_emulator.emulated(header))
    scales, biases = (w.w, w.w) if bits == 16 else (w.scales, w.biases)
    resid = x if residual is None else residual
    return kernel(inputs=[x, w.w, scales, biases, call.rows, resid, x if norm is None else norm[0]], **opts)[0]


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("case", [(128, 64, 4, 64, (2, 4)), (64, 48, 8, 32, (3,)), (64, 48, 16, 0, (3,)),
                                  (1024, 32, 4, 32, (2,))], ids=["q4", "q8", "bf16", "q4-split-k"])
def test_column_groups_give_the_engine_kernels_bits(case) -> None:
    """1 and 17 rows (one and two row tiles), plain, with a residual added and with a norm in the launch: every
    column group count equals the engine kernel bit for bit, and writes every element. Control: the engine
    kernel with other weights differs, so equality is not vacuous."""
    k, n, bits, group, groups = case
    header, engine = engine_source()
    body = columns(engine)
    w = weight(k, n, bits, group, seed=30)
    x = (mx.random.normal((17, k), key=mx.random.key(31))).astype(mx.bfloat16)
    residual = (mx.random.normal((17, n), key=mx.random.key(32))).astype(mx.bfloat16)
    norm = ((1 + 0.3 * mx.random.normal((k,), key=mx.random.key(33))).astype(mx.bfloat16), 1e-6)
    for m in (1, 17):
        for resid, how in ((None, None), (residual[:m], None), (None, norm)):
            ref = launch(engine, header, x[:m], w, bits, group, 1, resid, how)
            assert not bool(mx.any(mx.isnan(ref)).item())
            for colw in groups:
                got = launch(body, header, x[:m], w, bits, group, colw, resid, how)
                assert mx.array_equal(got, ref).item(), (m, colw, resid is not None, how is not None)
    other = launch(engine, header, x, weight(k, n, bits, group, seed=34), bits, group, 1, None, None)
    assert not mx.array_equal(other, ref).item()


def test_the_variant_refuses_an_engine_source_whose_lines_moved() -> None:
    """`columns` rewrites four lines of the engine kernel; a source without one of them is refused, not half
    rewritten."""
    _, engine = engine_source()
    with pytest.raises(AssertionError, match="line moved"):
        columns(engine.replace("const int n0 = blockIdx.x * (8 * NT);", "const int n0 = blockIdx.x * 8 * NT;"))
