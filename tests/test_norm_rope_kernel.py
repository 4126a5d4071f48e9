"""drafters/norm_rope_kernel.py: a drafter's q/k RMSNorm and RoPE in one launch (keys alone in another). On any CPU its CUDA
source runs under tests/cuda_emulator.py; on a CUDA GPU (`pytest -m gpu`) the device runs it.

What it must keep: each (row, head) its own, so rows launched together equal rows launched alone, bit
for bit (a drafter needs determinism, not MLX's bits); and the values of the chain it replaces
(`mx.fast.rms_norm`, then `mx.fast.rope` at each row's position) to bf16 accuracy, keys and queries alike.
"""

from __future__ import annotations

import cuda_emulator
import numpy as np
import pytest
from gpu import on_cuda

import mlx.core as mx

from dflash_bench.engine.drafters import norm_rope_kernel
from dflash_bench.engine.targets.base import rope_rows

THETA, EPS = 1_000_000.0, 1e-6


def inputs(rows: int, heads: int, d: int, seed: int = 0) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(seed)
    x = (mx.random.normal((rows, heads, d)) * 3).astype(mx.bfloat16)
    w = (1 + 0.5 * mx.random.normal((d,))).astype(mx.bfloat16)
    positions = mx.array([7, 4095, 0, 300, 301, 12_000, 5, 9][:rows], dtype=mx.int32)
    return x, w, positions


def chain(x: mx.array, w: mx.array, positions: mx.array) -> mx.array:
    """What the drafter ran before the kernel: (heads, rows, d) in float32 (the CPU computes it)."""
    normed = mx.fast.rms_norm(x.astype(mx.float32), w.astype(mx.float32), EPS)
    return rope_rows(normed, positions, x.shape[2], THETA)


def flat(x: mx.array) -> mx.array:
    """Rows (rows, heads, D) as the launches take them: (rows, heads * D)."""
    return x.reshape(x.shape[0], -1)


def test_rows_that_are_not_whole_heads_are_refused() -> None:
    x, w, positions = inputs(2, 3, 32)
    with pytest.raises(ValueError, match="not whole heads"):
        norm_rope_kernel.keys(flat(x)[:, :40], flat(x)[:, :40], w, positions, THETA, EPS)


def relative_error(got: mx.array, want: mx.array) -> float:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check(x: mx.array, w: mx.array, positions: mx.array) -> None:
    """Both launches on rows x: the same rows as queries and keys, and as keys alone, each with value rows; the
    launches take rows flat, (rows, heads * D), as a projection leaves them."""
    heads = x.shape[1]
    k = x[:, : max(1, heads // 2)]  # fewer key heads, as a drafter has
    v = (x[:, -k.shape[1] :].astype(mx.float32) * -2).astype(mx.bfloat16)  # any bf16 rows
    queries, kv = norm_rope_kernel.queries_and_keys(flat(x), flat(k), flat(v), w, w, positions, THETA, EPS)
    assert queries.dtype == mx.float32 and queries.shape == x.shape
    assert kv.dtype == mx.bfloat16 and kv.shape == (2, k.shape[1], x.shape[0], x.shape[2])
    keys = kv[0]
    # the values beside the keys, as they are (the joint cache's layout: one write for both)
    assert mx.array_equal(kv[1], v.transpose(1, 0, 2)).item()
    # a query is its key's bf16 value widened: the same arithmetic, rounded where the chain rounded
    assert mx.array_equal(queries[:, : k.shape[1]].astype(mx.bfloat16).transpose(1, 0, 2), keys).item()
    # the keys-only launch (an absorb's) turns keys and places values as the joint one does
    assert mx.array_equal(norm_rope_kernel.keys(flat(k), flat(v), w, positions, THETA, EPS), kv).item()
    want = chain(x, w, positions)
    assert relative_error(queries.transpose(1, 0, 2), want) < 1e-2, relative_error(queries.transpose(1, 0, 2), want)
    # each row its own: alone, at its own position, it is the same bits
    for r in range(x.shape[0]):
        alone, alone_kv = norm_rope_kernel.queries_and_keys(flat(x[r : r + 1]), flat(k[r : r + 1]), flat(v[r : r + 1]),
                                                            w, w, positions[r : r + 1], THETA, EPS)
        assert mx.array_equal(alone[0], queries[r]).item(), r
        assert mx.array_equal(alone_kv[:, :, 0], kv[:, :, r]).item(), r
    # a control: the same rows at other positions are other values (the positions are what turns them)
    moved = norm_rope_kernel.keys(flat(k), flat(v), w, positions + 1, THETA, EPS)
    assert not mx.array_equal(moved[0], keys).item() and mx.array_equal(moved[1], kv[1]).item()


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("heads, d", [(4, 32), (2, 128), (3, 64)])
def test_the_kernel_norms_and_turns_each_row_alone_under_the_emulator(heads: int, d: int, monkeypatch) -> None:
    cuda_emulator.install_norm_rope(monkeypatch)
    check(*inputs(6, heads, d))


@on_cuda
@pytest.mark.parametrize("heads, d", [(16, 128), (8, 128), (9, 64)])
def test_the_kernel_norms_and_turns_each_row_alone_on_the_gpu(heads: int, d: int) -> None:
    check(*inputs(8, heads, d))


def test_it_takes_bf16_rows_of_an_even_head_dim() -> None:
    assert norm_rope_kernel.fits(128, mx.bfloat16)
    assert not norm_rope_kernel.fits(128, mx.float32)
    assert not norm_rope_kernel.fits(63, mx.bfloat16)
