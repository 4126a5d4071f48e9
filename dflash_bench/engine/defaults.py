"""Defaults that ship with the package: the drafters a target can name, and the one it gets when the
user names none.

The default model (SmolLM2-135M-Instruct, see checkpoint.py) ships two drafters trained for it by
tools/train_drafter under dflash_bench/drafters/: DFlash v1 (`dflash`, the default; its receipt is
receipts/train-smollm2-135m-dflash.json) and DFlash2 (`dflash2`, grown from it; receipt
receipts/train-smollm2-135m-dflash2.json), so `decode` on a fresh machine drafts out of the box and
`--drafter dflash2` picks the other without a path.
"""

from __future__ import annotations

from pathlib import Path

from dflash_bench.engine.errors import DFlashBenchError

DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
SHIPPED = {"default": {"dflash": "smollm2-135m-dflash", "dflash2": "smollm2-135m-dflash2"}}
DEFAULT_NAME = "dflash"


class UnknownDrafterName(DFlashBenchError):
    """`--drafter` names a shipped drafter the target has none of (and no such folder exists)."""


def shipped_drafters(target: str | Path) -> dict[str, Path]:
    """The drafters shipped for `target` by name ("default" has `dflash` and `dflash2`), present ones only."""
    names = SHIPPED.get(str(target), {})
    return {name: DRAFTERS / folder for name, folder in names.items() if (DRAFTERS / folder / "config.json").is_file()}


def default_drafter_for(target: str | Path) -> Path | None:
    """The shipped drafter `target` gets when none is named, or None."""
    return shipped_drafters(target).get(DEFAULT_NAME)


def chosen_drafter(target: str | Path, drafter: str | None, no_drafter: bool = False) -> str | None:
    """The drafter a command runs TARGET with: none for `--no-drafter` or `--drafter none`; a folder
    as named; a shipped drafter's name (`dflash`, `dflash2`) when no folder of that name exists; else
    the target's default. `serve`, `plan`, `inspect` and `engine-speed` share it, so a plan prices
    what `serve` with the same arguments would load."""
    if no_drafter or drafter == "none":
        return None
    if drafter is not None:
        if Path(drafter).exists() or drafter not in {n for names in SHIPPED.values() for n in names}:
            return drafter
        shipped = shipped_drafters(target)
        if drafter not in shipped:
            have = ", ".join(sorted(shipped)) or "none"
            raise UnknownDrafterName(f"--drafter {drafter}: {target} ships no such drafter (shipped: {have}); "
                                     f"name a drafter folder")
        return str(shipped[drafter])
    shipped_default = default_drafter_for(target)
    return str(shipped_default) if shipped_default else None
