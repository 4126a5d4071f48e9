"""Shared test set-up: the package (and so OpenBLAS) loads before anything imports mlx.core."""

from __future__ import annotations

from pathlib import Path

import dflash_bench  # noqa: F401

# Verbatim copies of ../shared/fixtures/published (see tests/data/published/SOURCES.md).
PUBLISHED = Path(__file__).parent / "data" / "published"


def write_short_prompts(folder: Path) -> Path:
    """A prompts/ folder for end-to-end runs: two known-answer prompts, the probes, and one long
    prompt cut to two paragraphs (still past a fixture drafter's window and 512 fixture tokens)."""
    import json

    from dflash_bench.checks import prompts

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("probes.json", "prefill.json"):
        (folder / name).write_text((prompts.PROMPTS_DIR / name).read_text())
    known = json.loads((prompts.PROMPTS_DIR / "known_answers.json").read_text())
    known["prompts"] = known["prompts"][:2]
    (folder / "known_answers.json").write_text(json.dumps(known))
    long = json.loads((prompts.PROMPTS_DIR / "long.json").read_text())
    long["prompts"] = [long["prompts"][0] | {"id": "wrenmouth-short", "paragraphs": 2}]
    (folder / "long.json").write_text(json.dumps(long))
    return folder
