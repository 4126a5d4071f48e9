"""Keyed sampling: the draw for a token depends only on (seed, absolute position, token id).

A token at temperature T is argmax(logits / T + g) over the tokens that top-k and top-p keep, with
Gumbel noise g = -log(-log(u)) and u a hash of (seed, position, id): the Gumbel-max trick, so the
choice is a sample of the filtered softmax. Because the noise is a pure function of the key, the
target's choice at a position is the same whether that row was drafted, plain, alone or among
other streams, and a draft is kept only when it equals that choice (the same rule as greedy):
`accepted`, as a device value a round reads once (lanes.py's verify).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import mlx.core as mx

from dflash_bench.engine.row_ids import row_ids


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def seed_from_prompt(prompt: list[int]) -> int:
    """The seed of a request that names none: a hash of its prompt ids."""
    digest = hashlib.sha256(",".join(map(str, prompt)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _mix(x: mx.array) -> mx.array:
    """A 32-bit integer finalizer (xor-shift-multiply), elementwise on uint32."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x7FEB352D, dtype=mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(0x846CA68B, dtype=mx.uint32)
    return x ^ (x >> 16)


def gumbel(seed: int, positions: mx.array, vocab: int) -> mx.array:
    """Gumbel noise of shape (rows, vocab) keyed by (seed, positions[row], token id)."""
    ids = mx.arange(vocab, dtype=mx.uint32)[None, :]
    pos = _mix(positions.astype(mx.uint32)[:, None] + mx.array(seed & 0xFFFFFFFF, dtype=mx.uint32))
    x = _mix(pos ^ (ids * mx.array(0x9E3779B1, dtype=mx.uint32)))
    u = ((x >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))
    return -mx.log(-mx.log(u))


def filtered(scores: mx.array, top_k: int, top_p: float) -> mx.array:
    """Scores with what top-k and top-p drop set to -inf (ties at a threshold are kept)."""
    if 0 < top_k < scores.shape[-1]:
        kth = mx.min(mx.topk(scores, top_k, axis=-1), axis=-1, keepdims=True)
        scores = mx.where(scores >= kth, scores, -mx.inf)
    if top_p < 1.0:
        ordered = -mx.sort(-scores, axis=-1)
        probs = mx.softmax(ordered, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs
        kept = mx.where(before < top_p, ordered, mx.inf)
        floor = mx.min(kept, axis=-1, keepdims=True)
        scores = mx.where(scores >= floor, scores, -mx.inf)
    return scores


def choose(logits: mx.array, positions: mx.array, params: SamplingParams) -> mx.array:
    """The token chosen for each row; positions are the absolute positions of the chosen tokens."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    scores = filtered(logits.astype(mx.float32) / params.temperature, params.top_k, params.top_p)
    return mx.argmax(scores + gumbel(params.seed, positions, logits.shape[-1]), axis=-1)


def accepted(drafts: mx.array, chosen: mx.array, plus: int = 0) -> mx.array:
    """How many drafts a window keeps, as a device value: the first draft unequal to the choice before
    it (the choice at the row of the draft's parent), or all of them; `plus` more, counted in the same
    operations (verify.py counts the window's rows kept, the pending token's included). An elementwise compare
    and a minimum, kernels every round runs anyway (the warm-up runs this too). Along the last axis: drafts
    (windows, n) and choices (windows, n + 1) give each window's count (verify.py's windows together)."""
    n = drafts.shape[-1]
    if n == 0:
        return mx.array(plus, dtype=mx.int32)
    return mx.min(mx.where(drafts != chosen[..., :n], row_ids(n, plus), mx.array(n + plus, dtype=mx.int32)), axis=-1)
