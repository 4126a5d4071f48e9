"""The selector's top-k by chunk maxima (engine/topk.py) names the same set as a full argpartition."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from dflash_bench.engine.topk import top_k_indices


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_top_k_finds_the_rows_k_largest(chunk: int) -> None:
    """The top-k by chunk maxima names the same set as a full argpartition: on rows
    of distinct values, including rows whose k largest all sit in one chunk and a vocabulary the
    chunk does not divide."""
    rng = np.random.default_rng(3)
    rows = rng.permutation(4 * 3 * 1000).reshape(4, 3, 1000).astype(np.float32)  # distinct values
    rows[0, 0, 100:116] += 20_000  # the 16 largest of this row in one stretch
    logits, k = mx.array(rows), 16
    got = np.sort(np.array(top_k_indices(logits, k, chunk)), axis=-1)
    want = np.sort(np.array(mx.argpartition(logits, -k, axis=-1)[..., -k:]), axis=-1)
    assert np.array_equal(got, want)
    assert np.array_equal(got[0, 0], np.arange(100, 116))
