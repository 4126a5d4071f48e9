"""The DFlash v1 drafter as training runs it: many blocks of one sequence in one pass.

It computes what the engine's drafter (dflash_bench/engine/drafters/dflash.py) computes, laid out
for training. There, a stream's context is the fused rows of the tokens before its last token L,
and one block `[token L, mask x (B-1)]` sits at positions L..L+B-1. Here a sequence's fused rows
are computed once and N blocks ("anchors" a_1..a_N) attend to them at once, each block seeing only
the context rows before its own anchor, so every block is exactly an engine proposal made at L = a_n:

- context rows: `hidden_norm(fc(taps))`, per layer k_norm(k_proj) and v_proj, rope at the row's position;
- block rows: the target's embedding of `[token a, mask ...]`, rope at a..a+B-1, q_norm/k_norm;
- a sliding layer sees context rows within its window of the query; a full layer sees them all;
- inside the block a layer is causal when the config says so (sliding layers, without `is_causal`);
- rows 1..B-1 -> norm -> the target's (frozen, shared) lm_head.

The parameters carry the published tensor names, so export is a rename-free save (tests/test_train_smoke.py
checks the engine reads the export and proposes what this module proposes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import dflash_bench  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_bench.engine.draft_config import DraftConfig, parse_draft_config
from dflash_bench.engine.quantize import dequantize_packed, quantize_packed
from dflash_bench.engine.target_config import TargetConfig

GROUP_SIZE = 64  # quantization group: mlx-lm's default


@dataclass(frozen=True)
class Shape:
    """The drafter's architecture: what config.json says and training needs."""

    taps: tuple[int, ...]
    block: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    window: int
    mask_token_id: int
    layer_types: tuple[str, ...] = ()  # default: all sliding but the last, which is full
    bits: int = 0  # storage: 0 for bf16, else matrices in mlx-lm's affine layout (groups of GROUP_SIZE)

    def kinds(self) -> list[str]:
        return list(self.layer_types) or ["sliding_attention"] * (self.layers - 1) + ["full_attention"]


def drafter_config(shape: Shape, target: TargetConfig, eps: float = 1e-6) -> dict:
    """config.json in the z-lab layout (keys as z-lab/Qwen3.5-4B-DFlash publishes them)."""
    return {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "bos_token_id": None,
        "dflash_config": {
            "block_size": shape.block, "mask_token_id": shape.mask_token_id, "target_layer_ids": list(shape.taps),
        },
        "dtype": "bfloat16", "eos_token_id": target.eos_token_ids[0] if target.eos_token_ids else None,
        "head_dim": shape.head_dim, "hidden_act": "silu", "hidden_size": target.hidden_size,
        "initializer_range": 0.02, "intermediate_size": shape.intermediate, "layer_types": shape.kinds(),
        "max_position_embeddings": target.max_position_embeddings, "max_window_layers": shape.layers,
        "model_type": "qwen3", "num_attention_heads": shape.heads, "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads, "num_target_layers": target.num_layers, "pad_token_id": None,
        "rms_norm_eps": eps, "rope_parameters": {"rope_theta": target.rope_theta, "rope_type": "default"},
        "sliding_window": shape.window, "tie_word_embeddings": True, "use_cache": True,
        "use_sliding_window": True, "vocab_size": target.vocab_size,
    } | ({"quantization": {"group_size": GROUP_SIZE, "bits": shape.bits}} if shape.bits else {})


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(h, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        g = self.gate_proj(x)
        return self.down_proj(mx.sigmoid(g) * g * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)


class Drafter(nn.Module):
    """Trainable tensors only; the embedding and lm_head are the target's, passed in."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.taps) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [Layer(c) for _ in range(c.num_layers)]

    def init(self, seed: int, std: float = 0.02) -> None:
        """Projections ~N(0, std) (the published initializer_range), norms at one."""
        params = dict(tree_flatten(self.parameters()))
        keys = mx.random.split(mx.random.key(seed), len(params))
        for key, (name, w) in zip(keys, sorted(params.items())):
            if w.ndim == 2:
                params[name] = std * mx.random.normal(w.shape, key=key)
        self.load_weights(list(params.items()))

    def _rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        c = self.config
        return mx.fast.rope(x, c.head_dim, traditional=False, base=c.rope_theta, scale=1.0, offset=offset)

    def __call__(self, taps: mx.array, tokens: mx.array, anchors: mx.array, embed: mx.array) -> mx.array:
        """Hidden states of every block row after the final norm: (S, N, B, hidden).

        taps (S, T, taps x hidden): the target's tap planes of each sequence; tokens (S, T);
        anchors (S, N): the position of each block's first token (its context is rows < anchor).
        """
        c = self.config
        s, t = tokens.shape
        n, b = anchors.shape[1], c.block_size
        heads, kv, d = c.num_heads, c.num_kv_heads, c.head_dim
        ctx = self.hidden_norm(self.fc(taps))
        first = mx.take_along_axis(tokens, anchors, axis=1)
        ids = mx.concatenate([first[..., None], mx.full((s, n, b - 1), c.mask_token_id, dtype=tokens.dtype)], axis=-1)
        h = embed[ids].reshape(s, n * b, -1)
        offsets = anchors.reshape(-1)
        masks = {(kind, causal): block_mask(anchors, t, b, c.sliding_window if kind == "sliding_attention" else None, causal)
                 for kind, causal in set(zip(c.layer_types, c.causal))}

        def block_heads(x: mx.array, count: int, norm: nn.RMSNorm | None) -> mx.array:
            x = x.reshape(s * n, b, count, d)
            if norm is not None:
                x = self._rope(norm(x).transpose(0, 2, 1, 3), offsets)
            else:
                x = x.transpose(0, 2, 1, 3)
            return x.reshape(s, n, count, b, d).transpose(0, 2, 1, 3, 4).reshape(s, count, n * b, d)

        for layer, kind, causal in zip(self.layers, c.layer_types, c.causal):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = block_heads(a.q_proj(x), heads, a.q_norm)
            k = block_heads(a.k_proj(x), kv, a.k_norm)
            v = block_heads(a.v_proj(x), kv, None)
            kc = self._rope(a.k_norm(a.k_proj(ctx).reshape(s, t, kv, d)).transpose(0, 2, 1, 3), 0)
            vc = a.v_proj(ctx).reshape(s, t, kv, d).transpose(0, 2, 1, 3)
            o = mx.fast.scaled_dot_product_attention(
                q, mx.concatenate([kc, k], axis=2), mx.concatenate([vc, v], axis=2),
                scale=d**-0.5, mask=masks[(kind, causal)],
            )
            h = h + a.o_proj(o.transpose(0, 2, 1, 3).reshape(s, n * b, heads * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h).reshape(s, n, b, -1)

    def logits(self, hidden: mx.array, head: mx.array) -> mx.array:
        """Draft logits of block rows 1..B-1 through the target's lm_head: (S, N, B-1, vocab)."""
        c = self.config
        out = hidden[:, :, 1:, :] @ head.T
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping:
            out = mx.tanh(out / c.final_logit_softcapping) * c.final_logit_softcapping
        return out


def block_mask(anchors: mx.array, context: int, block: int, window: int | None, causal: bool) -> mx.array:
    """(S, 1, N*B, T + N*B): block n's row j (position a_n + j) sees context rows p < a_n (within
    `window` of a_n + j when sliding) and the rows of its own block (j' <= j when causal)."""
    s, n = anchors.shape
    pos = (anchors[:, :, None] + mx.arange(block)[None, None, :]).reshape(s, n * block, 1)
    kpos = mx.arange(context)[None, None, :]
    seen_ctx = kpos < mx.repeat(anchors, block, axis=1)[:, :, None]
    if window is not None:
        seen_ctx = seen_ctx & (pos - kpos < window)
    row = mx.arange(n * block)
    same = (row[:, None] // block) == (row[None, :] // block)
    if causal:
        same = same & (row[None, :] <= row[:, None])
    seen_block = mx.broadcast_to(same[None], (s, n * block, n * block))
    return mx.concatenate([seen_ctx, seen_block], axis=-1)[:, None]


def export(model: Drafter, config: dict, out_dir: Path) -> Path:
    """config.json + model.safetensors in the z-lab layout, what `load_drafter` reads: bf16, or with
    config.json's `quantization` block every matrix packed (`quantize.quantize_packed`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = dict(tree_flatten(model.parameters()))
    if quant := config.get("quantization"):  # packed from the float32 weights
        weights = quantize_packed(weights, quant["group_size"], quant["bits"])
    weights = {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in weights.items()}
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(sorted(weights.items())), metadata={"format": "pt"})
    return out_dir


def read_weights(out_dir: Path) -> tuple[dict, dict[str, mx.array]]:
    """An export's config.json and its weights in float32 (dequantized when stored packed)."""
    config = json.loads((Path(out_dir) / "config.json").read_text())
    weights = mx.load(str(Path(out_dir) / "model.safetensors"))
    if quant := config.get("quantization"):
        weights = dequantize_packed(weights, quant["group_size"], quant["bits"])
    return config, {k: v.astype(mx.float32) for k, v in weights.items()}


def average(sources: list[Path], out_dir: Path) -> Path:
    """Export the mean of several drafters' float32 weights (one architecture, stored as they are).

    Runs continued from one ancestor (on other data, seeds or learning rates) stay close enough
    that their mean drafts at least as well as they do: checkpoint averaging, as in model soups."""
    read = [read_weights(Path(s)) for s in sources]
    config = read[0][0]
    if odd := [str(s) for s, (c, _) in zip(sources, read) if c != config]:
        raise ValueError(f"cannot average drafters of different config.json: {odd} differ from {sources[0]}")
    mean = {k: sum(w[k] for _, w in read) / len(read) for k in read[0][1]}
    model = Drafter(parse_draft_config(config))
    model.load_weights(list(mean.items()))
    return export(model, config, out_dir)


def load(out_dir: Path) -> Drafter:
    """An exported drafter back as a training model (float32), to evaluate or continue."""
    config, weights = read_weights(out_dir)
    model = Drafter(parse_draft_config(config))
    model.load_weights(list(weights.items()))
    return model


GROWABLE = {"num_hidden_layers", "layer_types", "max_window_layers", "quantization"}


def start_from(model: Drafter, config: dict, source: Path) -> str:
    """Load an exported drafter into `model` (config.json `config`): the same architecture as is; one
    with fewer layers grown function-preserving, so training resumes from what the source computes:
    its layers keep their places at both ends (the last stays last), and each inserted layer starts
    as the identity (its o_proj and down_proj zero, the rest from `model`'s init), as LLaMA Pro grows
    a model. Returns how the weights were placed, for the receipt."""
    theirs, weights = read_weights(source)
    differs = {k for k in set(config) | set(theirs) if config.get(k) != theirs.get(k)}
    if not differs - {"quantization"}:
        model.load_weights(list(weights.items()))
        return "same architecture"
    have, want = theirs["num_hidden_layers"], config["num_hidden_layers"]
    kinds, their_kinds = config["layer_types"], theirs["layer_types"]
    placed = list(range(have - 1)) + [want - 1]
    if differs - GROWABLE or have >= want or [kinds[i] for i in placed] != their_kinds:
        raise ValueError(f"--init {source}: its drafter differs in {sorted(differs)}; only growing the layer count "
                         f"with the source's layer kinds kept at both ends is supported")
    moved = {}
    for name, value in weights.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            name = f"layers.{placed[int(i)]}.{rest}"
        moved[name] = value
    for i in sorted(set(range(want)) - set(placed)):
        layer = model.layers[i]
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model.load_weights(list(moved.items()), strict=False)
    return f"grown from {have} to {want} layers: source layers -> {placed}, the others start as the identity"
