"""device_values: our kernels' small inputs past MLX's small pool, and exact device copies of loaded tensors.

Where an array lands is MLX's allocator's choice on a CUDA GPU (device_values' docstring); what these tests hold on
any machine is what the engine relies on: the copies are bit for bit (a copy by arithmetic, x + 0, would turn -0.0
into 0.0), a launch's constants carry their values first and are longer than the pool's 8 bytes, and a round's
layout keeps its values. `on_cuda` is stood in for where the CUDA path's operations are what is checked (they run on
the CPU alike)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dflash_bench.engine import checkpoint, device_values
from dflash_bench.engine.device_values import POOL_BYTES, constant, off_pool, per_round, place
from dflash_bench.engine.tiles import Weight


@pytest.fixture
def cuda_path(monkeypatch):
    """device_values as on a CUDA GPU: its copies are made (MLX runs them on the CPU here)."""
    monkeypatch.setattr(device_values, "on_cuda", lambda: True)


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def test_a_placed_copy_has_every_bit_of_its_array(cuda_path) -> None:
    src = mx.array([-0.0, 0.0, 1.5, -3.25, 1e-30, 65504.0], dtype=mx.float32).astype(mx.bfloat16)
    (copy,) = place([src])
    assert copy.dtype == src.dtype and copy.shape == src.shape
    assert (bits(copy) == bits(src)).all()
    assert bits(copy)[0] == 0x8000  # -0.0 kept: a copy by arithmetic would not keep it
    assert not (bits(src + 0) == bits(src)).all()  # the negative control: x + 0 loses the sign of -0.0


def test_a_loaded_packed_weight_in_device_memory_is_the_same_weight(cuda_path) -> None:
    w = Weight(mx.random.normal((64, 128)).astype(mx.bfloat16), bits=4, group_size=64)
    moved = checkpoint.in_device_memory(w)
    assert isinstance(moved, Weight) and (moved.bits, moved.group_size) == (4, 64)
    for a, b in zip(w.arrays(), moved.arrays()):
        assert a.dtype == b.dtype and (bits(a) == bits(b)).all()
    plain = mx.array([[1.0, -0.0]], dtype=mx.bfloat16)
    assert (bits(checkpoint.in_device_memory(plain)) == bits(plain)).all()


@pytest.mark.parametrize("values, dtype", [((1,), mx.int32), ((16,), mx.int32), ((0, 17), mx.int32),
                                           ((1e-6,), mx.float32), ((2, 3, 5, 7, 11, 13), mx.int32)])
def test_a_launch_constant_starts_with_its_values_and_outgrows_the_pool(values, dtype) -> None:
    out = constant(values, dtype)
    assert out.dtype == dtype and out.nbytes > POOL_BYTES
    assert out.tolist()[: len(values)] == pytest.approx(list(values))
    assert all(v == 0 for v in out.tolist()[len(values):])


def test_a_rounds_layout_keeps_its_values_padded_only_where_the_pool_would_take_it(cuda_path) -> None:
    layout = [3, 1, 40, 0, 37, 1, 64]
    assert per_round(layout).tolist() == layout  # 28 bytes: as it is (attention's launch reads it whole)
    small = per_round([5])
    assert small.nbytes > POOL_BYTES and small.tolist()[0] == 5 and not any(small.tolist()[1:])


def test_a_rollbacks_single_count_is_padded_past_the_pool_and_several_are_not() -> None:
    one = off_pool(mx.array([3], dtype=mx.int32))
    assert one.nbytes > POOL_BYTES and one.tolist()[0] == 3 and not any(one.tolist()[1:])
    four = mx.array([1, 2, 3, 4], dtype=mx.int32)
    assert off_pool(four) is four
