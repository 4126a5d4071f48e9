"""Tests that need a CUDA GPU: marked `gpu` (so `pytest -m gpu` on the GPU machine runs every one of
them) and skipped where MLX does not compute on a CUDA GPU."""

from __future__ import annotations

from typing import Callable, TypeVar

import mlx.core as mx
import pytest

ON_CUDA = mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()
F = TypeVar("F", bound=Callable)


def on_cuda(test: F) -> F:
    """Mark `test` as a GPU test and skip it off a CUDA GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(not ON_CUDA, reason="needs MLX computing on a CUDA GPU")(test))
