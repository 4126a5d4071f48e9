"""Defaults that ship with the package: the drafter a target gets when the user names none.

The default model (SmolLM2-135M-Instruct, see checkpoint.py) has a DFlash v1 drafter trained for it
by tools/train_drafter and shipped under dflash_bench/drafters/ (its receipt is
receipts/train-smollm2-135m-dflash.json), so `decode` on a fresh machine drafts out of the box.
"""

from __future__ import annotations

from pathlib import Path

DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
DEFAULT_DRAFTERS = {"default": "smollm2-135m-dflash"}


def default_drafter_for(target: str | Path) -> Path | None:
    """The shipped drafter folder for `target` ("default" has one), or None."""
    name = DEFAULT_DRAFTERS.get(str(target))
    if name is None:
        return None
    path = DRAFTERS / name
    return path if (path / "config.json").is_file() else None
