"""The verify budget (engine/budget.py): `auto` drafts where drafting pays by its cost model and the
streams' acceptance, drafts nothing where it does not (probing now and then), and never changes a
token: drafted == plain and concurrent == solo hold with it on, on the fixtures' real engine."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dflash_bench.engine.budget import PROBE_DRAFTS, PROBE_EVERY, Acceptance, Budget, CostFit, CostModel, measure_cost
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.fixtures.small import write_fixture

BLOCK = 16
# a CPU-like model: a row costs a tenth of a forward's fixed part, a drafter pass about half a forward
CPU_LIKE = CostFit.around(CostModel(base=0.010, per_segment=0.002, per_row=0.001, draft_base=0.005,
                                     draft_per_stream=0.001))


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
    """With a row at 0.4 of a forward's fixed part (not 0.1), a middling stream verifies fewer drafts."""
    cheap = Budget("auto", BLOCK, CPU_LIKE).counts([15], [seen(0.7)], [0], [])[0]
    dear = Budget("auto", BLOCK, CostFit.around(CostModel(0.010, 0.002, 0.004, 0.005, 0.001))).counts([15], [seen(0.7)], [0], [])[0]
    assert 0 < dear < cheap, (dear, cheap)


def test_acceptance_counts_reached_and_kept_depths() -> None:
    a = Acceptance.empty(5)
    a.update(5, 2)  # drafts 1, 2 kept, 3 rejected: depths 0..2 reached, 0..1 kept
    a.update(3, 3)  # all three kept: depths 0..2 reached and kept
    assert a.reached.tolist() == [2, 2, 2, 0, 0] and a.kept.tolist() == [2, 2, 1, 0, 0]
    assert np.allclose(a.rates(np.full(5, 0.5), 1.0), [2.5 / 3, 2.5 / 3, 1.5 / 3, 0.5, 0.5])  # unseen depths: the prior


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
    assert cost is not None and cost.seconds([1], 0) > 0 and cost.seconds([16, 16], 2) > cost.seconds([1], 0)
    assert "verify budget auto (a forward" in engine.startup_line()
    again = measure_cost(engine.target, engine.drafter, 1, reps=1).model()
    assert again.seconds([1], 0) > 0


def test_the_fit_recovers_a_linear_cost_and_follows_the_rounds_away_from_a_wrong_start() -> None:
    """Exact observations of a linear cost give back its parts; rounds that disagree with the load-time
    fit (a drafter pass priced 20x too high, as one noisy timing at load gave) pull the model to them."""
    truth = CostModel(base=0.004, per_segment=0.0005, per_row=0.0002, draft_base=0.002, draft_per_stream=0.0015)
    fit = CostFit()
    for segments, rows in ((1, 1), (1, 16), (2, 2), (4, 64), (8, 8), (3, 39)):
        fit.add_forward(segments, rows, truth.seconds([rows // segments] * segments, 0))
    for streams in (1, 2, 4, 8):
        fit.add_draft(streams, truth.draft_base + truth.draft_per_stream * streams)
    got = fit.model()
    for part in ("base", "per_segment", "per_row", "draft_base", "draft_per_stream"):
        assert getattr(got, part) == pytest.approx(getattr(truth, part), rel=1e-6), part
    wrong = CostModel(truth.base, truth.per_segment, truth.per_row, 0.009, 0.0895)
    budget = Budget("auto", BLOCK, CostFit.around(wrong))
    assert budget.cost.draft_per_stream == pytest.approx(0.0895, rel=1e-6)
    rng = random.Random(4)
    for _ in range(200):  # rounds of 1 to 4 drafting streams, each of 1 to 16 rows
        rows = [rng.randrange(1, 17) for _ in range(rng.randrange(1, 5))]
        budget.observe(rows, truth.seconds(rows, 0), len(rows), truth.draft_base + truth.draft_per_stream * len(rows))
    assert budget.cost.draft_per_stream == pytest.approx(truth.draft_per_stream, rel=0.05)
    assert budget.measured.draft_per_stream == pytest.approx(0.0895, rel=1e-6)  # the startup line's, unchanged
    high = seen(0.8)
    assert budget.counts([15], [high], [0], [])[0] > Budget("auto", BLOCK, CostFit.around(wrong)).counts([15], [high], [0], [])[0]


def test_the_lanes_time_decode_rounds_for_the_fit(pair) -> None:
    """Every decode round reaches `observe` with its segments' rows; prompt chunks' rounds do not."""
    engine = Engine(*pair, Settings(parallel=2, context=512, verify_budget="auto"))
    seen_rounds: list[tuple[list[int], float, int, float]] = []
    observe = engine.budget.observe
    engine.budget.observe = lambda *a: seen_rounds.append(a) or observe(*a)
    rng = random.Random(5)
    reqs = [Request([rng.randrange(8, 500) for _ in range(40)], max_tokens=20, ignore_eos=True, seed=i) for i in range(2)]
    engine.run(reqs)
    assert seen_rounds and all(fs > 0 and ds >= 0 and len(rows) <= 2 for rows, fs, _, ds in seen_rounds)
    assert all(max(rows) <= BLOCK for rows, *_ in seen_rounds)  # decode segments only, no 40-row prompt chunk
    assert any(n > 0 and ds > 0 for _, _, n, ds in seen_rounds)


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
