"""Elementwise chains of the target's forward, each one kernel on a GPU.

A GPU decode forward pays per kernel launch, not per byte (docs/gpu-round-profile.md): at one row a
SwiGLU's sigmoid, product and product are three launches of ~3 us for a few kilobytes. `mx.compile`
fuses such a chain into one kernel. The arithmetic stays elementwise, so a row's bits still depend on
its own values alone, whatever shares its forward (tiles.py's rule); the forward calls the same
function for a window, a step, a prompt chunk and a rollback, so those agree as before.

On the CPU the plain ops run: MLX would build its compiled kernels with a C++ compiler at run time,
and CPU ops are not launch-bound.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx


def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return mx.sigmoid(gate) * gate * up


def _gated(z: mx.array, normed: mx.array) -> mx.array:
    return silu(z) * normed


def _sigmoid_gate(o: mx.array, gate: mx.array) -> mx.array:
    return o * mx.sigmoid(gate)


def _conv(*taps_and_rows: mx.array) -> mx.array:
    half = len(taps_and_rows) // 2
    taps, rows = taps_and_rows[:half], taps_and_rows[half:]
    acc = taps[0] * rows[0]
    for tap, row in zip(taps[1:], rows[1:]):
        acc = acc + tap * row
    return silu(acc)


def _on_gpu(plain: Callable[..., mx.array]) -> Callable[..., mx.array]:
    compiled = mx.compile(plain)

    def run(*args: mx.array) -> mx.array:
        return (compiled if mx.default_device().type == mx.DeviceType.gpu else plain)(*args)

    return run


swiglu = _on_gpu(_swiglu)  # an MLP's silu(gate) * up, in mlx-lm's order
gated = _on_gpu(_gated)  # qwen3_5's silu(z) * RMSNorm(y)
sigmoid_gate = _on_gpu(_sigmoid_gate)  # gated attention's o * sigmoid(gate)
conv_silu = _on_gpu(_conv)  # the causal conv: taps times their rows, summed in tap order, then silu
