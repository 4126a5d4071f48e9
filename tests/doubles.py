"""Test doubles that need no weights: a target that hashes its history and an oracle drafter.

`HashTarget`'s next-token logits are a hash of the whole token history *as read back from its
caches*: an attention-style cache holding every token at its position, and a recurrent checksum
rolled back through `LinearCache.redo` like a GatedDeltaNet state. Any cache, position or
rollback bug changes the output. `OracleDrafter` replays the target's own rule to draft exactly
k right tokens of a block followed by wrong ones, cycling k so every acceptance length occurs.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np

from dflash_bench.engine.cache import AttentionCache, LinearCache, TargetState
from dflash_bench.engine.drafters.dflash import Proposal
from dflash_bench.engine.sampling import choose
from dflash_bench.engine.targets.base import Segment, SegmentOut

VOCAB = 97
EOS = 3


def history_logits(history: list[int], checksum: int) -> np.ndarray:
    digest = hashlib.sha256((",".join(map(str, history)) + f"|{checksum}").encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    logits = rng.normal(size=VOCAB).astype(np.float32) * 3.0
    logits[EOS] -= 4.0  # keep replies long enough to exercise rounds
    return logits


def step_checksum(checksum: int, token: int, position: int) -> int:
    return (checksum * 1000003 + token * 7919 + position + 1) % 2_147_483_647


class HashTarget:
    """The Target interface over two caches whose contents decide every logit."""

    def __init__(self):
        self.embed = mx.zeros((VOCAB, 1))
        self.forwards = 0

    def new_state(self) -> TargetState:
        return TargetState([AttentionCache(1, 1), LinearCache(mx.zeros((1, 1)), mx.zeros((1,), dtype=mx.int32))])

    def forward(self, segments: list[Segment], taps: tuple[int, ...] = (), ids: mx.array | None = None
                ) -> list[SegmentOut]:
        """Every segment's logits from its state's history (`ids`, the segments' ids joined, adds nothing: each
        segment reads its own)."""
        self.forwards += 1
        outs = []
        for seg in segments:
            kv, rec = seg.state.layers
            assert seg.start == kv.length == rec.length, "segment is not at the state's end"
            tokens = list(seg.tokens) if seg.ids is None else seg.ids.tolist()  # a queued round's are an array
            start = seg.start if seg.at is None else seg.at.item()  # a device start: `seg.start` bounds it
            assert start <= seg.start
            n = len(tokens)
            ids = mx.array(tokens, dtype=mx.float32).reshape(1, n, 1)
            kv.write(seg.start, ids, ids)
            history = [int(t) for t in np.array(kv.k[0, : start + n, 0])]
            before = int(rec.state.item())
            sums, c = [], before
            for i, t in enumerate(tokens):
                c = step_checksum(c, t, start + i)
                sums.append(c)

            def redo(m: int | mx.array, before=before, start=start, tokens=tokens) -> tuple[mx.array, mx.array]:
                c = before
                for i, t in enumerate(tokens[: int(m.item()) if isinstance(m, mx.array) else m]):
                    c = step_checksum(c, t, start + i)
                return mx.zeros((1, 1)), mx.array([c], dtype=mx.int32)

            rec.state = mx.array([sums[-1]], dtype=mx.int32)
            rec.length, rec.window_start, rec.redo = seg.start + n, seg.start, (redo if n > 1 else None)
            rec.window_at = seg.at
            rows = [history_logits(history[: start + r + 1], sums[r]) for r in seg.logit_rows]
            logits = mx.array(np.stack(rows)) if rows else None
            tap_rows = mx.array(tokens, dtype=mx.float32).reshape(n, 1) if seg.want_taps else None
            outs.append(SegmentOut(logits, tap_rows))
        return outs


class OracleState:
    def __init__(self, history: list[int] | None = None):
        self.history = history or []

    @property
    def length(self) -> int:
        return len(self.history)

    start = length  # the host always knows it: keep_at reads the device value at once

    @property
    def nbytes(self) -> int:  # no arrays held
        return 0

    def keep_at(self, kept: mx.array, bound: int, low: int) -> None:
        self.history = self.history[: int(kept.item())]

    def settle(self, length: int) -> None:
        assert length == len(self.history)

    def snapshot(self, length: int) -> "OracleState":
        return OracleState(self.history[:length])

    def arrays(self) -> list[mx.array]:
        return []

    nbytes = 0


class OracleDrafter:
    """Drafts exactly k tokens the target will accept, then wrong ones; k cycles 0..B-1."""

    kind = "DFlash"

    def __init__(self, block: int = 6):
        self.block = block
        self.taps = (0,)
        self.proposed_k: list[int] = []
        self._turn = 0

    def block_rows(self, count: int) -> int:
        return count + 1

    def new_state(self) -> OracleState:
        return OracleState()

    def absorb(self, items) -> None:
        for state, taps in items:
            state.history += [int(t) for t in np.array(taps[:, 0])]

    def propose_queued(self, items: list[Proposal]) -> list[mx.array]:
        return [mx.array(d, dtype=mx.int32) for d in self.propose(items)]

    def propose(self, items: list[Proposal]) -> list[list[int]]:
        out = []
        for p in items:
            k = self._turn % self.block
            self._turn += 1
            history = list(p.state.history)
            checksum = 0
            for i, t in enumerate(history):
                checksum = step_checksum(checksum, t, i)
            drafts, token, pos = [], int(p.last.item()) if isinstance(p.last, mx.array) else p.last, len(history)
            for i in range(p.count):
                history.append(token)
                checksum = step_checksum(checksum, token, pos)
                logits = mx.array(history_logits(history, checksum)[None])
                truth = int(choose(logits, mx.array([pos + 1]), p.params).item())
                token = truth if i < k else (truth + 1) % VOCAB
                drafts.append(token)
                pos += 1
            self.proposed_k.append(min(k, p.count))
            out.append(drafts)
        return out
