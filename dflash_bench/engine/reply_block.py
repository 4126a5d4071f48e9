"""The reply's `dflash` block: one model the server writes (engine/server.py) and the client reads
(checks/client.py), so the two sides cannot drift apart on a key's name or meaning.

Every field is optional on reading: a foreign server may send a partial block (or none), and the
client must tell "not reported" (None) from zero. Unknown keys are kept for the same reason.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from dflash_bench.engine.request import Stats, token_sha


class DflashBlock(BaseModel):
    """What one reply says about how it was decoded."""

    model_config = ConfigDict(extra="allow")

    token_sha: Optional[str] = None  # request.token_sha of the completion's ids
    rounds: Optional[int] = None  # decode rounds (the first token comes from the prompt pass)
    drafted: Optional[int] = None  # draft tokens verified (a draft tree's nodes; the target verified rounds + drafted rows)
    accepted: Optional[int] = None  # of them, accepted
    tokens_per_round: Optional[float] = None
    drafter: Optional[str] = None  # the drafter's kind, None when the reply was decoded plainly
    prefill_seconds: Optional[float] = None
    decode_seconds: Optional[float] = None
    ttft_seconds: Optional[float] = None
    seed: Optional[int] = None
    # index k: drafted rounds that accepted exactly k drafts (rounds without drafts are not counted)
    acceptance_histogram: Optional[list[int]] = None
    # index d: rounds that drafted at least d + 1 tokens, a tree's depth counting (so replies' acceptance can be
    # summed exactly)
    drafted_by_depth: Optional[list[int]] = None
    # index d: of the rounds that drafted at least d + 1 tokens, the share that accepted the (d + 1)-th
    acceptance_by_depth: Optional[list[Optional[float]]] = Field(default=None)

    @classmethod
    def from_stats(cls, stats: Stats, tokens: list[int]) -> DflashBlock:
        return cls(token_sha=token_sha(tokens), rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted,
                   tokens_per_round=stats.tokens_per_round, drafter=stats.drafter,
                   prefill_seconds=stats.prefill_seconds, decode_seconds=stats.decode_seconds,
                   ttft_seconds=stats.ttft_seconds, seed=stats.seed,
                   acceptance_histogram=list(stats.accepted_counts),
                   drafted_by_depth=list(stats.drafted_counts), acceptance_by_depth=stats.acceptance_by_depth())
