"""Refusals before loading: a target and a drafter judged from their config.json files alone.

A wrong pairing found after gigabytes of weights are read wastes minutes and can crash mid-load; every
question here is answerable from the two configs, so it is asked first and answered in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_bench.engine.draft_config import DraftConfig, read_draft_config
from dflash_bench.engine.errors import BadDraftConfig, BadTargetConfig, DraftForAnotherTarget, NotStockDFlash2
from dflash_bench.engine.target_config import TargetConfig, parse_target_config

MAX_TAPS = 8
DFLASH2_TAPS = 5
DFLASH2_CONV_KERNEL = 2


def check_draft(draft: DraftConfig) -> None:
    """What is wrong with the drafter whatever the target: its taps, causality, DFlash2 layout."""
    taps = draft.taps
    repeated = sorted({t for t in taps if taps.count(t) > 1})
    if repeated:
        raise BadDraftConfig(f"dflash_config.target_layer_ids repeats {repeated} in {list(taps)}")
    if len(taps) > MAX_TAPS:
        raise BadDraftConfig(f"dflash_config.target_layer_ids has {len(taps)} taps, the engine takes at most {MAX_TAPS}")
    if draft.is_dflash2:
        check_stock_dflash2(draft)
    elif draft.is_causal:
        raise BadDraftConfig("is_causal is true on a DFlashDraftModel, the engine runs only block-bidirectional v1 drafts")


def check_stock_dflash2(draft: DraftConfig) -> None:
    """DFlash2 as published (five taps, kernel-2 grouped conv, a selector, sliding non-causal layers)."""

    def refuse(name: str, value: Any, stock: str) -> None:
        raise NotStockDFlash2(f"{name} is {value!r}, the engine runs DFlash2 with {stock}")

    if len(draft.taps) != DFLASH2_TAPS:
        refuse("dflash_config.target_layer_ids", list(draft.taps), f"exactly {DFLASH2_TAPS} taps")
    if draft.conv_kernel_size != DFLASH2_CONV_KERNEL:
        refuse("dflash_config.conv_kernel_size", draft.conv_kernel_size, f"conv_kernel_size {DFLASH2_CONV_KERNEL}")
    group = draft.conv_group_size
    if not group or group <= 0 or draft.hidden_size % group:
        refuse("dflash_config.conv_group_size", group, f"a conv_group_size dividing hidden_size {draft.hidden_size}")
    if not draft.selector_rank or draft.selector_rank <= 0:
        refuse("dflash_config.selector_rank", draft.selector_rank, "selector_rank > 0")
    if not draft.selector_top_k or draft.selector_top_k <= 0:
        refuse("dflash_config.selector_top_k", draft.selector_top_k, "selector_top_k > 0")
    for i, kind in enumerate(draft.layer_types):
        if kind != "sliding_attention":
            refuse(f"layer_types[{i}]", kind, "every layer sliding_attention")
    if draft.is_causal is not False:
        refuse("is_causal", draft.is_causal, "is_causal false")


def check_pair(target: TargetConfig, draft: DraftConfig) -> None:
    """Refuse a drafter the engine cannot run on this target; returns None when the pair is fine."""
    check_draft(draft)
    past = [t for t in draft.taps if t >= target.num_layers]
    if past:
        raise DraftForAnotherTarget(
            f"dflash_config.target_layer_ids holds {past[0]} in the drafter, the target has {target.num_layers} layers"
        )
    pairs = [
        ("hidden_size", draft.hidden_size, target.hidden_size),
        ("vocab_size", draft.vocab_size, target.vocab_size),
        ("num_target_layers", draft.num_target_layers, target.num_layers),
    ]
    for name, ours, theirs in pairs:
        if ours is not None and ours != theirs:
            raise DraftForAnotherTarget(f"{name} is {ours} in the drafter, {theirs} in the target")


def read_target_json(source: str | Path | dict[str, Any]) -> TargetConfig:
    """A target from a config.json dict, a config.json path, or a folder holding one."""
    if isinstance(source, dict):
        return parse_target_config(source)
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except OSError as err:
        raise BadTargetConfig(f"target config.json cannot be read at {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise BadTargetConfig(f"target config.json at {path} is not JSON: {err.msg} at line {err.lineno}") from None
    return parse_target_config(cfg, name=path.parent.name)


def check_dirs(
    target: TargetConfig | str | Path | dict[str, Any], drafter_dir: str | Path
) -> tuple[TargetConfig, DraftConfig]:
    """Read the two config.json files (nothing else), check the pair, return both configs."""
    target_cfg = target if isinstance(target, TargetConfig) else read_target_json(target)
    draft = read_draft_config(drafter_dir)
    check_pair(target_cfg, draft)
    return target_cfg, draft
