"""The verify budget: how many drafts each drafting stream sends to the target in a round.

`fixed` verifies a full block for every drafting stream (block - 1 drafts, fewer near max_tokens).
`auto` chooses each stream's count k (0: a plain step) to maximize the round's expected committed
tokens per second over all streams:

- a stream with per-depth acceptance a_1, a_2, ... (the chance draft d is kept given every draft
  before it was) commits 1 + sum over d <= k of a_1 * ... * a_d tokens in expectation;
- the round costs the target forward over every segment's rows plus, when any stream drafts, the
  drafter pass over the drafting streams: a linear model (a fixed part, a part a segment, a part a
  row; the drafter's fixed part and a part a stream), fitted by least squares first to forwards and
  drafter passes timed at load (`measure_cost`), then to every round the lanes time while serving,
  older observations fading by FORGET a round (`CostFit`): one timing at load, on a machine other
  processes share, can be far off (a drafter pass priced at 10x what rounds then showed), and the
  rounds themselves are what the choice is about;
- acceptance is counted per stream and per depth, discounted so it follows the text, and starts from
  what all streams saw so far; a stream held at k = 0 probes a few drafts every PROBE_EVERY rounds,
  so a stream whose text turns predictable drafts again.

The count only decides how many drafts the target checks, never which token is kept: the target's
keyed choice decides every token (lanes.py), so the exactness checks hold for either budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

BUDGETS = ("fixed", "auto")
DISCOUNT = 0.9  # each stream's counts fade by this a round they are updated: recent text weighs most
PRIOR_WEIGHT = 2.0  # rounds' worth of the lanes' shared acceptance a stream's estimate starts from
PROBE_EVERY = 8  # rounds a stream may stay at k = 0 before it drafts PROBE_DRAFTS again
PROBE_DRAFTS = 4
FORGET = 0.95  # the weight an observation of the round costs keeps a round later (about 20 rounds' memory)
RIDGE = 1e-9  # keeps the normal equations solvable when every round so far had the same shape


@dataclass(frozen=True)
class CostModel:
    """Seconds of a round: forward = base + per_segment * segments + per_row * rows, plus
    draft_base + draft_per_stream * drafting streams when any stream drafts."""

    base: float
    per_segment: float
    per_row: float
    draft_base: float
    draft_per_stream: float

    def seconds(self, rows: list[int], drafting: int) -> float:
        forward = self.base + self.per_segment * len(rows) + self.per_row * sum(rows)
        return forward + (self.draft_base + self.draft_per_stream * drafting if drafting else 0.0)

    def describe(self) -> str:
        b, s, r, d, ds = (f"{x * 1e3:.2f}" for x in (self.base, self.per_segment, self.per_row, self.draft_base,
                                                      self.draft_per_stream))
        return f"a forward {b} ms + {s} a stream + {r} a row; a drafter pass {d} + {ds} a stream"


@dataclass
class CostFit:
    """Weighted least squares of forward and drafter-pass seconds on their features, kept as normal
    equations so each observation costs a rank-one update: forward ~ [1, segments, rows], drafter
    pass ~ [1, streams]."""

    forward_a: np.ndarray = field(default_factory=lambda: RIDGE * np.eye(3))
    forward_b: np.ndarray = field(default_factory=lambda: np.zeros(3))
    draft_a: np.ndarray = field(default_factory=lambda: RIDGE * np.eye(2))
    draft_b: np.ndarray = field(default_factory=lambda: np.zeros(2))

    @classmethod
    def around(cls, model: CostModel, weight: float = 1.0) -> CostFit:
        """A fit holding `model` as `weight` rounds' worth of observations at a spread of shapes."""
        fit = cls()
        for segments, rows in ((1, 1), (1, 16), (4, 4), (4, 64)):
            fit.add_forward(segments, rows, model.seconds([rows // segments] * segments, 0), weight)
        for streams in (1, 4):
            fit.add_draft(streams, model.draft_base + model.draft_per_stream * streams, weight)
        return fit

    def add_forward(self, segments: int, rows: int, seconds: float, weight: float = 1.0) -> None:
        x = np.array([1.0, segments, rows])
        self.forward_a += weight * np.outer(x, x)
        self.forward_b += weight * seconds * x

    def add_draft(self, streams: int, seconds: float, weight: float = 1.0) -> None:
        x = np.array([1.0, streams])
        self.draft_a += weight * np.outer(x, x)
        self.draft_b += weight * seconds * x

    def fade(self, factor: float = FORGET) -> None:
        for a in (self.forward_a, self.forward_b, self.draft_a, self.draft_b):
            a *= factor

    def model(self) -> CostModel:
        """The least-squares model, each part held at zero or more."""
        base, per_segment, per_row = np.maximum(np.linalg.solve(self.forward_a, self.forward_b), 0.0)
        draft_base, per_stream = np.maximum(np.linalg.solve(self.draft_a, self.draft_b), 0.0)
        return CostModel(float(base), float(per_segment), float(per_row), float(draft_base), float(per_stream))


@dataclass
class Acceptance:
    """Discounted counts of drafts reached and kept at each depth (0-based)."""

    reached: np.ndarray
    kept: np.ndarray

    @classmethod
    def empty(cls, depths: int) -> Acceptance:
        return cls(np.zeros(depths), np.zeros(depths))

    def update(self, drafted: int, accepted: int, discount: float = 1.0) -> None:
        """One round that verified `drafted` drafts and kept the first `accepted`."""
        self.reached *= discount
        self.kept *= discount
        depth = min(drafted, accepted + 1)
        self.reached[:depth] += 1
        self.kept[:accepted] += 1

    def rates(self, prior: np.ndarray, weight: float) -> np.ndarray:
        return (self.kept + weight * prior) / (self.reached + weight)


@dataclass
class Budget:
    """Chooses each drafting stream's draft count every round (see the module docstring)."""

    kind: str
    block: int
    fit: CostFit | None = None
    shared: Acceptance = field(init=False)
    cost: CostModel | None = field(init=False, default=None)  # the fit's model now
    measured: CostModel | None = field(init=False, default=None)  # the fit's model at load (the startup line's)

    def __post_init__(self) -> None:
        if self.kind not in BUDGETS:
            raise ValueError(f"verify budget {self.kind!r}: expected one of {', '.join(BUDGETS)}")
        if self.kind == "auto" and self.fit is None:
            raise ValueError("the auto verify budget needs a cost fit (measure_cost)")
        self.shared = Acceptance.empty(self.block - 1)
        if self.fit is not None:
            self.cost = self.measured = self.fit.model()

    def observe(self, rows: list[int], forward_seconds: float, drafting: int, draft_seconds: float) -> None:
        """A round as the lanes timed it: its segments' rows and forward (with keep), and the drafter
        pass over `drafting` streams (none: 0). Older rounds fade; the model is refitted."""
        if self.fit is None or not rows:
            return
        self.fit.fade()
        self.fit.add_forward(len(rows), sum(rows), forward_seconds)
        if drafting:
            self.fit.add_draft(drafting, draft_seconds)
        self.cost = self.fit.model()

    def new_stream(self) -> Acceptance:
        return Acceptance.empty(self.block - 1)

    def record(self, acceptance: Acceptance, drafted: int, accepted: int) -> None:
        if drafted:
            acceptance.update(drafted, accepted, DISCOUNT)
            self.shared.update(drafted, accepted)

    def counts(self, limits: list[int], acceptances: list[Acceptance], idle: list[int], other_rows: list[int]) -> list[int]:
        """Draft counts for the decoding drafting streams (each at most its limit), given the rows of
        the round's other segments (prompt chunks, plain streams)."""
        if self.kind == "fixed":
            return list(limits)
        prior = self.shared.rates(np.full(self.block - 1, 0.5), 1.0)
        gains = [np.concatenate([[0.0], np.cumsum(np.cumprod(a.rates(prior, PRIOR_WEIGHT)[:n]))])
                 for a, n in zip(acceptances, limits)]
        k = [0] * len(limits)

        def rate(ks: list[int]) -> float:
            rows = other_rows + [1 + x for x in ks]
            tokens = sum(1 + g[x] for g, x in zip(gains, ks))
            return tokens / self.cost.seconds(rows, sum(1 for x in ks if x))

        best = rate(k)
        while True:
            options = [(rate(k[:i] + [n] + k[i + 1 :]), i, n) for i in range(len(k)) for n in range(limits[i] + 1)
                       if n != k[i]]
            if not options:
                break
            value, i, n = max(options)
            if value <= best * (1 + 1e-9):
                break
            best, k[i] = value, n
        return [max(x, min(PROBE_DRAFTS, n)) if x == 0 and wait >= PROBE_EVERY else x
                for x, n, wait in zip(k, limits, idle)]


def measure_cost(target, drafter, parallel: int, context: int = 64, reps: int = 3) -> CostFit:
    """Time target forwards (1, 2, 4 .. `parallel` streams of 1, 4, 8 and `drafter.block` rows after
    a `context`-token prompt) and drafter passes (1 .. `parallel` streams), median of `reps`: the fit
    the rounds then refine."""
    from dflash_bench.engine.drafters.dflash import Proposal
    from dflash_bench.engine.sampling import SamplingParams
    from dflash_bench.engine.targets.base import Segment

    streams = sorted({s for s in (1, 2, 4, 8, parallel) if s <= parallel})
    prompt = [(7 * i) % 97 + 8 for i in range(context)]
    states, dstates = [], []
    for _ in range(max(streams)):
        state = target.new_state()
        out = target.forward([Segment(prompt, 0, state, [], True, prefill=True)], drafter.taps)[0]
        state.keep(context)
        dstate = drafter.new_state()
        drafter.absorb([(dstate, out.taps)])
        states.append(state)
        dstates.append(dstate)

    def timed(fn) -> float:
        times = []
        for _ in range(reps + 1):  # the first call warms (compiles, allocates)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def forward(s: int, r: int) -> None:
        segs = [Segment(prompt[:r], context, states[i], list(range(r)), True) for i in range(s)]
        mx.eval([o.logits for o in target.forward(segs, drafter.taps)])
        for state in states[:s]:
            state.keep(context)

    fit = CostFit()
    for s in streams:
        for r in (1, 4, 8, drafter.block):
            fit.add_forward(s, s * r, timed(lambda s=s, r=r: forward(s, r)))

    def propose(s: int) -> None:
        drafter.propose([Proposal(dstates[i], prompt[-1], drafter.block - 1, SamplingParams()) for i in range(s)])

    for s in streams:
        fit.add_draft(s, timed(lambda s=s: propose(s)))
    return fit
