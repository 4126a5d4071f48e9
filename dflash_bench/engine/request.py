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

    @property
    def tokens_per_round(self) -> float:
        return self.decode_tokens / self.rounds if self.rounds else 0.0


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
