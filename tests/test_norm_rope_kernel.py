"""targets/norm_rope_kernel.py: q/k RMSNorm and RoPE in one launch (keys alone in another), a drafter's and a target's
decode rows'. On any CPU its CUDA source runs under tests/cuda_emulator.py; on a CUDA GPU (`pytest -m gpu`) the device
runs it.

What it must keep: each (row, head) its own, so rows launched together equal rows launched alone, bit
for bit (a drafter needs determinism, not MLX's bits, and a target's windows must equal its steps); and the
values of the chain it replaces (`mx.fast.rms_norm` where the layer has q/k norms, then `mx.fast.rope` of the
first rope_dims values at each row's position) to bf16 accuracy, keys and queries alike; a gated layer's q rows
read in place, their gates untouched.
"""

from __future__ import annotations

import cuda_emulator
import numpy as np
import pytest
from gpu import on_cuda

import mlx.core as mx

from dflash_bench.engine.targets import norm_rope_kernel
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


def check_layers(layers: int, heads: int, d: int, extra: int) -> None:
    """`layer_keys` on one product of every layer's weights, (rows, layers * S), each layer's S columns its keys, its
    values, then `extra` more (a drafter's queries): each layer's keys and values are `keys` of that layer's columns
    with that layer's norm weights, bit for bit, at 2l and 2l + 1."""
    x, _, positions = inputs(6, layers * (2 * heads + extra), d, seed=1)
    mx.random.seed(2)
    w = (1 + 0.5 * mx.random.normal((layers, d))).astype(mx.bfloat16)
    product = flat(x)
    out = norm_rope_kernel.layer_keys(product, w, positions, THETA, EPS, heads)
    assert out.dtype == mx.bfloat16 and out.shape == (2 * layers, heads, 6, d)
    s = (2 * heads + extra) * d
    for layer in range(layers):
        k = mx.contiguous(product[:, layer * s : layer * s + heads * d])
        v = mx.contiguous(product[:, layer * s + heads * d : layer * s + 2 * heads * d])
        want = norm_rope_kernel.keys(k, v, w[layer], positions, THETA, EPS)
        assert mx.array_equal(out[2 * layer : 2 * layer + 2], want).item(), layer
    # a control: another layer's norm weights give other keys (each layer reads its own row of w)
    swapped = norm_rope_kernel.layer_keys(product, w[::-1], positions, THETA, EPS, heads)
    assert not mx.array_equal(swapped[0], out[0]).item()
    with pytest.raises(ValueError, match="do not hold"):
        norm_rope_kernel.layer_keys(product[:, : s - d], w, positions, THETA, EPS, heads)


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("layers, heads, d, extra", [(3, 2, 32, 4), (2, 1, 64, 0)])
def test_every_layers_keys_in_one_launch_equal_each_layers_launch_under_the_emulator(
        layers: int, heads: int, d: int, extra: int, monkeypatch) -> None:
    cuda_emulator.install_norm_rope(monkeypatch)
    check_layers(layers, heads, d, extra)


@on_cuda
@pytest.mark.parametrize("layers, heads, d, extra", [(6, 8, 128, 32), (5, 3, 64, 9)])
def test_every_layers_keys_in_one_launch_equal_each_layers_launch_on_the_gpu(layers: int, heads: int, d: int,
                                                                             extra: int) -> None:
    check_layers(layers, heads, d, extra)


def test_it_takes_bf16_rows_of_an_even_head_dim() -> None:
    assert norm_rope_kernel.fits(128, mx.bfloat16)
    assert not norm_rope_kernel.fits(128, mx.float32)
    assert not norm_rope_kernel.fits(63, mx.bfloat16)


# (heads, kv heads, D, rope_dims, norms, gated): qwen3_5's full attention (partial rotary, a gate after each head's
# queries), llama's (no q/k norms), qwen3's (norms, all of D turned)
TARGET_LAYERS = {"qwen3_5": (4, 2, 64, 16, True, True), "llama": (3, 1, 64, 64, False, False),
                 "qwen3": (2, 1, 32, 32, True, False)}


def check_target_layer(heads: int, kv_heads: int, d: int, rope_dims: int, norms: bool, gated: bool) -> None:
    """The launch as a target's attention layer takes it (dense.py): against the chain it replaces, each row alone
    the same bits, a gated layer's q rows read in place (the same bits as its queries laid out alone), and the
    values past rope_dims not turned (without norms, exactly the rows' own)."""
    x, w, positions = inputs(6, heads + kv_heads, d, seed=5)
    q, k = x[:, :heads], x[:, heads:]
    v = (k.astype(mx.float32) * 0.5).astype(mx.bfloat16)
    qw, kw = (w, (w * 0.75).astype(mx.bfloat16)) if norms else (None, None)
    gate = (q.astype(mx.float32) - 1).astype(mx.bfloat16)
    q_rows = mx.concatenate([q, gate], axis=-1) if gated else q  # each head's queries, then its gate
    extra = dict(head_dim=d, rope_dims=rope_dims, gated=gated)
    queries, kv = norm_rope_kernel.queries_and_keys(flat(q_rows), flat(k), flat(v), qw, kw, positions, THETA, EPS,
                                                    **extra)
    assert queries.dtype == mx.float32 and queries.shape == q.shape and kv.shape == (2, kv_heads, 6, d)
    assert mx.array_equal(kv[1], v.transpose(1, 0, 2)).item()
    for rows, weight, got in ((q, qw, queries.transpose(1, 0, 2)), (k, kw, kv[0])):
        normed = rows.astype(mx.float32) if weight is None else mx.fast.rms_norm(
            rows.astype(mx.float32), weight.astype(mx.float32), EPS)
        want = rope_rows(normed, positions, rope_dims, THETA)
        assert relative_error(got, want) < 1e-2, relative_error(got, want)
        if weight is None:  # past rope_dims: the rows' own values (turned ones differ: the control)
            assert mx.array_equal(got[..., rope_dims:], rows.transpose(1, 0, 2)[..., rope_dims:]).item()
            assert not mx.array_equal(got[..., :rope_dims], rows.transpose(1, 0, 2)[..., :rope_dims]).item()
    if gated:  # read in place: the queries of the same rows without their gates, bit for bit
        alone, _ = norm_rope_kernel.queries_and_keys(flat(q), flat(k), flat(v), qw, kw, positions, THETA, EPS,
                                                     head_dim=d, rope_dims=rope_dims)
        assert mx.array_equal(alone, queries).item()
    for r in range(6):
        one_q, one_kv = norm_rope_kernel.queries_and_keys(flat(q_rows[r : r + 1]), flat(k[r : r + 1]),
                                                          flat(v[r : r + 1]), qw, kw, positions[r : r + 1], THETA,
                                                          EPS, **extra)
        assert mx.array_equal(one_q[0], queries[r]).item() and mx.array_equal(one_kv[:, :, 0], kv[:, :, r]).item(), r


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("layer", sorted(TARGET_LAYERS))
def test_a_target_layers_rows_under_the_emulator(layer: str, monkeypatch) -> None:
    cuda_emulator.install_norm_rope(monkeypatch)
    check_target_layer(*TARGET_LAYERS[layer])


@on_cuda
@pytest.mark.parametrize("layer", sorted(TARGET_LAYERS))
def test_a_target_layers_rows_on_the_gpu(layer: str) -> None:
    check_target_layer(*TARGET_LAYERS[layer])


def test_a_target_layers_launch_refuses_what_it_cannot_take() -> None:
    x, w, positions = inputs(2, 2, 32)
    for why, kwargs in (("come together", dict(qw=w, kw=None)), ("must be even", dict(qw=None, kw=None, rope_dims=5)),
                        ("must be even", dict(qw=None, kw=None, rope_dims=64)),
                        ("norm weights of", dict(qw=w[:16], kw=w[:16]))):
        qw, kw = kwargs.pop("qw"), kwargs.pop("kw")
        with pytest.raises(ValueError, match=why):
            norm_rope_kernel.queries_and_keys(flat(x), flat(x), flat(x), qw, kw, positions, THETA, EPS, head_dim=32,
                                              **kwargs)


@on_cuda
@pytest.mark.parametrize("theta, rope_dims", [(10_000.0, 64), (100_000.0, 64), (1_000_000.0, 16), (10_000_000.0, 64)])
def test_a_layer_without_norms_turns_rows_as_mlx_rope_does_bit_for_bit(theta: float, rope_dims: int) -> None:
    """Without q/k norms (llama) the launch's rotation is MLX's own on this GPU, bit for bit, at every position a
    4096-token context reaches and past it: a target's decode rows keep the bits (and so the tokens) they had with
    `mx.fast.rope`. Rows go 16 at a time, a verify window's rows: MLX 0.32.4's partial rotary (rope_dims < D) with
    an offset a row failed to launch at 128 rows on an H100 (cudaGraphAddKernelNode: invalid argument). The
    control turns the same rows one position on: other bits."""
    heads, kv_heads, d = 3, 1, 64
    everywhere = mx.concatenate([mx.arange(0, 4096, dtype=mx.int32), mx.arange(4096, 131_072, 997, dtype=mx.int32)])
    for start in range(0, everywhere.shape[0], 16):
        positions = everywhere[start : start + 16]
        rows = positions.shape[0]
        mx.random.seed(start)
        q = (mx.random.normal((rows, heads, d)) * 3).astype(mx.bfloat16)
        k = (mx.random.normal((rows, kv_heads, d)) * 3).astype(mx.bfloat16)
        queries, kv = norm_rope_kernel.queries_and_keys(flat(q), flat(k), flat(k), None, None, positions, theta, EPS,
                                                        head_dim=d, rope_dims=rope_dims)
        want_q = rope_rows(q, positions, rope_dims, theta)
        assert mx.array_equal(queries.astype(mx.bfloat16).transpose(1, 0, 2), want_q).item(), start
        assert mx.array_equal(kv[0], rope_rows(k, positions, rope_dims, theta)).item(), start
        assert not mx.array_equal(kv[0], rope_rows(k, positions + 1, rope_dims, theta)).item(), start
