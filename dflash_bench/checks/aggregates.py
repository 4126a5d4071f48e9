"""Each receipt kind's `aggregates`, typed: what a check writes and what tables, compare and report read.

Every field has a default because a run cut short (Ctrl-C, the server dying) writes the aggregates
it had reached: an exactness receipt stopped after two prompts holds two rows, a decode receipt
stopped in its first cell holds no aggregate_tps yet. Unknown keys are kept (extra="allow") so a
newer writer's receipt still loads in an older reader; the JSON Schema (`dflash-bench schema`)
names every key this version writes.
"""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class Loose(BaseModel):
    """A part of a receipt: known keys typed, unknown keys kept."""

    model_config = ConfigDict(extra="allow")


class Summary(Loose):
    """receipt.summary(): median, extremes, spread ((max - min) / median) and the per-rep values."""

    n: int = 0
    median: Optional[float] = None
    min: Optional[float] = None
    max: Optional[float] = None
    spread: Optional[float] = None
    values: list[float] = Field(default_factory=list)


class Percentiles(Loose):
    """receipt.percentiles(): n and p50/p90/p99 (None with no values)."""

    n: int = 0
    p50: Optional[float] = None
    p90: Optional[float] = None
    p99: Optional[float] = None


ByMode = dict[str, Summary]  # "drafted" / "plain" -> summary


# -- exactness ---------------------------------------------------------------------------------
class ExactnessRow(Loose):
    prompt_id: str
    kind: str
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    drafted_sha: Optional[str] = None
    plain_sha: Optional[str] = None
    equal: Optional[bool] = None
    first_diff: Optional[int] = None
    evidence: Optional[str] = None  # two-server mode: "token ids", "token pieces" or "text" (checks/pair.py)
    drafted_tokens_per_round: Optional[float] = None
    plain_tokens_per_round: Optional[float] = None
    known_answer: Optional[bool] = None


class KnownAnswers(Loose):
    right: int = 0
    asked: int = 0


class ExactnessAggregates(Loose):
    prompts: list[ExactnessRow] = Field(default_factory=list)
    equal: int = 0
    compared: int = 0
    differ: int = 0
    evidence: Optional[str] = None  # the weakest evidence of any compared row
    known_answers: KnownAnswers = Field(default_factory=KnownAnswers)


# -- concurrent --------------------------------------------------------------------------------
class ConcurrentCell(Loose):
    temperature: float
    level: int
    equal: int = 0
    failed: int = 0
    unverified: int = 0
    aggregate_tps: Optional[Summary] = None
    tokens_per_round: Optional[Summary] = None


class SerialCell(Loose):
    temperature: float
    equal: int = 0
    failed: int = 0
    unverified: int = 0


class ConcurrentAggregates(Loose):
    cells: list[ConcurrentCell] = Field(default_factory=list)
    serial: list[SerialCell] = Field(default_factory=list)


# -- resume ------------------------------------------------------------------------------------
class ResumeStep(Loose):
    step: str
    prompt_id: str
    status: str
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    token_sha: Optional[str] = None
    tokens_per_round: Optional[float] = None


class ResumeAggregates(Loose):
    steps: list[ResumeStep] = Field(default_factory=list)


# -- cancel ------------------------------------------------------------------------------------
class ProbeResult(Loose):
    equal: Optional[bool] = None


class CancelStep(Loose):
    step: str
    probes: list[Union[str, ProbeResult]] = Field(default_factory=list)
    memory_bytes: Optional[float] = None
    note: Optional[str] = None


class CancelAggregates(Loose):
    steps: list[CancelStep] = Field(default_factory=list)


# -- decode ------------------------------------------------------------------------------------
class Latency(Loose):
    """vLLM-bench's client-side latencies of one cell's streamed replies (checks/client.py)."""

    ttft_seconds: Percentiles = Field(default_factory=Percentiles)
    tpot_seconds: Percentiles = Field(default_factory=Percentiles)
    itl_seconds: Percentiles = Field(default_factory=Percentiles)


class Acceptance(Loose):
    """One cell's drafted rounds, summed over its replies' `dflash` blocks (engine/reply_block.py)."""

    histogram: list[int] = Field(default_factory=list)  # index k: rounds that accepted k drafts
    by_depth: list[Optional[float]] = Field(default_factory=list)  # index d: share accepting the (d+1)-th draft
    rounds: int = 0


class DecodeAggregates(Loose):
    modes: list[str] = Field(default_factory=list)
    probes: dict[str, str] = Field(default_factory=dict)  # role (code, chat) -> prompt id
    single_tps: dict[str, ByMode] = Field(default_factory=dict)  # role -> mode
    aggregate_tps: dict[str, dict[str, ByMode]] = Field(default_factory=dict)  # role -> level -> mode
    tokens_per_round: dict[str, dict[str, dict[str, Optional[float]]]] = Field(default_factory=dict)
    latency: dict[str, dict[str, dict[str, Latency]]] = Field(default_factory=dict)  # role -> level -> mode
    acceptance: dict[str, dict[str, dict[str, Acceptance]]] = Field(default_factory=dict)


# -- prefill -----------------------------------------------------------------------------------
class PrefillArray(Loose):
    requested: int
    tokens: int
    dropped: int = 0
    token_sha: Optional[str] = None
    sha256: Optional[str] = None


class PrefillCell(Loose):
    seconds: Summary = Field(default_factory=Summary)
    tps: Summary = Field(default_factory=Summary)


class PrefillAggregates(Loose):
    tokenizer: Optional[str] = None
    arrays: dict[str, PrefillArray] = Field(default_factory=dict)  # size -> array
    sizes: dict[str, dict[str, PrefillCell]] = Field(default_factory=dict)  # size -> mode
    seconds_source: list[str] = Field(default_factory=list)


# -- stress ------------------------------------------------------------------------------------
class StressCounts(Loose):
    planned: Optional[int] = None
    sent: Optional[int] = None
    not_sent: Optional[int] = None
    completed: Optional[int] = None
    dropped: Optional[int] = None
    drops_planned: Optional[int] = None
    http_5xx: Optional[int] = None
    errors: dict[str, int] = Field(default_factory=dict)


class StressProbe(Loose):
    prompt_id: str
    reference: Optional[str] = None
    after: Optional[str] = None
    equal: Optional[bool] = None


class StressAggregates(Loose):
    counts: StressCounts = Field(default_factory=StressCounts)
    latency: dict[str, Percentiles] = Field(default_factory=dict)  # ttft_seconds, total_seconds
    statuses: dict[str, int] = Field(default_factory=dict)
    rss: dict[str, Union[float, str, None]] = Field(default_factory=dict)
    memory: dict[str, Optional[float]] = Field(default_factory=dict)
    probes: list[StressProbe] = Field(default_factory=list)


# -- suite -------------------------------------------------------------------------------------
class SuiteRow(Loose):
    kind: str
    receipt: str
    result: str
    exit_code: int


class SuiteAggregates(Loose):
    checks: list[SuiteRow] = Field(default_factory=list)


# -- plan --check ------------------------------------------------------------------------------
class PeakComparison(Loose):
    predicted_bytes: int
    measured_bytes: int
    error: float


class HeldBytes(Loose):
    planned_bytes: int
    measured_bytes: int


class DrafterBytes(Loose):
    plan_added_bytes: int
    plan_without_drafter_bytes: int
    planned_held_bytes: int
    measured_held_bytes: int


class PlanAggregates(Loose):
    plan: dict = Field(default_factory=dict)  # planner.Plan.to_dict()
    measured: dict = Field(default_factory=dict)
    progress: dict = Field(default_factory=dict)
    held: dict[str, HeldBytes] = Field(default_factory=dict)
    drafter: Optional[DrafterBytes] = None
    comparison: dict[str, Union[PeakComparison, float]] = Field(default_factory=dict)  # mlx, process; tolerance

    @property
    def peaks(self) -> dict[str, PeakComparison]:
        """The predicted-vs-measured comparisons, without the tolerance that sits beside them."""
        return {k: v for k, v in self.comparison.items() if isinstance(v, PeakComparison)}


# -- engine-speed ------------------------------------------------------------------------------
class SpeedCell(Loose):
    """One mode at one level; the ratios and seconds a round are absent from receipts written before them."""

    stream_tok_s: Summary = Field(default_factory=Summary)
    aggregate_tok_s: Summary = Field(default_factory=Summary)
    tokens_per_round: Summary = Field(default_factory=Summary)
    seconds_per_round: Optional[Summary] = None
    over_mlx_lm: Optional[float] = None  # aggregate over mlx-lm's at the level
    round_over_plain: Optional[float] = None  # seconds a round over a plain round's at the level
    scaling: Optional[float] = None  # aggregate over the mode's at 1 stream
    equals_plain: Optional[bool] = None  # drafted cells: every stream's tokens are plain's
    # drafted cells: temperature -> every stream's sampled tokens are plain's stream of its seed; older receipts: none
    equals_plain_sampled: dict[str, bool] = Field(default_factory=dict)


class MlxLmCell(Loose):
    """Receipts before mlx-lm ran at every level: `generate_step` at one stream, ours beside it."""

    stream_tok_s: Summary
    ours_over_mlx_lm: float


class EngineSpeedAggregates(Loose):
    """probe -> mode -> streams -> cell, with "mlx-lm" beside the modes (its cells by level, or an
    MlxLmCell in older receipts); beside the probes: peak_bytes, why mlx-lm was not measured, how
    long the engine took to be ready and then to answer its first request, and the weights each mode's round reads."""

    __pydantic_extra__: dict[str, dict[str, Union[MlxLmCell, dict[str, SpeedCell]]]]
    peak_bytes: Optional[int] = None
    mlx_lm_note: Optional[str] = None
    load_seconds: Optional[float] = None  # loading the target, the self-check and the warm-up: until ready
    # mode -> until that mode's engine is ready served alone (engine_speed.engines); older receipts: load_seconds
    ready_seconds: dict[str, float] = Field(default_factory=dict)
    first_request_seconds: Optional[float] = None  # the first request after ready, start to last token
    # mode -> bytes of weights its round reads at least (Engine.weight_bytes); older receipts: none
    weight_bytes: dict[str, Optional[int]] = Field(default_factory=dict)

    def probes(self) -> dict[str, dict[str, Union[MlxLmCell, dict[str, SpeedCell]]]]:
        """The probes' cells (the keys beside peak_bytes)."""
        return dict(self.model_extra or {})


# -- selfcheck ---------------------------------------------------------------------------------
class SelfcheckAggregates(Loose):
    passed: Optional[bool] = None
    seconds: Optional[float] = None
    cached: Optional[bool] = None
    tiles: dict[str, int] = Field(default_factory=dict)
    attention: dict[str, str] = Field(default_factory=dict)
    line: Optional[str] = None


BY_KIND: dict[str, type[Loose]] = {
    "exactness": ExactnessAggregates, "concurrent": ConcurrentAggregates, "resume": ResumeAggregates,
    "cancel": CancelAggregates, "decode": DecodeAggregates, "prefill": PrefillAggregates,
    "stress": StressAggregates, "suite": SuiteAggregates, "plan": PlanAggregates,
    "engine-speed": EngineSpeedAggregates, "selfcheck": SelfcheckAggregates,
}
