"""A stream's target state: attention K/V per full-attention layer, GatedDeltaNet state per linear one.

Rows are written at absolute positions and kept (or not) after the round: `keep(length)` is the
only way a window's rejected rows leave, so a stream's state after keeping k+1 rows of a window is
the state of feeding those rows one by one (tests/test_rows.py proves it for every k).

A drafted round keeps before the host knows k (lanes.py builds the next round while the device runs
this one): `keep_at(kept, bound, low)` takes the kept length as a device value, with host bounds
low <= kept <= bound. Until `settle` tells the host the number, `length` is the upper bound (what
sizes writes and key views) and `at` the device value (where the next rows go, their positions, the
keys they see); keys past `at` are stale rows that every reader masks. A prompt
chunk is kept whole: the state it leaves is a deterministic function of the chunk and the state
before it (not of single steps), which is why snapshots are taken only at chunk boundaries
(tests/test_prefill.py proves a resumed prompt computes the fresh one's bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import mlx.core as mx

from dflash_bench.engine.row_ids import row_ids
from dflash_bench.engine.tiles import KEY_TILE

GROW = 4 * KEY_TILE  # capacity grows in whole key tiles


def tiles_for(length: int) -> int:
    """Key rows covering `length` positions, rounded up to whole key tiles."""
    return -(-length // KEY_TILE) * KEY_TILE


def capacity_for(capacity: int, end: int) -> int:
    """A cache's positions once it has room for positions up to `end` (`grown`): its own where they reach, else
    whole key tiles and GROW more."""
    return capacity if end <= capacity else tiles_for(end) + GROW


def grown(caches: tuple[mx.array, ...], end: int) -> tuple[mx.array, ...]:
    """Each cache (positions along its second-to-last axis) with room for positions up to `end`: where it has
    none, grown in whole key tiles and GROW more, one zero block for all of them."""
    axis = caches[0].ndim - 2
    if end <= caches[0].shape[axis]:
        return caches
    shape = list(caches[0].shape)
    shape[axis] = capacity_for(shape[axis], end) - shape[axis]
    pad = mx.zeros(shape, dtype=caches[0].dtype)
    return tuple(mx.concatenate([c, pad], axis=axis) for c in caches)


def put_rows(cache: mx.array, start: int, x: mx.array, index: mx.array | None) -> mx.array:
    """The cache (positions along its second-to-last axis, room for the rows) with rows x at positions start,
    start + 1, ..: copied in at a host start (`index` None), else scattered where `index` (`write_index`) says."""
    if index is None:
        cache[..., start : start + x.shape[-2], :] = x
        return cache
    return mx.put_along_axis(cache, index, x, axis=cache.ndim - 2)


def write_index(rows: mx.array, shape: tuple[int, ...]) -> mx.array:
    """Positions `rows` (n,) int32 as a scatter of rows of `shape` (positions along the second-to-last axis)
    takes them: reshaped and broadcast to `shape`. `mx.put_along_axis` would reshape and broadcast them at every
    write (two nodes a layer and stream for a GPU host to build and encode, three for a cache of keys and values
    apart); a forward builds this once a stream for all its layers (targets/base.py's `Segment.write_index`,
    drafters/dflash.py's `absorb`), and a write handed it adds nothing (`AttentionCache.write`)."""
    return mx.broadcast_to(rows.reshape(*(1,) * (len(shape) - 2), shape[-2], 1), shape)


class AttentionCache:
    """One layer's keys and values for one stream, (heads, capacity, head_dim), row j at position j."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32):
        self.k = mx.zeros((kv_heads, 0, head_dim), dtype=dtype)
        self.v = mx.zeros((kv_heads, 0, head_dim), dtype=dtype)
        self.length = 0  # positions held; while `at` is set, an upper bound of them
        self.at = None  # the length as a device value, until `settle` (module docstring)
        self.low = 0  # a lower bound of the length the host knows (== length when settled)

    @property
    def at(self) -> mx.array | None:
        """The length as a device value while the host has not read it (module docstring), else None: the
        value kept (`keep_at`) plus the rows written since, added only when read. A drafted round writes every
        layer's rows and then keeps the window's accepted ones, which replaces the value unread: an addition a
        layer built at each write would be an array for nothing (a 9B drafted round: 14 a stream)."""
        if self._ahead:
            self._at, self._ahead = self._at + self._ahead, 0
        return self._at

    @at.setter
    def at(self, value: mx.array | None) -> None:
        self._at, self._ahead = value, 0

    def write(self, start: int, k: mx.array, v: mx.array, rows: mx.array | None = None) -> None:
        """Rows at positions start, start + 1, ..; while the length is a device value, `start` is its
        upper bound and the rows go at `at` (the same positions, known only to the device): `rows`,
        those positions as an int32 array where the caller has them, or already as `write_index` gives
        them for rows of k's shape (a forward builds either once for every layer), else made here.

        At a device length the rows are scattered along their positions (`mx.put_along_axis`), not
        copied in at a device offset (`mx.slice_update`): MLX's CUDA copy at a dynamic offset
        launches a thread for every element of the whole cache, ~20 us a write at 512 rows on an
        H200 and growing with the context, where a scatter launches one per element written
        (docs/profiles/round-kernels-h200.txt). Both put the same values at the same positions."""
        self.k, self.v = self.placed((self.k, self.v), start, (k, v), rows)
        self.advance(start, k.shape[1])

    def placed(self, caches: tuple[mx.array, ...], start: int, xs: tuple[mx.array, ...],
               rows: mx.array | None) -> tuple[mx.array, ...]:
        """Each cache (positions along its second-to-last axis) with its rows `xs[i]` at positions start,
        start + 1, .. (at `at` and after while the length is a device value: `write`), grown in whole key
        tiles first: one zero block and one index for all of them."""
        index = self.index_for(xs[0].shape, rows)
        return tuple(put_rows(c, start, x, index) for c, x in zip(grown(caches, start + xs[0].shape[-2]), xs))

    def index_for(self, shape: tuple[int, ...], rows: mx.array | None = None) -> mx.array | None:
        """Where a write of rows (positions along the second-to-last axis of `shape`) goes as a scatter takes them
        (`write_index`), or None while the host knows the length (a copy at its start): `rows`, the positions (n,)
        or their index already (checked against `shape`), or none: the rows from the device length `at` on."""
        if self._at is None:  # (not `at`: reading it adds the rows written since)
            return None
        if rows is None or rows.ndim == 1:
            return write_index(self.at + row_ids(shape[-2]) if rows is None else rows, shape)
        if rows.shape != shape:
            raise ValueError(f"a write index of shape {rows.shape} for rows of shape {shape}")
        return rows

    def advance(self, start: int, n: int) -> None:
        """The lengths after `n` rows written at `start` (`write`)."""
        if self._at is None:
            self.low = start + n
        else:
            self._ahead, self.low = self._ahead + n, self.low + n
        self.length = start + n

    def view(self, length: int) -> tuple[mx.array, mx.array]:
        """Keys and values covering `length` positions in whole key tiles (rows past it are masked)."""
        n = tiles_for(length)
        return self.k[:, :n], self.v[:, :n]

    def keep(self, length: int) -> None:
        self.length = self.low = length
        self.at = None

    def keep_at(self, kept: mx.array, bound: int, low: int) -> None:
        self.at, self.length, self.low = kept, bound, low

    def settle(self, length: int) -> None:
        """The host has read the device length: it is `length`."""
        self.keep(length)

    def keep_path(self, start: int, rows: list[int]) -> None:
        """Keep a draft tree's accepted path (tree.py): its rows, written at start + row, move to
        start, start + 1, .. (their serial positions, where their keys were rotated), the rest leave."""
        if rows != list(range(len(rows))):
            index = mx.array([start + r for r in rows], dtype=mx.int32)
            self.k[:, start : start + len(rows)] = self.k[:, index]
            self.v[:, start : start + len(rows)] = self.v[:, index]
        self.length = start + len(rows)

    def snapshot(self, length: int) -> "AttentionCache":
        """A copy holding the first `length` positions (for the prompt cache)."""
        out = AttentionCache(self.k.shape[0], self.k.shape[2], self.k.dtype)
        n = tiles_for(length)
        out.k, out.v, out.length, out.low = mx.array(self.k[:, :n]), mx.array(self.v[:, :n]), length, length
        return out

    def arrays(self) -> list[mx.array]:
        """The arrays the cache holds (what a round evaluates to keep its writes)."""
        return [self.k, self.v]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class JointCache(AttentionCache):
    """An AttentionCache whose keys and values lie in one array, (2, heads, capacity, head_dim): keys then
    values, `k` and `v` views of it (with the strides a cache of its own would have). A Qwen3.5 target's attention
    layer's (targets/qwen3_5.py), and the view of one layer that a dense target's or a drafter's state of every layer
    in one array gives (stacked_cache.py's StackedLayer): every round writes each layer's
    rows, and at a device length a write is a scatter (`write`'s docstring), which a GPU round pays per launch
    (docs/gpu-round-profile.md): with both in one array it is one scatter a write, not two, where the rows come
    joined (`write_joint`: targets/norm_rope_kernel.py makes them so for a drafter; a target's decode joins its
    streams' rows once and writes each stream's view), and attention_kernel.py reads both from the one array."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32):
        self.kv = mx.zeros((2, kv_heads, 0, head_dim), dtype=dtype)
        self.length, self.at, self.low = 0, None, 0

    @property
    def k(self) -> mx.array:  # slices, not integer indices: an integer index is a gather, a copy
        return self.kv[:1].squeeze(0)

    @property
    def v(self) -> mx.array:
        return self.kv[1:].squeeze(0)

    def write(self, start: int, k: mx.array, v: mx.array, rows: mx.array | None = None) -> None:
        self.write_joint(start, mx.stack([k, v]), rows)

    def index_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of a write's positions (`write_index`) for rows of `shape`, as `write_joint` takes them: the
        rows' own."""
        return shape

    def write_joint(self, start: int, kv: mx.array, rows: mx.array | None = None) -> None:
        """`write` of rows joined as (2, heads, n, head_dim), keys then values: one copy or one scatter."""
        (self.kv,) = self.placed((self.kv,), start, (kv,), rows)
        self.advance(start, kv.shape[2])

    def keep_path(self, start: int, rows: list[int]) -> None:
        if rows != list(range(len(rows))):
            index = mx.array([start + r for r in rows], dtype=mx.int32)
            self.kv[:, :, start : start + len(rows)] = self.kv[:, :, index]
        self.length = start + len(rows)

    def arrays(self) -> list[mx.array]:
        return [self.kv]

    def snapshot(self, length: int) -> "JointCache":
        out = JointCache(self.kv.shape[1], self.kv.shape[3], self.kv.dtype)
        out.kv, out.length, out.low = mx.array(self.kv[:, :, : tiles_for(length)]), length, length
        return out

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes


class Together(Protocol):
    """The rollback record of one layer's windows that one launch ran (qwen3_5.py's `PackedRedo`)."""

    windows: int  # how many windows the launch ran

    @staticmethod
    def many(jobs: list[tuple["Together", mx.array, dict[int, mx.array]]]) -> list[dict[int, tuple[mx.array, mx.array]]]:
        """For each (record, counts, kept): window w's (conv, state) after its first kept[w] rows, for each w of
        `kept`; `counts` holds every window's count (0 for those not kept here) as the launch takes them.
        Records alike (a round's layers) roll back in one launch."""


@dataclass
class LinearCache:
    """One GatedDeltaNet layer's state: the conv's last inputs and the recurrent state.

    A window's forward leaves `redo`: a function that recomputes the state after its first m rows,
    which `keep` calls when only part of the window is accepted, and `keep_at` with m a device value.
    Where one launch ran several streams' windows, it also leaves `together`: the rollback of all of
    them in one launch (`Together`) and this one's window in it, which `keep_windows` uses.
    The state holds no positions, so a window's rows never need the device length, only the kept count.
    """

    conv: mx.array
    state: mx.array
    length: int = 0
    redo: Callable[[int | mx.array], tuple[mx.array, mx.array]] | None = field(default=None, repr=False)
    window_start: int = 0
    window_at: mx.array | None = field(default=None, repr=False)  # the window's start as a device value
    together: tuple[Together, int] | None = field(default=None, repr=False)

    def keep(self, length: int) -> None:
        if length != self.length:
            if self.redo is None or not (self.window_start <= length < self.length):
                raise ValueError(f"cannot roll a linear-attention state from {self.length} back to {length}")
            self.conv, self.state = self.redo(length - self.window_start)
            self.length = length
        self.redo = self.together = None

    def keep_at(self, kept: mx.array, bound: int, low: int, rows: mx.array | None = None) -> None:
        """Keep the window's first `kept - start` rows, a device value (`rows`, where the caller made it:
        TargetState.keep_at): one recurrence over the kept rows whatever their count, since the host does
        not know it (qwen3_5.py's `redo_fn`)."""
        if self.redo is not None:
            self.conv, self.state = self.redo(self.kept_rows(kept) if rows is None else rows)
        self.redo, self.together, self.window_at, self.length = None, None, None, bound

    def kept_rows(self, kept: mx.array) -> mx.array:
        """How many of the window's rows a kept length `kept` (a device value) keeps."""
        return kept - (self.window_start if self.window_at is None else self.window_at)

    def settle(self, length: int) -> None:
        self.length = length

    def snapshot(self, length: int) -> "LinearCache":
        if length != self.length or self.redo is not None:
            raise ValueError("a linear-attention state can be snapshotted only at its committed length")
        return LinearCache(self.conv, self.state, length)

    def arrays(self) -> list[mx.array]:
        return [self.conv, self.state]

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.state.nbytes


class TargetState:
    """Every layer's cache for one stream, and how many positions it holds."""

    def __init__(self, layers: list[AttentionCache | LinearCache]):
        self.layers = layers

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def at(self) -> mx.array | None:
        """The length as a device value while the host has not read it (module docstring), else None."""
        for layer in self.layers:
            if isinstance(layer, AttentionCache):
                return layer.at
        return None

    def keep(self, length: int) -> None:
        for layer in self.layers:
            layer.keep(length)

    def keep_at(self, kept: mx.array, bound: int, low: int) -> None:
        """Keep `kept` positions, a device value the host knows only as low <= kept <= bound. The
        GatedDeltaNet layers' windows all start where the stream's forward did, so how many rows they
        keep is one subtraction a stream, not one a layer (24 on a Qwen3.5-9B)."""
        rows = self.kept_rows(kept)
        for layer in self.layers:
            if isinstance(layer, LinearCache):
                layer.keep_at(kept, bound, low, rows)
            else:
                layer.keep_at(kept, bound, low)

    def kept_rows(self, kept: mx.array) -> mx.array | None:
        """How many rows of its window a kept length keeps in the GatedDeltaNet layers that have one to
        roll back (None where none has): their windows start where the stream's forward did."""
        return next((layer.kept_rows(kept) for layer in self.layers
                     if isinstance(layer, LinearCache) and layer.redo is not None), None)

    def settle(self, length: int) -> None:
        """The host has read the kept length: it is `length` (no array changes)."""
        for layer in self.layers:
            layer.settle(length)

    def keep_path(self, start: int, rows: list[int]) -> None:
        """Keep a draft tree's accepted rows (root first) at start, start + 1, ..: attention layers
        only, since a linear-attention state is one per path (trees fall back to chains there)."""
        for layer in self.layers:
            if not isinstance(layer, AttentionCache):
                raise ValueError("a linear-attention state cannot keep a draft tree's path")
            layer.keep_path(start, rows)

    def snapshot(self, length: int) -> "TargetState":
        return type(self)([layer.snapshot(length) for layer in self.layers])

    def arrays(self) -> list[mx.array]:
        out: list[mx.array] = []
        for layer in self.layers:
            out += layer.arrays()
        return out

    def committed(self) -> list[mx.array]:
        """Every array a stream's future depends on: K/V up to its length (not the slack past it), the
        conv inputs and recurrent state. Two states whose `committed` arrays are equal continue alike."""
        out: list[mx.array] = []
        for layer in self.layers:
            if isinstance(layer, AttentionCache):
                out += [layer.k[:, : layer.length], layer.v[:, : layer.length]]
            else:
                out += [layer.conv, layer.state]
        return out

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def keep_windows(kept: list[tuple[TargetState, tuple[mx.array, int, int]]]) -> None:
    """Each stream's `keep_at(*keep)`, for streams whose windows one forward ran: where GatedDeltaNet layers'
    launches ran them (`LinearCache.together`), their rollback is one launch for every layer and stream, not
    one a layer and stream (lanes.py keeps a round's chain windows so; 24 layers on a Qwen3.5-9B). Each window
    still walks its own kept rows from its own state (delta_kernel.py's `rollback`), so every state is the one
    `keep_at` leaves."""
    # each layer's launch record with its windows' kept rows and caches, in the layers' order: one walk over
    # each state's layers (walking every state's layer i for each i cost about 0.1 ms more of a 9B-pattern drafted
    # round on this project's CPU: tools/round_host.py)
    groups: dict[int, tuple[Together, dict[int, mx.array], list[LinearCache]]] = {}
    for state, (kept_length, _, _) in kept:
        if not isinstance(state, TargetState):
            continue
        rows = None  # the stream's kept rows, made once and only where a launch needs them
        for c in state.layers:
            if not isinstance(c, LinearCache) or c.together is None:
                continue
            group, w = c.together
            if rows is None:
                rows = state.kept_rows(kept_length)
            entry = groups.get(id(group))
            if entry is None:
                entry = groups[id(group)] = (group, {}, [])
            entry[1][w] = rows
            entry[2].append(c)
    counts: dict[tuple, mx.array] = {}  # the launch's counts, once a round: every layer's windows lie alike
    jobs: list[tuple[Together, mx.array, dict[int, mx.array]]] = []
    for group, by_window, _ in groups.values():
        key = (group.windows, *((w, id(m)) for w, m in sorted(by_window.items())))
        if key not in counts:
            zero = mx.zeros((1,), dtype=mx.int32)
            parts = [mx.reshape(by_window[w], (1,)) if w in by_window else zero for w in range(group.windows)]
            counts[key] = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        jobs.append((group, counts[key], by_window))
    for (_, _, members), done in zip(groups.values(), type(jobs[0][0]).many(jobs) if jobs else []):
        for c in members:
            c.conv, c.state = done[c.together[1]]
            c.redo = c.together = None
    for state, keep in kept:  # the rest of each state: attention layers, and windows rolled back alone
        state.keep_at(*keep)
