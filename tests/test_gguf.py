"""GGUF: the header reader sees what llama.cpp wrote, names map both ways, Q/K order inverts."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dflash_bench.engine import gguf
from dflash_bench.engine.checkpoint import default_model_path
from dflash_bench.engine.errors import CheckpointError


def test_header_of_the_default_model_holds_llama_hyperparameters_and_tokenizer():
    header = gguf.read_header(default_model_path())
    meta = header.metadata
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert meta["llama.embedding_length"] == 576
    assert meta["llama.attention.head_count"] == 9
    assert meta["llama.attention.head_count_kv"] == 3
    assert meta["llama.attention.layer_norm_rms_epsilon"] == 1e-5  # float32 read back as its shortest decimal
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert meta["tokenizer.ggml.tokens"][2] == "<|im_end|>"
    assert len(header.tensors) == 272
    assert header.tensors["token_embd.weight"].shape == (49152, 576)
    assert header.tensors["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert header.tensors["blk.0.attn_q.weight"].type_name == "Q4_1"
    assert "output.weight" not in header.tensors  # tied embeddings


def test_header_reader_agrees_with_mx_load_on_a_written_file(tmp_path):
    path = tmp_path / "t.gguf"
    meta = {
        "general.architecture": "llama",
        "llama.block_count": mx.array(7, dtype=mx.uint32),
        "llama.rope.freq_base": mx.array(500000.0, dtype=mx.float32),
        "tokenizer.ggml.tokens": ["a", "b", "é"],
        "tokenizer.ggml.token_type": mx.array([1, 3, 1], dtype=mx.int32),
        "flag": mx.array(True),
    }
    mx.save_gguf(str(path), {"blk.0.attn_q.weight": mx.zeros((6, 4)), "output_norm.weight": mx.ones((4,))}, meta)
    header = gguf.read_header(path)
    assert header.metadata == {
        "general.architecture": "llama",
        "llama.block_count": 7,
        "llama.rope.freq_base": 500000.0,
        "tokenizer.ggml.tokens": ["a", "b", "é"],
        "tokenizer.ggml.token_type": [1, 3, 1],
        "flag": True,
    }
    assert header.tensors["blk.0.attn_q.weight"].shape == (6, 4)
    assert header.tensors["output_norm.weight"].shape == (4,)


def test_truncated_or_foreign_files_are_refused_with_the_path(tmp_path):
    path = tmp_path / "t.gguf"
    mx.save_gguf(str(path), {"x.weight": mx.zeros((2,))}, {"general.name": "x" * 100})
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:40])
    with pytest.raises(CheckpointError, match="short.gguf: GGUF header ends early"):
        gguf.read_header(tmp_path / "short.gguf")
    (tmp_path / "other.gguf").write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        gguf.read_header(tmp_path / "other.gguf")


@pytest.mark.parametrize(
    "gguf_name, canonical",
    [
        ("token_embd", "embed_tokens"),
        ("output_norm", "norm"),
        ("output", "lm_head"),
        ("blk.12.attn_q", "layers.12.self_attn.q_proj"),
        ("blk.0.attn_output", "layers.0.self_attn.o_proj"),
        ("blk.29.ffn_down", "layers.29.mlp.down_proj"),
        ("blk.1.ffn_norm", "layers.1.post_attention_layernorm"),
    ],
)
def test_llama_cpp_names_map_to_canonical_and_back(gguf_name, canonical):
    assert gguf.canonical_module(gguf_name) == canonical
    assert gguf.gguf_module(canonical) == gguf_name


def test_unknown_llama_cpp_names_have_no_canonical_name():
    assert gguf.canonical_module("rope_freqs") is None
    assert gguf.canonical_module("blk.0.ffn_gate_exps") is None


def test_qk_permutation_pairs_rotate_half_rows_and_inverts():
    n_head, head_dim = 2, 8
    rows = mx.arange(n_head * head_dim)[:, None] * mx.ones((1, 3), dtype=mx.int32)
    permuted = gguf.permute_qk(rows, n_head)
    # Within each head, row i and row i + d/2 (a rotate-half pair) become neighbours.
    assert permuted[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert mx.array_equal(gguf.unpermute_qk(permuted, n_head), rows)
