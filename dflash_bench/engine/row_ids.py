"""Small int32 index arrays built once from host data and kept: a round's positions at a device length.

A window placed at a kept length the host has not read yet (cache.py's `keep_at`) takes its rows' positions as
that length plus 0..n-1, and a drafted round builds such positions for every stream: the target's verify, the
drafter's block pass and absorb, the draft keys, the accepted count's row numbers. Built with `mx.arange`, each
is an operation of the round's graph (on a GPU a kernel launch, and the host's cost of encoding one, a stream
each time). Built from host data, the array is an input the graph reads: the same int32 values, no operation.
Kept per shape, the host writes it once (never a buffer the device has used since, as a fresh host array
could be), and it is never evaluated inside a round, which would wait for the work queued before it.
"""

from __future__ import annotations

import threading

import mlx.core as mx

_KEPT: dict[tuple[int, int, int], mx.array] = {}
_LOCK = threading.Lock()


def row_ids(n: int, first: int = 0, zeros: int = 0) -> mx.array:
    """first, first + 1, ..., first + n - 1 as int32 (`mx.arange(first, first + n)`'s values), then `zeros`
    zeros (a window's rows padded to whole query tiles): the same array for the same arguments. For windows'
    few rows only: an array a shape is kept for the process's life."""
    key = (n, first, zeros)
    with _LOCK:
        ids = _KEPT.get(key)
        if ids is None:
            ids = _KEPT[key] = mx.array([*range(first, first + n), *([0] * zeros)], dtype=mx.int32)
        return ids
