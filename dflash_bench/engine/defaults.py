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


def chosen_drafter(target: str | Path, drafter: str | None, no_drafter: bool = False) -> str | None:
    """The drafter a command runs TARGET with: the one named; none for `--no-drafter` or `--drafter
    none`; else the target's shipped drafter. `serve`, `plan` and `engine-speed` share it, so a plan
    prices what `serve` with the same arguments would load."""
    if no_drafter or drafter == "none":
        return None
    if drafter is not None:
        return drafter
    shipped = default_drafter_for(target)
    return str(shipped) if shipped else None
