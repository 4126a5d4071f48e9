"""The memory planner: what N streams of C tokens hold in this engine, from config.json files alone.

A user must know before loading whether the streams fit, and the server must refuse what cannot
fit instead of dying. So every term below prices a structure the engine actually allocates, with
the engine's own growth rules (README.md's `plan` command):

- weights: the target's tensors (`checkpoint.expected_shapes`), in the engine's mode (backend.py):
  dequantized to float32 in the cpu mode, kept packed (bits plus a bf16 scale and bias per group)
  with bf16 for the rest in the gpu mode; the drafter's (`inventory.expected_inventory`), float in
  the mode's activation dtype, or its `--drafter-bits` copies;
- per stream, held: the attention K/V of every full-attention layer (`AttentionCache` grows to whole
  64-key tiles plus 256 rows of slack), the GatedDeltaNet conv and fp32 state, the record a round
  keeps to roll that state back, the drafter's K/V per layer (DFlash2's as v1's), and,
  with the prompt cache on, the copy a stream holds of its state at its last prompt-chunk boundary;
- per stream, transient: the prompt pass's working set (a chunk's attention scores, MLP rows, the
  recurrence's per-row states, the drafter's tap rows) and a decode window's;
- shared: the logits rows of a round and the prompt cache budget.

A stream is priced at the larger of its two phases. During the prompt pass its caches hold what
the chunked prefill grows them to (`prefill_rows`, exact) while the chunk's working set is live;
while decoding they may reach the bound for the served span (`cache_rows`), with only a window's
working set. The transient coefficients were measured on MLX 0.32.4's CPU backend (a round's
segments are evaluated together, so each stream's working set counts): a decode window's tiled
attention holds its scores, their exponentials and the per-key-tile products, `(2 + head_dim / 64)`
score-sized arrays over whole key tiles; a prompt chunk's attention (one sdpa call over exactly its
keys, targets/dense.py) holds `SDPA_SCORES` of them on CPU, where MLX composes it from two matmuls
and a softmax (measured: about one score array, 1.0 to 1.3 from 4096 down to 512 keys). MLX's CUDA
backend does not fuse it at a prompt chunk's shape either: measured on an H200 (MLX 0.32.4), one sdpa
of 256 queries x 65,536 keys (16 heads of 256) held 1.0 GiB beyond its inputs, one float32 score
array, with bf16 inputs too; so both modes price float32 scores (`Backend.score_bytes`). An MLP
stage holds `5 x intermediate + 3 x hidden` activations a row, a projection stage `7.5 x hidden`;
a GatedDeltaNet layer over a prompt chunk (the chunked delta rule, float32) `GDN_ROW` float32
arrays of value-head width a row plus `GDN_STATES` recurrent states (measured on this CPU at the
9B's heads: 27 MiB at 64 rows, 77 MiB at 256 in the cpu mode, 79 MiB in the gpu mode; the per-row
loop it replaced held one state a row, 0.6 GiB at 256 rows on the H200).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from dflash_bench.engine.backend import CPU, LOGIT_BYTES, STATE_BYTES, Backend
from dflash_bench.engine.cache import GROW
from dflash_bench.engine.checkpoint import expected_shapes, read_target_config
from dflash_bench.engine.constants import CHUNK, GIB, MIB
from dflash_bench.engine.draft_config import DraftConfig
from dflash_bench.engine.inventory import expected_inventory
from dflash_bench.engine.preload import check_dirs, read_target_json
from dflash_bench.engine.target_config import TargetConfig
from dflash_bench.engine.tiles import KEY_TILE, QUERY_TILE, ROW_TILE

ATTN_ROW = 6.5  # floats of hidden width a row holds beside the attention scores
SDPA_SCORES = 1.0  # score-sized arrays a prompt chunk's unfused sdpa holds (CPU, over exactly its keys)
MLP_ROW = (5.0, 3.0)  # floats a row in the MLP stage: x intermediate, x hidden
PROJ_ROW = 7.5  # floats a row in the projection stage, x hidden
GDN_ROW = 17  # float32 arrays of (value heads x head width) a prompt row holds in a GatedDeltaNet layer
GDN_STATES = 5  # recurrent states alive beside them (the sub-chunks' states and their transposes)


def logit_bytes(rows: int, vocab: int, act: int) -> int:
    """A logits block: the lm_head tiles' outputs and their concatenation in the activation dtype, and
    the float32 rows the sampler takes (an astype, a no-op copy in the cpu mode: 3 x 4 bytes there)."""
    return rows * vocab * (2 * act + LOGIT_BYTES)


@dataclass(frozen=True)
class PlanInputs:
    """Everything the plan depends on: the two configs and the serve settings."""

    target: TargetConfig
    drafter: DraftConfig | None = None
    parallel: int = 1
    context: int = 4096
    prompt_cache_gib: float = 0.0
    drafter_bits: int = 0
    memory_bytes: int | None = None  # what the backend may use; None: not judged
    backend: Backend = CPU
    chunk: int = CHUNK


@dataclass(frozen=True)
class Term:
    """One priced structure. Weights and shared terms count once, stream terms once per stream (at the
    stream's larger phase), load terms only while loading."""

    name: str
    scope: str  # "weights", "shared", "stream" or "load"
    prompt: int  # bytes while a stream is in its prompt pass (shared terms: the bytes)
    decode: int  # bytes while it decodes
    detail: str = ""
    drafter: bool = False


@dataclass
class Plan:
    inputs: PlanInputs
    terms: list[Term] = field(default_factory=list)

    @property
    def shared_bytes(self) -> int:
        return sum(t.prompt for t in self.terms if t.scope in ("weights", "shared"))

    @property
    def stream_prompt_bytes(self) -> int:
        return sum(t.prompt for t in self.terms if t.scope == "stream")

    @property
    def stream_decode_bytes(self) -> int:
        return sum(t.decode for t in self.terms if t.scope == "stream")

    @property
    def stream_bytes(self) -> int:
        """One stream at the larger of its phases."""
        return max(self.stream_prompt_bytes, self.stream_decode_bytes)

    @property
    def load_bytes(self) -> int:
        """At load: the weights, and a quantized drafter's float matrices until the first round."""
        return sum(t.prompt for t in self.terms if t.scope in ("weights", "load"))

    @property
    def serve_bytes(self) -> int:
        return self.shared_bytes + self.inputs.parallel * self.stream_bytes

    @property
    def total_bytes(self) -> int:
        """The peak: serving, or loading when a drafter's float copies outweigh the streams."""
        return max(self.serve_bytes, self.load_bytes)

    @property
    def fits(self) -> bool | None:
        m = self.inputs.memory_bytes
        return None if m is None else self.total_bytes <= m

    @property
    def streams_fit(self) -> int | None:
        """How many streams of `context` tokens fit in `memory_bytes` (None when no memory is given)."""
        return streams_fit(self.inputs)

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)

    @property
    def without_drafter(self) -> "Plan":
        """The same settings with no drafter: what the target alone needs."""
        return plan(replace(self.inputs, drafter=None, drafter_bits=0))

    @property
    def drafter_added_bytes(self) -> int:
        """What the drafter adds to the peak: this plan's total less the drafter-less plan's (0 without one).
        More than the drafter's own terms when its tap rows or round rows tip which phase is larger."""
        return self.total_bytes - self.without_drafter.total_bytes if self.inputs.drafter else 0

    def to_dict(self) -> dict:
        i = self.inputs
        return {
            "target": i.target.name, "family": i.target.family,
            "drafter": i.drafter.kind if i.drafter else None, "parallel": i.parallel, "context": i.context,
            "prompt_cache_gib": i.prompt_cache_gib, "drafter_bits": i.drafter_bits if i.drafter else None,
            "backend": i.backend.name, "memory_bytes": i.memory_bytes, "chunk": i.chunk,
            "terms": [
                {"name": t.name, "scope": t.scope, "prompt_bytes": t.prompt, "decode_bytes": t.decode,
                 "detail": t.detail, "drafter": t.drafter}
                for t in self.terms
            ],
            "shared_bytes": self.shared_bytes, "stream_prompt_bytes": self.stream_prompt_bytes,
            "stream_decode_bytes": self.stream_decode_bytes, "stream_bytes": self.stream_bytes,
            "load_bytes": self.load_bytes, "serve_bytes": self.serve_bytes, "total_bytes": self.total_bytes,
            "fits": self.fits, "streams_fit": self.streams_fit, "drafter_added_bytes": self.drafter_added_bytes,
        }


# --- the engine's cache growth -------------------------------------------------------------------


def tiles(n: int) -> int:
    """Rows covering n positions in whole key tiles (`cache.tiles_for`)."""
    return -(-n // KEY_TILE) * KEY_TILE


def grown(end: int, capacity: int) -> int:
    """`AttentionCache.write`: capacity after writing up to `end`."""
    return capacity if end <= capacity else tiles(end) + GROW


def cache_rows(span: int) -> int:
    """The most rows a cache can hold when no write ends past `span`: the last growth can happen at
    any end up to the span, and takes whole tiles plus the slack."""
    return tiles(span) + GROW


def prefill_rows(prompt_tokens: int, start: int = 0, chunk: int = CHUNK) -> int:
    """Rows a cache holds after prefilling `prompt_tokens` in chunks from `start` (0, or a prompt-cache
    boundary, whose snapshot holds exactly `tiles(start)` rows)."""
    rows, pos = tiles(start), start
    while pos < prompt_tokens:
        end = min(prompt_tokens, (pos // chunk + 1) * chunk)
        rows, pos = grown(end, rows), end
    return rows


@lru_cache(maxsize=64)
def most_prefill_rows(context: int, chunk: int = CHUNK, resumes: bool = False) -> int:
    """The most rows any prompt that fits `context` leaves its caches with after its prompt pass.

    Capacity only grows with the prompt, so the longest prompt (context - 1: a request keeps room for
    one token) bounds it; a resumed prompt restarts growth from its boundary's snapshot, so with the
    prompt cache on every boundary is a start."""
    longest = context - 1
    starts = range(0, longest, chunk) if resumes else (0,)
    return max(prefill_rows(longest, s, chunk) for s in starts)


# --- the terms -------------------------------------------------------------------------------------


def tap_row_bytes(draft: DraftConfig, act_bytes: int = 2) -> int:
    """The prompt pass's tap rows, a prompt row: a drafter with t taps (v1, or DFlash2's five) holds the
    t planes, their row-major copy, fc's rows and the fused row, (2t + 2) x hidden."""
    return (2 * len(draft.taps) + 2) * draft.hidden_size * act_bytes


def drafter_weight_bytes(draft: DraftConfig, bits: int, backend: Backend) -> tuple[int, int]:
    """(resident bytes, float copies alive until the first round quantizes them)."""
    shapes = expected_inventory(draft).values()
    if not bits:
        return sum(math.prod(s) * backend.act_bytes for s in shapes), 0
    quant = {"bits": bits, "group_size": 64}
    quantized = replace(backend, dequantizes=False)  # mx.quantize of act-dtype matrices: act-dtype scales
    resident = sum(quantized.weight_bytes(s, quant) for s in shapes)
    staging = sum(math.prod(s) * backend.act_bytes for s in shapes if len(s) >= 2)
    return resident, staging


def _window(i: PlanInputs) -> int:
    """Rows of a decode window: the pending token plus a block's drafts (1 without a drafter)."""
    return i.drafter.block_size if i.drafter else 1


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _attention_scores(t: TargetConfig, rows: int, keys: int, act: int, prompt: Backend | None) -> float:
    """Bytes of score-sized arrays a segment's attention holds: a decode window's tiles (`prompt` None)
    pad queries and keys to whole tiles; a prompt chunk's sdpa sees exactly its keys, unfused."""
    if prompt is None:
        return (2 + t.head_dim / 64) * t.num_heads * _pad(rows, QUERY_TILE) * tiles(keys) * act
    return SDPA_SCORES * t.num_heads * rows * keys * prompt.score_bytes


def _forward_work(t: TargetConfig, rows: int, keys: int, act: int, prompt: Backend | None = None) -> int:
    """The working set one segment of `rows` adds to a target forward with `keys` keys in view: the
    largest of its attention, MLP, projection and recurrence stages. `prompt` is the backend of a
    prompt chunk (per-chunk attention), None for a decode window (tiled attention)."""
    h = t.hidden_size
    stages = [
        int(_attention_scores(t, rows, keys, act, prompt) + ATTN_ROW * h * rows * act),
        int((MLP_ROW[0] * t.intermediate_size + MLP_ROW[1] * h) * rows * act),
        int(PROJ_ROW * h * rows * act),
    ]
    if t.linear is not None:
        lin = t.linear
        state = lin.num_value_heads * lin.value_head_dim * lin.key_head_dim * STATE_BYTES
        if prompt is None:  # a window's per-row loop: one state a row, beside its float32 conv rows
            stages.append(rows * state + 3 * lin.conv_dim * rows * STATE_BYTES)
        else:
            width = lin.num_value_heads * max(lin.key_head_dim, lin.value_head_dim) * STATE_BYTES
            stages.append(GDN_ROW * width * rows + GDN_STATES * state)
    return max(stages)


def _drafter_pass_work(d: DraftConfig, keys: int, act: int) -> int:
    """The drafter's pass over one stream's block: its attention over the context, its MLP rows."""
    b = d.block_size
    scores = d.num_heads * _pad(b, QUERY_TILE) * tiles(keys + b) * act
    return max(
        int((2 + d.head_dim / 64) * scores + ATTN_ROW * d.hidden_size * b * act),
        int((MLP_ROW[0] * d.intermediate_size + MLP_ROW[1] * d.hidden_size) * _pad(b, ROW_TILE) * act),
    )


def plan(i: PlanInputs) -> Plan:
    """Price every term for `i`; the totals and the verdict are the Plan's properties."""
    if i.parallel < 1:
        raise ValueError(f"parallel is {i.parallel}, expected at least 1")
    if i.context < 2:
        raise ValueError(f"context is {i.context}, expected at least 2")
    t, d, act, be = i.target, i.drafter, i.backend.act_bytes, i.backend
    p = Plan(i)
    add = p.terms.append
    mib = lambda n: f"{n / MIB:,.1f} MiB"  # noqa: E731

    params = expected_shapes(t)
    weights = sum(be.weight_bytes(s, t.quantization, name) for name, s in params.items())
    add(Term("target weights", "weights", weights, weights,
             f"{sum(math.prod(s) for s in params.values()):,} parameters"))
    if d is not None:
        resident, staging = drafter_weight_bytes(d, i.drafter_bits, be)
        how = f"{i.drafter_bits}-bit matrices" if i.drafter_bits else "float"
        add(Term("drafter weights", "weights", resident, resident, how, drafter=True))
        if staging:
            add(Term("drafter float staging", "load", staging, 0, "until the first round quantizes them",
                     drafter=True))
    window = _window(i)
    chunk = min(i.chunk, i.context - 1)  # the largest prompt chunk a request of this context can have
    logit_rows = _pad(i.parallel * window, ROW_TILE)
    logits = logit_bytes(logit_rows, t.vocab_size, act)
    add(Term("round logits", "shared", logits, logits, f"{logit_rows} rows x {t.vocab_size} vocab"))
    budget = int(i.prompt_cache_gib * GIB)
    if budget:
        add(Term("prompt cache budget", "shared", budget, budget, f"{i.prompt_cache_gib:g} GiB"))

    resumes = budget > 0
    prompt_rows = most_prefill_rows(i.context, i.chunk, resumes)
    decode_rows = cache_rows(i.context - 1)  # a request's last write ends before its window does
    full = len(t.full_attention_layers)
    kv_row = full * 2 * t.num_kv_heads * t.head_dim * act
    add(Term("attention K/V", "stream", kv_row * prompt_rows, kv_row * max(prompt_rows, decode_rows),
             f"{full} layers x {kv_row // max(full, 1):,} B a row; {prompt_rows} rows after the prompt, "
             f"up to {max(prompt_rows, decode_rows)}"))
    if t.linear is not None:
        lin = t.linear
        layers = len(t.layer_types) - full
        state = lin.num_value_heads * lin.value_head_dim * lin.key_head_dim * STATE_BYTES
        conv = (lin.conv_kernel - 1) * lin.conv_dim * act  # the conv's last inputs, as the projection wrote them
        add(Term("GatedDeltaNet state", "stream", layers * (state + conv), layers * (state + conv),
                 f"{layers} layers x ({mib(state)} fp32 state + {mib(conv)} conv)"))
        # the state and conv rows a window started from, its conv inputs (kernel - 1 + rows, in the activation
        # dtype), and its float32 q, k, v, g and beta rows (what the rollback reruns the recurrence on,
        # qwen3_5.py), kept until keep
        inputs = (lin.conv_kernel - 1 + window) * lin.conv_dim * act
        key_dim, value_dim = lin.num_key_heads * lin.key_head_dim, lin.num_value_heads * lin.value_head_dim
        rows = window * (2 * key_dim + value_dim + 2 * lin.num_value_heads) * STATE_BYTES
        record = layers * (state + conv + inputs + rows)
        add(Term("GatedDeltaNet rollback record", "stream", 0, record,
                 "a window's starting state and its rows, kept until keep (a prompt chunk keeps none)"))
    if budget:
        copy = kv_row * tiles(i.context - 1) + sum(x.prompt for x in p.terms if x.name == "GatedDeltaNet state")
        add(Term("prompt-cache boundary copy", "stream", copy, copy, "a stream's state at its last chunk boundary"))

    keys = i.context - 1
    add(Term("prompt pass work", "stream", _forward_work(t, chunk, keys, act, prompt=be), 0,
             f"a {chunk}-row chunk over {keys} keys (sdpa, its scores unfused)"))
    add(Term("decode window work", "stream", 0, _forward_work(t, window, keys, act), f"{window}-row window"))
    if d is not None:
        _drafter_terms(p, i, d, prompt_rows, resumes)
    return p


def _drafter_terms(p: Plan, i: PlanInputs, d: DraftConfig, prompt_rows: int, resumes: bool) -> None:
    """The drafter's per-stream terms: its K/V context cache, a DFlash2 ring, its tap rows and pass."""
    act, add = i.backend.act_bytes, p.terms.append
    span = i.context + d.block_size - 3  # a block written after the longest kept context
    kv_layer = 2 * d.num_kv_heads * d.head_dim * act
    # This engine absorbs each fused row into every layer's K/V at once, DFlash2 as v1 (drafters/
    # dflash2.py: no ring of raw rows is kept), and a sliding layer's cache keeps the whole span: it
    # attends its window of it.
    rows = max(prompt_rows, cache_rows(span))
    add(Term("drafter context K/V", "stream", d.num_layers * kv_layer * prompt_rows, d.num_layers * kv_layer * rows,
             f"{d.num_layers} layers x {kv_layer:,} B a row, whole span ({rows} rows)", drafter=True))
    if resumes:
        copy = d.num_layers * kv_layer * tiles(i.context - 1)
        add(Term("drafter boundary copy", "stream", copy, copy, "the drafter part of a prompt-cache entry",
                 drafter=True))
    taps = tap_row_bytes(d, act)
    add(Term("prompt tap rows", "stream", taps * min(i.chunk, i.context - 1), taps * d.block_size,
             f"{taps:,} B a row (2 x {len(d.taps)} + 2 planes)",
             drafter=True))
    work = _drafter_pass_work(d, i.context, act)
    logits = logit_bytes(_pad(d.block_size, ROW_TILE), d.vocab_size, act)
    add(Term("drafter pass work", "stream", 0, work + logits, f"a {d.block_size}-row block and its logits",
             drafter=True))


def streams_fit(i: PlanInputs) -> int | None:
    """The most streams of `i.context` tokens whose plan fits `i.memory_bytes` (0 when none does)."""
    if i.memory_bytes is None:
        return None
    one = plan(replace(i, parallel=1))
    per_stream = max(one.stream_bytes, 1)
    n = max(0, (i.memory_bytes - one.shared_bytes) // per_stream)
    while n > 0 and plan(replace(i, parallel=n)).total_bytes > i.memory_bytes:
        n -= 1  # the shared logits rows grow with the streams
    return int(n)


# --- reading the configs ------------------------------------------------------------------------------


def read_configs(target: str, drafter: str | None) -> tuple[TargetConfig, DraftConfig | None]:
    """The two configs a plan reads (a checkpoint, `default` or a bare config.json; a drafter folder
    or its config.json), checked as a pair the way the engine's pre-load check does."""
    cfg = read_target_json(target) if str(target).endswith(".json") else read_target_config(target)
    if drafter is None:
        return cfg, None
    return check_dirs(cfg, drafter)


# --- admission ---------------------------------------------------------------------------------------


def backend_memory_bytes() -> int:
    """What the backend may use: MLX's memory limit (on a GPU, its recommended working set)."""
    import mlx.core as mx

    return int(mx.get_memory_limit())


@dataclass(frozen=True)
class AdmissionDecision:
    """What the server may serve: `streams` lanes of the context, or a refusal naming why not."""

    streams: int
    requested: int
    refused_reason: str | None
    plan: Plan  # the plan at the admitted streams (at one stream when refused)

    @property
    def lowered(self) -> bool:
        return self.refused_reason is None and self.streams < self.requested

    def line(self) -> str:
        """The plan's part of the startup line."""
        p, i = self.plan, self.plan.inputs
        gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        if self.refused_reason:
            return f"plan: refused: {self.refused_reason}"
        lowered = f" (lowered from --parallel {self.requested}: more do not fit)" if self.lowered else ""
        return (f"plan: {self.streams} streams of {i.context} tokens{lowered}: {gib(p.total_bytes)} of "
                f"{gib(i.memory_bytes or 0)} (weights {gib(p.load_bytes)}, a stream {gib(p.stream_bytes)})")


def admit(i: PlanInputs) -> AdmissionDecision:
    """Startup admission: refuse a context that cannot fit one stream, lower the streams to what fits."""
    if i.memory_bytes is None:
        i = replace(i, memory_bytes=backend_memory_bytes())
    fit = streams_fit(i) or 0
    if fit == 0:
        one = plan(replace(i, parallel=1))
        reason = (f"--context {i.context} does not fit one stream: it needs {one.total_bytes / GIB:.2f} GiB "
                  f"({one.stream_bytes / GIB:.2f} GiB a stream beside {one.shared_bytes / GIB:.2f} GiB shared), "
                  f"the backend may use {i.memory_bytes / GIB:.2f} GiB")
        return AdmissionDecision(0, i.parallel, reason, one)
    streams = min(i.parallel, fit)
    return AdmissionDecision(streams, i.parallel, None, plan(replace(i, parallel=streams)))


def request_refusal(decision: AdmissionDecision, prompt_tokens: int, max_tokens: int) -> str | None:
    """Why a request cannot be served in a lane of this plan (None when it fits).

    A lane is priced for a whole context, so a request fits when its prompt plus max_tokens stays
    inside the context and its stream's price inside a lane's; the server answers anything else
    with HTTP 400 before the request takes a lane."""
    i = decision.plan.inputs
    if decision.refused_reason:
        return decision.refused_reason
    span = prompt_tokens + max_tokens
    if span > i.context:
        return (f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {span}, "
                f"past the context window of {i.context}")
    need = plan(replace(i, parallel=1, context=max(span, 2))).stream_bytes
    if need > decision.plan.stream_bytes:
        return f"the request needs {need / GIB:.2f} GiB, a lane holds {decision.plan.stream_bytes / GIB:.2f} GiB"
    return None
