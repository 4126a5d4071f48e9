"""MLX affine quantization of checkpoint tensors: read a packed matrix's group size and bits from its
shapes, dequantize it to float32, or pack a float checkpoint's matrices the way a drafter is stored.

mlx-lm's layout: a matrix's `.weight` is uint32 (32 / bits codes a word) beside `.scales` and
`.biases`, one pair a group of `group_size` input columns; only affine quantization is read.
"""

from __future__ import annotations

import mlx.core as mx

from dflash_bench.engine.draft_config import QUANT_BITS
from dflash_bench.engine.errors import CheckpointError


def dequantize(
    key: str, w: mx.array, scales: mx.array, biases: mx.array | None, in_dim: int, hint: tuple[int, int] | None
) -> mx.array:
    """Affine-dequantize a packed uint32 tensor to float32 (its group size and bits: `quantization`)."""
    group_size, bits = quantization(key, w, scales, biases, in_dim, hint)
    return mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)


def quantize_packed(weights: dict[str, mx.array], group_size: int, bits: int) -> dict[str, mx.array]:
    """The inverse of `dequantize_packed`, as a drafter is stored: every matrix (a 2-D `.weight`) packed by
    `mx.quantize` beside float16 scales and biases (bf16 would add up to half a step of error at 8
    bits); the rest passes through, DFlash2's bare codebooks included (validate.py reads a packed
    tensor only under a `.weight` name)."""
    out = dict(weights)
    for name in [k for k, v in weights.items() if v.ndim == 2 and k.endswith(".weight")]:
        module = name.removesuffix(".weight")
        packed, scales, biases = mx.quantize(weights[name].astype(mx.float32), group_size=group_size, bits=bits)
        out |= {name: packed, f"{module}.scales": scales.astype(mx.float16), f"{module}.biases": biases.astype(mx.float16)}
    return out


def dequantize_packed(weights: dict[str, mx.array], group_size: int, bits: int) -> dict[str, mx.array]:
    """A checkpoint's tensors with every packed matrix (mlx-lm's `.weight` uint32 beside `.scales` and
    `.biases`) dequantized to float32 in place of the three; what is not packed passes through."""
    out = dict(weights)
    for name in [k for k in weights if k.endswith(".scales")]:
        module = name.removesuffix(".scales")
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = dequantize(
            f"{module}.weight", w, out.pop(name), out.pop(f"{module}.biases", None), w.shape[-1] * 32 // bits,
            (group_size, bits),
        )
    return out


def quantization(
    key: str, w: mx.array, scales: mx.array, biases: mx.array | None, in_dim: int, hint: tuple[int, int] | None
) -> tuple[int, int]:
    """(group size, bits) of a packed uint32 tensor, from the packed shapes and the config's input
    width (they must agree with the config's own numbers); only affine quantization is read."""
    if biases is None:
        raise CheckpointError(f"tensor {key!r}: quantized without biases; only affine quantization is supported")
    bits, rest = divmod(w.shape[-1] * 32, in_dim)
    groups = scales.shape[-1]
    if rest or in_dim % groups or bits not in QUANT_BITS:
        raise CheckpointError(
            f"tensor {key!r}: packed shape {tuple(w.shape)} with scales {tuple(scales.shape)} "
            f"does not dequantize to {in_dim} columns"
        )
    group_size = in_dim // groups
    if hint is not None and hint != (group_size, bits):
        raise CheckpointError(
            f"tensor {key!r}: quantized with group_size {group_size} and {bits} bits, "
            f"config.json says group_size {hint[0]} and {hint[1]} bits"
        )
    return group_size, bits
