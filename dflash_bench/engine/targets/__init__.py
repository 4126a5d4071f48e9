"""Target models: one family per module, all with the same segment-batched forward."""

from __future__ import annotations

from dflash_bench.engine.target_config import TargetConfig
from dflash_bench.engine.targets.base import Segment, SegmentOut, Target


def build_target(config: TargetConfig, weights: dict) -> Target:
    """The model for a loaded checkpoint (weights in canonical names, float32)."""
    if config.family in ("llama", "qwen3"):
        from dflash_bench.engine.targets.dense import DenseTarget

        return DenseTarget(config, weights)
    if config.family == "qwen3_5":
        from dflash_bench.engine.targets.qwen3_5 import HybridTarget

        return HybridTarget(config, weights)
    raise ValueError(f"no engine model for family {config.family!r}")


__all__ = ["Segment", "SegmentOut", "Target", "build_target"]
