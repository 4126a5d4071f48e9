"""Pre-load refusals: a target and drafter judged from their config.json files alone, one line each."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from dflash_bench.engine.draft_config import DraftConfig, parse_draft_config
from dflash_bench.engine.errors import BadDraftConfig, DraftForAnotherTarget, NotStockDFlash2
from dflash_bench.engine.preload import check_dirs, check_pair
from dflash_bench.engine.target_config import parse_target_config

PUBLISHED = Path(__file__).parent / "data" / "published"


def published(name: str) -> dict:
    return json.loads((PUBLISHED / f"{name}.config.json").read_text())


def target_4b(**text_edits) -> dict:
    """A copy of Qwen3.5-4B's config.json with text_config fields changed."""
    cfg = copy.deepcopy(published("qwen3.5-4b"))
    text = cfg["text_config"]
    text.update(text_edits)
    layers = text["num_hidden_layers"]
    text["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
    return cfg


def target_for_27b_dflash2() -> dict:
    """Qwen3.5-4B's config reshaped to the 27B drafter's target (64 layers, hidden 5120)."""
    return target_4b(num_hidden_layers=64, hidden_size=5120)


def draft(name: str, **edits) -> DraftConfig:
    cfg = copy.deepcopy(published(name))
    dflash = edits.pop("dflash_config", {})
    cfg.update(edits)
    cfg["dflash_config"].update(dflash)
    return parse_draft_config(cfg)


def test_4b_dflash_is_accepted_for_qwen35_4b() -> None:
    check_pair(parse_target_config(published("qwen3.5-4b")), draft("qwen3.5-4b-dflash"))


def test_stock_dflash2_is_accepted_for_its_target() -> None:
    check_pair(parse_target_config(target_for_27b_dflash2()), draft("qwen3.8-27b-dflash2"))


def test_other_hidden_size_is_draft_for_another_target() -> None:
    target = parse_target_config(target_4b(hidden_size=4096))
    with pytest.raises(DraftForAnotherTarget) as err:
        check_pair(target, draft("qwen3.5-4b-dflash"))
    assert err.value.line() == "DraftForAnotherTarget: hidden_size is 2560 in the drafter, 4096 in the target"


def test_fewer_target_layers_than_a_tap_is_draft_for_another_target() -> None:
    target = parse_target_config(target_4b(num_hidden_layers=24))
    with pytest.raises(DraftForAnotherTarget) as err:
        check_pair(target, draft("qwen3.5-4b-dflash"))
    assert str(err.value) == "dflash_config.target_layer_ids holds 25 in the drafter, the target has 24 layers"


def test_more_target_layers_than_trained_for_is_draft_for_another_target() -> None:
    target = parse_target_config(target_4b(num_hidden_layers=40))
    with pytest.raises(DraftForAnotherTarget) as err:
        check_pair(target, draft("qwen3.5-4b-dflash"))
    assert str(err.value) == "num_target_layers is 32 in the drafter, 40 in the target"


def test_other_vocab_is_draft_for_another_target() -> None:
    target = parse_target_config(target_4b(vocab_size=151936))
    with pytest.raises(DraftForAnotherTarget, match="vocab_size is 248320 in the drafter, 151936 in the target"):
        check_pair(target, draft("qwen3.5-4b-dflash"))


def test_repeated_taps_are_refused() -> None:
    target = parse_target_config(published("qwen3.5-4b"))
    with pytest.raises(BadDraftConfig, match=r"target_layer_ids repeats \[5\]"):
        check_pair(target, draft("qwen3.5-4b-dflash", dflash_config={"target_layer_ids": [1, 5, 5, 9, 13, 17, 21, 25]}))


def test_nine_taps_are_refused() -> None:
    target = parse_target_config(published("qwen3.5-4b"))
    nine = {"target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29, 31]}
    with pytest.raises(BadDraftConfig, match="has 9 taps, the engine takes at most 8"):
        check_pair(target, draft("qwen3.5-4b-dflash", dflash_config=nine))


def test_causal_v1_draft_is_refused() -> None:
    target = parse_target_config(published("qwen3.5-4b"))
    with pytest.raises(BadDraftConfig, match="is_causal is true on a DFlashDraftModel"):
        check_pair(target, draft("qwen3.5-4b-dflash", is_causal=True))


def test_v1_with_explicit_non_causal_is_accepted() -> None:
    check_pair(parse_target_config(published("qwen3.5-4b")), draft("qwen3.5-4b-dflash", is_causal=False))


NOT_STOCK = {
    "four taps": ({"dflash_config": {"target_layer_ids": [5, 19, 33, 47]}}, "target_layer_ids is [5, 19, 33, 47]"),
    "conv kernel 3": ({"dflash_config": {"conv_kernel_size": 3}}, "conv_kernel_size is 3"),
    "group not dividing hidden": ({"dflash_config": {"conv_group_size": 48}}, "conv_group_size is 48"),
    "selector rank 0": ({"dflash_config": {"selector_rank": 0}}, "selector_rank is 0"),
    "selector top-k 0": ({"dflash_config": {"selector_top_k": 0}}, "selector_top_k is 0"),
    "a full-attention layer": (
        {"layer_types": ["sliding_attention"] * 4 + ["full_attention"]},
        "layer_types[4] is 'full_attention'",
    ),
    "causal": ({"is_causal": True}, "is_causal is True"),
}


@pytest.mark.parametrize("case", sorted(NOT_STOCK))
def test_non_stock_dflash2_is_refused_naming_field_and_value(case: str) -> None:
    edits, named = NOT_STOCK[case]
    target = parse_target_config(target_for_27b_dflash2())
    with pytest.raises(NotStockDFlash2) as err:
        check_pair(target, draft("qwen3.8-27b-dflash2", **copy.deepcopy(edits)))
    assert named in str(err.value)


def test_dflash2_without_is_causal_key_is_not_stock() -> None:
    cfg = published("qwen3.8-27b-dflash2")
    del cfg["is_causal"]
    with pytest.raises(NotStockDFlash2, match="is_causal is None"):
        check_pair(parse_target_config(target_for_27b_dflash2()), parse_draft_config(cfg))


def _folders(tmp_path: Path, target: str, drafter: str) -> tuple[Path, Path]:
    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    (tmp_path / "t" / "config.json").write_text((PUBLISHED / f"{target}.config.json").read_text())
    (tmp_path / "d" / "config.json").write_text((PUBLISHED / f"{drafter}.config.json").read_text())
    return tmp_path / "t", tmp_path / "d"


def test_check_dirs_reads_the_two_configs(tmp_path: Path) -> None:
    target_dir, drafter_dir = _folders(tmp_path, "qwen3.5-4b", "qwen3.5-4b-dflash")
    target, draft_cfg = check_dirs(target_dir, drafter_dir)
    assert (target.family, draft_cfg.kind) == ("qwen3_5", "DFlash")
    assert check_dirs(target_dir / "config.json", drafter_dir)[0] == target
    assert check_dirs(published("qwen3.5-4b"), drafter_dir)[1] == draft_cfg
    assert check_dirs(target, drafter_dir)[0] is target


def test_check_dirs_refuses_before_touching_weights(tmp_path: Path) -> None:
    target_dir, drafter_dir = _folders(tmp_path, "qwen3.5-4b", "qwen3.8-27b-dflash2")
    (drafter_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DraftForAnotherTarget, match="target_layer_ids holds 33"):
        check_dirs(target_dir, drafter_dir)


def test_check_dirs_without_drafter_config_is_bad_draft_config(tmp_path: Path) -> None:
    target_dir, drafter_dir = _folders(tmp_path, "qwen3.5-4b", "qwen3.5-4b-dflash")
    (drafter_dir / "config.json").unlink()
    with pytest.raises(BadDraftConfig, match="config.json cannot be read"):
        check_dirs(target_dir, drafter_dir)
