"""The verify budget: how many drafts each drafting stream sends to the target in a round.

`fixed` verifies a full block for every drafting stream (block - 1 drafts, fewer near max_tokens).
`auto` chooses each stream's count k (0: a plain step) to maximize the round's expected committed
tokens per second over all streams:

- a stream with per-depth acceptance a_1, a_2, ... (the chance draft d is kept given every draft
  before it was) commits 1 + sum over d <= k of a_1 * ... * a_d tokens in expectation;
- the round costs the target forward over every segment's rows plus, when any stream drafts, the
  drafter pass over the drafting streams. Both are priced by the tiles they run (tiles.py): a
  forward's projections run over all decode rows packed in ROW_TILE-row tiles and its attention in
  QUERY_TILE-query tiles per segment, so a 16-row window costs a plain step's projections; a drafter
  pass runs each stream's block rows (`block_rows`) packed the same way. The model is linear in those
  counts (a forward: a fixed part, a part a row tile, a part a query tile, a part a row of a
  branching draft tree, whose rows each attend over their own key view; a drafter pass: a fixed
  part, a part a stream, a part a row tile), fitted by least squares first to forwards and drafter
  passes timed at load (`measure_cost`), then to every round the lanes time while serving, older
  observations fading by FORGET a round (`CostFit`): one timing at load, on a machine other
  processes share, can be far off (a drafter pass priced at 10x what rounds then showed), and the
  rounds themselves are what the choice is about. Priced by rows instead, one stream's 16-row window
  looked 2.26x a plain step where it cost 1.09x, and the budget verified 2-4 drafts where 15 cost
  almost nothing more (docs/verify-budget.md);
- acceptance is counted per stream and per depth, discounted so it follows the text, and starts from
  what all streams saw so far; a stream held at k = 0 probes a few drafts every PROBE_EVERY rounds,
  so a stream whose text turns predictable drafts again;
- with draft trees a count n is a tree of n nodes, and what it keeps is not a chain's: it also keeps
  a path through a depth's second or third candidate. So each round also counts, per depth the
  accept walk reached, the rank of the target's choice among the drafter's candidates there
  (`tree.choice_ranks`), and a tree of n nodes is worth the sum of the n most likely nodes' chances,
  a node's chance the product of its ranks' rates along its path (`tree_gains`): the nodes a
  best-first tree holds when ranks at different depths are independent. Before any rank is counted
  the rates are the chain's (rank 0 at the chain's acceptance, the rest nothing), so a tree starts
  priced as a chain of its size. Priced as a chain throughout, the budget grew trees that kept 3.34
  tokens a round on a code prompt where fixed 15-node trees keep 3.63; priced by ranks it keeps 3.63
  (docs/verify-budget.md).

The count only decides how many drafts the target checks, never which token is kept: the target's
keyed choice decides every token (lanes.py), so the exactness checks hold for either budget.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from dflash_bench.engine.tiles import QUERY_TILE, ROW_TILE

BUDGETS = ("fixed", "auto")
DISCOUNT = 0.9  # each stream's counts fade by this a round they are updated: recent text weighs most
PRIOR_WEIGHT = 2.0  # rounds' worth of the lanes' shared acceptance a stream's estimate starts from
PROBE_EVERY = 8  # rounds a stream may stay at k = 0 before it drafts PROBE_DRAFTS again
PROBE_DRAFTS = 4
FORGET = 0.95  # the weight an observation of the round costs keeps a round later (about 20 rounds' memory)
# Added at each solve, relative to the normal equations' scale, so they stay solvable when every
# round had the same shape (one stream: every forward one row tile, every DFlash2 pass one block).
# Kept in the faded sums instead, it faded with them and the equations turned singular mid-serving.
RIDGE = 1e-12
RANKS = 4  # candidate ranks a tree's worth tells apart (the v1 lattice's width); a choice past them counts as a miss


def forward_features(rows: list[int], tree_rows: int = 0) -> np.ndarray:
    """[1, row tiles, query tiles, tree rows] of a forward whose decode segments have `rows` rows each,
    `tree_rows` of them in branching draft trees (each row attends over its own key view there:
    tree_attention.py)."""
    return np.array([1.0, -(-sum(rows) // ROW_TILE), sum(-(-r // QUERY_TILE) for r in rows), tree_rows])


def draft_features(block_rows: list[int]) -> np.ndarray:
    """[1, streams, row tiles] of a drafter pass over blocks of `block_rows` rows each."""
    return np.array([1.0, len(block_rows), -(-sum(block_rows) // ROW_TILE)])


@dataclass(frozen=True)
class CostModel:
    """Seconds of a round: the forward, base + per_row_tile * row tiles + per_query_tile * query tiles
    + per_tree_row * rows in branching trees, plus, when any stream drafts, draft_base +
    draft_per_stream * streams + draft_per_row_tile * the pass's row tiles (`forward_features`,
    `draft_features`)."""

    base: float
    per_row_tile: float
    per_query_tile: float
    per_tree_row: float
    draft_base: float
    draft_per_stream: float
    draft_per_row_tile: float

    def forward(self, rows: list[int], tree_rows: int = 0) -> float:
        return float(np.dot([self.base, self.per_row_tile, self.per_query_tile, self.per_tree_row],
                            forward_features(rows, tree_rows)))

    def draft(self, block_rows: list[int]) -> float:
        if not block_rows:
            return 0.0
        return float(np.dot([self.draft_base, self.draft_per_stream, self.draft_per_row_tile], draft_features(block_rows)))

    def seconds(self, rows: list[int], block_rows: list[int], tree_rows: int = 0) -> float:
        """A round whose decode segments have `rows` rows (`tree_rows` in branching trees) and whose
        drafter pass runs `block_rows`."""
        return self.forward(rows, tree_rows) + self.draft(block_rows)

    def describe(self, trees: bool = False) -> str:
        b, t, q, r, d, ds, dt = (f"{x * 1e3:.2f}" for x in (
            self.base, self.per_row_tile, self.per_query_tile, self.per_tree_row, self.draft_base,
            self.draft_per_stream, self.draft_per_row_tile))
        tree = f" + {r} a tree row" if trees else ""
        return (f"a forward {b} ms + {t} a {ROW_TILE}-row tile + {q} a {QUERY_TILE}-query tile{tree}; "
                f"a drafter pass {d} + {ds} a stream + {dt} a row tile")


@dataclass
class CostFit:
    """Weighted least squares of forward and drafter-pass seconds on their features, kept as normal
    equations so each observation costs a rank-one update."""

    forward_a: np.ndarray = field(default_factory=lambda: np.zeros((4, 4)))
    forward_b: np.ndarray = field(default_factory=lambda: np.zeros(4))
    draft_a: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))
    draft_b: np.ndarray = field(default_factory=lambda: np.zeros(3))

    @classmethod
    def around(cls, model: CostModel, weight: float = 1.0) -> CostFit:
        """A fit holding `model` as `weight` rounds' worth of observations at a spread of shapes."""
        fit = cls()
        for rows, trees in (([1], 0), ([16], 0), ([8, 8], 0), ([1] * 4, 0), ([16] * 4, 0), ([4] * 8, 0), ([16], 16),
                            ([4] * 4, 16)):
            fit.add_forward(rows, model.forward(rows, trees), weight, trees)
        for blocks in ([2], [16], [2] * 4, [16] * 4, [8] * 8):
            fit.add_draft(blocks, model.draft(blocks), weight)
        return fit

    def add_forward(self, rows: list[int], seconds: float, weight: float = 1.0, tree_rows: int = 0) -> None:
        x = forward_features(rows, tree_rows)
        self.forward_a += weight * np.outer(x, x)
        self.forward_b += weight * seconds * x

    def add_draft(self, block_rows: list[int], seconds: float, weight: float = 1.0) -> None:
        x = draft_features(block_rows)
        self.draft_a += weight * np.outer(x, x)
        self.draft_b += weight * seconds * x

    def fade(self, factor: float = FORGET) -> None:
        for a in (self.forward_a, self.forward_b, self.draft_a, self.draft_b):
            a *= factor

    def model(self) -> CostModel:
        """The least-squares model with every part zero or more."""
        return CostModel(*nonnegative(ridged(self.forward_a), self.forward_b), *nonnegative(ridged(self.draft_a), self.draft_b))


def ridged(a: np.ndarray) -> np.ndarray:
    """`a` plus RIDGE times its mean diagonal (at least RIDGE) on the diagonal."""
    return a + RIDGE * max(float(np.trace(a)) / len(a), 1.0) * np.eye(len(a))


def nonnegative(a: np.ndarray, b: np.ndarray) -> list[float]:
    """argmin over x >= 0 of x.a.x - 2 b.x (least squares from its normal equations a, b): the best of
    the unconstrained solutions on each subset of free parts (at most four parts: 16 subsets); clipping
    the full solution instead would leave the other parts fitted around a negative one."""
    n = len(b)
    best, best_value = np.zeros(n), 0.0
    for mask in range(1, 1 << n):
        free = [i for i in range(n) if mask >> i & 1]
        x = np.zeros(n)
        x[free] = np.linalg.solve(a[np.ix_(free, free)], b[free])
        value = float(x @ a @ x - 2 * b @ x)
        if (x >= 0).all() and value < best_value:
            best, best_value = x, value
    return [float(v) for v in best]


@dataclass
class Acceptance:
    """Discounted counts of drafts reached and kept at each depth (0-based), and, where the lanes draft
    trees, of the rank the target's choice had among the drafter's candidates at each depth a round's
    accept walk reached."""

    reached: np.ndarray
    kept: np.ndarray
    ranked: np.ndarray  # (depths,): depths whose choice's rank was counted
    rank_hits: np.ndarray  # (depths, RANKS): how often the choice was the candidate of each rank

    @classmethod
    def empty(cls, depths: int) -> Acceptance:
        return cls(np.zeros(depths), np.zeros(depths), np.zeros(depths), np.zeros((depths, RANKS)))

    def update(self, drafted: int, accepted: int, discount: float = 1.0, ranks: list[int] = ()) -> None:
        """One round that verified `drafted` drafts (a tree: as deep) and kept the first `accepted`, the
        target's choices having `ranks` among the candidates at depths 1, 2, .. (`tree.choice_ranks`)."""
        for a in (self.reached, self.kept, self.ranked, self.rank_hits):
            a *= discount
        depth = min(drafted, accepted + 1)
        self.reached[:depth] += 1
        self.kept[:accepted] += 1
        for d, rank in enumerate(ranks[: len(self.ranked)]):
            self.ranked[d] += 1
            if 0 <= rank < RANKS:
                self.rank_hits[d, rank] += 1

    def rates(self, prior: np.ndarray, weight: float) -> np.ndarray:
        return (self.kept + weight * prior) / (self.reached + weight)

    def rank_rates(self, prior: np.ndarray, weight: float) -> np.ndarray:
        """(depths, RANKS): the chance the choice at each depth is each rank's candidate."""
        return (self.rank_hits + weight * prior) / (self.ranked + weight)[:, None]


def tree_gains(rank_rates: np.ndarray, most: int) -> np.ndarray:
    """Expected drafts a best-first tree of n nodes keeps, n = 0 .. `most`: the sum of the n likeliest
    nodes' chances, a node at depth d reached through ranks r_1 .. r_d having the chance of the
    product of rank_rates[i - 1, r_i]. A node is never likelier than its parent, so the n likeliest
    form a tree; they are found best-first from the root's children."""
    gains, frontier = [0.0], [(-float(p), 1, float(p)) for p in (rank_rates[0] if len(rank_rates) else ())]
    heapq.heapify(frontier)
    while frontier and len(gains) <= most:
        _, depth, chance = heapq.heappop(frontier)
        gains.append(gains[-1] + chance)
        if depth < len(rank_rates):
            for p in rank_rates[depth]:
                heapq.heappush(frontier, (-chance * float(p), depth + 1, chance * float(p)))
    return np.array(gains + [gains[-1]] * (most + 1 - len(gains)))


@dataclass
class Budget:
    """Chooses each drafting stream's draft count every round (see the module docstring).
    `block_rows` is the drafter's rows a pass runs for a stream's count (DFlashDrafter.block_rows);
    with `trees` a count of 2 or more is a draft tree of that many nodes (lanes.py), priced as
    branching."""

    kind: str
    block: int
    fit: CostFit | None = None
    block_rows: Callable[[int], int] = lambda count: count + 1
    trees: bool = False
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

    def observe(self, rows: list[int], forward_seconds: float, counts: list[int], draft_seconds: float,
                tree_rows: int = 0) -> None:
        """A round as the lanes timed it: its segments' rows (`tree_rows` of them in branching trees)
        and forward (with keep), and the drafter pass for the drafting streams' `counts` (none: []).
        Older rounds fade; the model is refitted."""
        if self.fit is None or not rows:
            return
        self.fit.fade()
        self.fit.add_forward(rows, forward_seconds, tree_rows=tree_rows)
        if counts:
            self.fit.add_draft([self.block_rows(c) for c in counts], draft_seconds)
        self.cost = self.fit.model()

    @property
    def counts_ranks(self) -> bool:
        """Whether rounds should bring the ranks of the target's choices (`record`): only the auto
        budget's tree prices use them."""
        return self.kind == "auto" and self.trees

    def new_stream(self) -> Acceptance:
        return Acceptance.empty(self.block - 1)

    def record(self, acceptance: Acceptance, drafted: int, accepted: int, ranks: list[int] = ()) -> None:
        if drafted:
            acceptance.update(drafted, accepted, DISCOUNT, ranks)
            self.shared.update(drafted, accepted, ranks=ranks)

    def counts(self, limits: list[int], acceptances: list[Acceptance], idle: list[int], other_rows: list[int]) -> list[int]:
        """Draft counts for the decoding drafting streams (each at most its limit), given the rows of
        the round's other segments (prompt chunks, plain streams)."""
        if self.kind == "fixed" or not limits:
            return list(limits)
        prior = self.shared.rates(np.full(self.block - 1, 0.5), 1.0)
        if self.trees:  # rank 0 at the chain's rate and nothing else until ranks are counted
            rank_prior = self.shared.rank_rates(np.pad(prior[:, None], [(0, 0), (0, RANKS - 1)]), 1.0)
            gains = [tree_gains(a.rank_rates(rank_prior, PRIOR_WEIGHT)[:n], n) for a, n in zip(acceptances, limits)]
        else:
            gains = [np.concatenate([[0.0], np.cumsum(np.cumprod(a.rates(prior, PRIOR_WEIGHT)[:n]))])
                     for a, n in zip(acceptances, limits)]

        def rate(ks: list[int]) -> float:
            rows = other_rows + [1 + x for x in ks]
            tokens = sum(1 + g[x] for g, x in zip(gains, ks))
            tree_rows = sum(1 + x for x in ks if x > 1) if self.trees else 0
            return tokens / max(self.cost.seconds(rows, [self.block_rows(x) for x in ks if x], tree_rows), 1e-9)

        # The price is a step function of the rows (whole tiles) with a fixed part for any drafting,
        # so moving one stream at a time from all-plain stalls where only several moving together pay:
        # start from the best count shared by all streams, then improve one stream at a time.
        k = max(([min(n, limit) for limit in limits] for n in range(max(limits, default=0) + 1)), key=rate)
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


def measure_cost(target, drafter, parallel: int, trees: bool = False, context: int = 64, reps: int = 3) -> CostFit:
    """Time target forwards (1, 2, 4 .. `parallel` streams of 1, 4, 8 and `drafter.block` rows after
    a `context`-token prompt) and drafter passes (as many streams, each drafting 1, half a block or a
    block's drafts; as trees of that many nodes where the lanes draft trees), median of `reps`: the
    fit the rounds then refine."""
    from dflash_bench.engine.drafters.dflash import Proposal
    from dflash_bench.engine.sampling import SamplingParams
    from dflash_bench.engine.targets.base import Segment
    from dflash_bench.engine.tree import Tree

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
        mx.eval([o.logits for o in target.forward(segs, drafter.taps)], [states[i].arrays() for i in range(s)])
        for state in states[:s]:
            state.keep(context)

    def tree_forward(s: int) -> None:
        tree = Tree.of(prompt[: drafter.block], [-1] + [(r - 1) // 2 for r in range(1, drafter.block)])  # a binary tree
        segs = [Segment(list(tree.tokens), context, states[i], list(range(drafter.block)), True, tree=tree)
                for i in range(s)]
        mx.eval([o.logits for o in target.forward(segs, drafter.taps)], [states[i].arrays() for i in range(s)])
        for state in states[:s]:
            state.keep(context)

    fit = CostFit()
    for s in streams:
        for r in (1, 4, 8, drafter.block):
            fit.add_forward([r] * s, timed(lambda s=s, r=r: forward(s, r)))
        if trees:
            fit.add_forward([drafter.block] * s, timed(lambda s=s: tree_forward(s)), tree_rows=s * drafter.block)

    def propose(s: int, count: int) -> None:
        items = [Proposal(dstates[i], prompt[-1], count, SamplingParams(), count if trees else 0) for i in range(s)]
        drafter.propose_trees(items) if trees else drafter.propose(items)

    for s in streams:
        for count in (1, drafter.block // 2 - 1, drafter.block - 1):
            fit.add_draft([drafter.block_rows(count)] * s, timed(lambda s=s, c=count: propose(s, c)))
    return fit
