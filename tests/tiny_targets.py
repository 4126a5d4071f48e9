"""Tiny random targets for the engine's tests, with mlx-lm's own model on the same weights.

Two sizes per family: `small` (hidden 64) and `smol` (SmolLM2-135M's hidden 576 and intermediate
1536), so both of `tiles.row_tile`'s regimes run: products of at most 64^3 multiply-adds in 8-row
tiles, larger ones in 16-row tiles. The weights come from mlx-lm's `Model` (its initialisers), with
every norm weight and `dt_bias` perturbed away from its constant start so they matter.
"""

from __future__ import annotations

import dflash_bench  # noqa: F401  (OpenBLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama, qwen3, qwen3_5

from dflash_bench.engine.target_config import parse_target_config
from dflash_bench.engine.targets import Target, build_target

FAMILIES = ("llama", "qwen3", "qwen3_5")
VOCAB = 512

SIZES = {
    # hidden, intermediate, heads, kv heads, head dim, linear (key heads, value heads, key dim, value dim)
    "small": dict(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, linear=(2, 4, 16, 16)),
    "smol": dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, linear=(2, 4, 64, 64)),
}


def config_dict(family: str, size: str = "small", layers: int = 4, tied: bool = False) -> dict:
    """A config.json for a tiny target (qwen3_5: one full-attention layer every `min(layers, 4)`)."""
    s = SIZES[size]
    text = {
        "model_type": family,
        "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": layers,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": s["head_dim"],
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tied,
        "rope_theta": 10000.0 if family != "qwen3" else 1000000.0,
    }
    if family != "qwen3_5":
        return text
    hk, hv, dk, dv = s["linear"]
    text.pop("rope_theta")
    text.update(
        model_type="qwen3_5_text",
        full_attention_interval=min(layers, 4),
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=4,
        attn_output_gate=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    )
    return {"model_type": "qwen3_5", "tie_word_embeddings": tied, "text_config": text}


def reference_model(cfg: dict, seed: int = 0) -> nn.Module:
    """mlx-lm's model for `cfg`, float32, random weights (norms and dt_bias perturbed)."""
    module = {"llama": llama, "qwen3": qwen3, "qwen3_5": qwen3_5}[cfg["model_type"]]
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    params = dict(tree_flatten(model.parameters()))
    for name, value in params.items():
        if name.endswith("norm.weight") or name.endswith("dt_bias"):
            params[name] = value + 0.2 * mx.random.normal(value.shape)
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def canonical_weights(model: nn.Module) -> dict[str, mx.array]:
    """mlx-lm's (sanitized) parameter names minus the `language_model.` / `model.` prefixes."""
    out = {}
    for name, value in tree_flatten(model.parameters()):
        for prefix in ("language_model.", "model."):
            name = name.removeprefix(prefix)
        out[name] = value
    return out


def hf_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Canonical names (`canonical_weights`) as a Hugging Face llama/qwen3 checkpoint spells them on disk."""
    return {(k if k.startswith("lm_head") else f"model.{k}"): v for k, v in weights.items()}


def tiny_target(family: str, size: str = "small", layers: int = 4, tied: bool = False, seed: int = 0) -> tuple[Target, nn.Module]:
    """The engine's target and mlx-lm's model, on the same random weights."""
    cfg = config_dict(family, size, layers, tied)
    model = reference_model(cfg, seed)
    return build_target(parse_target_config(cfg), canonical_weights(model)), model
