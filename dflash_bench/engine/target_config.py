"""The target model's shape, read from a Hugging Face config.json (or GGUF metadata).

One typed record for the three families the engine runs: `llama`, `qwen3` (dense, q/k norms) and
`qwen3_5` (hybrid: GatedDeltaNet linear-attention layers and gated full-attention layers, its text
model nested in `text_config`). The planner, the pre-load checks and the models all read this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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


def _need(cfg: dict[str, Any], key: str, kind: type | tuple[type, ...] = int) -> Any:
    if key not in cfg:
        raise BadTargetConfig(f"config.json has no {key!r}")
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadTargetConfig(f"config.json {key!r} is {value!r}, expected {getattr(kind, '__name__', kind)}")
    if isinstance(value, int) and value <= 0:
        raise BadTargetConfig(f"config.json {key!r} is {value}, expected a positive number")
    return value


def family_of(cfg: dict[str, Any]) -> str:
    """The engine family of a config.json (`model_type`), or BadTargetConfig."""
    model_type = cfg.get("model_type")
    if model_type in ("qwen3_5", "qwen3_5_text"):
        return "qwen3_5"
    if model_type in ("llama", "qwen3"):
        return model_type
    raise BadTargetConfig(f"config.json model_type is {model_type!r}, expected one of {', '.join(FAMILIES)}")


def parse_target_config(cfg: dict[str, Any], name: str = "") -> TargetConfig:
    """Parse a target config.json (the text config of a qwen3_5 is read from `text_config`)."""
    if not isinstance(cfg, dict):
        raise BadTargetConfig("config.json is not a JSON object")
    family = family_of(cfg)
    text = cfg.get("text_config", cfg) if family == "qwen3_5" else cfg
    if not isinstance(text, dict):
        raise BadTargetConfig("config.json text_config is not an object")
    layers = _need(text, "num_hidden_layers")
    hidden = _need(text, "hidden_size")
    heads = _need(text, "num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    head_dim = text.get("head_dim") or hidden // heads
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    rope_theta = float(text.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise BadTargetConfig(f"config.json rope scaling {rope_type!r} is not supported, the engine runs plain RoPE ('default')")
    layer_types: tuple[str, ...]
    linear = None
    if family == "qwen3_5":
        layer_types = tuple(text.get("layer_types") or ())
        if not layer_types:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = tuple(
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
            )
        linear = LinearAttention(
            num_key_heads=_need(text, "linear_num_key_heads"),
            num_value_heads=_need(text, "linear_num_value_heads"),
            key_head_dim=_need(text, "linear_key_head_dim"),
            value_head_dim=_need(text, "linear_value_head_dim"),
            conv_kernel=_need(text, "linear_conv_kernel_dim"),
        )
    else:
        layer_types = ("full_attention",) * layers
    if len(layer_types) != layers:
        raise BadTargetConfig(f"config.json layer_types has {len(layer_types)} entries, num_hidden_layers is {layers}")
    bad = set(layer_types) - {"full_attention", "linear_attention"}
    if bad:
        raise BadTargetConfig(f"config.json layer_types holds {sorted(bad)}, expected full_attention or linear_attention")
    eos = text.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    quant = cfg.get("quantization") or cfg.get("quantization_config")
    return TargetConfig(
        family=family,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=_need(text, "intermediate_size"),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=_need(text, "vocab_size"),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(tie),
        layer_types=layer_types,
        max_position_embeddings=int(text.get("max_position_embeddings", 8192)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
        attn_output_gate=bool(text.get("attn_output_gate", family == "qwen3_5")),
        linear=linear,
        eos_token_ids=eos_ids,
        name=name,
        dtype=str(text.get("dtype") or text.get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16"),
        quantization={"bits": int(quant["bits"]), "group_size": int(quant["group_size"])} if quant else None,
        raw=cfg,
    )
