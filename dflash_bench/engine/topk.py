"""Each row's k largest logits without sorting the whole row.

DFlash2's selector keeps the top 16 of a 49,152-id vocabulary at every draft position: in the
engine's drafter pass (drafters/dflash2.py), 16 rows a stream, and in its training loss
(tools/train_drafter/train.py), 2,048 blocks x 15 rows a step. MLX's argpartition costs ~7.6 ms for
16 such rows on the CPU, and on CUDA it sorts each full row. Every element of a chunk is at most the
chunk's maximum, so the k chunks with the largest maxima hold a top-k set: a chunk holding one of
the k largest values has a maximum that fewer than k other chunks exceed. Ranking V / chunk maxima,
then the k * chunk gathered values, ranks ~25x fewer elements at chunk 64 (1.7 ms for those 16 rows).
"""

from __future__ import annotations

import mlx.core as mx


def top_k_indices(logits: mx.array, k: int, chunk: int = 64) -> mx.array:
    """The indices of each row's k largest logits (last axis), in no order. The set equals
    argpartition's; ties may resolve to other indices of equal value."""
    vocab = logits.shape[-1]
    if vocab <= k * chunk:  # the gathered chunks would be the whole row
        return mx.argpartition(logits, -k, axis=-1)[..., -k:]
    pad = -vocab % chunk
    if pad:
        logits = mx.concatenate([logits, mx.full((*logits.shape[:-1], pad), -mx.inf, logits.dtype)], axis=-1)
    blocks = logits.reshape(*logits.shape[:-1], -1, chunk)
    best = mx.argpartition(blocks.max(axis=-1), -k, axis=-1)[..., -k:]
    columns = (best[..., None] * chunk + mx.arange(chunk)).reshape(*best.shape[:-1], k * chunk)
    pick = mx.argpartition(mx.take_along_axis(logits, columns, axis=-1), -k, axis=-1)[..., -k:]
    return mx.take_along_axis(columns, pick, axis=-1)
