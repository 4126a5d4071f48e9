"""The prompt cache: finished streams' states at a prompt-chunk boundary, keyed by token prefix.

A prompt is prefilled in chunks whose boundaries sit at multiples of the chunk size from position
0, so the state at a boundary depends on the tokens before it alone, and a request that shares
that prefix can start from it and compute exactly the chunks a fresh request would. Each entry
keeps the state at the last boundary before its prompt's final token (so a resumed request always
has at least one token left to prefill); the least recently used entries leave first when the
budget is exceeded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dflash_bench.engine.cache import TargetState
from dflash_bench.engine.drafters.dflash import DrafterState


@dataclass
class Entry:
    tokens: tuple[int, ...]  # the prefix, whose length is a chunk boundary
    state: TargetState
    drafter: DrafterState | None

    @property
    def nbytes(self) -> int:
        return self.state.nbytes + (self.drafter.nbytes if self.drafter else 0)


def last_boundary(prompt_len: int, chunk: int) -> int:
    """The largest chunk boundary that still leaves at least one prompt token to prefill."""
    return (prompt_len - 1) // chunk * chunk


class PromptCache:
    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def lookup(self, prompt: list[int], chunk: int, need_drafter: bool) -> Entry | None:
        """The entry with the longest prefix of `prompt` that leaves a token to prefill."""
        limit = last_boundary(len(prompt), chunk)
        best: Entry | None = None
        for key, entry in self.entries.items():
            n = len(key)
            if 0 < n <= limit and (best is None or n > len(best.tokens)) and tuple(prompt[:n]) == key:
                if entry.drafter is not None or not need_drafter:
                    best = entry
        if best is not None:
            self.entries.move_to_end(best.tokens)
        return best

    def insert(self, entry: Entry) -> None:
        if not self.enabled or not entry.tokens or entry.nbytes > self.budget:
            return
        old = self.entries.get(entry.tokens)
        if old is not None and (old.drafter is not None or entry.drafter is None):
            self.entries.move_to_end(entry.tokens)
            return
        self.entries[entry.tokens] = entry
        self.entries.move_to_end(entry.tokens)
        while self.nbytes > self.budget:
            self.entries.popitem(last=False)
