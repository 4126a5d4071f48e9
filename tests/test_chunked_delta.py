"""The chunked gated delta rule computes what the per-row recurrence computes (numerics, so a tolerance).

The reference is mlx-lm's `gated_delta_ops`, the sequential loop the decode path runs. Shapes cover
Hk < Hv, Dk != Dv, a non-zero starting state, lengths that are and are not whole sub-chunks, keys
that repeat (where the nilpotent-series inverse loses float32 precision), and decays so strong that
the linear-space gate underflows to zero. Bit-exactness per chunk is tests/test_prefill.py's job.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_ops, normalize_qk

from dflash_bench.engine.targets.chunked_delta import SUB, chunked_gated_delta, log_gate, unit_lower_inverse


def inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 32, dv: int = 48, seed: int = 0, repeat_keys: bool = False,
           decay: float = 1.0):
    key = iter(mx.random.split(mx.random.key(seed), 8))
    q, k = mx.random.normal((t, hk, dk), key=next(key)), mx.random.normal((t, hk, dk), key=next(key))
    if repeat_keys:
        k = mx.broadcast_to(k[:1], k.shape)
    q, k = normalize_qk(q, k, inv_scale=dk**-0.5, eps=1e-6)
    v = mx.random.normal((t, hv, dv), key=next(key))
    a_log = mx.random.normal((hv,), key=next(key)) + mx.log(mx.array(decay))
    lg = log_gate(a_log, mx.random.normal((t, hv), key=next(key)), mx.random.normal((hv,), key=next(key)))
    beta = mx.sigmoid(mx.random.normal((t, hv), key=next(key)))
    state = 0.1 * mx.random.normal((hv, dv, dk), key=next(key))
    return q, k, v, lg, beta, state


def reference(q, k, v, lg, beta, state):
    y, s = gated_delta_ops(q[None], k[None], v[None], mx.exp(lg)[None], beta[None], state[None])
    return y[0], s[0]


def max_error(got: mx.array, want: mx.array) -> float:
    return mx.abs(got - want).max().item() / max(mx.abs(want).max().item(), 1.0)


@pytest.mark.parametrize("t", [1, 37, SUB, 256])
def test_chunked_equals_the_per_row_recurrence(t: int) -> None:
    args = inputs(t, seed=t)
    y, s = chunked_gated_delta(*args)
    y_ref, s_ref = reference(*args)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert max_error(y, y_ref) < 1e-5 and max_error(s, s_ref) < 1e-5


def test_repeated_keys_and_underflowing_decays_stay_exact_to_float32() -> None:
    """All keys equal make the strictly lower A dense and near one; a decay of exp(-hundreds) is 0 as
    a linear gate (the reference multiplies by 0) but finite as a log gate."""
    for kwargs in (dict(repeat_keys=True), dict(decay=200.0)):
        args = inputs(200, seed=3, **kwargs)
        y, s = chunked_gated_delta(*args)
        y_ref, s_ref = reference(*args)
        assert max_error(y, y_ref) < 1e-5 and max_error(s, s_ref) < 1e-5, kwargs
        assert mx.isfinite(y).all().item() and mx.isfinite(s).all().item()


def test_unit_lower_inverse_inverts() -> None:
    """Entries of the size the delta rule makes (beta < 1 times a product of unit keys)."""
    a = 0.3 * mx.tril(mx.random.normal((3, SUB, SUB), key=mx.random.key(1)), -1)
    err = mx.abs(unit_lower_inverse(a) @ (mx.eye(SUB) + a) - mx.eye(SUB)).max().item()
    assert err < 1e-4


def test_a_chunk_computes_the_same_bits_every_time_and_its_padding_is_inert() -> None:
    """Deterministic per chunk (what the prompt regime needs), and a short chunk's zero padding rows
    leave the state as the rows before them left it."""
    args = inputs(100, seed=9)
    first, second = chunked_gated_delta(*args), chunked_gated_delta(*args)
    assert all(mx.array_equal(a, b).item() for a, b in zip(first, second))
    y_sub, s_sub = chunked_gated_delta(*args, sub=128)  # one sub-chunk of 128 holding 28 padding rows
    assert max_error(y_sub, first[0]) < 1e-5 and max_error(s_sub, first[1]) < 1e-5
