"""engine/stacked_cache.py: a dense target's every layer in one array holds what a cache a layer holds, and a
forward's rows written at once wait for the array's next read, where MLX may write them in place."""

from __future__ import annotations

from buffers import address

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine.cache import JointCache
from dflash_bench.engine.stacked_cache import StackedState

LAYERS, HEADS, D = 3, 2, 8


def rows(n: int, seed: int) -> mx.array:
    """Every layer's rows, (2 * layers, heads, n, d) in bf16."""
    return mx.random.normal((2 * LAYERS, HEADS, n, D), key=mx.random.key(seed)).astype(mx.bfloat16)


def test_one_array_holds_what_a_cache_a_layer_does_written_at_once_or_a_layer_at_a_time() -> None:
    """The same rows into a StackedState at once (`write_layers`), into another a layer at a time (each layer's
    `write_joint`, as a prompt chunk's layers write) and into a JointCache a layer: at host starts, past the first
    capacity, at a device length (cache.py's keep_at: a window kept in part, the next rows over its stale ones), a
    draft tree's kept path and a snapshot; every layer's keys and values, the committed arrays and the lengths are
    the same bits."""
    at_once, by_layer = StackedState(LAYERS, HEADS, D, mx.bfloat16), StackedState(LAYERS, HEADS, D, mx.bfloat16)
    joint = [JointCache(HEADS, D, mx.bfloat16) for _ in range(LAYERS)]

    def write(start: int, kv: mx.array, positions: mx.array | None = None) -> None:
        at_once.write_layers(start, kv, positions)
        for i, (layer, cache) in enumerate(zip(by_layer.layers, joint)):
            layer.write_joint(start, kv[2 * i : 2 * i + 2], positions)
            cache.write_joint(start, kv[2 * i : 2 * i + 2], positions)

    def every(fn) -> None:
        for holder in (at_once, by_layer, *joint):
            fn(holder)

    write(0, rows(5, 1))
    every(lambda c: c.keep(5))
    write(5, rows(3, 2))  # a window of three
    every(lambda c: c.keep_at(mx.array(6, dtype=mx.int32), 8, 6))  # one of its drafts kept, a device value
    write(8, rows(70, 3))  # at the device length (6), past the first capacity
    every(lambda c: c.settle(76))
    write(76, rows(2, 4), mx.array([76, 77], dtype=mx.int32))
    every(lambda c: c.keep(78))
    for holder in (at_once, by_layer):
        holder.keep_path(75, [0, 2])
    for cache in joint:
        cache.keep_path(75, [0, 2])
    snaps = [at_once.snapshot(77), by_layer.snapshot(77)]
    for state in (at_once, by_layer, *snaps):
        assert [layer.length for layer in state.layers] == [77] * LAYERS
        for layer, cache in zip(state.layers, joint):
            assert mx.array_equal(layer.kv[:, :, :77], cache.kv[:, :, :77]).item()
            assert mx.array_equal(layer.k[:, :77], cache.k[:, :77]).item()
        assert all(mx.array_equal(a, b).item() for a, b in zip(state.committed(), snaps[0].committed()))
    assert at_once.nbytes == by_layer.nbytes == sum(c.nbytes for c in joint)


def test_a_forwards_rows_wait_for_the_next_read_where_they_are_written_in_place() -> None:
    """A forward whose every layer read the array leaves its rows pending (`write_layers`): the round evaluates
    them and the array, not a write; the next read writes them, and with nothing else holding the array MLX writes
    in its buffer. The control writes them in the forward whose launches hold the array (its views, alive through
    the evaluation): MLX copies the whole array into a new buffer."""

    def forward(state: StackedState, flush_now: bool) -> tuple[int, int]:
        state.write_layers(0, rows(40, 5))  # a prompt: capacity for the row below
        state.keep(40)
        mx.eval(state.stack.kv)
        mx.synchronize()
        before = address(state.stack.kv)
        views = [state.stack.kv[2 * i : 2 * i + 2] for i in range(LAYERS)]  # (slices: the array, as a launch holds it)
        readers = [mx.sum(v) for v in views]
        state.write_layers(40, rows(1, 6))
        if flush_now:
            state.stack.flush()
        mx.eval(readers, state.arrays())
        mx.synchronize()
        assert (state.stack.pending is None) == flush_now
        del views, readers  # the round is over
        kv = state.stack.kv  # the next read: the pending rows written
        mx.eval(kv)
        mx.synchronize()
        assert mx.array_equal(kv[:, :, 40:41], rows(1, 6)).item()
        return before, address(kv)

    before, after = forward(StackedState(LAYERS, HEADS, D, mx.bfloat16), flush_now=False)
    assert before == after
    before, after = forward(StackedState(LAYERS, HEADS, D, mx.bfloat16), flush_now=True)
    assert before != after


def test_a_states_size_counts_its_pending_rows_as_written() -> None:
    """A state's bytes with rows pending are those it holds once they are written (what the planner prices,
    tests/test_gpu_mode.py): the array's where its capacity has room for them, the grown array's where it has not;
    never the array's plus the rows'."""
    state = StackedState(LAYERS, HEADS, D, mx.bfloat16)
    state.write_layers(0, rows(40, 5))
    waiting = state.nbytes
    state.stack.flush()
    assert waiting == state.nbytes  # grown for them: the grown array's
    mx.eval(state.stack.kv)
    state.write_layers(40, rows(3, 6))  # room for them: the array's
    assert state.nbytes == state.stack.kv.nbytes
    capacity = state.stack.kv.shape[2]
    state.write_layers(capacity, rows(1, 7))  # past its capacity: grown again
    waiting = state.nbytes
    assert waiting > state.stack.arrays()[0].nbytes
    state.stack.flush()
    assert waiting == state.nbytes
