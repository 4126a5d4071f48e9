"""The gated delta rule over a whole prompt chunk in a few dozen batched ops (chunkwise-parallel form).

Why: the per-row loop (`mx.fast.gated_delta_update`, mlx-lm's `gated_delta_ops`) is one step per
row; on an H200 one 256-row call at Qwen3.5-9B's shapes took 41 ms, so 4 x 65,536 prompt tokens
would spend about 1000 s in it. A prompt chunk needs no single-step equality (targets/base.py), only
rows that are a deterministic function of the chunk, so it can take the chunkwise form of
flash-linear-attention's `chunk_gated_delta_rule` instead: rows are cut into sub-chunks of `SUB`
at fixed offsets from the chunk's start, everything inside a sub-chunk is a handful of batched
matmuls, and only the state is carried from one sub-chunk to the next.

The recurrence, per value head, with state S (Dv x Dk), decay g_t, write strength beta_t:
    S_t = g_t S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - g_t S_{t-1} k_t),   y_t = S_t q_t.
Inside a sub-chunk starting from S_0, with gamma_i = g_1 ... g_i (cumulative log-gates, so ratios
gamma_i / gamma_j are exp of differences and never overflow), the u_i solve one unit lower-triangular
system, (I + A) U = beta (V - gamma K S_0^T) with A_ij = beta_i (gamma_i / gamma_j) k_i . k_j for j < i,
so U = Ut - W S_0^T with Ut = (I + A)^-1 beta V and W = (I + A)^-1 beta gamma K (the WY form). Then
    Y = gamma Q S_0^T + ((Q K^T) * gamma_i / gamma_j, j <= i) U,
    S_C = gamma_C S_0 + ((gamma_C / gamma_j) U)^T K.
(I + A)^-1 is built by block-recursive inversion from 1 x 1 blocks: [[L11, 0], [L21, L22]]^-1 has
off-diagonal block -L22^-1 L21 L11^-1, doubling the block size each level (log2 SUB levels). The
nilpotent series (I - A)(I + A^2)(I + A^4)... is as few matmuls, but its partial products can be
huge when keys repeat (all-equal keys give binomial-sized terms) and cancel in float32; the block
recursion only ever forms the inverses of leading sub-blocks, which are as bounded as the answer.

Arithmetic is float32 throughout (the state is float32 on every backend). Padding rows (k = v = 0,
beta = 0, log-gate 0) leave the state untouched, so a short last chunk pads to whole sub-chunks.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

SUB = 64  # rows per sub-chunk, as flash-linear-attention's chunk size


def log_gate(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g = -exp(A_log) * softplus(a + dt_bias), float32: mlx-lm's `compute_g` before its exp.

    Taken in log space so a decay that underflows to 0 in linear space stays finite here."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus((a + dt_bias).astype(mx.float32))


def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A of shape (..., C, C), C a power of two."""
    *batch, c, _ = a.shape
    inv = mx.ones((*batch, c, 1, 1), dtype=a.dtype)  # the (c) diagonal 1 x 1 blocks of I + A, inverted
    b = 1
    while b < c:
        m = c // (2 * b)
        pairs = inv.reshape(*batch, m, 2, b, b)
        i11, i22 = pairs[..., 0, :, :], pairs[..., 1, :, :]
        # A's lower-left b x b quadrant of each 2b diagonal block: rows 2bp + b.., columns 2bp..
        quads = a.reshape(*batch, m, 2, b, m, 2, b)[..., :, 1, :, :, 0, :]  # (..., m, b, m, b)
        a21 = mx.moveaxis(mx.diagonal(quads, axis1=-4, axis2=-2), -1, -3)  # (..., m, b, b)
        off = -(i22 @ (a21 @ i11))
        top = mx.concatenate([i11, mx.zeros_like(i11)], axis=-1)
        inv = mx.concatenate([top, mx.concatenate([off, i22], axis=-1)], axis=-2)
        b *= 2
    return inv.reshape(*batch, c, c)


def chunked_gated_delta(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array, state: mx.array,
                        sub: int = SUB) -> tuple[mx.array, mx.array]:
    """One stream's chunk of the gated delta rule: (y, final state).

    q, k: (T, Hk, Dk), already normalized as mlx-lm's `normalize_qk` leaves them; v: (T, Hv, Dv);
    log_g, beta: (T, Hv); state: (Hv, Dv, Dk) float32. Returns y (T, Hv, Dv) in v's dtype and the
    float32 state after row T. Not `mx.compile`d: on this CPU that was no faster (91 against 81 ms
    at the 9B's heads), and a compiled graph keeps its constants alive per shape, which the
    memory-returns-to-baseline checks would see.
    """
    if sub & (sub - 1):
        raise ValueError(f"sub-chunk size must be a power of two, got {sub}")
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    n = -(-t // sub)
    pad = n * sub - t
    f32 = mx.float32

    def blocks(x: mx.array) -> mx.array:
        """(T, H, ...) -> (H, n, sub, ...) in float32, zero-padded to whole sub-chunks."""
        x = x.astype(f32)
        if pad:
            x = mx.concatenate([x, mx.zeros((pad, *x.shape[1:]), dtype=f32)])
        return mx.moveaxis(x.reshape(n, sub, *x.shape[1:]), 2, 0)

    if hv != hk:
        q, k = mx.repeat(q, hv // hk, axis=1), mx.repeat(k, hv // hk, axis=1)
    qb, kb, vb, gb, bb = blocks(q), blocks(k), blocks(v), blocks(log_g), blocks(beta)
    cum = mx.cumsum(gb, axis=-1)  # log gamma_i, (hv, n, sub)
    ratio = cum[..., :, None] - cum[..., None, :]  # log gamma_i / gamma_j
    rows = mx.arange(sub)
    strict, lower = rows[:, None] > rows[None, :], rows[:, None] >= rows[None, :]
    kt = kb.swapaxes(-1, -2)
    a = bb[..., None] * mx.exp(mx.where(strict, ratio, -math.inf)) * (kb @ kt)
    inv = unit_lower_inverse(a)
    gamma = mx.exp(cum)
    w = inv @ ((bb * gamma)[..., None] * kb)  # (hv, n, sub, dk)
    ut = inv @ (bb[..., None] * vb)  # (hv, n, sub, dv)
    p = (qb @ kt) * mx.exp(mx.where(lower, ratio, -math.inf))  # (hv, n, sub, sub)
    tail = mx.exp(cum[..., -1:] - cum)  # gamma_C / gamma_j
    s = state.astype(f32)
    ys = []
    for i in range(n):
        st = s.swapaxes(-1, -2)  # (hv, dk, dv)
        u = ut[:, i] - w[:, i] @ st
        ys.append(gamma[:, i, :, None] * (qb[:, i] @ st) + p[:, i] @ u)
        s = gamma[:, i, -1, None, None] * s + (u * tail[:, i, :, None]).swapaxes(-1, -2) @ kb[:, i]
    y = mx.stack(ys, axis=1).reshape(hv, n * sub, dv)
    return mx.moveaxis(y, 0, 1)[:t].astype(v.dtype), s
