"""A stream's target state: attention K/V per full-attention layer, GatedDeltaNet state per linear one.

Rows are written at absolute positions and kept (or not) after the round: `keep(length)` is the
only way a window's rejected rows leave, so a stream's state after keeping k+1 rows of a window is
the state of feeding those rows one by one (tests/test_rows.py proves it for every k). A prompt
chunk is kept whole: the state it leaves is a deterministic function of the chunk and the state
before it (not of single steps), which is why snapshots are taken only at chunk boundaries
(tests/test_prefill.py proves a resumed prompt computes the fresh one's bits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from dflash_bench.engine.tiles import KEY_TILE

GROW = 4 * KEY_TILE  # capacity grows in whole key tiles


def tiles_for(length: int) -> int:
    """Key rows covering `length` positions, rounded up to whole key tiles."""
    return -(-length // KEY_TILE) * KEY_TILE


class AttentionCache:
    """One layer's keys and values for one stream, (heads, capacity, head_dim), row j at position j."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32):
        self.k = mx.zeros((kv_heads, 0, head_dim), dtype=dtype)
        self.v = mx.zeros((kv_heads, 0, head_dim), dtype=dtype)
        self.length = 0

    def write(self, start: int, k: mx.array, v: mx.array) -> None:
        end = start + k.shape[1]
        if end > self.k.shape[1]:
            grow = tiles_for(end) + GROW - self.k.shape[1]
            pad = mx.zeros((self.k.shape[0], grow, self.k.shape[2]), dtype=self.k.dtype)
            self.k = mx.concatenate([self.k, pad], axis=1)
            self.v = mx.concatenate([self.v, pad], axis=1)
        self.k[:, start:end] = k
        self.v[:, start:end] = v
        self.length = end

    def view(self, length: int) -> tuple[mx.array, mx.array]:
        """Keys and values covering `length` positions in whole key tiles (rows past it are masked)."""
        n = tiles_for(length)
        return self.k[:, :n], self.v[:, :n]

    def keep(self, length: int) -> None:
        self.length = length

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
        out.k, out.v, out.length = mx.array(self.k[:, :n]), mx.array(self.v[:, :n]), length
        return out

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class LinearCache:
    """One GatedDeltaNet layer's state: the conv's last inputs and the recurrent state.

    A window's forward leaves `redo`: a function that recomputes the state after its first n rows,
    which `keep` calls when only part of the window is accepted.
    """

    conv: mx.array
    state: mx.array
    length: int = 0
    redo: Callable[[int], tuple[mx.array, mx.array]] | None = field(default=None, repr=False)
    window_start: int = 0

    def keep(self, length: int) -> None:
        if length != self.length:
            if self.redo is None or not (self.window_start <= length < self.length):
                raise ValueError(f"cannot roll a linear-attention state from {self.length} back to {length}")
            self.conv, self.state = self.redo(length - self.window_start)
            self.length = length
        self.redo = None

    def snapshot(self, length: int) -> "LinearCache":
        if length != self.length or self.redo is not None:
            raise ValueError("a linear-attention state can be snapshotted only at its committed length")
        return LinearCache(self.conv, self.state, length)

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

    def keep(self, length: int) -> None:
        for layer in self.layers:
            layer.keep(length)

    def keep_path(self, start: int, rows: list[int]) -> None:
        """Keep a draft tree's accepted rows (root first) at start, start + 1, ..: attention layers
        only, since a linear-attention state is one per path (trees fall back to chains there)."""
        for layer in self.layers:
            if not isinstance(layer, AttentionCache):
                raise ValueError("a linear-attention state cannot keep a draft tree's path")
            layer.keep_path(start, rows)

    def snapshot(self, length: int) -> "TargetState":
        return TargetState([layer.snapshot(length) for layer in self.layers])

    def arrays(self) -> list[mx.array]:
        out: list[mx.array] = []
        for layer in self.layers:
            out += [layer.k, layer.v] if isinstance(layer, AttentionCache) else [layer.conv, layer.state]
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
