"""Fixture checkpoints: every kind written in its published layout, read back by the engine's own
readers, byte-identical per seed, and alive enough (varied argmax tokens) for the tests built on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_bench.cli import app
from dflash_bench.engine.checkpoint import expected_shapes, load_target
from dflash_bench.engine.draft_config import read_draft_config
from dflash_bench.engine.errors import DFlashBenchError
from dflash_bench.engine.inventory import check_inventory, read_folder_header
from dflash_bench.engine.preload import check_dirs
from dflash_bench.engine.target_config import parse_target_config
from dflash_bench.engine.tokenizer import Tokenizer
from dflash_bench.fixtures import small as F
from dflash_bench.fixtures import tokenizer as T

PUBLISHED = Path(__file__).parent / "data" / "published"
TARGETS = ("llama", "llama-gguf", "qwen3", "qwen3_5", "qwen3_5-4bit")
TEXT = "The quick brown fox, 2024: def f(x):\n    return x * 3.14  # naïve café ✓"


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every kind at seed 0 (drafters for the default llama target)."""
    root = tmp_path_factory.mktemp("fixtures")
    return {kind: F.write_fixture(kind, root / kind) for kind in F.FIXTURE_KINDS}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _header(path: Path) -> dict[str, dict]:
    return {k: v for k, v in read_folder_header(path).items() if k != "__metadata__"}


def test_every_kind_is_written_where_a_loader_looks(written: dict[str, Path]) -> None:
    assert set(written) == set(F.FIXTURE_KINDS)
    assert written["llama-gguf"].is_file() and written["llama-gguf"].suffix == ".gguf"
    for kind in set(F.FIXTURE_KINDS) - {"llama-gguf"}:
        assert (written[kind] / "config.json").is_file() and (written[kind] / "model.safetensors").is_file()
    for kind in ("llama", "qwen3", "qwen3_5", "qwen3_5-4bit"):
        assert _json(written[kind] / "tokenizer_config.json")["chat_template"] == T.CHAT_TEMPLATE


@pytest.mark.parametrize(
    ("kind", "family", "layers", "tied", "quantization"),
    [
        ("llama", "llama", 6, False, None),
        ("qwen3", "qwen3", 6, False, None),
        ("qwen3_5", "qwen3_5", 8, True, None),
        ("qwen3_5-4bit", "qwen3_5", 8, True, {"bits": 4, "group_size": 32}),
    ],
)
def test_target_config_parses_as_its_family(
    written: dict[str, Path], kind: str, family: str, layers: int, tied: bool, quantization: dict | None
) -> None:
    cfg = parse_target_config(_json(written[kind] / "config.json"))
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (family, layers, 64, T.VOCAB_SIZE)
    assert cfg.tie_word_embeddings is tied
    assert cfg.quantization == quantization
    assert cfg.eos_token_ids == (T.IM_END,)
    if family == "qwen3_5":
        assert cfg.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
        assert cfg.attn_output_gate and cfg.rope_dims == 8 and cfg.linear.conv_dim == 128


def test_qwen3_5_config_has_the_published_keys(written: dict[str, Path]) -> None:
    ours, published = _json(written["qwen3_5"] / "config.json"), _json(PUBLISHED / "qwen3.5-4b.config.json")
    assert ours.keys() == published.keys()
    assert ours["text_config"].keys() == published["text_config"].keys()
    assert ours["text_config"]["rope_parameters"].keys() == published["text_config"]["rope_parameters"].keys()
    assert ours["vision_config"].keys() == published["vision_config"].keys()


@pytest.mark.parametrize(
    ("kind", "published"),
    [("dflash", "qwen3.5-4b-dflash.config.json"), ("dflash2", "qwen3.8-27b-dflash2.config.json")],
)
def test_drafter_config_has_the_published_keys(written: dict[str, Path], kind: str, published: str) -> None:
    ours, theirs = _json(written[kind] / "config.json"), _json(PUBLISHED / published)
    assert list(ours) == list(theirs)
    assert ours["dflash_config"].keys() == theirs["dflash_config"].keys()
    assert ours["architectures"] == theirs["architectures"]


@pytest.mark.parametrize("target", F.TARGET_KINDS)
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_drafter_fits_its_target_fixture(tmp_path: Path, kind: str, target: str) -> None:
    target_dir = F.write_fixture(target, tmp_path / target)
    drafter_dir = F.write_fixture(kind, tmp_path / kind, target=target)
    target_cfg, draft = check_dirs(target_dir, drafter_dir)  # raises on any refusal
    assert draft.variant == ("DFlash" if kind == "dflash" else "DFlash2")
    assert len(draft.taps) == (5 if kind == "dflash2" else target_cfg.num_layers // 2)
    assert draft.mask_token_id == T.MASK
    assert T.build_tokenizer().id_to_token(draft.mask_token_id) == "<|mask|>"
    assert "sliding_attention" in draft.layer_types
    assert ("full_attention" in draft.layer_types) is (kind == "dflash")
    check_inventory(draft, read_folder_header(drafter_dir))


def test_dflash_tensors_are_3_plus_11_per_layer(written: dict[str, Path]) -> None:
    header = _header(written["dflash"])
    per_layer = [
        "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm",
    ]
    layers = read_draft_config(written["dflash"]).num_layers
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{m}.weight" for i in range(layers) for m in per_layer}
    assert set(header) == expected and len(header) == 3 + 11 * layers
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    assert header["fc.weight"]["shape"] == [64, 3 * 64]


def test_dflash2_tensors_are_named_like_the_published_header(written: dict[str, Path]) -> None:
    header = _header(written["dflash2"])
    published = _json(PUBLISHED / "muse-glimmer-30b-dflash2.safetensors-header.json")
    layers = read_draft_config(written["dflash2"]).num_layers
    expected = {k for k in published if k != "__metadata__" and not k.startswith("layers.")}
    expected |= {k.replace("layers.0.", f"layers.{i}.") for k in published if k.startswith("layers.0.") for i in range(layers)}
    assert set(header) == expected and len(header) == 6 + 15 * layers
    assert "candidate_selector.predecessor_codebook" in header  # bare, no .weight
    assert {v["dtype"] for v in header.values()} == {"BF16"}


def test_hf_targets_hold_the_published_names(written: dict[str, Path]) -> None:
    llama = _header(written["llama"])
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.5.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= set(llama)
    assert {v["dtype"] for v in llama.values()} == {"BF16"}
    qwen = _header(written["qwen3_5"])
    root = "model.language_model.layers"
    assert qwen[f"{root}.0.linear_attn.conv1d.weight"]["shape"] == [128, 1, 4]  # HF (conv_dim, 1, kernel)
    assert qwen[f"{root}.3.self_attn.q_proj.weight"]["shape"] == [2 * 4 * 32, 64]  # query and gate
    for name in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                 "out_proj.weight", "dt_bias", "A_log", "norm.weight"):
        assert f"{root}.0.linear_attn.{name}" in qwen
    assert "lm_head.weight" not in qwen and any(k.startswith("mtp.") for k in qwen)
    assert not any(k.startswith("model.language_model.layers.3.linear_attn") for k in qwen)


def test_quantized_target_is_what_mlx_lm_convert_saves(written: dict[str, Path]) -> None:
    header = _header(written["qwen3_5-4bit"])
    assert all(k.startswith("language_model.model.") for k in header)
    q = "language_model.model.layers.3.self_attn.q_proj"
    assert header[f"{q}.weight"]["dtype"] == "U32" and header[f"{q}.weight"]["shape"] == [256, 64 * 4 // 32]
    assert header[f"{q}.scales"]["shape"] == header[f"{q}.biases"]["shape"] == [256, 64 // 32]
    assert "language_model.model.embed_tokens.scales" in header
    assert header["language_model.model.layers.0.linear_attn.conv1d.weight"]["shape"] == [128, 4, 1]
    assert _json(written["qwen3_5-4bit"] / "config.json")["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}


def test_gguf_holds_llama_cpp_names_and_permuted_qk(written: dict[str, Path]) -> None:
    weights, meta = mx.load(str(written["llama-gguf"]), return_metadata=True)
    hf = F.target_weights("llama")
    assert len(weights) == len(hf)
    heads, kv_heads = 4, 2

    def converter_permute(w: mx.array, n_head: int) -> mx.array:  # convert_hf_to_gguf.py LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)

    pairs = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "output.weight": hf["lm_head.weight"],
        "blk.2.attn_q.weight": converter_permute(hf["model.layers.2.self_attn.q_proj.weight"], heads),
        "blk.2.attn_k.weight": converter_permute(hf["model.layers.2.self_attn.k_proj.weight"], kv_heads),
        "blk.2.attn_v.weight": hf["model.layers.2.self_attn.v_proj.weight"],
        "blk.2.ffn_down.weight": hf["model.layers.2.mlp.down_proj.weight"],
    }
    for name, expected in pairs.items():
        assert weights[name].dtype == mx.float16
        assert mx.array_equal(weights[name].astype(mx.float32), expected.astype(mx.float32)).item(), name
    assert weights["blk.2.attn_norm.weight"].dtype == weights["output_norm.weight"].dtype == mx.float32
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["llama.block_count"].item() == 6 and meta["llama.attention.head_count_kv"].item() == kv_heads
    assert len(meta["tokenizer.ggml.tokens"]) == T.VOCAB_SIZE
    assert meta["tokenizer.ggml.eos_token_id"].item() == T.IM_END
    assert meta["tokenizer.chat_template"] == T.CHAT_TEMPLATE


@pytest.mark.parametrize("kind", F.FIXTURE_KINDS)
def test_same_seed_writes_identical_bytes(tmp_path: Path, kind: str) -> None:
    a = F.write_fixture(kind, tmp_path / "a", seed=7)
    b = F.write_fixture(kind, tmp_path / "b", seed=7)
    c = F.write_fixture(kind, tmp_path / "c", seed=8)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    weights = a if a.is_file() else a / "model.safetensors"
    other = c if c.is_file() else c / "model.safetensors"
    assert weights.read_bytes() != other.read_bytes()


def test_same_seed_writes_identical_bytes_across_processes(tmp_path: Path, written: dict[str, Path]) -> None:
    """Another interpreter (another hash seed) trains the same tokenizer and draws the same weights."""
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-m", "dflash_bench", "fixture", "llama-gguf", str(tmp_path)],
        env=env, capture_output=True, text=True, check=True,
    )
    assert Path(out.stdout.strip()).read_bytes() == written["llama-gguf"].read_bytes()


def test_fixture_tokenizer_round_trips_text(written: dict[str, Path]) -> None:
    tok = T.build_tokenizer()
    assert tok.get_vocab_size() == T.VOCAB_SIZE
    assert tok.decode(tok.encode(TEXT).ids) == TEXT
    assert tok.encode("".join(T.SPECIAL_TOKENS)).ids == list(range(len(T.SPECIAL_TOKENS)))
    assert len(tok.encode(TEXT).ids) < len(TEXT.encode())  # merges were learned
    from_dir = Tokenizer.from_dir(written["llama"])
    from_gguf = Tokenizer.from_gguf_metadata(mx.load(str(written["llama-gguf"]), return_metadata=True)[1])
    assert from_dir.encode(TEXT) == from_gguf.encode(TEXT) == tok.encode(TEXT).ids
    chat = from_gguf.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert from_dir.decode(from_dir.encode(chat)) == chat


@pytest.mark.parametrize("kind", TARGETS)
def test_every_target_kind_loads_back(written: dict[str, Path], kind: str) -> None:
    loaded = load_target(written[kind])
    assert loaded.weights.keys() == expected_shapes(loaded.config).keys()
    assert loaded.tokenizer.encode(TEXT) == T.build_tokenizer().encode(TEXT).ids
    family = "llama" if kind == "llama-gguf" else kind.removesuffix("-4bit")
    reference = load_target(written[family]).weights
    for name, w in loaded.weights.items():
        diff = mx.abs(w - reference[name]).max().item()
        if kind == "qwen3_5-4bit":  # 4-bit groups of 32: a step is about a fifteenth of a group's range
            assert diff <= mx.abs(reference[name]).max().item() / 10, name
        else:  # the GGUF holds the very bf16 values, in f16
            assert diff == 0.0, name
    if family == "qwen3_5":  # HF norms are offsets: the loader's +1 brings them near one
        assert abs(loaded.weights["layers.0.input_layernorm.weight"].mean().item() - 1.0) < 0.1


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5"])
def test_forward_argmax_is_varied(written: dict[str, Path], kind: str) -> None:
    """Downstream tests need different tokens across positions: the residual must not collapse or copy."""
    from mlx_lm.utils import load_model

    model, _ = load_model(written[kind])
    model.set_dtype(mx.float32)
    prompt = T.build_tokenizer().encode(TEXT).ids
    argmax = mx.argmax(model(mx.array([prompt]))[0], axis=-1).tolist()
    assert len(set(argmax)) >= len(prompt) // 2
    assert sum(a == b for a, b in zip(argmax, prompt)) <= len(prompt) // 4


def test_unknown_kind_or_target_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(DFlashBenchError, match="fixture kind is 'gemma'"):
        F.write_fixture("gemma", tmp_path)
    with pytest.raises(DFlashBenchError, match="fixture target is 'gemma'"):
        F.write_fixture("dflash", tmp_path, target="gemma")


def test_cli_writes_a_fixture_and_prints_its_path(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["fixture", "llama", str(tmp_path / "llama")])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(tmp_path / "llama")
    assert parse_target_config(_json(tmp_path / "llama" / "config.json")).family == "llama"
    result = runner.invoke(app, ["fixture", "dflash2", str(tmp_path / "d2"), "--target", "qwen3_5", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert read_draft_config(tmp_path / "d2").taps == (1, 2, 4, 5, 7)
    result = runner.invoke(app, ["fixture", "gemma", str(tmp_path / "x")])
    assert result.exit_code == 2 and "gemma" in result.output



def test_a_random_drafter_like_the_shipped_one_keeps_its_layout_not_its_weights(tmp_path):
    from dflash_bench.engine.defaults import default_drafter_for
    from dflash_bench.engine.draft_config import read_draft_config
    from dflash_bench.engine.inventory import check_inventory, read_folder_header
    from dflash_bench.fixtures.small import write_random_like

    shipped_dir = default_drafter_for("default")
    out = write_random_like(shipped_dir, tmp_path / "random")
    assert (out / "config.json").read_bytes() == (shipped_dir / "config.json").read_bytes()
    check_inventory(read_draft_config(out), read_folder_header(out))
    ours, shipped = (mx.load(str(d / "model.safetensors")) for d in (out, shipped_dir))
    assert ours.keys() == shipped.keys()
    assert all(ours[k].dtype == shipped[k].dtype and ours[k].shape == shipped[k].shape for k in ours)
    assert not mx.array_equal(ours["fc.weight"], shipped["fc.weight"])


@pytest.mark.parametrize("kind", ["llama", "llama-gguf", "qwen3", "qwen3_5", "qwen3_5-4bit"])
def test_every_target_fixture_is_inspected_with_both_drafters(tmp_path, kind):
    family = "qwen3_5" if kind.startswith("qwen3_5") else ("llama" if kind.startswith("llama") else kind)
    target = F.write_fixture(kind, tmp_path / "target")
    for drafter_kind in ("dflash", "dflash2"):
        drafter = F.write_fixture(drafter_kind, tmp_path / drafter_kind, target=family)
        result = CliRunner().invoke(app, ["inspect", str(target), "--drafter", str(drafter), "--json"])
        assert result.exit_code == 0, result.output
        shown = json.loads(result.stdout)
        assert shown["target"]["family"] == family
        assert shown["drafter"]["kind"] == ("DFlash" if drafter_kind == "dflash" else "DFlash2")
