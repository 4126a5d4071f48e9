"""Where an MLX array's buffer lies, for tests that tell a write made in place (MLX donated the buffer) from one
copied into a new buffer (tests/test_round_timeline.py, tests/test_stacked_cache.py)."""

from __future__ import annotations

import numpy as np

import mlx.core as mx


def address(a: mx.array) -> int:
    """The address of the array's (evaluated) buffer."""
    view = memoryview(a)
    try:
        return np.frombuffer(view, dtype=np.uint8).ctypes.data
    finally:
        view.release()
