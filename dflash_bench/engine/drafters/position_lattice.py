"""A v1 drafter's draft-tree candidates from one block pass (tree.py's `Lattice`): each depth's top tokens by the
scores the chain picks by, ranked in NumPy (`PositionLattice`). drafters/dflash.py's `lattices` makes one a stream."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def best_ids(scores: np.ndarray, width: int) -> np.ndarray:
    """Each row's `width` highest-scoring ids, best first (ties: the lower id), by repeated argmax."""
    left, rows = scores.copy(), np.arange(scores.shape[0])
    best = np.empty((scores.shape[0], width), dtype=np.int64)
    for j in range(width):
        best[:, j] = left.argmax(axis=-1)
        left[rows, best[:, j]] = -np.inf
    return best


class PositionLattice:
    """v1's tree candidates (tree.py): each depth's top `width` tokens by the chain's own scores (the
    logits, or at T > 0 the keyed Gumbel-perturbed filtered ones), the same after any parent, the
    chain's draft first, with their log-probabilities under those scores."""

    def __init__(self, scores: mx.array, picks: mx.array, width: int):
        # Ranked in NumPy: only which drafts a tree proposes depends on these numbers, never a kept
        # token, and MLX's CPU exp over a block's vocabulary rows cost ~6x NumPy's (17 vs 2.7 ms for
        # 15 x 49,152 on a 2-core CPU): the lattice took 32.5 ms, a tenth of a one-stream drafted
        # round, and takes 20.3 ms this way (docs/verify-budget.md). Each depth's best `width` come
        # from `width` argmax sweeps, not a partition of the vocabulary: 0.4 against 7.4 ms at
        # 15 x 49,152 here, ties going to the lower token id.
        s = np.array(scores.astype(mx.float32))
        width = min(width, s.shape[-1])
        top = s.max(axis=-1, keepdims=True)
        with np.errstate(invalid="ignore"):  # -inf - -inf in a row with nothing kept: NaN, dropped below
            lse = top + np.log(np.exp(s - top).sum(axis=-1, keepdims=True))
        picks_np = np.array(picks)
        best = best_ids(s, width)
        self.depths: list[tuple[list[int], list[float]]] = []
        for row in range(s.shape[0]):
            pick = int(picks_np[row])
            ranked = [(pick, float(s[row, pick] - lse[row, 0]))]
            for token in best[row]:  # best first; a row with fewer finite scores repeats tokens or has -inf
                logp = float(s[row, token] - lse[row, 0])
                if len(ranked) < width and np.isfinite(logp) and all(int(token) != t for t, _ in ranked):
                    ranked.append((int(token), logp))
            self.depths.append(([t for t, _ in ranked], [lp for _, lp in ranked]))

    @property
    def levels(self) -> int:
        return len(self.depths)

    def children(self, depth: int, parent_token: int) -> tuple[list[int], list[float]]:
        return self.depths[depth - 1]
