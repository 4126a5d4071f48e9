"""Target models: one family per module, all with the same segment-batched forward."""

from __future__ import annotations

import mlx.core as mx

from dflash_bench.engine.target_config import TargetConfig
from dflash_bench.engine.targets.base import Segment, SegmentOut, Target


def build_target(config: TargetConfig, weights: dict, dtype: mx.Dtype = mx.float32) -> Target:
    """The model for a loaded checkpoint (weights in canonical names; `dtype` its activations')."""
    if config.family in ("llama", "qwen3"):
        from dflash_bench.engine.targets.dense import DenseTarget

        return DenseTarget(config, weights, dtype)
    if config.family == "qwen3_5":
        from dflash_bench.engine.targets.qwen3_5 import HybridTarget

        return HybridTarget(config, weights, dtype)
    raise ValueError(f"no engine model for family {config.family!r}")


__all__ = ["Segment", "SegmentOut", "Target", "build_target"]
