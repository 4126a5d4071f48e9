"""A drafter pass sends only the rows each stream drafts from through the lm_head (drafters/dflash.py's
`block_pass`), and those rows keep their bits: short proposals draft what a full block's first rows draft,
alone or beside other streams, for DFlash v1 and DFlash2, greedy and sampled."""

from __future__ import annotations

import pytest

from dflash_bench.engine.drafters.dflash import Proposal
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.sampling import SamplingParams
from dflash_bench.engine.targets import Segment
from dflash_bench.fixtures.small import write_fixture


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def drafter(request, tmp_path_factory):
    """The engine's drafter: the lm_head's row tiles are the ones its self-check proved on this machine."""
    root = tmp_path_factory.mktemp(request.param)
    engine = Engine(write_fixture("llama", root / "target", seed=1),
                    write_fixture(request.param, root / "drafter", seed=2, target="llama"), Settings(parallel=3, context=512))
    assert engine.selfcheck.passed, engine.selfcheck.line()
    target, drafter = engine.target, engine.drafter
    prompt = [(11 * i) % 400 + 8 for i in range(37)]
    taps = target.forward([Segment(prompt, 0, target.new_state(), want_taps=True)], drafter.taps)[0].taps
    states = []
    for n in (37, 30, 21):
        state = drafter.new_state()
        drafter.absorb([(state, taps[:n])])
        states.append(state)
    return drafter, states


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_short_proposals_draft_a_full_blocks_first_rows_and_run_only_their_rows(drafter, temperature, monkeypatch):
    drafter, states = drafter
    full = drafter.block - 1
    params = [SamplingParams(temperature, seed=s) for s in range(3)]
    whole = [drafter.propose([Proposal(st, 9 + i, full, p)])[0] for i, (st, p) in enumerate(zip(states, params))]
    counts = (3, full, 1)
    rows: list[int] = []
    logits = drafter.logits

    def counted(x):
        rows.append(x.shape[0])
        return logits(x)

    monkeypatch.setattr(drafter, "logits", counted)
    short = drafter.propose([Proposal(st, 9 + i, n, p) for i, (st, n, p) in enumerate(zip(states, counts, params))])
    assert short == [w[:n] for w, n in zip(whole, counts)]
    assert rows == [sum(counts)]  # not 3 x full
