"""The engine's two numeric modes, named after the backend each is chosen for: what it holds, per element.

- `cpu`: every target weight dequantized to float32 at load, float32 activations and caches. On
  this CPU bf16 and quantized matmuls are slow, and float32 keeps the arithmetic reproducible.
- `gpu`: MLX-quantized target weights stay packed (uint32 plus a scale and a bias per group, in
  bf16, and `mx.quantized_matmul`), unquantized weights, activations, attention K/V and the drafter
  in bf16. A 4-bit Qwen3.5-9B then holds ~5 GiB instead of ~36 GiB of float32, and MLX's CUDA
  quantized matmuls run their tensor-core kernels, which take bf16 (or fp16) inputs.
In both: the GatedDeltaNet conv inputs and recurrent state are float32 (the recurrence decays and
accumulates over the whole prompt), a prompt chunk's sdpa scores are float32 (MLX's own choice,
measured on CPU and CUDA) and the sampler gets float32 logits; a decode window's tiled attention
runs in the activation dtype.

The planner prices a mode from these same objects (planner.py), so a plan for `gpu` is a plan for
what this engine holds in that mode. The mode follows MLX's default device unless asked for: tests
run the `gpu` mode on the CPU at tiny shapes (`Settings(backend="gpu")`, `serve --backend gpu`,
`plan --check --backend gpu`).
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from dataclasses import dataclass

import mlx.core as mx

STATE_BYTES = 4  # GatedDeltaNet recurrent state and rows: float32 in both modes (its conv inputs: activations)
SCORE_BYTES = 4  # a prompt chunk's sdpa scores: float32 with bf16 inputs too (measured on CPU and an H200)
LOGIT_BYTES = 4  # the logits rows handed to the sampler
FLOAT32_TENSORS = ("A_log",)  # kept float32 in both modes, as mlx-lm keeps them (the GatedDeltaNet's decay rates)
# How large a CUDA graph MLX hands the device: operations and MB of inputs a graph. MLX's own sm_90 limits (100, 1,000)
# commit a graph every 100 operations or ~1 GB of weights read, and its host waits once 10 committed graphs are
# unfinished, so it runs under half a 9B drafted round (~2,500 operations) ahead of the device. With these, on an
# H200 (docs/profiles/round-split-h200-40.txt): the 9B's drafted round 15.92 / 15.62 ms (code / chat) against
# 20.40 / 17.17 at MLX's limits, plain 10.83 / 10.09 against 10.25 / 11.38. Graphs change timings, never bits.
CUDA_GRAPH_LIMITS = {"MLX_MAX_OPS_PER_BUFFER": "400", "MLX_MAX_MB_PER_BUFFER": "100000"}


@dataclass(frozen=True)
class Backend:
    """Bytes per element of what the engine holds in one mode, and the dtypes behind them."""

    name: str
    act_bytes: int  # activations, attention K/V, unquantized weights, float drafter weights
    dequantizes: bool  # target weights are dequantized to act_bytes at load (the cpu mode)

    @property
    def dtype(self) -> mx.Dtype:
        return {4: mx.float32, 2: mx.bfloat16}[self.act_bytes]

    @property
    def scale_bytes(self) -> int:
        """A kept-packed group's scale and bias, each: held in the activation dtype."""
        return self.act_bytes

    @property
    def score_bytes(self) -> int:
        return SCORE_BYTES

    def weight_bytes(self, shape: tuple[int, ...], quant: dict[str, int] | None, name: str = "") -> int:
        """Bytes one tensor takes once loaded: float, or packed bits plus a scale and bias per group."""
        n = math.prod(shape)
        if quant and not self.dequantizes and quantizable(shape, quant["group_size"]):
            return n * quant["bits"] // 8 + 2 * self.scale_bytes * (n // quant["group_size"])
        return n * (4 if name.endswith(FLOAT32_TENSORS) else self.act_bytes)


def quantizable(shape: tuple[int, ...], group_size: int) -> bool:
    """Whether mlx-lm's quantization packs a tensor of this shape: a Linear's or Embedding's matrix
    whose input width is whole groups (conv1d's (C, K, 1) weight and 1-D tensors stay float)."""
    return len(shape) == 2 and shape[-1] % group_size == 0


CPU = Backend("cpu", act_bytes=4, dequantizes=True)
GPU = Backend("gpu", act_bytes=2, dequantizes=False)
BACKENDS = {b.name: b for b in (CPU, GPU)}


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU here."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


def size_cuda_graphs(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set MLX's CUDA graph limits to CUDA_GRAPH_LIMITS where the environment does not name them, on a CUDA
    device; returns the limits now in the environment ({} off CUDA). MLX reads them once, when it makes its first
    stream's command encoder (mlx/backend/cuda/device.cpp), so this must run before the process's first GPU work:
    the Engine calls it first thing. A value the environment already holds wins (an A/B at MLX's limits sets them)."""
    if not on_cuda():
        return {}
    environ = os.environ if environ is None else environ
    for name, value in CUDA_GRAPH_LIMITS.items():
        environ.setdefault(name, value)
    return {name: environ[name] for name in CUDA_GRAPH_LIMITS}


def device_backend() -> Backend:
    """The mode for MLX's default device: `gpu` on a GPU (CUDA or Metal), `cpu` otherwise."""
    return GPU if mx.default_device().type == mx.DeviceType.gpu else CPU


def resolve(name: str | None) -> Backend:
    """A mode by name ('cpu', 'gpu'), or the default device's for None or 'auto'."""
    if name in (None, "auto"):
        return device_backend()
    if name not in BACKENDS:
        raise ValueError(f"backend is {name!r}, expected auto, {' or '.join(BACKENDS)}")
    return BACKENDS[name]
