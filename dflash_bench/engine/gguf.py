"""GGUF files: a metadata reader, llama.cpp's tensor names, its Q/K row order, and a small writer.

The pre-load checks and the planner need a GGUF's hyperparameters and tensor list without touching
its tensor data, so `read_header` parses only the header (magic, version, typed key/value pairs,
tensor infos). Tensor data is read by `mx.load`, which hands quantized blocks back as MLX affine
triples (weight, scales, biases). `write_llama_gguf` goes the other way for tests and fixtures,
through `mx.save_gguf`, applying llama.cpp's Q/K permutation so the file looks like a converted one.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from dflash_bench.engine.errors import CheckpointError

MAGIC = b"GGUF"

# GGUF value types: (struct format, size) for the scalar ones; 8 is a string, 9 an array.
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9

# ggml tensor types by id, for reports (the engine never decodes blocks itself: mx.load does).
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
    12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 28: "F64", 30: "BF16",
}


# (elements a block, bytes a block) of the float and quantized ggml types, from ggml's type traits: a
# tensor's byte size follows from its shape, so a header's byte ranges can be checked against the file
# (validate.py). Integer types (I8..I64) are left out: no weight the engine reads is one.
GGML_BLOCKS = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 36),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    28: (1, 8), 30: (1, 2),
}
DEFAULT_ALIGNMENT = 32  # where `general.alignment` is absent


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy) order: ggml's dims reversed
    ggml_type: int
    offset: int = 0  # of its data, from the start of the data section

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, f"type{self.ggml_type}")


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_start: int = 0  # the data section's offset in the file (aligned after the tensor infos)
    file_size: int = 0


class _Reader:
    """Reads GGUF values at a moving offset of a memory-mapped file (only header pages are touched)."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf = buf
        self.path = path
        self.pos = 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise CheckpointError(f"{self.path}: GGUF header ends early (truncated file?)")
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def scalar(self, kind: int) -> Any:
        fmt, size = _SCALARS[kind]
        if self.pos + size > len(self.buf):
            raise CheckpointError(f"{self.path}: GGUF header ends early (truncated file?)")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        return self.take(self.scalar(10)).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == 6:  # float32: keep its shortest decimal (1e-05, not 9.999999747378752e-06)
            return float(str(np.float32(self.scalar(6))))
        if kind in _SCALARS:
            return self.scalar(kind)
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar(4), self.scalar(10)
            if item_kind in _SCALARS:
                fmt, size = _SCALARS[item_kind]
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(count * size)))
            return [self.value(item_kind) for _ in range(count)]
        raise CheckpointError(f"{self.path}: GGUF value type {kind} is unknown")


def read_header(path: str | Path) -> Header:
    """Parse a GGUF file's metadata and tensor infos; tensor data is not read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot map the file ({e})") from None
    with buf:
        r = _Reader(buf, path)
        if r.take(4) != MAGIC:
            raise CheckpointError(f"{path}: not a GGUF file (magic is not 'GGUF')")
        version = r.scalar(4)
        if version not in (2, 3):
            raise CheckpointError(f"{path}: GGUF version is {version}, expected 2 or 3")
        n_tensors, n_kv = r.scalar(10), r.scalar(10)
        metadata = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.scalar(4))
        tensors = {}
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.scalar(10) for _ in range(r.scalar(4))]
            ggml_type = r.scalar(4)
            if name in tensors:
                raise CheckpointError(f"{path}: GGUF tensor {name!r} is listed twice")
            tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, r.scalar(10))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise CheckpointError(f"{path}: GGUF general.alignment is {alignment!r}, expected a positive integer")
        data_start = -(-r.pos // alignment) * alignment
        return Header(version, metadata, tensors, data_start, len(buf))


# llama.cpp's llama tensor names -> canonical names (see docs/helpers-brief.md).
_GLOBAL_NAMES = {
    "token_embd": "embed_tokens",
    "output_norm": "norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)$")


def canonical_module(gguf_module: str) -> str | None:
    """`blk.3.attn_q` -> `layers.3.self_attn.q_proj`; None for a name the engine does not know."""
    if gguf_module in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_module]
    m = _LAYER_RE.match(gguf_module)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def gguf_module(canonical: str) -> str:
    """The inverse of `canonical_module` (for writers)."""
    for g, c in _GLOBAL_NAMES.items():
        if canonical == c:
            return g
    m = re.match(r"layers\.(\d+)\.(.+)$", canonical)
    if m:
        for g, c in _LAYER_NAMES.items():
            if m.group(2) == c:
                return f"blk.{m.group(1)}.{g}"
    raise ValueError(f"no GGUF name for {canonical!r}")


def permute_qk(w: mx.array, n_head: int) -> mx.array:
    """llama.cpp's convert_hf_to_gguf row order for q_proj/k_proj: each head's rotate-half pairs
    (i, i + d/2) become adjacent rows (i.e. interleaved RoPE)."""
    out_dim = w.shape[0]
    return w.reshape(n_head, 2, out_dim // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: mx.array, n_head: int) -> mx.array:
    """Undo `permute_qk`, giving back the Hugging Face row order that rotate-half RoPE expects."""
    out_dim = w.shape[0]
    return w.reshape(n_head, out_dim // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _u32(x: int) -> mx.array:
    return mx.array(x, dtype=mx.uint32)


def llama_metadata(
    *,
    num_layers: int,
    hidden_size: int,
    intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    vocab_size: int,
    rms_norm_eps: float,
    rope_theta: float,
    context_length: int,
    name: str,
) -> dict[str, Any]:
    """The `general.*` and `llama.*` keys llama.cpp writes for a llama model."""
    return {
        "general.architecture": "llama",
        "general.name": name,
        "llama.block_count": _u32(num_layers),
        "llama.embedding_length": _u32(hidden_size),
        "llama.feed_forward_length": _u32(intermediate_size),
        "llama.attention.head_count": _u32(num_heads),
        "llama.attention.head_count_kv": _u32(num_kv_heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(rms_norm_eps, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(rope_theta, dtype=mx.float32),
        "llama.rope.dimension_count": _u32(hidden_size // num_heads),
        "llama.context_length": _u32(context_length),
        "llama.vocab_size": _u32(vocab_size),
    }


def tokenizer_metadata(
    tokens: list[str],
    merges: list[str],
    token_types: list[int],
    *,
    bos_id: int,
    eos_id: int,
    chat_template: str | None = None,
    pre: str = "smollm",
) -> dict[str, Any]:
    """`tokenizer.ggml.*` keys for a byte-level BPE ("gpt2") vocabulary, as llama.cpp writes them."""
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.token_type": mx.array(token_types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": _u32(bos_id),
        "tokenizer.ggml.eos_token_id": _u32(eos_id),
        "tokenizer.ggml.add_bos_token": mx.array(False),
    }
    if chat_template is not None:
        meta["tokenizer.chat_template"] = chat_template
    return meta


def write_llama_gguf(
    path: str | Path,
    weights: dict[str, mx.array],
    metadata: dict[str, Any],
    *,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Write canonical llama weights as a GGUF file the way llama.cpp's converter lays them out:
    llama.cpp names, Q/K rows permuted for interleaved RoPE, float tensors as given."""
    arrays = {}
    for name, w in weights.items():
        module, _, leaf = name.rpartition(".")
        if module.endswith("self_attn.q_proj"):
            w = permute_qk(w, num_heads)
        elif module.endswith("self_attn.k_proj"):
            w = permute_qk(w, num_kv_heads)
        arrays[f"{gguf_module(module)}.{leaf}"] = w
    mx.save_gguf(str(path), arrays, metadata)
