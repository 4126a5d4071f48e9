"""Shared test set-up: the package (and so OpenBLAS) loads before anything imports mlx.core."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import dflash_bench  # noqa: F401

# The engine caches its self-check verdicts (engine/selfcheck.py): the tests start from none and
# leave none behind in the user's cache (servers they start inherit this).
os.environ["DFLASH_BENCH_CACHE"] = tempfile.mkdtemp(prefix="dflash-bench-test-cache-")
atexit.register(shutil.rmtree, os.environ["DFLASH_BENCH_CACHE"], True)

# Published configs and headers, copied verbatim (tests/data/published/SOURCES.md says where from).
PUBLISHED = Path(__file__).parent / "data" / "published"


def write_short_prompts(folder: Path, known_prompts: int = 2, long_paragraphs: int | None = 2) -> Path:
    """A prompts/ folder for end-to-end runs: the first `known_prompts` known-answer prompts, the
    probes, and the first long prompt, cut to `long_paragraphs` paragraphs (two: still past a fixture
    drafter's window and 512 fixture tokens; None keeps it whole)."""
    import json

    from dflash_bench.checks import prompts

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("probes.json", "prefill.json"):
        (folder / name).write_text((prompts.PROMPTS_DIR / name).read_text())
    known = json.loads((prompts.PROMPTS_DIR / "known_answers.json").read_text())
    known["prompts"] = known["prompts"][:known_prompts]
    (folder / "known_answers.json").write_text(json.dumps(known))
    long = json.loads((prompts.PROMPTS_DIR / "long.json").read_text())
    first = long["prompts"][0]
    if long_paragraphs is not None:
        first = first | {"id": "wrenmouth-short", "paragraphs": long_paragraphs}
    long["prompts"] = [first]
    (folder / "long.json").write_text(json.dumps(long))
    return folder


def stop_server(proc, log) -> None:
    """End a server process the tests started (SIGTERM, then SIGKILL after 15 s) and close its log."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)
    log.close()
