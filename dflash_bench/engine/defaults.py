"""What `default` means: the bundled target and the drafter shipped for it."""

from __future__ import annotations

from pathlib import Path

DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"
DEFAULT_DRAFTER = DRAFTERS / "smollm2-135m-dflash"


def default_drafter_for(target: str) -> Path | None:
    """The shipped drafter of the default model, when the target is `default` and it is installed."""
    if str(target) == "default" and (DEFAULT_DRAFTER / "config.json").is_file():
        return DEFAULT_DRAFTER
    return None
