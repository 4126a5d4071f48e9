"""Qwen3.5-9B-shaped random checkpoints: the layout mlx-lm saves, the 9B's numbers, sane values, and a
writer that streams (the `tiny` preset runs the same code at small sizes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from conftest import PUBLISHED
from dflash_bench.cli import app
from dflash_bench.engine.backend import GPU
from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.draft_config import parse_draft_config
from dflash_bench.engine.inventory import expected_inventory, read_folder_header
from dflash_bench.engine.planner import PlanInputs, plan
from dflash_bench.engine.preload import check_dirs, check_pair
from dflash_bench.engine.target_config import parse_target_config
from dflash_bench.engine.targets import Segment, build_target
from dflash_bench.fixtures import big as B


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("big")
    return (B.write_big("qwen3_5-9b-4bit", root / "target", "tiny", shard_bytes=200_000),
            B.write_big("dflash-9b", root / "drafter", "tiny"))


def header(folder: Path) -> dict[str, dict]:
    return {k: v for k, v in read_folder_header(folder).items() if k != "__metadata__"} if \
        (folder / "model.safetensors").exists() else _sharded_header(folder)


def _sharded_header(folder: Path) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        out.update({k: v for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"})
    return out


def test_the_target_is_what_mlx_lm_saves_quantized(tiny: tuple[Path, Path]) -> None:
    """Every name and shape mlx-lm's qwen3_5 model has once quantized at groups of 64 and 4 bits
    (embedding and lm_head included), uint32 packed weights, A_log float32 (mlx-lm's cast_predicate
    keeps it), everything else bf16."""
    from mlx_lm.models import qwen3_5
    from mlx_lm.utils import quantize_model

    config = B.target_config(B.PRESETS["tiny"])
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    model, _ = quantize_model(model, config, 64, 4)
    want = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    got = header(tiny[0])
    assert {k: tuple(v["shape"]) for k, v in got.items()} == want
    for name, entry in got.items():
        expected = "U32" if name.endswith(".weight") and f"{name[:-7]}.scales" in got else \
            "F32" if name.endswith("A_log") else "BF16"
        assert entry["dtype"] == expected, name
    index = json.loads((tiny[0] / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got) and len(set(index["weight_map"].values())) > 1


def test_the_configs_follow_the_published_4b_pair_with_the_9b_numbers() -> None:
    """Same keys as Qwen/Qwen3.5-4B's and z-lab/Qwen3.5-4B-DFlash's config.json (plus mlx-lm's
    quantization blocks); the numbers of SOURCES.md's facts; the drafter's 1,291,904,512 parameters
    in 69 tensors; the pair passes the pre-load checks."""
    p = B.PRESETS["9b"]
    t_cfg, d_cfg = B.target_config(p), B.drafter_config(p)
    four_b = json.loads((PUBLISHED / "qwen3.5-4b.config.json").read_text())
    assert set(t_cfg) == set(four_b) | {"quantization", "quantization_config"}
    assert set(t_cfg["text_config"]) == set(four_b["text_config"])
    assert set(d_cfg) == set(json.loads((PUBLISHED / "qwen3.5-4b-dflash.config.json").read_text()))
    t, d = parse_target_config(t_cfg), parse_draft_config(d_cfg)
    lin = t.linear
    assert (t.num_layers, t.hidden_size, t.intermediate_size, t.num_heads, t.num_kv_heads, t.head_dim) == \
        (32, 4096, 12288, 16, 4, 256)
    assert list(t.layer_types) == (["linear_attention"] * 3 + ["full_attention"]) * 8
    assert (lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim, lin.conv_kernel) == \
        (16, 32, 128, 128, 4)
    assert (t.vocab_size, t.tie_word_embeddings, t.rope_dims, t.rope_theta, t.attn_output_gate) == \
        (248320, False, 64, 1e7, True)
    assert t.quantization == {"group_size": 64, "bits": 4}
    shapes = expected_inventory(d)
    assert len(shapes) == 69 and sum(math.prod(s) for s in shapes.values()) == 1_291_904_512
    assert shapes["fc.weight"] == (4096, 32768) and (d.num_layers, d.num_heads, d.num_kv_heads) == (6, 32, 8)
    check_pair(t, d)


def test_the_9b_tensors_are_the_planned_weights() -> None:
    """The planner's gpu-mode weights are the bytes the writer lays down (4.69 GiB for the target)."""
    p = B.PRESETS["9b"]
    t, d = parse_target_config(B.target_config(p)), parse_draft_config(B.drafter_config(p))
    planned = plan(PlanInputs(t, d, backend=GPU))
    assert planned.term("target weights").prompt == sum(x.nbytes for x in B.target_tensors(p))
    assert planned.term("drafter weights").prompt == sum(x.nbytes for x in B.drafter_tensors(p)) == 2 * 1_291_904_512


def test_the_same_seed_writes_the_same_bytes_and_another_does_not(tmp_path: Path) -> None:
    a = B.write_big("dflash-9b", tmp_path / "a", "tiny", seed=3)
    b = B.write_big("dflash-9b", tmp_path / "b", "tiny", seed=3)
    c = B.write_big("dflash-9b", tmp_path / "c", "tiny", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_values_are_sane_and_a_forward_is_finite(tiny: tuple[Path, Path]) -> None:
    """Dequantized matrices have mean ~0 and deviation ~fan_in^-0.5; drafter matrices about that; a
    forward's logits are finite and pick varied tokens."""
    target, drafter = tiny
    loaded = load_target(target)
    for name in ("layers.0.mlp.down_proj.weight", "embed_tokens.weight", "layers.3.self_attn.q_proj.weight"):
        w = loaded.weights[name]
        std = mx.sqrt(mx.var(w)).item()
        assert abs(mx.mean(w).item()) < 0.1 * std and std == pytest.approx(w.shape[1] ** -0.5, rel=0.05), name
    fc = mx.load(str(drafter / "model.safetensors"))["fc.weight"].astype(mx.float32)
    assert mx.sqrt(mx.mean(fc * fc)).item() == pytest.approx(fc.shape[1] ** -0.5, rel=0.5)
    model = build_target(loaded.config, loaded.weights)
    state = model.new_state()
    logits = model.forward([Segment(list(range(10, 110)), 0, state, list(range(100)), prefill=True)])[0].logits
    assert mx.isfinite(logits).all().item()
    assert len(set(mx.argmax(logits, axis=-1).tolist())) > 10


def test_the_fixture_command_writes_both_kinds_and_they_load_as_a_pair(tmp_path: Path) -> None:
    runner = CliRunner()
    for kind in B.KINDS:
        result = runner.invoke(app, ["fixture", kind, str(tmp_path / kind), "--preset", "tiny"])
        assert result.exit_code == 0, result.output
        assert result.output.strip() == str(tmp_path / kind)
    check_dirs(load_target(tmp_path / "qwen3_5-9b-4bit").config, str(tmp_path / "dflash-9b"))


def test_writing_streams_block_by_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor larger than a block is generated and written a block at a time."""
    monkeypatch.setattr(B, "BLOCK_BYTES", 4096)
    tensors = [B.Tensor("big.weight", "U32", (64, 128), "codes"), B.Tensor("x.weight", "BF16", (300, 70), "signed", 0.1)]
    seen: list[int] = []
    blocks = B._blocks
    monkeypatch.setattr(B, "_blocks", lambda t, rng: (seen.append(b.nbytes) or b for b in blocks(t, rng)))
    [path] = B.write_safetensors(tmp_path, tensors, seed=0, namespace="t")
    assert max(seen) <= 4096 and sum(seen) == sum(t.nbytes for t in tensors)
    loaded = mx.load(str(path))
    assert loaded["big.weight"].shape == (64, 128) and loaded["x.weight"].dtype == mx.bfloat16
