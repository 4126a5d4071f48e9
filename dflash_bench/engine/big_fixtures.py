"""Big random checkpoints in the published layouts: Qwen3.5-9B at 4 bits and its DFlash v1 drafter.

Why: the planner's receipt on a GPU needs a target of the 9B's shapes in the MLX-community 4-bit
layout and a drafter of the 9B drafter's shapes, and neither may be downloaded. The small fixtures
(fixtures.py) quantize float weights through mlx-lm, which at 9B would hold tens of GB; here every
tensor is generated block by block straight into its file (random uint32 words for the packed
weights, constant scales and biases), so writing takes seconds and a few hundred MB of host memory.

Layouts: the target is what `mlx_lm.convert(quantize=True)` saves from Qwen/Qwen3.5-9B (names under
`language_model.`, conv1d as (C, K, 1), norms already holding 1 + w, the embedding and the untied
lm_head quantized too, A_log float32, the rest bf16; config.json with `quantization` and
`quantization_config` blocks), sharded with an index; the drafter is z-lab's DFlash v1 layout in
bf16. The configs follow the published Qwen3.5-4B pair (tests/data/published) with the 9B numbers
(../shared/fixtures/published/SOURCES.md). The `tiny` preset runs the same code at small sizes.

Values: a packed weight's 4-bit codes are uniform on 0..15 (random words) with one scale s and bias
-7.5 s a tensor, so it dequantizes to mean 0 and standard deviation 4.61 s = fan_in^-0.5 (0.016 at
hidden 4096); a float matrix's bf16 values have a random sign and a random mantissa under one
exponent (magnitudes uniform on [m, 2m), deviation 1.53 m, m the power of two nearest fan_in^-0.5 /
1.53), drawn as bits because converting floats to bf16 in numpy runs at a tenth of the speed; norms
are 1, dt_bias 1, A_log log U(1, 16), as the small fixtures draw them. A forward then stays finite
and picks varied tokens.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from dflash_bench.engine.fixtures import IM_END, MASK, write_tokenizer

GROUP_SIZE, BITS = 64, 4
CODE_STD = math.sqrt((16**2 - 1) / 12)  # standard deviation of a code uniform on 0..15
BLOCK_BYTES = 64 << 20  # generated and written this much at a time
SHARD_BYTES = 2 << 30


@dataclass(frozen=True)
class Preset:
    """The shapes of one target and its drafter (the config.json numbers)."""

    layers: int = 32  # [linear, linear, linear, full] x 8
    hidden: int = 4096
    intermediate: int = 12288
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 256
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_head_dim: int = 128
    conv_kernel: int = 4
    vocab: int = 248320
    eos: int = 248046  # <|im_end|>
    pad: int = 248044
    mask: int = 248077  # the Qwen3.5 DFlash drafters' mask token
    mrope_section: tuple[int, int, int] = (11, 11, 10)  # sums to head_dim x 0.25 / 2
    draft_layers: int = 6  # 5 sliding + 1 full, as the 4B drafter
    draft_heads: int = 32
    draft_kv_heads: int = 8
    draft_head_dim: int = 128
    # 1,291,904,512 parameters (SOURCES.md; no embedding or lm_head) = fc 4096 x 32768 + 2 norms of
    # 4096 + 6 x (q, k, v, o: 41,943,040 + 4 norms: 8,448 + 3 x 4096 x intermediate): intermediate 12,288.
    draft_intermediate: int = 12288
    taps: tuple[int, ...] = (1, 5, 9, 13, 17, 21, 25, 29)
    block: int = 16
    window: int = 4096

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(self.layers)]


PRESETS = {
    "9b": Preset(),
    "tiny": replace(
        Preset(), layers=8, hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=64, linear_key_heads=2,
        linear_value_heads=4, linear_head_dim=32, vocab=1024, eos=IM_END, pad=IM_END, mask=MASK,
        mrope_section=(3, 3, 2), draft_layers=2, draft_heads=4, draft_kv_heads=2, draft_head_dim=32,
        draft_intermediate=256, taps=(1, 3, 5, 7), window=64,
    ),
}
KINDS = ("qwen3_5-9b-4bit", "dflash-9b")


# --- config.json ---------------------------------------------------------------------------------


def target_config(p: Preset) -> dict[str, Any]:
    """Qwen/Qwen3.5-4B's config.json keys with these shapes, untied, as mlx-lm saves it quantized."""
    quant = {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
        "eos_token_id": p.eos, "full_attention_interval": 4, "head_dim": p.head_dim, "hidden_act": "silu",
        "hidden_size": p.hidden, "initializer_range": 0.02, "intermediate_size": p.intermediate,
        "layer_types": p.layer_types, "linear_conv_kernel_dim": p.conv_kernel,
        "linear_key_head_dim": p.linear_head_dim, "linear_num_key_heads": p.linear_key_heads,
        "linear_num_value_heads": p.linear_value_heads, "linear_value_head_dim": p.linear_head_dim,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": p.heads,
        "num_hidden_layers": p.layers, "num_key_value_heads": p.kv_heads, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": p.vocab, "mamba_ssm_dtype": "float32",
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": list(p.mrope_section),
                            "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    }
    vision = {  # the 4B's vision tower (the engine reads none of it), projecting to this text width
        "deepstack_visual_indexes": [], "depth": 24, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1024,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096, "model_type": "qwen3_5",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": p.hidden, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5",
        "quantization": quant, "quantization_config": dict(quant), "text_config": text,
        "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 248057,
        "vision_config": vision, "vision_end_token_id": 248054, "vision_start_token_id": 248053,
    }


def drafter_config(p: Preset) -> dict[str, Any]:
    """z-lab/Qwen3.5-4B-DFlash's config.json keys with these shapes (5 sliding layers + 1 full)."""
    return {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "bos_token_id": None,
        "dflash_config": {"block_size": p.block, "mask_token_id": p.mask, "target_layer_ids": list(p.taps)},
        "dtype": "bfloat16", "eos_token_id": p.eos, "head_dim": p.draft_head_dim, "hidden_act": "silu",
        "hidden_size": p.hidden, "initializer_range": 0.02, "intermediate_size": p.draft_intermediate,
        "layer_types": ["sliding_attention"] * (p.draft_layers - 1) + ["full_attention"],
        "max_position_embeddings": 262144, "max_window_layers": p.draft_layers, "model_type": "qwen3",
        "num_attention_heads": p.draft_heads, "num_hidden_layers": p.draft_layers,
        "num_key_value_heads": p.draft_kv_heads, "num_target_layers": p.layers, "pad_token_id": None,
        "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
        "sliding_window": p.window, "tie_word_embeddings": True, "transformers_version": "5.7.0",
        "use_cache": True, "use_sliding_window": True, "vocab_size": p.vocab,
    }


# --- tensors -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its name, safetensors dtype, shape, and how its values are drawn."""

    name: str
    dtype: str  # "U32", "BF16" or "F32"
    shape: tuple[int, ...]
    fill: str  # "codes" (random packed words), "signed" (bf16), "const" or "log_uniform" (float32)
    value: float = 0.0  # signed: the standard deviation aimed at; const: the value

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * {"U32": 4, "BF16": 2, "F32": 4}[self.dtype]


def _quantized(name: str, out_dim: int, in_dim: int) -> list[Tensor]:
    """A 4-bit matrix: packed codes, a scale s and a bias -7.5 s per group (fan_in^-0.5 deviation)."""
    s = in_dim**-0.5 / CODE_STD
    groups = (out_dim, in_dim // GROUP_SIZE)
    return [Tensor(f"{name}.weight", "U32", (out_dim, in_dim * BITS // 32), "codes"),
            Tensor(f"{name}.scales", "BF16", groups, "const", s),
            Tensor(f"{name}.biases", "BF16", groups, "const", -7.5 * s)]


def target_tensors(p: Preset) -> list[Tensor]:
    """Every tensor of the MLX 4-bit target, in name order."""
    out: list[Tensor] = []
    q, norm = _quantized, lambda name, n: Tensor(f"{name}.weight", "BF16", (n,), "const", 1.0)  # noqa: E731
    root = "language_model.model."
    out += q(f"{root}embed_tokens", p.vocab, p.hidden) + q("language_model.lm_head", p.vocab, p.hidden)
    out.append(norm(f"{root}norm", p.hidden))
    key_dim, value_dim = p.linear_key_heads * p.linear_head_dim, p.linear_value_heads * p.linear_head_dim
    conv_dim = 2 * key_dim + value_dim
    for i, kind in enumerate(p.layer_types):
        lp = f"{root}layers.{i}."
        out += [norm(f"{lp}input_layernorm", p.hidden), norm(f"{lp}post_attention_layernorm", p.hidden)]
        for name, rows, cols in (("gate_proj", p.intermediate, p.hidden), ("up_proj", p.intermediate, p.hidden),
                                 ("down_proj", p.hidden, p.intermediate)):
            out += q(f"{lp}mlp.{name}", rows, cols)
        if kind == "linear_attention":
            la = f"{lp}linear_attn."
            out += q(f"{la}in_proj_qkv", conv_dim, p.hidden) + q(f"{la}in_proj_z", value_dim, p.hidden)
            out += q(f"{la}in_proj_b", p.linear_value_heads, p.hidden) + q(f"{la}in_proj_a", p.linear_value_heads, p.hidden)
            out += q(f"{la}out_proj", p.hidden, value_dim)
            out += [Tensor(f"{la}conv1d.weight", "BF16", (conv_dim, p.conv_kernel, 1), "signed", p.conv_kernel**-0.5),
                    Tensor(f"{la}dt_bias", "BF16", (p.linear_value_heads,), "const", 1.0),
                    Tensor(f"{la}A_log", "F32", (p.linear_value_heads,), "log_uniform"),
                    norm(f"{la}norm", p.linear_head_dim)]
        else:
            sa = f"{lp}self_attn."
            out += q(f"{sa}q_proj", 2 * p.heads * p.head_dim, p.hidden)  # queries and the output gate
            out += q(f"{sa}k_proj", p.kv_heads * p.head_dim, p.hidden) + q(f"{sa}v_proj", p.kv_heads * p.head_dim, p.hidden)
            out += q(f"{sa}o_proj", p.hidden, p.heads * p.head_dim)
            out += [norm(f"{sa}q_norm", p.head_dim), norm(f"{sa}k_norm", p.head_dim)]
    return sorted(out, key=lambda t: t.name)


def drafter_tensors(p: Preset) -> list[Tensor]:
    """The DFlash v1 drafter's 3 + 11 x layers bf16 tensors, in name order."""
    def matrix(name: str, rows: int, cols: int) -> Tensor:
        return Tensor(f"{name}.weight", "BF16", (rows, cols), "signed", cols**-0.5)

    def norm(name: str, n: int) -> Tensor:
        return Tensor(f"{name}.weight", "BF16", (n,), "const", 1.0)

    h, q, kv = p.hidden, p.draft_heads * p.draft_head_dim, p.draft_kv_heads * p.draft_head_dim
    out = [matrix("fc", h, len(p.taps) * h), norm("hidden_norm", h), norm("norm", h)]
    for i in range(p.draft_layers):
        lp = f"layers.{i}."
        out += [norm(f"{lp}input_layernorm", h), norm(f"{lp}post_attention_layernorm", h),
                matrix(f"{lp}mlp.gate_proj", p.draft_intermediate, h), matrix(f"{lp}mlp.up_proj", p.draft_intermediate, h),
                matrix(f"{lp}mlp.down_proj", h, p.draft_intermediate), matrix(f"{lp}self_attn.q_proj", q, h),
                matrix(f"{lp}self_attn.k_proj", kv, h), matrix(f"{lp}self_attn.v_proj", kv, h),
                matrix(f"{lp}self_attn.o_proj", h, q), norm(f"{lp}self_attn.q_norm", p.draft_head_dim),
                norm(f"{lp}self_attn.k_norm", p.draft_head_dim)]
    return sorted(out, key=lambda t: t.name)


# --- writing -------------------------------------------------------------------------------------


def _bf16(x: float) -> int:
    """A float's bf16 bit pattern (rounded to nearest)."""
    return int((np.array([x], dtype=np.float32).view(np.uint32)[0] + 0x8000) >> 16)


def _raw(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """`nbytes` random bytes (the bit generator's raw words: ten times faster than `rng.bytes`)."""
    return rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]


def _blocks(t: Tensor, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The tensor's values, BLOCK_BYTES at a time (so a 1 GB embedding never sits in memory whole)."""
    size = {"U32": 4, "BF16": 2, "F32": 4}[t.dtype]
    total = math.prod(t.shape)
    step = max(1, BLOCK_BYTES // size)
    exponent = 127 + round(math.log2(t.value / math.sqrt(7 / 3))) if t.fill == "signed" else 0
    for start in range(0, total, step):
        n = min(step, total - start)
        if t.fill == "codes":
            yield _raw(rng, n * size)
        elif t.fill == "signed":  # sign and 7 mantissa bits random, the exponent fixed
            bits = _raw(rng, 2 * n).view(np.uint16)
            bits &= 0x807F
            bits |= exponent << 7
            yield bits
        elif t.fill == "const":
            yield np.full(n, _bf16(t.value), dtype=np.uint16)
        else:  # log_uniform, float32
            yield np.log(rng.uniform(1.0, 16.0, n)).astype(np.float32)


def write_safetensors(out_dir: Path, tensors: list[Tensor], seed: int, namespace: str,
                      shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Write `tensors` into shards of at most `shard_bytes` (one file when they fit) and, for several,
    model.safetensors.index.json; each tensor's values come from its own stream keyed by (seed,
    namespace, name), so the same seed writes the same bytes."""
    shards: list[list[Tensor]] = [[]]
    for t in tensors:
        if shards[-1] and sum(x.nbytes for x in shards[-1]) + t.nbytes > shard_bytes:
            shards.append([])
        shards[-1].append(t)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "mlx"}}, 0
        for t in shard:
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out_dir / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for t in shard:
                rng = np.random.default_rng([seed, zlib.crc32(f"{namespace}:{t.name}".encode())])
                for block in _blocks(t, rng):
                    f.write(block)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                 "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [out_dir / n for n in names]


def write_big(kind: str, out_dir: Path, preset: str = "9b", seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the `kind` checkpoint (KINDS) of `preset` (PRESETS) into `out_dir`; return the folder."""
    p = PRESETS[preset]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "qwen3_5-9b-4bit":
        config, tensors = target_config(p), target_tensors(p)
        write_tokenizer(out_dir, "qwen3_5")  # the small fixture's BPE: plan --check feeds token ids
    elif kind == "dflash-9b":
        config, tensors = drafter_config(p), drafter_tensors(p)
    else:
        raise ValueError(f"kind is {kind!r}, expected one of {', '.join(KINDS)}")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(out_dir, tensors, seed, f"{kind}-{preset}", shard_bytes)
    return out_dir
