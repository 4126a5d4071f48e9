"""DraftConfig reads the published DFlash and DFlash2 config.json files, and names the field it refuses."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dflash_bench.engine.draft_config import parse_draft_config, read_draft_config
from dflash_bench.engine.errors import BadDraftConfig

PUBLISHED = Path(__file__).parent / "data" / "published"


def published(name: str) -> dict:
    return json.loads((PUBLISHED / f"{name}.config.json").read_text())


def test_qwen35_4b_dflash_is_v1_with_eight_taps_and_five_sliding_layers() -> None:
    draft = read_draft_config(PUBLISHED / "qwen3.5-4b-dflash.config.json")
    assert (draft.variant, draft.kind, draft.is_dflash2) == ("DFlash", "DFlash", False)
    assert draft.taps == (1, 5, 9, 13, 17, 21, 25, 29)
    assert (draft.block_size, draft.mask_token_id) == (16, 248077)
    assert draft.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert draft.sliding_window == 4096
    assert draft.is_causal is None
    assert draft.causal == (True,) * 5 + (False,)  # sliding: causal in block; full: bidirectional
    assert (draft.hidden_size, draft.num_layers, draft.num_heads, draft.num_kv_heads, draft.head_dim) == (
        2560, 6, 32, 8, 128,
    )
    assert (draft.intermediate_size, draft.vocab_size, draft.num_target_layers) == (9216, 248320, 32)
    assert draft.rope_theta == 10_000_000.0 and draft.rms_norm_eps == 1e-6
    assert draft.tie_word_embeddings is True
    assert draft.output_multiplier == 1.0 and draft.final_logit_softcapping is None
    assert draft.selector_rank is None and draft.conv_kernel_size is None


def test_qwen38_27b_dflash2_has_block_8_selector_and_five_taps() -> None:
    draft = parse_draft_config(published("qwen3.8-27b-dflash2"))
    assert (draft.variant, draft.kind, draft.is_dflash2) == ("DFlash2", "DFlash2", True)
    assert draft.taps == (5, 19, 33, 47, 61)
    assert (draft.block_size, draft.mask_token_id) == (8, 248070)
    assert (draft.selector_rank, draft.selector_top_k) == (256, 16)
    assert (draft.conv_kernel_size, draft.conv_group_size) == (2, 16)
    assert draft.layer_types == ("sliding_attention",) * 5 and draft.sliding_window == 2048
    assert draft.is_causal is False and draft.causal == (False,) * 5
    assert (draft.hidden_size, draft.num_target_layers) == (5120, 64)
    assert draft.output_multiplier == 1.0 and draft.final_logit_softcapping is None


def test_muse_glimmer_dflash2_reads_output_multiplier_and_softcapping() -> None:
    draft = parse_draft_config(published("muse-glimmer-30b-dflash2"))
    assert draft.kind == "DFlash2"
    assert draft.taps == (1, 13, 25, 37, 49)
    assert (draft.block_size, draft.selector_rank, draft.selector_top_k) == (16, 256, 16)
    assert draft.output_multiplier == 0.19611613513818404
    assert draft.final_logit_softcapping == 20.0
    assert (draft.hidden_size, draft.vocab_size, draft.rms_norm_eps, draft.rope_theta) == (6656, 202048, 1e-5, 500000.0)


def test_softcapping_falls_back_to_the_top_level() -> None:
    cfg = published("qwen3.8-27b-dflash2")
    cfg["final_logit_softcapping"] = 30.0
    assert parse_draft_config(cfg).final_logit_softcapping == 30.0


def test_explicit_is_causal_applies_to_every_layer() -> None:
    cfg = published("qwen3.5-4b-dflash")
    cfg["is_causal"] = False
    assert parse_draft_config(cfg).causal == (False,) * 6
    cfg["is_causal"] = True
    assert parse_draft_config(cfg).causal == (True,) * 6


def test_missing_layer_types_means_all_full_attention() -> None:
    cfg = published("qwen3.5-4b-dflash")
    del cfg["layer_types"], cfg["sliding_window"]
    draft = parse_draft_config(cfg)
    assert draft.layer_types == ("full_attention",) * 6
    assert draft.causal == (False,) * 6 and draft.sliding_window is None


def test_rope_theta_at_the_top_level_wins() -> None:
    cfg = published("qwen3.5-4b-dflash")
    del cfg["rope_parameters"]
    cfg["rope_theta"] = 1000000
    assert parse_draft_config(cfg).rope_theta == 1_000_000.0


def _edit(name: str, edit) -> dict:
    cfg = copy.deepcopy(published(name))
    edit(cfg)
    return cfg


MALFORMED = {
    "missing block_size": (lambda c: c["dflash_config"].pop("block_size"), "has no dflash_config.block_size"),
    "string hidden_size": (lambda c: c.update(hidden_size="2560"), "hidden_size is '2560', expected int"),
    "zero hidden_size": (lambda c: c.update(hidden_size=0), "hidden_size is 0, expected a positive number"),
    "bool num_hidden_layers": (lambda c: c.update(num_hidden_layers=True), "num_hidden_layers is True"),
    "negative block_size": (lambda c: c["dflash_config"].update(block_size=-16), "dflash_config.block_size is -16"),
    "layer_types too short": (lambda c: c["layer_types"].pop(), "layer_types has 5 entries, num_hidden_layers is 6"),
    "unknown layer type": (lambda c: c["layer_types"].__setitem__(0, "linear_attention"), "linear_attention"),
    "sliding without window": (lambda c: c.pop("sliding_window"), "has no sliding_window"),
    "unknown architecture": (lambda c: c.update(architectures=["EagleDraftModel"]), "EagleDraftModel"),
    "no dflash_config": (lambda c: c.pop("dflash_config"), "dflash_config"),
    "taps not a list": (lambda c: c["dflash_config"].update(target_layer_ids=5), "target_layer_ids is 5"),
    "negative tap": (lambda c: c["dflash_config"].update(target_layer_ids=[-1, 5]), "target_layer_ids holds -1"),
    "mask past vocab": (lambda c: c["dflash_config"].update(mask_token_id=248320), "mask_token_id is 248320"),
    "is_causal a string": (lambda c: c.update(is_causal="yes"), "is_causal is 'yes'"),
    "quantization a number": (lambda c: c.update(quantization=8), "quantization is 8, expected an object"),
    "quantization at 7 bits": (lambda c: c.update(quantization={"group_size": 64, "bits": 7}), "quantization.bits is 7"),
    "quantization mxfp4": (lambda c: c.update(quantization={"group_size": 32, "bits": 4, "mode": "mxfp4"}),
                           "quantization.mode is 'mxfp4'"),
    "quantization without groups": (lambda c: c.update(quantization={"bits": 8}), "has no quantization.group_size"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_v1_config_is_refused_naming_the_field(case: str) -> None:
    edit, named = MALFORMED[case]
    with pytest.raises(BadDraftConfig) as err:
        parse_draft_config(_edit("qwen3.5-4b-dflash", edit))
    assert named in str(err.value)


def test_dflash2_without_selector_rank_is_refused() -> None:
    cfg = _edit("qwen3.8-27b-dflash2", lambda c: c["dflash_config"].pop("selector_rank"))
    with pytest.raises(BadDraftConfig, match="has no dflash_config.selector_rank"):
        parse_draft_config(cfg)


def test_missing_config_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadDraftConfig, match="config.json cannot be read"):
        read_draft_config(tmp_path)


def test_config_that_is_not_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BadDraftConfig, match="is not JSON"):
        read_draft_config(tmp_path)


def test_draft_config_is_frozen() -> None:
    draft = parse_draft_config(published("qwen3.5-4b-dflash"))
    with pytest.raises(AttributeError):
        draft.block_size = 8  # type: ignore[misc]
