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
(I + A)^-1 is built by block-recursive inversion, doubling the block size each level (log2 SUB
levels of two matmuls, `unit_lower_inverse`). The nilpotent series (I - A)(I + A^2)(I + A^4)... is
as few matmuls, but its partial products can be huge when keys repeat (all-equal keys give
binomial-sized terms) and cancel in float32; the block recursion only ever forms inverses of
diagonal blocks, which are as bounded as the answer. Value heads that share a key head broadcast
its keys rather than copy them, and the whole chunk is about 110 MLX ops whatever its length (on a
GPU a forward is bound by how many kernels it launches).

Arithmetic is float32 throughout (the state is float32 on every backend). Padding rows (k = v = 0,
beta = 0, log-gate 0) leave the state untouched, so a short last chunk pads to whole sub-chunks.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

SUB = 64  # rows per sub-chunk, as flash-linear-attention's chunk size


def log_gate(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g = -exp(A_log) * softplus(a + dt_bias), float32: mlx-lm's `compute_g` before its exp.

    Taken in log space so a decay that underflows to 0 in linear space stays finite here."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus((a + dt_bias).astype(mx.float32))


@lru_cache(maxsize=8)
def _masks(c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(strictly lower, lower, per-level) masks of a c x c sub-chunk; level b (1, 2, 4, ...) marks the
    lower-left b x b quadrant of each 2b x 2b diagonal block. Numpy, so no MLX memory stays behind."""
    i = np.arange(c)
    levels = [((i[:, None] // (2 * b)) == (i[None, :] // (2 * b))) & (i[:, None] % (2 * b) >= b) & (i[None, :] % (2 * b) < b)
              for b in (1 << e for e in range(c.bit_length() - 1))]
    return i[:, None] > i[None, :], i[:, None] >= i[None, :], np.stack(levels).astype(np.float32)


def unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A of shape (..., C, C), C a power of two.

    X starts as the inverse of I + A's 1 x 1 diagonal blocks (the identity); with L the part of A in
    the lower-left quadrants of its 2b x 2b diagonal blocks, the block-diagonal part of I + A at size
    2b is D + L, and since L X L = 0, (D + L)^-1 = X - X L X: four ops a level, log2 C levels.
    """
    c = a.shape[-1]
    x = mx.broadcast_to(mx.eye(c, dtype=a.dtype), a.shape)
    for level in mx.array(_masks(c)[2]):
        x = x - x @ ((level * a) @ x)
    return x


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
    r, n = hv // hk, -(-t // sub)
    pad = n * sub - t

    def blocks(x: mx.array) -> mx.array:
        """(T, H, ...) -> (Hk, H / Hk, n, sub, ...) in float32, zero-padded to whole sub-chunks: value
        head h is key head h // (H / Hk)'s, as mlx-lm repeats them, so key heads broadcast, not copy."""
        x = x.astype(mx.float32)
        if pad:
            x = mx.concatenate([x, mx.zeros((pad, *x.shape[1:]), dtype=mx.float32)])
        x = x.reshape(n, sub, hk, x.shape[1] // hk, *x.shape[2:])
        return x.transpose(2, 3, 0, 1, *range(4, x.ndim))

    qb, kb, vb, gb, bb = blocks(q), blocks(k), blocks(v), blocks(log_g), blocks(beta)
    strict, lower, _ = (mx.array(m) for m in _masks(sub))
    cum = mx.cumsum(gb, axis=-1)  # log gamma_i, (hk, r, n, sub)
    ratio = cum[..., :, None] - cum[..., None, :]  # log gamma_i / gamma_j
    kt = kb.swapaxes(-1, -2)
    a = bb[..., None] * mx.exp(mx.where(strict, ratio, -math.inf)) * (kb @ kt)
    inv = unit_lower_inverse(a)
    gamma = mx.exp(cum)[..., None]  # (hk, r, n, sub, 1)
    w = inv @ ((bb[..., None] * gamma) * kb)  # (hk, r, n, sub, dk)
    ut = inv @ (bb[..., None] * vb)  # (hk, r, n, sub, dv)
    p = (qb @ kt) * mx.exp(mx.where(lower, ratio, -math.inf))  # (hk, r, n, sub, sub)
    tail = mx.exp(cum[..., -1:] - cum)[..., None]  # gamma_C / gamma_j
    parts = [mx.split(x, n, axis=2) if n > 1 else [x] for x in (ut, w, qb, kb, p, gamma, tail)]
    s = state.astype(mx.float32).reshape(hk, r, 1, dv, dk)
    ys = []
    for ut_i, w_i, q_i, k_i, p_i, gamma_i, tail_i in zip(*parts):
        st = s.swapaxes(-1, -2)  # (hk, r, 1, dk, dv)
        u = ut_i - w_i @ st
        ys.append(gamma_i * (q_i @ st) + p_i @ u)
        s = gamma_i[..., -1:, :] * s + (u * tail_i).swapaxes(-1, -2) @ k_i
    y = (mx.concatenate(ys, axis=2) if n > 1 else ys[0]).reshape(hv, n * sub, dv)
    return y.swapaxes(0, 1)[:t].astype(v.dtype), s.reshape(hv, dv, dk)
