"""Tiny random checkpoints in the real published layouts, so tests and users run everything without weights.

Every kind is written the way its real counterpart is published: Hugging Face safetensors (bf16) for
`llama`, `qwen3` and `qwen3_5`; the file llama.cpp's converter writes (`--outtype f16`) for
`llama-gguf`; what mlx-lm's `convert(quantize=True)` saves for `qwen3_5-4bit`; the z-lab config.json
and tensor names for the `dflash` and `dflash2` drafters. The loaders therefore read fixtures through
the same code paths as real weights. The same seed gives byte-identical files.

Weights are random but scaled so a forward gives varied argmax tokens: projections ~N(0, 1/fan_in),
embeddings ~N(0, 1) (0.1 when the head is tied, or the head would copy its input), norms near one
(qwen3_5's HF norms are stored as offsets from one, as published).
Values below 2**-17 are flushed to zero so every bf16 weight is exactly representable in f16: the
GGUF fixture then holds exactly the HF fixture's weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import dflash_bench  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dflash_bench.engine import gguf
from dflash_bench.engine.checkpoint import quantize_packed
from dflash_bench.engine.errors import DFlashBenchError

TARGET_KINDS = ("llama", "qwen3", "qwen3_5")
FIXTURE_KINDS = ("llama", "llama-gguf", "qwen3", "qwen3_5", "qwen3_5-4bit", "dflash", "dflash2")

VOCAB_SIZE = 512
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|mask|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
ENDOFTEXT, IM_START, IM_END, MASK, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QUANT_GROUP_SIZE, QUANT_BITS = 32, 4
EMBED_STD_TIED = 0.1

# The fixed text the fixture tokenizer's merges are learned from (English prose and Python).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a block of tokens, and
the target model verifies the whole block in one forward pass. When the draft matches, the reply
advances by several tokens in a single round; when it does not, the target's own token is kept and
the drafter starts again from there. The output is the same as plain decoding, token for token.
Every request carries a prompt, a number of tokens to generate, a temperature and a seed. The server
answers with the generated text, the token ids, and how many tokens each round accepted. Memory is
planned before a request is admitted: the weights, the attention cache of every stream, the state
of the linear attention layers, and the buffers of the drafter all have to fit.
Once upon a time there was a small model that wanted to write stories. It read books about the sea,
the mountains and the stars, and every night it wrote a new sentence. Some of its sentences were
short. Others were long and wandered from one idea to the next, like a river that cannot decide
where it wants to go. The people who read them smiled, because the model was learning.
def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value

if __name__ == "__main__":
    counter = Counter()
    for index in range(10):
        print(index, fibonacci(index), counter.increment())
import json
from pathlib import Path

def load_config(path: Path) -> dict:
    with open(path / "config.json") as handle:
        return json.load(handle)

result = {"hidden_size": 64, "num_layers": 6, "vocab_size": 512, "tokens": [1, 2, 3]}
for key, value in sorted(result.items()):
    print(f"{key} = {value}")
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: What color is the sky on a clear day? Answer: The sky is blue on a clear day.
"""


def build_tokenizer() -> Tokenizer:
    """A SmolLM2-style byte-level BPE (specials first, digits split, GPT-2 regex), learned deterministically."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer)
    return tokenizer


@dataclass(frozen=True)
class TargetDims:
    """The shape of one tiny target family (what its config.json says)."""

    family: str
    layer_types: tuple[str, ...]
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    eps: float = 1e-6
    tie: bool = False
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_head_dim: int = 16
    conv_kernel: int = 4

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


# Layer counts let both drafters fit: DFlash2 needs five distinct tap layers.
TARGET_DIMS = {
    "llama": TargetDims("llama", ("full_attention",) * 6, eps=1e-5),
    "qwen3": TargetDims("qwen3", ("full_attention",) * 6, head_dim=32, rope_theta=1e6),
    "qwen3_5": TargetDims(
        "qwen3_5", ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",),
        head_dim=32, rope_theta=1e7, tie=True,
    ),
}


class _Weights(dict):
    """Random bf16 tensors by name, each drawn from its own stream keyed by (seed, namespace, name):
    drawing order does not matter, and two kinds never share values by accident."""

    def __init__(self, seed: int, namespace: str) -> None:
        super().__init__()
        self.seed, self.namespace = seed, namespace

    def rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(f"{self.namespace}:{name}".encode())])

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        values = (mean + std * self.rng(name).standard_normal(shape)).astype(np.float32)
        values[np.abs(values) < 2.0**-17] = 0.0  # exactly representable in f16 too
        self[name] = mx.array(values).astype(mx.bfloat16)

    def linear(self, module: str, out_dim: int, in_dim: int) -> None:
        self.normal(f"{module}.weight", (out_dim, in_dim), in_dim**-0.5)

    def norm(self, module: str, dim: int, offset: bool = False) -> None:
        self.normal(f"{module}.weight", (dim,), 0.1, mean=0.0 if offset else 1.0)

    def attention(self, p: str, d: TargetDims, q_rows: int, qk_norm: bool, offset: bool = False) -> None:
        self.linear(f"{p}q_proj", q_rows, d.hidden)
        self.linear(f"{p}k_proj", d.kv_heads * d.head_dim, d.hidden)
        self.linear(f"{p}v_proj", d.kv_heads * d.head_dim, d.hidden)
        self.linear(f"{p}o_proj", d.hidden, d.heads * d.head_dim)
        if qk_norm:
            self.norm(f"{p}q_norm", d.head_dim, offset)
            self.norm(f"{p}k_norm", d.head_dim, offset)

    def mlp(self, p: str, hidden: int, intermediate: int) -> None:
        self.linear(f"{p}gate_proj", intermediate, hidden)
        self.linear(f"{p}up_proj", intermediate, hidden)
        self.linear(f"{p}down_proj", hidden, intermediate)

    def gated_delta_net(self, p: str, d: TargetDims) -> None:
        """HF layout: conv1d weight (conv_dim, 1, kernel); the gated norm is a weight, not an offset."""
        key_dim, value_dim = d.linear_key_heads * d.linear_head_dim, d.linear_value_heads * d.linear_head_dim
        conv_dim = 2 * key_dim + value_dim
        for module, rows in (("in_proj_qkv", conv_dim), ("in_proj_z", value_dim),
                             ("in_proj_b", d.linear_value_heads), ("in_proj_a", d.linear_value_heads)):
            self.linear(f"{p}{module}", rows, d.hidden)
        self.linear(f"{p}out_proj", d.hidden, value_dim)
        self.normal(f"{p}conv1d.weight", (conv_dim, 1, d.conv_kernel), d.conv_kernel**-0.5)
        self.normal(f"{p}dt_bias", (d.linear_value_heads,), 0.1, mean=1.0)
        a = self.rng(f"{p}A_log").uniform(1.0, 16.0, d.linear_value_heads)
        self[f"{p}A_log"] = mx.array(np.log(a).astype(np.float32)).astype(mx.bfloat16)
        self.norm(f"{p}norm", d.linear_head_dim)

    def sorted(self) -> dict[str, mx.array]:
        return dict(sorted(self.items()))


def target_weights(family: str, seed: int = 0) -> dict[str, mx.array]:
    """The HF checkpoint's tensors (names as published, bf16) of the tiny target of `family`."""
    d = TARGET_DIMS[family]
    w = _Weights(seed, family)
    root = "model.language_model." if family == "qwen3_5" else "model."
    offset = family == "qwen3_5"  # HF qwen3_5 RMSNorms hold (weight - 1)
    q_rows = d.heads * d.head_dim * (2 if family == "qwen3_5" else 1)  # qwen3_5: query and output gate
    # A tied head scores tokens by their embeddings: small ones keep the residual from copying the input.
    w.normal(f"{root}embed_tokens.weight", (VOCAB_SIZE, d.hidden), EMBED_STD_TIED if d.tie else 1.0)
    for i, kind in enumerate(d.layer_types):
        p = f"{root}layers.{i}."
        w.norm(f"{p}input_layernorm", d.hidden, offset)
        w.norm(f"{p}post_attention_layernorm", d.hidden, offset)
        if kind == "linear_attention":
            w.gated_delta_net(f"{p}linear_attn.", d)
        else:
            w.attention(f"{p}self_attn.", d, q_rows, qk_norm=family != "llama", offset=offset)
        w.mlp(f"{p}mlp.", d.hidden, d.intermediate)
    w.norm(f"{root}norm", d.hidden, offset)
    if not d.tie:
        w.linear("lm_head", VOCAB_SIZE, d.hidden)
    if family == "qwen3_5":
        # Beside the text model the published checkpoint carries the MTP head and the vision tower
        # (here only its patch embedding); loaders skip both, as mlx-lm's sanitize does.
        w.linear("mtp.fc", d.hidden, 2 * d.hidden)
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm",
                     "layers.0.input_layernorm", "layers.0.post_attention_layernorm"):
            w.norm(f"mtp.{norm}", d.hidden, offset=True)
        w.attention("mtp.layers.0.self_attn.", d, q_rows, qk_norm=True, offset=True)
        w.mlp("mtp.layers.0.mlp.", d.hidden, d.intermediate)
        w.normal("model.visual.patch_embed.proj.weight", (32, 3, 2, 2, 2), 0.1)
        w.normal("model.visual.patch_embed.proj.bias", (32,), 0.1)
    return w.sorted()


def target_config(family: str) -> dict[str, Any]:
    """The HF config.json of the tiny target of `family`, with the keys its published counterpart has."""
    d = TARGET_DIMS[family]
    if family == "llama":  # SmolLM2-style (transformers 4.x keys: rope_theta, torch_dtype)
        return {
            "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": IM_START, "eos_token_id": IM_END, "head_dim": d.head_dim, "hidden_act": "silu",
            "hidden_size": d.hidden, "initializer_range": 0.02, "intermediate_size": d.intermediate,
            "max_position_embeddings": 4096, "mlp_bias": False, "model_type": "llama",
            "num_attention_heads": d.heads, "num_hidden_layers": d.num_layers, "num_key_value_heads": d.kv_heads,
            "pad_token_id": IM_END, "pretraining_tp": 1, "rms_norm_eps": d.eps, "rope_scaling": None,
            "rope_theta": d.rope_theta, "tie_word_embeddings": d.tie, "torch_dtype": "bfloat16",
            "transformers_version": "4.42.3", "use_cache": True, "vocab_size": VOCAB_SIZE,
        }
    if family == "qwen3":
        return {
            "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": ENDOFTEXT, "eos_token_id": IM_END, "head_dim": d.head_dim, "hidden_act": "silu",
            "hidden_size": d.hidden, "initializer_range": 0.02, "intermediate_size": d.intermediate,
            "max_position_embeddings": 4096, "max_window_layers": d.num_layers, "model_type": "qwen3",
            "num_attention_heads": d.heads, "num_hidden_layers": d.num_layers, "num_key_value_heads": d.kv_heads,
            "rms_norm_eps": d.eps, "rope_scaling": None, "rope_theta": d.rope_theta, "sliding_window": None,
            "tie_word_embeddings": d.tie, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
            "use_cache": True, "use_sliding_window": False, "vocab_size": VOCAB_SIZE,
        }
    text_config = {  # qwen3_5: shaped like Qwen/Qwen3.5-4B's config.json
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
        "eos_token_id": IM_END, "full_attention_interval": 4, "head_dim": d.head_dim, "hidden_act": "silu",
        "hidden_size": d.hidden, "initializer_range": 0.02, "intermediate_size": d.intermediate,
        "layer_types": list(d.layer_types), "linear_conv_kernel_dim": d.conv_kernel,
        "linear_key_head_dim": d.linear_head_dim, "linear_num_key_heads": d.linear_key_heads,
        "linear_num_value_heads": d.linear_value_heads, "linear_value_head_dim": d.linear_head_dim,
        "max_position_embeddings": 4096, "mlp_only_layers": [], "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": d.heads,
        "num_hidden_layers": d.num_layers, "num_key_value_heads": d.kv_heads, "rms_norm_eps": d.eps,
        "tie_word_embeddings": d.tie, "use_cache": True, "vocab_size": VOCAB_SIZE, "mamba_ssm_dtype": "float32",
        "rope_parameters": {  # 0.25 x head_dim 32 = 8 rotary dims: mrope sections sum to 4
            "mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "default",
            "rope_theta": d.rope_theta, "partial_rotary_factor": 0.25,
        },
    }
    vision_config = {
        "deepstack_visual_indexes": [], "depth": 1, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 64, "model_type": "qwen3_5",
        "num_heads": 2, "num_position_embeddings": 64, "out_hidden_size": d.hidden, "patch_size": 2,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "image_token_id": IMAGE_PAD, "model_type": "qwen3_5",
        "text_config": text_config, "tie_word_embeddings": d.tie, "transformers_version": "4.57.0.dev0",
        "video_token_id": VIDEO_PAD, "vision_config": vision_config, "vision_end_token_id": VISION_END,
        "vision_start_token_id": VISION_START,
    }


def tokenizer_config(family: str) -> dict[str, Any]:
    """tokenizer_config.json: the specials, their roles and the ChatML chat template."""
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    bos = SPECIAL_TOKENS[IM_START] if family == "llama" else None
    pad = SPECIAL_TOKENS[IM_END] if family == "llama" else SPECIAL_TOKENS[ENDOFTEXT]
    return {
        "add_prefix_space": False, "added_tokens_decoder": added, "bos_token": bos, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "eos_token": SPECIAL_TOKENS[IM_END], "model_max_length": 4096,
        "pad_token": pad, "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_tokenizer(out_dir: Path, family: str) -> None:
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(family))


def _write_hf_target(out_dir: Path, family: str, seed: int) -> None:
    _write_json(out_dir / "config.json", target_config(family))
    mx.save_safetensors(str(out_dir / "model.safetensors"), target_weights(family, seed), metadata={"format": "pt"})
    write_tokenizer(out_dir, family)


def _write_qwen3_5_4bit(out_dir: Path, seed: int) -> None:
    """What `mlx_lm.convert(..., quantize=True, q_group_size=32)` saves from the qwen3_5 fixture: the model
    built from the sanitized HF weights, quantized, saved under mlx-lm's names with its config."""
    from mlx_lm.models import qwen3_5
    from mlx_lm.utils import quantize_model, save_config, save_model

    config = target_config("qwen3_5")
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    model.load_weights(list(model.sanitize(target_weights("qwen3_5", seed)).items()))
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a bits-per-weight line
        model, config = quantize_model(model, config, QUANT_GROUP_SIZE, QUANT_BITS)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    write_tokenizer(out_dir, "qwen3_5")


def gguf_metadata() -> dict[str, Any]:
    """The general.*, llama.* and tokenizer.ggml.* keys llama.cpp's converter writes for the llama fixture."""
    d = TARGET_DIMS["llama"]
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [" ".join(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]]
    token_types = [3 if i < len(SPECIAL_TOKENS) else 1 for i in range(len(tokens))]  # 3 CONTROL, 1 NORMAL
    return (
        gguf.llama_metadata(
            num_layers=d.num_layers, hidden_size=d.hidden, intermediate_size=d.intermediate, num_heads=d.heads,
            num_kv_heads=d.kv_heads, vocab_size=VOCAB_SIZE, rms_norm_eps=d.eps, rope_theta=d.rope_theta,
            context_length=4096, name="dflash-bench llama fixture",
        )
        | gguf.tokenizer_metadata(  # pre "smollm": digits split one by one, then the GPT-2 regex
            tokens, merges, token_types, bos_id=IM_START, eos_id=IM_END, chat_template=CHAT_TEMPLATE, pre="smollm"
        )
        | {
            "general.type": "model",
            "general.file_type": mx.array(1, dtype=mx.uint32),  # LLAMA_FTYPE_MOSTLY_F16
            "general.quantization_version": mx.array(2, dtype=mx.uint32),
            "tokenizer.ggml.padding_token_id": mx.array(IM_END, dtype=mx.uint32),
        }
    )


def _write_llama_gguf(out_dir: Path, seed: int) -> Path:
    """The llama fixture as `convert_hf_to_gguf.py --outtype f16` writes it: llama.cpp names, Q and K rows
    permuted for interleaved RoPE, matrices f16 (exactly the bf16 values), 1-D tensors f32."""
    d = TARGET_DIMS["llama"]
    weights = {
        name.removeprefix("model."): w.astype(mx.float32 if w.ndim == 1 else mx.float16)
        for name, w in target_weights("llama", seed).items()
    }
    path = out_dir / "llama-fixture-F16.gguf"
    gguf.write_llama_gguf(path, weights, gguf_metadata(), num_heads=d.heads, num_kv_heads=d.kv_heads)
    return path


@dataclass(frozen=True)
class DraftDims:
    """The shape of the tiny drafters (hidden size and vocab come from the target)."""

    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    sliding_window: int = 32
    v1_block_size: int = 16
    v2_block_size: int = 8
    conv_group_size: int = 16
    conv_kernel_size: int = 2
    selector_rank: int = 16
    selector_top_k: int = 8


DRAFT_DIMS = DraftDims()


def draft_taps(kind: str, target: str) -> list[int]:
    """Tap layers inside the target: DFlash every other layer from 1, DFlash2 five spread over 1..L-1."""
    n = TARGET_DIMS[target].num_layers
    if kind == "dflash":
        return list(range(1, n, 2))
    return [1 + i * (n - 2) // 4 for i in range(5)]


def draft_config(kind: str, target: str = "llama") -> dict[str, Any]:
    """config.json of a drafter for the `target` fixture, keyed like the published z-lab configs."""
    t, d = TARGET_DIMS[target], DRAFT_DIMS
    dflash_config: dict[str, Any] = {"block_size": d.v1_block_size, "mask_token_id": MASK}
    if kind == "dflash2":
        dflash_config = {
            "block_size": d.v2_block_size, "conv_group_size": d.conv_group_size,
            "conv_kernel_size": d.conv_kernel_size, "mask_token_id": MASK, "selector_rank": d.selector_rank,
            "selector_top_k": d.selector_top_k,
        }
    dflash_config["target_layer_ids"] = draft_taps(kind, target)
    if kind == "dflash":
        head: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "bos_token_id": None,
        }
        layer_types = ["sliding_attention"] * (d.layers - 1) + ["full_attention"]
    else:
        head = {
            "architectures": ["DFlash2DraftModel"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": None, "is_causal": False,
        }
        layer_types = ["sliding_attention"] * d.layers
    return head | {
        "dflash_config": dflash_config, "dtype": "bfloat16", "eos_token_id": IM_END, "head_dim": d.head_dim,
        "hidden_act": "silu", "hidden_size": t.hidden, "initializer_range": 0.02,
        "intermediate_size": d.intermediate, "layer_types": layer_types, "max_position_embeddings": 4096,
        "max_window_layers": d.layers, "model_type": "qwen3", "num_attention_heads": d.heads,
        "num_hidden_layers": d.layers, "num_key_value_heads": d.kv_heads, "num_target_layers": t.num_layers,
        "pad_token_id": IM_END if kind == "dflash2" else None, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": t.rope_theta, "rope_type": "default"},
        "sliding_window": d.sliding_window, "tie_word_embeddings": kind == "dflash",
        "transformers_version": "5.7.0" if kind == "dflash" else "5.15.0", "use_cache": True,
        "use_sliding_window": True, "vocab_size": VOCAB_SIZE,
    }


def draft_weights(kind: str, target: str = "llama", seed: int = 0) -> dict[str, mx.array]:
    """The drafter's tensors: DFlash 3 + 11 per layer, DFlash2 6 + 15 per layer (bare codebooks)."""
    t, d = TARGET_DIMS[target], DRAFT_DIMS
    h = t.hidden
    body = TargetDims("qwen3", ("full_attention",) * d.layers, hidden=h, intermediate=d.intermediate,
                      heads=d.heads, kv_heads=d.kv_heads, head_dim=d.head_dim)
    w = _Weights(seed, f"{kind}-for-{target}")
    w.linear("fc", h, len(draft_taps(kind, target)) * h)
    w.norm("hidden_norm", h)
    w.norm("norm", h)
    for i in range(d.layers):
        p = f"layers.{i}."
        w.norm(f"{p}input_layernorm", h)
        w.norm(f"{p}post_attention_layernorm", h)
        w.attention(f"{p}self_attn.", body, d.heads * d.head_dim, qk_norm=True)
        w.mlp(f"{p}mlp.", h, d.intermediate)
        if kind == "dflash2":
            # base_kernel [2, kernel, hidden] (published [2, 2, hidden] at kernel 2); the projection makes
            # 2 x kernel taps per group of conv_group_size channels: [hidden / group x 2 x kernel, hidden].
            k = d.conv_kernel_size
            for conv in ("attention_conv", "mlp_conv"):
                w.normal(f"{p}{conv}.base_kernel", (2, k, h), k**-0.5)
                w.linear(f"{p}{conv}.kernel_projection", h // d.conv_group_size * 2 * k, h)
    if kind == "dflash2":
        w.linear("candidate_selector.hidden_projection", d.selector_rank, h)
        for book in ("predecessor_codebook", "successor_codebook"):  # bare tensors, no .weight
            w.normal(f"candidate_selector.{book}", (VOCAB_SIZE, d.selector_rank), 1.0)
    return w.sorted()


def write_random_like(drafter_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A drafter with `drafter_dir`'s config.json (a real layout) and random weights of its shapes,
    packed as its config's `quantization` says when it has one.

    What a fresh, untrained drafter for a real target looks like: the engine's speed and exactness
    can be measured with it, and its rounds keep about one token.
    """
    from dflash_bench.engine.draft_config import read_draft_config
    from dflash_bench.engine.inventory import expected_inventory

    draft = read_draft_config(drafter_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    w = _Weights(seed, f"random-like-{draft.kind}")
    for name, shape in expected_inventory(draft).items():
        if len(shape) == 1:
            w.normal(name, shape, 0.1, mean=1.0)
        else:
            w.normal(name, shape, shape[-1] ** -0.5)
    tensors = w.sorted()
    if draft.quantization is not None:  # stored packed like the original (the shipped drafter is 6-bit)
        tensors = quantize_packed(tensors, *draft.quantization)
    (out_dir / "config.json").write_bytes((Path(drafter_dir) / "config.json").read_bytes())
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(sorted(tensors.items())), metadata={"format": "pt"})
    return out_dir


def write_fixture(kind: str, out_dir: Path, seed: int = 0, target: str = "llama") -> Path:
    """Write the `kind` fixture under `out_dir`; return what a loader takes (the folder, or the .gguf file).

    `target` picks the target fixture a drafter is made for (its hidden size, vocab and layers);
    target kinds ignore it.
    """
    if kind not in FIXTURE_KINDS:
        raise DFlashBenchError(f"fixture kind is {kind!r}, expected one of {', '.join(FIXTURE_KINDS)}")
    if target not in TARGET_KINDS:
        raise DFlashBenchError(f"fixture target is {target!r}, expected one of {', '.join(TARGET_KINDS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "llama-gguf":
        return _write_llama_gguf(out_dir, seed)
    if kind == "qwen3_5-4bit":
        _write_qwen3_5_4bit(out_dir, seed)
    elif kind in TARGET_KINDS:
        _write_hf_target(out_dir, kind, seed)
    else:
        _write_json(out_dir / "config.json", draft_config(kind, target))
        mx.save_safetensors(str(out_dir / "model.safetensors"), draft_weights(kind, target, seed),
                            metadata={"format": "pt"})
    return out_dir
