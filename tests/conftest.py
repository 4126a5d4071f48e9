"""Shared test set-up: the package (and so OpenBLAS) loads before anything imports mlx.core."""

from __future__ import annotations

from pathlib import Path

import dflash_bench  # noqa: F401

# Verbatim copies of ../shared/fixtures/published (see tests/data/published/SOURCES.md).
PUBLISHED = Path(__file__).parent / "data" / "published"
