"""The target model's shape, read from a Hugging Face config.json (or GGUF metadata).

One typed record for the three families the engine runs: `llama`, `qwen3` (dense, q/k norms) and
`qwen3_5` (hybrid: GatedDeltaNet linear-attention layers and gated full-attention layers, its text
model nested in `text_config`). The planner, the pre-load checks and the models all read this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dflash_bench.engine.draft_config import QUANT_BITS
from dflash_bench.engine.errors import BadTargetConfig

FAMILIES = ("llama", "qwen3", "qwen3_5")


@dataclass(frozen=True)
class LinearAttention:
    """GatedDeltaNet dimensions of a qwen3_5 target."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class TargetConfig:
    family: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    linear: LinearAttention | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    dtype: str = "bfloat16"
    quantization: dict[str, int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_5")

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @property
    def rope_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class _Fields:
    """Typed reads of one config object, each refusal naming the file and the field.

    JSON gives strings, bools, NaN and Infinity wherever a number is expected, and Python's own
    conversions accept them silently (`bool("false")` is True, which drops an untied lm_head), so
    every value the engine uses is read here with its type and range checked.
    """

    def __init__(self, cfg: dict[str, Any], where: str = "", source: str = "config.json"):
        self.cfg, self.where, self.source = cfg, where, source

    def refuse(self, key: str, value: Any, expected: str) -> BadTargetConfig:
        return BadTargetConfig(f"{self.source} {self.where}{key} is {value!r}, expected {expected}")

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def integer(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """An integer >= `minimum` (bools are not integers here); required when `default` is None."""
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise BadTargetConfig(f"{self.source} has no {self.where}{key}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.refuse(key, value, "an integer")
        if value < minimum:
            raise self.refuse(key, value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: float, maximum: float = math.inf) -> float:
        """A finite number in (0, maximum]; integers are accepted as numbers."""
        value = self.cfg.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.refuse(key, value, "a finite number")
        if not 0 < value <= maximum:
            raise self.refuse(key, value, f"a number in (0, {maximum:g}]")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.refuse(key, value, "true or false")
        return value

    def text(self, key: str) -> str | None:
        value = self.cfg.get(key)
        if value is not None and not isinstance(value, str):
            raise self.refuse(key, value, "a string")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        value = self.cfg.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.refuse(key, value, "an object")
        return value

    def token_ids(self, key: str) -> tuple[int, ...] | None:
        """A token id or a list of them (None when absent)."""
        value = self.cfg.get(key)
        if value is None:
            return None
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise self.refuse(key, value, "a token id or a list of token ids")
        return tuple(ids)


def family_of(cfg: dict[str, Any]) -> str:
    """The engine family of a config.json (`model_type`), or BadTargetConfig."""
    model_type = cfg.get("model_type")
    if model_type in ("qwen3_5", "qwen3_5_text"):
        return "qwen3_5"
    if model_type in ("llama", "qwen3"):
        return model_type
    raise BadTargetConfig(f"config.json model_type is {model_type!r}, expected one of {', '.join(FAMILIES)}")


def _quantization(cfg: dict[str, Any], source: str) -> dict[str, int] | None:
    """mlx-lm's `quantization` block (or HF's `quantization_config`): bits and group size, checked
    with every per-module override in it, since the loader unpacks by them (checkpoint.py)."""
    key = "quantization" if cfg.get("quantization") is not None else "quantization_config"
    quant = _Fields(cfg, source=source).mapping(key)
    if not quant:
        return None
    blocks = {f"{key}.": quant} | {f"{key}.{name}.": v for name, v in quant.items() if isinstance(v, dict)}
    for where, block in blocks.items():
        fields = _Fields(block, where, source)
        bits = fields.integer("bits")
        if bits not in QUANT_BITS:
            raise fields.refuse("bits", bits, f"one of {', '.join(map(str, QUANT_BITS))}")
        fields.integer("group_size")
    return {"bits": quant["bits"], "group_size": quant["group_size"]}


def parse_target_config(cfg: dict[str, Any], name: str = "", source: str = "config.json") -> TargetConfig:
    """Parse a target config.json (the text config of a qwen3_5 is read from `text_config`); `source`
    names the file in refusals (a GGUF's metadata goes through here too)."""
    if not isinstance(cfg, dict):
        raise BadTargetConfig(f"{source} is not a JSON object")
    family = family_of(cfg)
    top = _Fields(cfg, source=source)
    text = top.mapping("text_config") if family == "qwen3_5" and "text_config" in cfg else cfg
    t = _Fields(text, "text_config." if text is not cfg else "", source)
    layers = t.integer("num_hidden_layers")
    hidden = t.integer("hidden_size")
    heads = t.integer("num_attention_heads")
    kv_heads = t.integer("num_key_value_heads", heads)
    if heads % kv_heads:
        raise t.refuse("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads {heads}")
    head_dim = t.integer("head_dim", hidden // heads)
    rope = t.mapping("rope_parameters") if t.has("rope_parameters") else t.mapping("rope_scaling")
    r = _Fields(rope, t.where + ("rope_parameters." if t.has("rope_parameters") else "rope_scaling."), source)
    rope_theta = t.number("rope_theta", r.number("rope_theta", 10000.0))
    rope_type = r.text("rope_type") or r.text("type") or "default"
    if rope_type != "default":
        raise BadTargetConfig(f"{source} rope scaling {rope_type!r} is not supported, the engine runs plain RoPE ('default')")
    linear = None
    if family == "qwen3_5":
        types = text.get("layer_types")
        if types is None:
            interval = t.integer("full_attention_interval", 4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        linear = LinearAttention(
            num_key_heads=t.integer("linear_num_key_heads"),
            num_value_heads=t.integer("linear_num_value_heads"),
            key_head_dim=t.integer("linear_key_head_dim"),
            value_head_dim=t.integer("linear_value_head_dim"),
            conv_kernel=t.integer("linear_conv_kernel_dim"),
        )
    else:
        types = ["full_attention"] * layers
    if not isinstance(types, list) or len(types) != layers:
        raise t.refuse("layer_types", types, f"a list of {layers} layer kinds (num_hidden_layers)")
    bad = sorted({kind for kind in types if kind not in ("full_attention", "linear_attention")}, key=repr)
    if bad:
        raise BadTargetConfig(f"{source} {t.where}layer_types holds {bad}, expected full_attention or linear_attention")
    eos = t.token_ids("eos_token_id") if t.has("eos_token_id") else top.token_ids("eos_token_id")
    tie = top.flag("tie_word_embeddings", t.flag("tie_word_embeddings", False))
    partial = r.number("partial_rotary_factor", t.number("partial_rotary_factor", 1.0, maximum=1.0), maximum=1.0)
    dtype = t.text("dtype") or t.text("torch_dtype") or top.text("torch_dtype") or "bfloat16"
    return TargetConfig(
        family=family,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=t.integer("intermediate_size"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=t.integer("vocab_size"),
        rms_norm_eps=t.number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        tie_word_embeddings=tie,
        layer_types=tuple(types),
        max_position_embeddings=t.integer("max_position_embeddings", 8192),
        partial_rotary_factor=partial,
        attn_output_gate=t.flag("attn_output_gate", family == "qwen3_5"),
        linear=linear,
        eos_token_ids=eos or (),
        name=name,
        dtype=dtype,
        quantization=_quantization(cfg, source),
        raw=cfg,
    )
