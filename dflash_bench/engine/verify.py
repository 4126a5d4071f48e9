"""A round's chain windows verified on the device: each window's choices, its accepted count and its anchor.

A window is a stream's pending token then its drafts. The target's choice at each row (sampling.choose), the
rows kept k + 1 (the pending token and the leading run of k drafts equal to the choices before them:
sampling.accepted, counting the pending token in the same operations, so that the kept length is one addition
from a device origin, lanes.py's `keep_verdict`) and the anchor (the choice after them, row k) stay device values
until lanes.py's `read`, so the next round can be queued on them. Alone, a window's verify is a pick, a cast, a compare, a select, a minimum, a gather and a join: seven
operations a stream, each a kernel launch on a GPU. Greedy windows of one width whose logits rows lie one after
another in the forward's logits (every stream's full-block window, as rounds usually are) are verified together
in the same seven (and a stack of their drafts): an argmax, a compare and a minimum are row by row, so each
window's values are the bits it gets alone (tests/test_verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from dflash_bench.engine.sampling import SamplingParams, accepted, choose
from dflash_bench.engine.targets.base import Segment, SegmentOut
from dflash_bench.engine.tree import Lattice


@dataclass
class Verdict:
    """A chain window's verify as device values: its rows kept (k + 1) then the target's choice at each row,
    and what reading them needs."""

    values: mx.array  # int32 (1 + rows,): k + 1, then the choices
    keep: tuple[mx.array, int, int]  # the kept length, its host bounds (cache.py's keep_at)
    window: list[int]  # the window's tokens where the host has them (the auto budget's tree ranks), else []
    lattice: Lattice | None


@dataclass(frozen=True)
class Window:
    """One stream's window to verify: its sampling, its segment and forward output, and its drafts (device
    values where the drafter's pass left them there, else the host's)."""

    params: SamplingParams
    segment: Segment
    out: SegmentOut
    drafts: mx.array | tuple[int, ...]


@dataclass(frozen=True)
class Verified:
    """A window's verify: [k + 1, choices...], the rows kept k + 1 (the pending token and k drafts), and the
    anchor (the choice at row k), device values."""

    values: mx.array
    kept: mx.array
    anchor: mx.array


def verify(windows: list[Window]) -> list[Verified]:
    """Every window's verify, in order: each run of windows that `follows` allows together, the others alone."""
    verified: list[Verified] = []
    start = 0
    while start < len(windows):
        end = start + 1
        while end < len(windows) and follows(windows[end - 1], windows[end]):
            end += 1
        run = windows[start:end]
        verified += joint(run) if len(run) > 1 else [alone(run[0])]
        start = end
    return verified


def drafts_array(w: Window) -> mx.array:
    """The window's drafts as an int32 array (the host's become an input, not an operation)."""
    return w.drafts if isinstance(w.drafts, mx.array) else mx.array(w.drafts, dtype=mx.int32)


def alone(w: Window) -> Verified:
    chosen = choose(w.out.logits, w.segment.positions() + 1, w.params).astype(mx.int32)
    kept = accepted(drafts_array(w), chosen, plus=1)
    values = mx.concatenate([kept.reshape(1), chosen])
    return Verified(values, kept, values[kept])  # values[k + 1] is the choice at row k


def greedy_chain(w: Window) -> bool:
    """A greedy window with drafts, every row's logits wanted."""
    rows = len(w.segment.tokens)
    return w.params.greedy and rows > 1 and rows == len(w.drafts) + 1 == w.out.logits.shape[0]


def follows(a: Window, b: Window) -> bool:
    """Whether `b` joins `a`'s run: both greedy chains of one width, b's logits rows right after a's in one
    forward's logits."""
    rows = len(a.segment.tokens)
    return (greedy_chain(a) and greedy_chain(b) and len(b.segment.tokens) == rows and a.out.joint is not None
            and b.out.joint is a.out.joint and b.out.first == a.out.first + rows)


def joint(windows: list[Window]) -> list[Verified]:
    """`alone`'s values for every window from one launch a step: the windows' logits rows as one block (a view
    of the forward's logits), picks (streams, rows), drafts (streams, rows - 1)."""
    streams, rows, first = len(windows), len(windows[0].segment.tokens), windows[0].out.first
    logits = windows[0].out.joint[first : first + streams * rows]
    picks = mx.argmax(logits, axis=-1).astype(mx.int32).reshape(streams, rows)
    if any(isinstance(w.drafts, mx.array) for w in windows):
        drafts = mx.stack([drafts_array(w) for w in windows])
    else:  # the host's drafts: an input, not an operation
        drafts = mx.array([list(w.drafts) for w in windows], dtype=mx.int32)
    kept = accepted(drafts, picks, plus=1)
    values = mx.concatenate([kept[:, None], picks], axis=1)
    anchors = mx.take_along_axis(values, kept[:, None], axis=1)  # values[k + 1]: the choice at row k
    # a row as a slice (a view): an int index is a gather in MLX
    return [Verified(values[i : i + 1].reshape(rows + 1), kept[i : i + 1].reshape(()), anchors[i, 0])
            for i in range(streams)]
