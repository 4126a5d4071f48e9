"""Drafter inventories: the tensor names and shapes a checkpoint must hold, from its header alone."""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from dflash_bench.engine.draft_config import DraftConfig, parse_draft_config, read_draft_config
from dflash_bench.engine.errors import CheckpointError
from dflash_bench.engine.inventory import (
    check_inventory,
    expected_inventory,
    read_folder_header,
    read_safetensors_header,
    stored_inventory,
    tensor_bytes,
)

PUBLISHED = Path(__file__).parent / "data" / "published"


def published_draft(name: str) -> DraftConfig:
    return read_draft_config(PUBLISHED / f"{name}.config.json")


def muse_header() -> dict:
    return json.loads((PUBLISHED / "muse-glimmer-30b-dflash2.safetensors-header.json").read_text())


def v1_header_4b() -> dict:
    """The 69 tensors of Qwen3.5-4B-DFlash, written out from its config (hidden 2560, FFN 9216,
    32 Q / 8 KV heads of 128, 8 taps, 6 layers) independently of the code under test."""
    shapes = {"fc.weight": [2560, 8 * 2560], "hidden_norm.weight": [2560], "norm.weight": [2560]}
    for i in range(6):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": [2560],
            p + "post_attention_layernorm.weight": [2560],
            p + "mlp.gate_proj.weight": [9216, 2560],
            p + "mlp.up_proj.weight": [9216, 2560],
            p + "mlp.down_proj.weight": [2560, 9216],
            p + "self_attn.q_proj.weight": [4096, 2560],
            p + "self_attn.k_proj.weight": [1024, 2560],
            p + "self_attn.v_proj.weight": [1024, 2560],
            p + "self_attn.o_proj.weight": [2560, 4096],
            p + "self_attn.q_norm.weight": [128],
            p + "self_attn.k_norm.weight": [128],
        }
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return header


def test_muse_glimmer_header_passes_the_dflash2_inventory() -> None:
    draft = published_draft("muse-glimmer-30b-dflash2")
    header = muse_header()
    assert len(header) == 81 == len(expected_inventory(draft)) == 6 + 15 * draft.num_layers
    check_inventory(draft, header)  # names and shapes: the config's hidden size matches the header's
    assert {name: tuple(e["shape"]) for name, e in header.items()} == expected_inventory(draft)


def test_dflash2_selector_codebooks_are_bare_tensors() -> None:
    names = expected_inventory(published_draft("qwen3.8-27b-dflash2"))
    assert names["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert names["candidate_selector.successor_codebook"] == (248320, 256)
    assert "candidate_selector.predecessor_codebook.weight" not in names
    assert len(names) == 81


def test_4b_v1_drafter_has_69_tensors_and_its_published_parameter_count() -> None:
    draft = published_draft("qwen3.5-4b-dflash")
    names = expected_inventory(draft)
    assert len(names) == 69 == 3 + 11 * draft.num_layers
    assert sum(math.prod(shape) for shape in names.values()) == 634_425_856
    check_inventory(draft, v1_header_4b())


def test_v1_fc_takes_every_tap_plane() -> None:
    assert expected_inventory(published_draft("qwen3.5-4b-dflash"))["fc.weight"] == (2560, 8 * 2560)


def test_missing_tensor_is_named() -> None:
    header = v1_header_4b()
    del header["layers.3.self_attn.k_norm.weight"]
    with pytest.raises(CheckpointError, match="has no tensor 'layers.3.self_attn.k_norm.weight'"):
        check_inventory(published_draft("qwen3.5-4b-dflash"), header)


def test_unexpected_tensor_is_named() -> None:
    header = v1_header_4b()
    header["embed_tokens.weight"] = {"dtype": "BF16", "shape": [248320, 2560], "data_offsets": [0, 0]}
    with pytest.raises(CheckpointError, match="unexpected tensor 'embed_tokens.weight'"):
        check_inventory(published_draft("qwen3.5-4b-dflash"), header)


def test_misshaped_tensor_is_named_with_both_shapes() -> None:
    header = v1_header_4b()
    header["fc.weight"]["shape"] = [2560, 7 * 2560]
    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \[2560, 17920\], the config gives \[2560, 20480\]"):
        check_inventory(published_draft("qwen3.5-4b-dflash"), header)


def test_codebook_with_a_weight_suffix_is_refused() -> None:
    header = muse_header()
    header["candidate_selector.successor_codebook.weight"] = header.pop("candidate_selector.successor_codebook")
    with pytest.raises(CheckpointError, match="has no tensor 'candidate_selector.successor_codebook'"):
        check_inventory(published_draft("muse-glimmer-30b-dflash2"), header)


def test_v1_header_does_not_pass_as_dflash2() -> None:
    with pytest.raises(CheckpointError, match="candidate_selector"):
        check_inventory(published_draft("qwen3.8-27b-dflash2"), v1_header_4b())


def test_metadata_entry_is_not_a_tensor() -> None:
    header = copy.deepcopy(muse_header())
    header["__metadata__"] = {"format": "pt"}
    check_inventory(published_draft("muse-glimmer-30b-dflash2"), header)
    assert tensor_bytes(header) == tensor_bytes(muse_header())


def test_tensor_bytes_sum_the_byte_ranges() -> None:
    assert tensor_bytes(v1_header_4b()) == 2 * 634_425_856


def test_reads_a_real_safetensors_header(tmp_path: Path) -> None:
    save_file({"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.int8)}, tmp_path / "x.safetensors")
    header = read_safetensors_header(tmp_path / "x.safetensors")
    assert header["a"]["shape"] == [2, 3] and header["a"]["dtype"] == "F32"
    assert tensor_bytes(header) == 24 + 4


def _header_only_file(path: Path, header: dict) -> None:
    """A safetensors header with none of the data it describes: readable only if no weight is read."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_header_is_read_without_the_weights(tmp_path: Path) -> None:
    _header_only_file(tmp_path / "model.safetensors", v1_header_4b())
    assert read_safetensors_header(tmp_path / "model.safetensors") == v1_header_4b()


def test_folder_header_merges_shards_and_refuses_duplicates(tmp_path: Path) -> None:
    header = v1_header_4b()
    names = list(header)
    _header_only_file(tmp_path / "model-00001-of-00002.safetensors", {n: header[n] for n in names[:30]})
    _header_only_file(tmp_path / "model-00002-of-00002.safetensors", {n: header[n] for n in names[30:]})
    assert read_folder_header(tmp_path) == header
    _header_only_file(tmp_path / "model-00002-of-00002.safetensors", {n: header[n] for n in names[29:]})
    with pytest.raises(CheckpointError, match=f"tensor '{names[29]}' appears in more than one file"):
        read_folder_header(tmp_path)


@pytest.mark.parametrize(
    "content, named",
    [
        (b"\x01\x02", "too short for a safetensors header"),
        (struct.pack("<Q", 10**12) + b"{}", "claims a 1000000000000-byte header"),
        (struct.pack("<Q", 5) + b"{nope", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    ],
)
def test_broken_header_is_a_checkpoint_error(tmp_path: Path, content: bytes, named: str) -> None:
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(CheckpointError, match=named):
        read_safetensors_header(tmp_path / "model.safetensors")


def quantized_4b(group_size: int = 64, bits: int = 8) -> DraftConfig:
    """Qwen3.5-4B-DFlash's published config with mlx-lm's `quantization` block added."""
    cfg = json.loads((PUBLISHED / "qwen3.5-4b-dflash.config.json").read_text())
    return parse_draft_config(cfg | {"quantization": {"group_size": group_size, "bits": bits}})


def test_an_8_bit_drafter_stores_packed_matrices_with_scales_and_biases() -> None:
    """mlx-lm's layout: a matrix's `.weight` holds 32 / bits columns a uint32 word, and a scale and a
    bias per group of columns sit beside it; norms stay as they are."""
    draft = quantized_4b()
    stored = stored_inventory(draft)
    assert stored["fc.weight"] == (2560, 8 * 2560 * 8 // 32)
    assert stored["fc.scales"] == stored["fc.biases"] == (2560, 8 * 2560 // 64)
    assert stored["layers.0.mlp.down_proj.weight"] == (2560, 9216 // 4)
    assert stored["layers.0.self_attn.q_norm.weight"] == (128,)
    assert len(stored) == 69 + 2 * (1 + 7 * 6)


def test_a_header_packed_at_other_bits_than_the_config_says_is_refused() -> None:
    """A header written at 4 bits under a config that says 8: the first matrix is named with both shapes."""
    header = {}
    for name, shape in stored_inventory(quantized_4b(bits=4)).items():
        header[name] = {"dtype": "U32", "shape": list(shape), "data_offsets": [0, 0]}
    check_inventory(quantized_4b(bits=4), header)
    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \[2560, 2560\], the config gives \[2560, 5120\]"):
        check_inventory(quantized_4b(bits=8), header)


def test_groups_that_do_not_divide_a_matrix_are_refused() -> None:
    with pytest.raises(CheckpointError, match="'layers.0.mlp.gate_proj.weight' has 2560 columns, which 8-bit groups of 5120 do not divide"):
        stored_inventory(quantized_4b(group_size=5120))
