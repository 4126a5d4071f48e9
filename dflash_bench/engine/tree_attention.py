"""Attention of a draft tree's rows, each exactly the serial step of its path (tree.py).

A tree node at depth d is the token at position start + d after its ancestors, so its serial step
sees the committed keys [0, start), then its ancestors' keys at start, start + 1, .., then its own
at start + d. An additive mask over the tree's rows in their packed order would not give those
bits: a reduction groups its summands by slot, and the ancestors would sit at other slots, with
other rows' (masked) keys between them. So each row gets its own key view laid out as its serial
step's: the committed keys, then its path at the serial positions, then masked slots.

Only the key tiles from start // KEY_TILE on differ between rows. The tiles before them (`prefix`)
are shared: their products run for all rows in packed query tiles, as a chain window's do (a row's
bits in a fixed-shape gemm do not depend on the other rows of its tile or its place there:
selfcheck.py proves it on the machine that serves). The `tail` tiles run per row against that
row's own keys: the row's query heads that share a K/V head fill one zero-padded query tile, the
same QUERY_TILE x KEY_TILE gemm shape (one call per row and K/V head, not one per query head: a
forward's cost is mostly such calls). Both parts then go through the chain's own softmax and
merge (tiles.py), reduced over key tiles in the same order, so masked slots and trailing tiles add
exact zeros. tests/test_trees.py proves the result equals serial steps bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dflash_bench.engine.tiles import (
    KEY_TILE, QUERY_TILE, AttentionPath, merge, scores_of, softmax_parts, weighted_of,
)
from dflash_bench.engine.tree import Tree


def tail_index(tree: Tree, start: int, rows: int) -> tuple[int, int, np.ndarray]:
    """Where each row's tail key slots come from.

    Returns (prefix, tail, index): the shared key rows [0, prefix) (whole tiles before `start`), the
    tail's length (whole tiles covering the deepest node), and index (rows, tail) into the source
    rows [cache rows prefix .. start, then the tree's rows]. Padded rows copy the root's. A masked
    slot (past the row's own position) holds the root's key: any finite key adds an exact zero
    there, as the stale rows past a chain window's end do.
    """
    prefix = start // KEY_TILE * KEY_TILE
    end = start + tree.depth + 1
    tail = -(-end // KEY_TILE) * KEY_TILE - prefix
    committed, n = start - prefix, len(tree.tokens)
    index = np.full((rows, tail), committed, dtype=np.int32)
    index[:, :committed] = np.arange(committed, dtype=np.int32)
    for row in range(rows):
        path = tree.path(row if row < n else 0)
        index[row, committed : committed + len(path)] = committed + np.array(path, dtype=np.int32)
    return prefix, tail, index


def tree_keys(source: mx.array, index: mx.array) -> mx.array:
    """Each row's tail keys (or values), (heads, rows, tail, d), gathered from the cache's rows
    [prefix, start + n): the committed rows of the tail's first tile, then the tree's rows."""
    return source[:, index]


def tree_attention(
    q: mx.array,
    prefix_k: mx.array,
    prefix_v: mx.array,
    tail_k: mx.array,
    tail_v: mx.array,
    seen: mx.array,
    *,
    scale: float,
    path: AttentionPath = "tiled",
) -> mx.array:
    """q: (Hq, R, d), R a multiple of QUERY_TILE; prefix_k/v: (Hkv, P, d), the shared key tiles (P a
    multiple of KEY_TILE, possibly 0); tail_k/v: (Hkv, R, L, d), each row's own key tiles; `seen`
    from `key_mask` over P + L keys at the rows' positions. Returns (Hq, R, d)."""
    hq, rq, d = q.shape
    hkv, p, _ = prefix_k.shape
    group = hq // hkv
    nq, nsh, nt = rq // QUERY_TILE, p // KEY_TILE, tail_k.shape[2] // KEY_TILE
    qs = q * scale
    parts = []
    if nsh:
        kt = prefix_k.reshape(hkv, 1, 1, nsh, KEY_TILE, d).swapaxes(-1, -2)
        parts.append(scores_of(qs.reshape(hkv, group, nq, 1, QUERY_TILE, d), kt, path))
    heads_q = qs.reshape(hkv, group, rq, d).transpose(0, 2, 1, 3)  # (hkv, R, group, d): one row's heads
    kt = tail_k.reshape(hkv, rq, nt, 1, KEY_TILE, d).swapaxes(-1, -2)
    parts.append(from_rows(by_head(scores_of(head_tiles(heads_q)[:, :, None], kt, path), group), nq))
    e, total = softmax_parts(mx.concatenate(parts, axis=3) if len(parts) > 1 else parts[0], seen)
    weighted = []
    if nsh:
        vt = prefix_v.reshape(hkv, 1, 1, nsh, KEY_TILE, d)
        weighted.append(weighted_of(e[:, :, :, :nsh], vt, path))
    heads_e = e[:, :, :, nsh:].swapaxes(3, 4).reshape(hkv, group, rq, nt, KEY_TILE).transpose(0, 2, 3, 1, 4)
    vt = tail_v.reshape(hkv, rq, nt, 1, KEY_TILE, d)
    weighted.append(from_rows(by_head(weighted_of(head_tiles(heads_e), vt, path), group), nq))
    return merge(mx.concatenate(weighted, axis=3) if len(weighted) > 1 else weighted[0], total).reshape(hq, rq, d)


def head_tiles(rows: mx.array) -> mx.array:
    """(..., group, w): one tree row's query heads that share a K/V head (or their weights), padded with
    zero rows into whole QUERY_TILE-row tiles: (..., tiles, QUERY_TILE, w)."""
    group = rows.shape[-2]
    tiles = -(-group // QUERY_TILE)
    padded = mx.pad(rows, [(0, 0)] * (rows.ndim - 2) + [(0, tiles * QUERY_TILE - group), (0, 0)])
    return padded.reshape(*rows.shape[:-2], tiles, QUERY_TILE, rows.shape[-1])


def by_head(x: mx.array, group: int) -> mx.array:
    """(hkv, R, tail tiles, head tiles, QUERY_TILE, w) products of `head_tiles` back to
    (hkv, group, R, tail tiles, w)."""
    hkv, rq, nt, tiles, _, w = x.shape
    return x.reshape(hkv, rq, nt, tiles * QUERY_TILE, w)[:, :, :, :group].transpose(0, 3, 1, 2, 4)


def from_rows(x: mx.array, nq: int) -> mx.array:
    """(hkv, group, R, tiles, w) per-row results back to the tiled layout (hkv, group, nq, tiles, QUERY_TILE, w)."""
    hkv, group, _, tiles, w = x.shape
    return x.reshape(hkv, group, nq, QUERY_TILE, tiles, w).swapaxes(3, 4)
