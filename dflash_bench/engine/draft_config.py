"""The drafter's shape, read from a DFlash or DFlash2 config.json.

Both kinds are qwen3-style bodies whose DFlash fields sit in `dflash_config`: the target layers they
tap, the block size and the mask token. DFlash2 adds the grouped dynamic conv around each sublayer
and the candidate selector. Parsing checks the file on its own terms (types, sizes, layer kinds);
whether it fits a target and whether the engine runs it are `preload`'s questions.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_bench.engine.errors import BadDraftConfig

ARCHITECTURES = {"DFlashDraftModel": "DFlash", "DFlash2DraftModel": "DFlash2"}
LAYER_TYPES = ("sliding_attention", "full_attention")
QUANT_BITS = (2, 3, 4, 5, 6, 8)  # what mx.dequantize unpacks


@dataclass(frozen=True)
class DraftConfig:
    variant: str  # "DFlash" (v1) or "DFlash2"
    taps: tuple[int, ...]
    block_size: int
    mask_token_id: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_types: tuple[str, ...]
    causal: tuple[bool, ...]
    sliding_window: int | None = None
    is_causal: bool | None = None  # the explicit key, None when the file has none
    num_target_layers: int | None = None
    tie_word_embeddings: bool = False
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    quantization: tuple[int, int] | None = None  # (group_size, bits) of weights stored MLX affine-quantized
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def kind(self) -> str:
        """The name the server and receipts use: "DFlash" or "DFlash2"."""
        return self.variant

    @property
    def is_dflash2(self) -> bool:
        return self.variant == "DFlash2"


def _field(cfg: dict[str, Any], key: str, where: str, kind: type = int, positive: bool = True) -> Any:
    """One required field of `kind`; bools are not ints here, floats are finite, and sizes must be positive."""
    if key not in cfg:
        raise BadDraftConfig(f"drafter config.json has no {where}{key}")
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadDraftConfig(f"drafter config.json {where}{key} is {value!r}, expected {kind.__name__}")
    if kind is float and not math.isfinite(value):  # json reads NaN and Infinity as floats
        raise BadDraftConfig(f"drafter config.json {where}{key} is {value!r}, expected a finite number")
    if positive and value <= 0:
        raise BadDraftConfig(f"drafter config.json {where}{key} is {value!r}, expected a positive number")
    return value


def _optional(cfg: dict[str, Any], key: str, where: str, kind: type, default: Any) -> Any:
    if cfg.get(key) is None:
        return default
    return _field(cfg, key, where, kind)


def _flag(cfg: dict[str, Any], key: str) -> bool:
    """A true/false field, false when absent (`bool("false")` would be True)."""
    value = cfg.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadDraftConfig(f"drafter config.json {key} is {value!r}, expected true or false")
    return value


def _variant(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures")
    if not isinstance(archs, list):
        raise BadDraftConfig(f"drafter config.json architectures is {archs!r}, expected a list")
    found = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
    if len(found) != 1:
        raise BadDraftConfig(
            f"drafter config.json architectures is {archs!r}, expected one of {', '.join(ARCHITECTURES)}"
        )
    return found[0]


def _taps(dflash: dict[str, Any]) -> tuple[int, ...]:
    taps = dflash.get("target_layer_ids")
    if not isinstance(taps, list) or not taps:
        raise BadDraftConfig(f"drafter config.json dflash_config.target_layer_ids is {taps!r}, expected a list of layer ids")
    for tap in taps:
        if isinstance(tap, bool) or not isinstance(tap, int) or tap < 0:
            raise BadDraftConfig(
                f"drafter config.json dflash_config.target_layer_ids holds {tap!r}, expected layer ids >= 0"
            )
    return tuple(taps)


def _layer_kinds(cfg: dict[str, Any], num_layers: int) -> tuple[tuple[str, ...], int | None]:
    types = cfg.get("layer_types")
    if types is None:
        types = ["full_attention"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        count = len(types) if isinstance(types, list) else types
        raise BadDraftConfig(f"drafter config.json layer_types has {count!r} entries, num_hidden_layers is {num_layers}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES}, key=str)
    if unknown:
        raise BadDraftConfig(f"drafter config.json layer_types holds {unknown}, expected {' or '.join(LAYER_TYPES)}")
    window = None
    if "sliding_attention" in types:
        window = _field(cfg, "sliding_window", "")
    return tuple(types), window


def _causality(cfg: dict[str, Any], layer_types: tuple[str, ...]) -> tuple[bool | None, tuple[bool, ...]]:
    """Per-layer causality inside the block.

    An explicit `is_causal` applies to every layer; without it a sliding layer is causal inside the
    block and a full layer bidirectional (how the published v1 drafters were trained).
    """
    if "is_causal" in cfg:
        flag = cfg["is_causal"]
        if not isinstance(flag, bool):
            raise BadDraftConfig(f"drafter config.json is_causal is {flag!r}, expected true or false")
        return flag, (flag,) * len(layer_types)
    return None, tuple(kind == "sliding_attention" for kind in layer_types)


def _quantization(cfg: dict[str, Any]) -> tuple[int, int] | None:
    """The `quantization` block mlx-lm writes beside weights stored affine-quantized (the loader
    dequantizes them; the block says how they were packed, and the header must agree)."""
    q = cfg.get("quantization")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise BadDraftConfig(f"drafter config.json quantization is {q!r}, expected an object")
    if q.get("mode", "affine") != "affine":
        raise BadDraftConfig(f"drafter config.json quantization.mode is {q['mode']!r}, expected 'affine'")
    group_size, bits = _field(q, "group_size", "quantization."), _field(q, "bits", "quantization.")
    if bits not in QUANT_BITS:
        raise BadDraftConfig(f"drafter config.json quantization.bits is {bits}, expected one of {QUANT_BITS}")
    return group_size, bits


def parse_draft_config(cfg: dict[str, Any]) -> DraftConfig:
    """Parse a drafter config.json dict, or raise BadDraftConfig naming the field."""
    if not isinstance(cfg, dict):
        raise BadDraftConfig("drafter config.json is not a JSON object")
    variant = _variant(cfg)
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        raise BadDraftConfig(f"drafter config.json dflash_config is {dflash!r}, expected an object")
    d = "dflash_config."
    hidden = _field(cfg, "hidden_size", "")
    heads = _field(cfg, "num_attention_heads", "")
    num_layers = _field(cfg, "num_hidden_layers", "")
    vocab = _field(cfg, "vocab_size", "")
    mask = _field(dflash, "mask_token_id", d, positive=False)
    if not 0 <= mask < vocab:
        raise BadDraftConfig(f"drafter config.json {d}mask_token_id is {mask}, outside the vocab of {vocab}")
    layer_types, window = _layer_kinds(cfg, num_layers)
    is_causal, causal = _causality(cfg, layer_types)
    rope = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else None)
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not 0 < rope_theta < math.inf:
        raise BadDraftConfig(f"drafter config.json rope_theta is {rope_theta!r}, expected a positive number")
    softcap = dflash.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
    if softcap is not None:
        softcap = _field({"final_logit_softcapping": softcap}, "final_logit_softcapping", "", float)
    dflash2: dict[str, int | None] = dict.fromkeys(
        ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    )
    if variant == "DFlash2":
        # Values are checked against what the engine runs in preload (NotStockDFlash2), not here.
        dflash2 = {key: _field(dflash, key, d, positive=False) for key in dflash2}
    return DraftConfig(
        variant=variant,
        taps=_taps(dflash),
        block_size=_field(dflash, "block_size", d),
        mask_token_id=mask,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_optional(cfg, "num_key_value_heads", "", int, heads),
        head_dim=_optional(cfg, "head_dim", "", int, hidden // heads),
        intermediate_size=_field(cfg, "intermediate_size", ""),
        vocab_size=vocab,
        rms_norm_eps=_optional(cfg, "rms_norm_eps", "", float, 1e-6),
        rope_theta=float(rope_theta),
        layer_types=layer_types,
        causal=causal,
        sliding_window=window,
        is_causal=is_causal,
        num_target_layers=_optional(cfg, "num_target_layers", "", int, None),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings"),
        output_multiplier=_optional(dflash, "output_multiplier", d, float, 1.0),
        final_logit_softcapping=softcap,
        quantization=_quantization(cfg),
        raw=cfg,
        **dflash2,
    )


def read_draft_config(drafter_dir: str | Path) -> DraftConfig:
    """Parse `drafter_dir/config.json`; reads nothing else in the folder."""
    path = Path(drafter_dir)
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text()
    except OSError as err:
        raise BadDraftConfig(f"drafter config.json cannot be read at {path}: {err.strerror or err}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise BadDraftConfig(f"drafter config.json at {path} is not JSON: {err.msg} at line {err.lineno}") from None
    return parse_draft_config(cfg)
