"""A stream state with every layer's keys and values in one array: (2 * layers, kv heads, capacity, head dim),
layer i's keys at row 2i and its values at row 2i + 1. A dense target's (targets/dense.py) and a drafter's
(drafters/dflash.py, whose `absorb` writes every layer's context rows at once a stream the same way).

Why one array: a decode forward wrote each layer's new K/V rows into each stream's cache as it went, one scatter a
layer and stream (30 a stream a step for the default model, 120 at 4 streams), each an operation for a GPU host to
build and encode (docs/gpu-round-profile.md). A forward whose layers read their own rows from the forward's K/V
(targets/attention_kernel.py's `block`, which gives the bits of the cache written first) writes every layer's at
once instead (`StackedState.write_layers`: one copy or scatter a stream, DenseTarget.layers; made where the array is
next read: `Stack`), and the attention launch reads a layer's keys before the rows' start from the one array at the
layer's offset (its `layer`). Every other reader and writer (prompt chunks, the tile products, trees, the launch
where layers write as they go) takes a layer's view (`StackedLayer`) as it takes a JointCache (cache.py).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from dflash_bench.engine.cache import JointCache, TargetState, capacity_for, grown, put_rows, tiles_for


@lru_cache(maxsize=256)
def _rows_index(first: int, heads: int, n: int) -> mx.array:
    """Rows first, first + 1 of the stacked array (a layer's keys and values) as a scatter's first index for n
    rows of each kv head (`StackedLayer.index_shape`): one array a layer and row count, made once."""
    return mx.broadcast_to(mx.arange(first, first + 2, dtype=mx.int32).reshape(2, 1, 1, 1), (2, heads, n, 1))


@lru_cache(maxsize=64)
def _heads_index(heads: int, n: int) -> mx.array:
    """The kv heads as a scatter's second index for n rows of each (`StackedLayer.index_shape`)."""
    return mx.broadcast_to(mx.arange(heads, dtype=mx.int32).reshape(1, heads, 1, 1), (2, heads, n, 1))


class Stack:
    """The one array of a StackedState, which its layers share, and the rows a forward left to write into it
    (`pending`). Not the state itself: a layer holding its state would make a reference cycle, and a dropped
    stream's cache would stay until Python's cycle collector ran (the cancel check's memory_returns_to_baseline saw
    it: tests/test_checks_e2e.py).

    Why a forward's rows wait: a write copies the whole array into a new buffer unless MLX may donate it, which it
    may not while anything else holds the array (docs/gpu-round-profile.md, session 49), and every layer's attention
    launch of the forward that made the rows holds it. Written at that forward's end, every step would copy every
    layer's cache. Written where the array is next read (`kv`: the next forward's first attention launch, or any
    other reader), it is written as a layer's own write was, before the launches that read it."""

    def __init__(self, kv: mx.array):
        self._kv = kv
        self.pending: tuple[int, mx.array, mx.array | None] | None = None  # (start, rows, their device positions)

    @property
    def kv(self) -> mx.array:
        """The array with every row written (the pending ones first: `flush`)."""
        self.flush()
        return self._kv

    @kv.setter
    def kv(self, value: mx.array) -> None:
        self.pending, self._kv = None, value

    def flush(self) -> None:
        """The pending rows written."""
        if self.pending is not None:
            start, rows, index = self.pending
            self.pending = None
            self.write(start, rows, index)

    def write(self, start: int, kv: mx.array, index: mx.array | None) -> None:
        """kv (2 * layers, kv heads, n, head dim) at positions start, start + 1, .. in one copy, or where `index`
        (cache.py's `write_index` of the device positions, for kv's shape) says in one scatter."""
        self.grow(start + kv.shape[2])
        self._kv = put_rows(self._kv, start, kv, index)

    def write_layer(self, layer: int, start: int, kv: mx.array, index: mx.array | None) -> None:
        """Layer `layer`'s rows kv (2, kv heads, n, head dim) at positions start, start + 1, .. (the pending rows
        first): one copy into its rows, or one scatter where `index` (for `StackedLayer.index_shape`) says."""
        self.flush()
        n, heads = kv.shape[2], kv.shape[1]
        self.grow(start + n)
        if index is None:
            self._kv[2 * layer : 2 * layer + 2, :, start : start + n] = kv
        else:
            where = (_rows_index(2 * layer, heads, n), _heads_index(heads, n), index)
            self._kv[where] = kv.reshape(*index.shape, kv.shape[3])

    def grow(self, end: int) -> None:
        """Room for positions up to `end` (cache.py's `grown`)."""
        (self._kv,) = grown((self._kv,), end)

    def arrays(self) -> list[mx.array]:
        """What a round evaluates to keep its writes: the array, and the rows still to write (not written here:
        this round's launches hold the array)."""
        if self.pending is None:
            return [self._kv]
        return [self._kv, *(a for a in self.pending[1:] if a is not None)]

    @property
    def layers(self) -> int:
        return self._kv.shape[0] // 2

    @property
    def nbytes(self) -> int:
        """The array's bytes once the pending rows are written (not written here: a read of the size is no write):
        what the state holds, as the planner prices it (planner.py), where the rows waiting are a forward's output
        until then. A drafter's absorb leaves its rows so after every prompt (tests/test_gpu_mode.py)."""
        if self.pending is None:
            return self._kv.nbytes
        start, rows, _ = self.pending
        two_layers, heads, capacity, dim = self._kv.shape
        return two_layers * heads * dim * self._kv.dtype.size * capacity_for(capacity, start + rows.shape[2])


class StackedLayer(JointCache):
    """Layer `index` of a StackedState: a JointCache whose keys and values are rows 2i, 2i + 1 of the state's one
    array (`stack`: its Stack). Its lengths are its own, as every cache's (cache.py); its rows go into the state's
    array."""

    def __init__(self, stack: Stack, index: int):
        self.stack, self.index = stack, index
        self.length, self.at, self.low = 0, None, 0

    @property
    def kv(self) -> mx.array:
        """The layer's (2, kv heads, capacity, head dim) view of the state's array."""
        return self.stack.kv[2 * self.index : 2 * self.index + 2]

    def index_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A write's positions for rows of `shape` (2, kv heads, n, head dim) as its scatter takes them: (2, kv heads,
        n, 1), one index a row and head, the head dim its slice (the stacked array is indexed on three axes)."""
        return (*shape[:-1], 1)

    def write_joint(self, start: int, kv: mx.array, rows: mx.array | None = None) -> None:
        """JointCache's `write_joint` into the layer's rows of the state's array: a copy at a host start, else one
        scatter at the device positions (`rows`: the positions (n,), or cache.py's `write_index` of them for
        `index_shape(kv.shape)`, made once a forward for every layer: targets/base.py's `Segment.write_index`; or
        none: made from `at`)."""
        self.stack.write_layer(self.index, start, kv, self.index_for(self.index_shape(kv.shape), rows))
        self.advance(start, kv.shape[2])

    def keep_path(self, start: int, rows: list[int]) -> None:
        if rows != list(range(len(rows))):
            index = mx.array([start + r for r in rows], dtype=mx.int32)
            layer = slice(2 * self.index, 2 * self.index + 2)
            self.stack.flush()
            self.stack.kv[layer, :, start : start + len(rows)] = self.stack.kv[layer][:, :, index]
        self.length = start + len(rows)

    def arrays(self) -> list[mx.array]:
        return self.stack.arrays()

    @property
    def nbytes(self) -> int:
        return self.stack.nbytes // self.stack.layers


class StackedState(TargetState):
    """A dense target's state for one stream: every layer's keys and values in `kv` (module docstring), and each
    layer's view of it in `layers`."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32):
        self.stack = Stack(mx.zeros((2 * layers, kv_heads, 0, head_dim), dtype=dtype))
        super().__init__([StackedLayer(self.stack, i) for i in range(layers)])

    @property
    def kv(self) -> mx.array:
        return self.stack.kv

    @kv.setter
    def kv(self, value: mx.array) -> None:
        self.stack.kv = value

    def write_layers(self, start: int, kv: mx.array, rows: mx.array | None = None) -> None:
        """Every layer's rows at once, kv (2 * layers, kv heads, n, head dim) as the state's array lays them out,
        at positions start, start + 1, .. (at the device length and on while there is one: `rows`, the positions
        as cache.py's `write_index` gives them for kv's shape, or none: made here): one copy or one scatter, where a
        layer's `write_joint` each would be one a layer, made where the array is next read (`Stack`)."""
        index = self.layers[0].index_for(kv.shape, rows)
        self.stack.flush()  # (rows an earlier forward left)
        self.stack.pending = (start, kv, index)
        for layer in self.layers:
            layer.advance(start, kv.shape[2])

    def snapshot(self, length: int) -> "StackedState":
        kv = self.kv
        out = type(self)(len(self.layers), kv.shape[1], kv.shape[3], kv.dtype)
        out.kv = mx.array(kv[:, :, : tiles_for(length)])
        for layer in out.layers:
            layer.length = layer.low = length
        return out

    def arrays(self) -> list[mx.array]:
        return self.stack.arrays()

    @property
    def nbytes(self) -> int:
        return self.stack.nbytes
