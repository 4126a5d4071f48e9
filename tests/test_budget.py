"""The verify budget (engine/budget.py): `auto` drafts where drafting pays by its cost model and the
streams' acceptance, drafts nothing where it does not (probing now and then), and never changes a
token: drafted == plain and concurrent == solo hold with it on, on the fixtures' real engine."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dflash_bench.engine.budget import (PROBE_DRAFTS, PROBE_EVERY, RANKS, Acceptance, Budget, CostFit, CostModel, forward_features,
                                        measure_cost, nonnegative, tree_gains)
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.fixtures.small import write_fixture

BLOCK = 16
# a CPU-like model, as the default model's timings on a 2-core CPU (docs/verify-budget.md): a 16-row tile
# of projections a quarter of a plain step, an 8-query tile of attention a twentieth, a drafter pass at
# one stream about a quarter of a step
CPU_LIKE = CostFit.around(CostModel(base=0.160, per_row_tile=0.060, per_query_tile=0.010, per_tree_row=0.004,
                                     draft_base=0.040, draft_per_stream=0.010, draft_per_row_tile=0.015))


def seen(rate: float, rounds: int = 40) -> Acceptance:
    """A stream's counts after `rounds` full blocks each kept draft by draft with chance `rate`."""
    rng = random.Random(1)
    a = Acceptance.empty(BLOCK - 1)
    for _ in range(rounds):
        k = 0
        while k < BLOCK - 1 and rng.random() < rate:
            k += 1
        a.update(BLOCK - 1, k, 0.9)
    return a


def test_fixed_verifies_every_limit() -> None:
    budget = Budget("fixed", BLOCK)
    assert budget.counts([15, 3, 0], [seen(0.0)] * 3, [0, 0, 0], []) == [15, 3, 0]


def test_auto_drafts_long_where_drafts_are_kept_and_not_at_all_where_they_never_are() -> None:
    budget = Budget("auto", BLOCK, CPU_LIKE)
    good, bad = seen(0.95), seen(0.0)
    counts = budget.counts([15, 15], [good, bad], [0, 0], [])
    assert counts[0] >= 8 and counts[1] == 0, counts
    # a stream held at 0 long enough probes a few drafts, so it can find predictable text again
    assert budget.counts([15], [bad], [PROBE_EVERY], [])[0] == PROBE_DRAFTS
    # near max_tokens the limit bounds the count
    assert budget.counts([2], [good], [0], []) == [2]


def test_auto_shortens_windows_when_rows_cost_more() -> None:
    """With a second query tile of attention at a tenth of a step's fixed part (not a sixteenth of
    it), a stream that keeps most drafts stops at the first query tile's 8 rows."""
    cheap = Budget("auto", BLOCK, CPU_LIKE).counts([15], [seen(0.8)], [0], [])[0]
    dear = Budget("auto", BLOCK, CostFit.around(CostModel(0.160, 0.060, 0.100, 0.004, 0.040, 0.010, 0.015))).counts(
        [15], [seen(0.8)], [0], [])[0]
    assert 0 < dear <= 7 < cheap, (dear, cheap)


def test_a_window_inside_one_row_tile_is_priced_as_the_tile() -> None:
    """A forward's projections run in 16-row tiles over all decode rows (tiles.Layout): one stream's
    16-row window pays a plain step's projections and one more query tile, so a stream whose drafts
    are mostly kept verifies a whole block; eight such streams' windows take eight tiles, and the
    budget drafts less there, but still in every stream: moving one stream at a time from all-plain,
    the search stalled with six of the eight plain (any drafting pays the pass's fixed part first)."""
    cost = CPU_LIKE.model()
    assert cost.forward([16]) - cost.forward([1]) == pytest.approx(cost.per_query_tile)
    assert cost.forward([16] * 8) - cost.forward([1] * 8) == pytest.approx(7 * cost.per_row_tile + 8 * cost.per_query_tile)
    assert forward_features([16, 1]).tolist() == [1.0, 2.0, 3.0, 0.0]
    budget = Budget("auto", BLOCK, CPU_LIKE)
    assert budget.counts([15], [seen(0.8)], [0], []) == [15]
    eight = budget.counts([15] * 8, [seen(0.8)] * 8, [0] * 8, [])
    assert 0 < min(eight) and sum(eight) < 8 * 15, eight


def test_branching_trees_are_priced_by_their_rows() -> None:
    """A tree's rows attend over their own key views (tree_attention.py), a cost a chain window does
    not pay: with trees on and tree rows dear, eight streams draft single drafts (a one-node tree is a
    chain) where the same streams with trees off draft several."""
    dear_trees = CostFit.around(CostModel(0.160, 0.060, 0.010, 0.030, 0.040, 0.010, 0.015))
    with_trees = Budget("auto", BLOCK, dear_trees, trees=True).counts([15] * 8, [seen(0.8)] * 8, [0] * 8, [])
    chains = Budget("auto", BLOCK, dear_trees).counts([15] * 8, [seen(0.8)] * 8, [0] * 8, [])
    assert max(with_trees) <= 1 < min(chains), (with_trees, chains)


def test_the_fit_keeps_every_part_at_zero_or_more_by_refitting_the_others() -> None:
    """Observations that pull one part below zero: the others are refitted with it at zero, which fits
    better than the full solution with the negative part clipped."""
    rows = np.array([[1.0, 1.0, 0.0], [1.0, 2.0, 1.0], [1.0, 3.0, 1.0], [1.0, 4.0, 3.0]])
    seconds = np.array([1.0, 2.0, 3.2, 3.9])
    a, b = rows.T @ rows, rows.T @ seconds
    full = np.linalg.solve(a, b)
    assert (full < 0).any()
    got = np.array(nonnegative(a, b))
    clipped = np.maximum(full, 0)
    assert (got >= 0).all()
    assert np.sum((rows @ got - seconds) ** 2) < np.sum((rows @ clipped - seconds) ** 2)


def ranked(rates: list[float], rounds: int = 60) -> Acceptance:
    """A stream's counts after `rounds` tree rounds in which, at every depth, the target's choice is the
    candidate of rank r with chance rates[r] (else none of them), the walk going on while it is one."""
    rng = random.Random(2)
    a = Acceptance.empty(BLOCK - 1)
    for _ in range(rounds):
        ranks = []
        while len(ranks) < BLOCK - 1:
            ranks.append(rng.choices(range(-1, len(rates)), [1 - sum(rates), *rates])[0])
            if ranks[-1] < 0:
                break
        kept = len(ranks) - (ranks[-1] < 0)
        a.update(BLOCK - 1, kept, 0.9, ranks)
    return a


def test_a_trees_worth_is_its_likeliest_nodes_chances() -> None:
    """tree_gains against every node of a small lattice enumerated and sorted; with rank 0 alone it is a
    chain's cumulative acceptance."""
    rates = np.array([[0.5, 0.3, 0.1, 0.05], [0.6, 0.2, 0.1, 0.0], [0.4, 0.4, 0.1, 0.1]])
    chances = []
    for r1 in range(4):
        chances.append(rates[0, r1])
        for r2 in range(4):
            chances.append(rates[0, r1] * rates[1, r2])
            chances += [rates[0, r1] * rates[1, r2] * rates[2, r3] for r3 in range(4)]
    top = np.concatenate([[0.0], np.cumsum(sorted(chances, reverse=True))])
    assert np.allclose(tree_gains(rates, 20), top[:21])
    chain = np.array([[0.8, 0, 0, 0]] * 5)
    kept = np.cumsum([0.8**d for d in range(1, 6)])
    assert np.allclose(tree_gains(chain, 7), [0, *kept, kept[-1], kept[-1]])  # 5 deep: more nodes keep nothing more
    assert tree_gains(rates[:0], 0).tolist() == [0.0]


def test_trees_are_worth_what_their_ranks_keep_not_a_chain_of_their_size() -> None:
    """Two streams with the same chain acceptance (rank 0 kept 40% of the time) but one whose target
    picks the drafter's second or third candidate another 40% of the time: its trees keep far more, so
    with trees on the budget grows them bigger for it; before any rank is counted a tree is priced as a
    chain of its size."""
    wide, narrow = ranked([0.4, 0.3, 0.1]), ranked([0.4])
    assert wide.ranked[0] > 0 and narrow.ranked[0] > 0
    budget = Budget("auto", BLOCK, CPU_LIKE, trees=True)
    got = budget.counts([15, 15], [wide, narrow], [0, 0], [])
    assert got[0] > got[1], got
    unranked = seen(0.4)
    assert unranked.ranked.sum() == 0
    prior = np.pad(np.full((BLOCK - 1, 1), 0.4), [(0, 0), (0, RANKS - 1)])
    assert np.array_equal(unranked.rank_rates(prior, 2.0), prior)


def test_the_lanes_count_the_ranks_of_the_targets_choices_with_trees(pair) -> None:
    """With the auto budget, tree rounds and the chain rounds of a tree-drafting engine reach the budget
    with the ranks of the target's choices among the drafter's candidates; without trees, or with a
    fixed budget that has no use for them, none are counted."""
    rng = random.Random(6)
    reqs = [Request([rng.randrange(8, 500) for _ in range(30)], max_tokens=24, ignore_eos=True, seed=i) for i in range(2)]
    for tree_nodes, budget in ((6, "auto"), (0, "auto"), (6, "fixed")):
        engine = Engine(*pair, Settings(parallel=2, context=512, verify_budget=budget, tree_nodes=tree_nodes))
        engine.run(reqs)
        shared = engine.budget.shared
        assert shared.reached.sum() > 0
        if tree_nodes and budget == "auto":
            assert 0 < shared.ranked.sum() and shared.rank_hits.sum() <= shared.ranked.sum()
            assert shared.ranked[0] >= shared.reached[0] - 1e-9  # every walk ranks its first depth
        else:
            assert shared.ranked.sum() == 0


def test_acceptance_counts_reached_and_kept_depths() -> None:
    a = Acceptance.empty(5)
    a.update(5, 2)  # drafts 1, 2 kept, 3 rejected: depths 0..2 reached, 0..1 kept
    a.update(3, 3)  # all three kept: depths 0..2 reached and kept
    assert a.reached.tolist() == [2, 2, 2, 0, 0] and a.kept.tolist() == [2, 2, 1, 0, 0]
    assert np.allclose(a.rates(np.full(5, 0.5), 1.0), [2.5 / 3, 2.5 / 3, 1.5 / 3, 0.5, 0.5])  # unseen depths: the prior
    a.update(4, 1, ranks=[2, -1])  # a tree walk: the first depth's choice the third candidate, the second's none
    assert a.ranked.tolist() == [1, 1, 0, 0, 0] and a.rank_hits[:, 2].tolist() == [1, 0, 0, 0, 0]
    assert a.rank_hits.sum() == 1 and a.rank_hits.shape == (5, RANKS)


def test_unknown_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="verify budget 'most'"):
        Budget("most", BLOCK)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    return write_fixture("llama", root / "t", seed=1), write_fixture("dflash", root / "d", seed=2, target="llama")


def test_cost_model_is_timed_at_load_and_named_in_the_startup_line(pair) -> None:
    engine = Engine(*pair, Settings(parallel=2, context=512, verify_budget="auto"))
    cost = engine.budget.cost
    assert cost is not None and cost.seconds([1], []) > 0 and cost.seconds([16, 16], [16, 16]) > cost.seconds([1], [])
    assert "verify budget auto (a forward" in engine.startup_line()
    again = measure_cost(engine.target, engine.drafter, 1, reps=1).model()
    assert again.seconds([1], []) > 0


def test_the_fit_recovers_a_linear_cost_and_follows_the_rounds_away_from_a_wrong_start() -> None:
    """Exact observations of a cost linear in the tiles give back its parts; rounds that disagree with the
    load-time fit (a drafter pass priced 10x too high, as one noisy timing at load gave) pull the model
    to them."""
    truth = CostModel(base=0.004, per_row_tile=0.002, per_query_tile=0.0005, per_tree_row=0.0003, draft_base=0.002,
                      draft_per_stream=0.0015, draft_per_row_tile=0.001)
    fit = CostFit()
    for rows, trees in (([1], 0), ([16], 0), ([2, 2], 0), ([16] * 4, 0), ([8] * 8, 0), ([13, 13, 13], 26), ([16], 16)):
        fit.add_forward(rows, truth.forward(rows, trees), tree_rows=trees)
    for blocks in ([2], [16], [2] * 4, [16] * 4, [8] * 8):
        fit.add_draft(blocks, truth.draft(blocks))
    got = fit.model()
    for part in ("base", "per_row_tile", "per_query_tile", "per_tree_row", "draft_base", "draft_per_stream",
                 "draft_per_row_tile"):
        assert getattr(got, part) == pytest.approx(getattr(truth, part), rel=1e-6), part
    wrong = CostModel(truth.base, truth.per_row_tile, truth.per_query_tile, truth.per_tree_row, 0.009, 0.0195, 0.01)
    budget = Budget("auto", BLOCK, CostFit.around(wrong))
    assert budget.cost.draft_per_stream == pytest.approx(0.0195, rel=1e-6)
    rng = random.Random(4)
    for _ in range(200):  # rounds of 1 to 4 drafting streams, each drafting 1 to 15
        counts = [rng.randrange(1, 16) for _ in range(rng.randrange(1, 5))]
        rows = [c + 1 for c in counts]
        budget.observe(rows, truth.forward(rows), counts, truth.draft(rows))
    assert budget.cost.draft_per_stream == pytest.approx(truth.draft_per_stream, rel=0.05)
    assert budget.measured.draft_per_stream == pytest.approx(0.0195, rel=1e-6)  # the startup line's, unchanged
    high = seen(0.6)
    assert budget.counts([15], [high], [0], [])[0] > Budget("auto", BLOCK, CostFit.around(wrong)).counts([15], [high], [0], [])[0]


def test_the_fit_stays_solvable_through_many_rounds_of_one_shape() -> None:
    """One stream drafting DFlash2 blocks: every forward is one row tile and every drafter pass one
    block, so the features never vary. A thousand faded rounds of that shape still give a model, and
    it prices that shape as observed (the ridge faded with the sums once and the solve raised)."""
    truth = CostModel(base=0.004, per_row_tile=0.002, per_query_tile=0.0005, per_tree_row=0.0003, draft_base=0.002,
                      draft_per_stream=0.0015, draft_per_row_tile=0.001)
    budget = Budget("auto", BLOCK, CostFit.around(truth), block_rows=lambda count: BLOCK, trees=True)
    for _ in range(1000):
        budget.observe([16], truth.forward([16], 16), [15], truth.draft([BLOCK]), tree_rows=16)
    assert budget.cost.forward([16], 16) == pytest.approx(truth.forward([16], 16), rel=1e-6)
    assert budget.cost.draft([BLOCK]) == pytest.approx(truth.draft([BLOCK]), rel=1e-6)


@pytest.mark.parametrize("tree_nodes", [0, 4])
def test_the_lanes_time_decode_rounds_for_the_fit(pair, tree_nodes) -> None:
    """Every decode round reaches `observe` with its segments' rows, the drafting streams' counts and
    the rows in branching trees (none without trees); prompt chunks' rounds do not."""
    engine = Engine(*pair, Settings(parallel=2, context=512, verify_budget="auto", tree_nodes=tree_nodes))
    seen_rounds: list[tuple[list[int], float, list[int], float, int]] = []
    observe = engine.budget.observe
    engine.budget.observe = lambda *a: seen_rounds.append(a) or observe(*a)
    rng = random.Random(5)
    reqs = [Request([rng.randrange(8, 500) for _ in range(40)], max_tokens=20, ignore_eos=True, seed=i) for i in range(2)]
    engine.run(reqs)
    assert seen_rounds and all(fs > 0 and ds >= 0 and len(rows) <= 2 for rows, fs, _, ds, _ in seen_rounds)
    assert all(max(rows) <= BLOCK for rows, *_ in seen_rounds)  # decode segments only, no 40-row prompt chunk
    assert any(counts and ds > 0 for _, _, counts, ds, _ in seen_rounds)
    assert all(0 <= trees <= sum(rows) for rows, *_, trees in seen_rounds)
    assert any(trees for *_, trees in seen_rounds) == bool(tree_nodes)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_auto_budget_keeps_drafted_equal_to_plain_and_concurrent_equal_to_solo(pair, temperature) -> None:
    """A random drafter keeps almost nothing, so auto verifies far fewer drafts than fixed; every reply
    is still plain decoding's, alone and four streams at once."""
    auto = Engine(*pair, Settings(parallel=4, context=512, verify_budget="auto"))
    fixed = Engine(*pair, Settings(parallel=4, context=512))
    rng = random.Random(3)
    reqs = [Request([rng.randrange(8, 500) for _ in range(rng.randrange(3, 60))], max_tokens=40, ignore_eos=True,
                    temperature=temperature, seed=i) for i in range(4)]
    together = auto.run(reqs, arrivals=[0, 1, 2, 5])
    drafted = {"auto": sum(r.stats.drafted for r in together)}
    drafted["fixed"] = sum(fixed.generate(r).stats.drafted for r in reqs)
    for req, got in zip(reqs, together):
        plain = fixed.generate(Request(req.prompt, max_tokens=40, ignore_eos=True, temperature=temperature,
                                       seed=req.seed, draft=False))
        assert got.tokens == plain.tokens
    assert drafted["auto"] < drafted["fixed"] / 2, drafted
