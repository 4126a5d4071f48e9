"""The DFlash v1 and DFlash2 drafters as training runs them: many blocks of one sequence in one pass.

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

DFlash2 (dflash_bench/engine/drafters/dflash2.py) adds a grouped dynamic causal conv on each
sublayer's input and output (block-local: blocks are contiguous rows here, so a shift along the
block axis is the engine's shift) and the candidate selector, whose walk `drafts` replays.

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
from dflash_bench.engine.topk import top_k_indices

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
    variant: str = "dflash"  # or "dflash2": the fields below then shape its convs and selector
    conv_kernel: int = 2
    conv_group: int = 64
    selector_rank: int = 8
    selector_top_k: int = 16

    def kinds(self) -> list[str]:
        return list(self.layer_types) or ["sliding_attention"] * (self.layers - 1) + ["full_attention"]


def drafter_config(shape: Shape, target: TargetConfig, eps: float = 1e-6) -> dict:
    """config.json in the z-lab layout (keys as z-lab/Qwen3.5-4B-DFlash and z-lab's Qwen3.8-27B-DFlash2
    publish them)."""
    config = {
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
    if shape.variant == "dflash2":  # the published DFlash2 head: no auto_map, is_causal false
        del config["auto_map"]
        config["architectures"] = ["DFlash2DraftModel"]
        config["is_causal"] = False
        config["dflash_config"] |= {"conv_kernel_size": shape.conv_kernel, "conv_group_size": shape.conv_group,
                                    "selector_rank": shape.selector_rank, "selector_top_k": shape.selector_top_k}
    return config


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


class Conv(nn.Module):
    """DFlash2's grouped dynamic causal conv around one sublayer: `prepare` convolves the sublayer's
    normed input (base kernel 0 plus the first half of the dynamic kernel projected from that input)
    and returns the second half, with which `convolve` then mixes the sublayer's output (base kernel 1).
    It starts as the identity (tap 0 one, the rest zero, the projection zero)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.kernel, self.group = c.conv_kernel_size, c.conv_group_size
        self.groups = c.hidden_size // self.group
        base = mx.zeros((2, self.kernel, c.hidden_size))
        base[:, 0] = 1.0
        self.base_kernel = base
        self.kernel_projection = nn.Linear(c.hidden_size, self.groups * 2 * self.kernel, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def prepare(self, x: mx.array, block: int) -> tuple[mx.array, mx.array]:
        s, rows, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(s, rows // block, block, 2, self.kernel, self.groups)
        return self.convolve(x, dynamic[:, :, :, 0], 0, block), dynamic[:, :, :, 1]

    def convolve(self, x: mx.array, dynamic: mx.array, which: int, block: int) -> mx.array:
        """Row t of each block: sum over taps o of (base[which][o] + dynamic[t][o]) * row t - o of
        the same block (zero before its first row)."""
        s, rows, hidden = x.shape
        values = x.reshape(s, rows // block, block, self.groups, self.group)
        out = mx.zeros_like(values)
        for o in range(self.kernel):
            shifted = values if o == 0 else mx.pad(values[:, :, :-o], [(0, 0), (0, 0), (o, 0), (0, 0), (0, 0)])
            out = out + self.base_kernel[which, o].reshape(self.groups, self.group) * shifted
            out = out + dynamic[:, :, :, o, :, None] * shifted
        return out.reshape(s, rows, hidden)


class CandidateSelector(nn.Module):
    """DFlash2's pairwise term: predecessor codebook row of the previous token, times the position's
    projected hidden row, times each candidate's successor codebook row, summed over the rank. It
    starts at zero (the hidden projection zero; the codebooks random, so its gradient is not)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.top_k = c.selector_top_k
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        self.hidden_projection.weight = mx.zeros_like(self.hidden_projection.weight)
        self.predecessor_codebook = mx.zeros((c.vocab_size, c.selector_rank))
        self.successor_codebook = mx.zeros((c.vocab_size, c.selector_rank))

    def pairwise(self, hidden: mx.array, previous: mx.array, candidates: mx.array) -> mx.array:
        """hidden (..., hidden), previous (...), candidates (..., k) -> (..., k), in float32."""
        projected = self.hidden_projection(hidden).astype(mx.float32)
        before = self.predecessor_codebook[previous].astype(mx.float32)
        return ((before * projected)[..., None, :] * self.successor_codebook[candidates].astype(mx.float32)).sum(-1)


class Layer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if c.is_dflash2:
            self.attention_conv = Conv(c)
            self.mlp_conv = Conv(c)

    def sublayer(self, conv: str, x: mx.array, block: int, fn) -> mx.array:
        """fn over the normed rows x, between the layer's two convs when it has them (DFlash2)."""
        if "attention_conv" not in self:
            return fn(x)
        c: Conv = self[conv]
        x, dynamic = c.prepare(x, block)
        return c.convolve(fn(x), dynamic, 1, block)


class Drafter(nn.Module):
    """Trainable tensors only; the embedding and lm_head are the target's, passed in."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.taps) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [Layer(c) for _ in range(c.num_layers)]
        if c.is_dflash2:
            self.candidate_selector = CandidateSelector(c)

    def init(self, seed: int, std: float = 0.02) -> None:
        """Projections ~N(0, std) (the published initializer_range), norms at one; DFlash2's convs
        as the identity and its pairwise term zero (codebooks ~N(0, 1)), so a fresh DFlash2 body
        drafts what a v1 body with the same weights drafts."""
        params = dict(tree_flatten(self.parameters()))
        keys = mx.random.split(mx.random.key(seed), len(params))
        for key, (name, w) in zip(keys, sorted(params.items())):
            if name.endswith("codebook"):
                params[name] = mx.random.normal(w.shape, key=key)
            elif name.endswith("kernel_projection.weight") or name.endswith("hidden_projection.weight"):
                params[name] = mx.zeros_like(w)
            elif w.ndim == 2:
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

            def attend(x: mx.array) -> mx.array:
                q = block_heads(a.q_proj(x), heads, a.q_norm)
                k = block_heads(a.k_proj(x), kv, a.k_norm)
                v = block_heads(a.v_proj(x), kv, None)
                kc = self._rope(a.k_norm(a.k_proj(ctx).reshape(s, t, kv, d)).transpose(0, 2, 1, 3), 0)
                vc = a.v_proj(ctx).reshape(s, t, kv, d).transpose(0, 2, 1, 3)
                o = mx.fast.scaled_dot_product_attention(
                    q, mx.concatenate([kc, k], axis=2), mx.concatenate([vc, v], axis=2),
                    scale=d**-0.5, mask=masks[(kind, causal)],
                )
                return a.o_proj(o.transpose(0, 2, 1, 3).reshape(s, n * b, heads * d))

            h = h + layer.sublayer("attention_conv", layer.input_layernorm(h), b, attend)
            h = h + layer.sublayer("mlp_conv", layer.post_attention_layernorm(h), b, layer.mlp)
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


    def drafts(self, hidden: mx.array, logits: mx.array, first: mx.array) -> mx.array:
        """Greedy drafts of rows 1..B-1 (S, N, B-1): v1 each row's argmax; DFlash2 the selector's walk
        over each row's top-k from the block's first token (`first` (S, N)), as the engine walks it."""
        if not self.config.is_dflash2:
            return mx.argmax(logits, axis=-1)
        sel: CandidateSelector = self.candidate_selector
        candidates = top_k_indices(logits, sel.top_k)
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        previous, picks = first, []
        for j in range(logits.shape[2]):
            scores = unary[:, :, j] + sel.pairwise(hidden[:, :, j + 1], previous, candidates[:, :, j])
            previous = mx.take_along_axis(candidates[:, :, j], mx.argmax(scores, axis=-1)[..., None], axis=-1)[..., 0]
            picks.append(previous)
        return mx.stack(picks, axis=-1)


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


def stored_body(source: Path) -> dict[str, mx.array]:
    """Every tensor of an export but its selector's, as stored (what `export(..., body=)` ships)."""
    return {k: v for k, v in mx.load(str(Path(source) / "model.safetensors")).items() if not k.startswith(SELECTOR)}


def export(model: Drafter, config: dict, out_dir: Path, body: dict[str, mx.array] | None = None) -> Path:
    """config.json + model.safetensors in the z-lab layout, what `load_drafter` reads: bf16, or with
    config.json's `quantization` block every matrix packed (`quantize.quantize_packed`). With `body`
    (`stored_body` of the drafter whose selector alone was trained), every tensor but the selector's
    is that one's as stored, so the body ships bit for bit as it was."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = dict(tree_flatten(model.parameters()))
    if quant := config.get("quantization"):  # packed from the float32 weights
        weights = quantize_packed(weights, quant["group_size"], quant["bits"])
    weights = {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in weights.items()}
    if body is not None:
        if set(body) != {k for k in weights if not k.startswith(SELECTOR)}:
            raise ValueError("the stored body's tensors are not this drafter's")
        weights |= body
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


SELECTOR = "candidate_selector."  # the selector's tensors' prefix (the published names)
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
    if differs == {"dflash_config"} and _rank_alone_differs(config, theirs):
        model.load_weights([(k, v) for k, v in weights.items() if not k.startswith(SELECTOR)], strict=False)
        return (f"the body of {source} as it is; a fresh rank-{config['dflash_config']['selector_rank']} selector "
                f"(its pairwise term zero) in place of its rank-{theirs['dflash_config']['selector_rank']} one")
    if model.config.is_dflash2 and "DFlashDraftModel" in theirs.get("architectures", []):
        return _v1_into_dflash2(model, config, theirs, weights, source)
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


def _rank_alone_differs(config: dict, theirs: dict) -> bool:
    """Whether two DFlash2 configs differ in the selector's rank and in nothing else."""
    ours_d, theirs_d = dict(config["dflash_config"]), dict(theirs["dflash_config"])
    if "selector_rank" not in ours_d or "selector_rank" not in theirs_d:
        return False
    del ours_d["selector_rank"], theirs_d["selector_rank"]
    return ours_d == theirs_d


DFLASH2_OWN = {"architectures", "auto_map", "is_causal", "dflash_config", "layer_types", "sliding_window",
               "quantization", "transformers_version", "pad_token_id"}


def _v1_into_dflash2(model: Drafter, config: dict, theirs: dict, weights: dict[str, mx.array], source: Path) -> str:
    """A v1 drafter's body into a DFlash2 one of the same dimensions: its tensors keep their names,
    the convs stay the identity and the pairwise term zero (Drafter.init), so the new drafter starts
    from the v1 drafter's function, changed only where DFlash2's layout differs (every layer sliding
    and bidirectional inside the block)."""
    differs = {k for k in set(config) | set(theirs) if config.get(k) != theirs.get(k)} - DFLASH2_OWN
    ours_d, theirs_d = config["dflash_config"], theirs["dflash_config"]
    differs |= {f"dflash_config.{k}" for k in ("block_size", "mask_token_id", "target_layer_ids")
                if ours_d.get(k) != theirs_d.get(k)}
    if differs:
        raise ValueError(f"--init {source}: a v1 drafter becomes a DFlash2 one only at the same dimensions; "
                         f"it differs in {sorted(differs)}")
    model.load_weights(list(weights.items()), strict=False)
    return (f"DFlash2 from the v1 drafter {source}: its {len(weights)} tensors as they are; convs the identity, "
            f"the selector's pairwise term zero; every layer sliding ({config['sliding_window']}) and bidirectional")
