"""Requests in, streamed events out: the engine's Python API shared by the server and the tests."""

from __future__ import annotations

import hashlib
import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import Iterable

_ids = itertools.count(1)


def token_sha(tokens: Iterable[int]) -> str:
    """First 12 hex digits of sha256 over the comma-joined decimal token ids (the receipts' token hash)."""
    return hashlib.sha256(",".join(str(int(t)) for t in tokens).encode()).hexdigest()[:12]


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    draft: bool = True
    ignore_eos: bool = False
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")


@dataclass
class Stats:
    """Per-request figures for the reply's `usage` and `dflash` blocks."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    decode_tokens: int = 0  # tokens decode rounds produced, a final eos included (the first comes from the prompt pass)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    ttft_seconds: float = 0.0
    drafter: str | None = None
    seed: int = 0
    # index k: drafted rounds that accepted k drafts; index d: rounds that drafted more than d tokens
    # (a tree: whose nodes reached depth d + 1).
    # Counts, not a list of rounds, so a long reply's stats stay a few numbers (the reply's `dflash` block).
    accepted_counts: list[int] = field(default_factory=list)
    drafted_counts: list[int] = field(default_factory=list)

    @property
    def tokens_per_round(self) -> float:
        return self.decode_tokens / self.rounds if self.rounds else 0.0

    def count_round(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One decode round that verified `drafted` draft tokens and accepted the first `accepted`.

        A draft tree (tree.py) verifies `drafted` nodes reaching `depth` positions ahead and accepts a
        path of `accepted` of them: per-depth counts follow the depths, the totals the nodes. A chain's
        depth is its length."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            _grow(self.accepted_counts, accepted + 1)[accepted] += 1
            counts = _grow(self.drafted_counts, drafted if depth is None else depth)
            for d in range(drafted if depth is None else depth):
                counts[d] += 1

    def acceptance_by_depth(self) -> list[float | None]:
        """Per draft position d: the share of rounds that drafted it and accepted it (accepted > d)."""
        return [sum(self.accepted_counts[d + 1:]) / n if n else None for d, n in enumerate(self.drafted_counts)]


def _grow(counts: list[int], size: int) -> list[int]:
    counts.extend([0] * (size - len(counts)))
    return counts


@dataclass
class Event:
    """New tokens of one round for one request; the last event has `finish` set and the stats."""

    tokens: list[int]
    finish: str | None = None  # "stop" (eos), "length", "cancelled", "error"
    stats: Stats | None = None
    error: str | None = None


@dataclass
class Result:
    request: Request
    tokens: list[int]
    finish: str
    stats: Stats
    error: str | None = None

    @property
    def token_sha(self) -> str:
        return token_sha(self.tokens)


class Handle:
    """A submitted request: read its events, or cancel it (taken at the next round or chunk)."""

    def __init__(self, request: Request):
        self.request = request
        self.events: queue.Queue[Event] = queue.Queue()
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self):
        while True:
            event = self.events.get()
            yield event
            if event.finish is not None:
                return

    def result(self) -> Result:
        tokens: list[int] = []
        for event in self:
            tokens += event.tokens
            if event.finish is not None:
                return Result(self.request, tokens, event.finish, event.stats or Stats(), event.error)
        raise RuntimeError("event stream ended without a finish")
