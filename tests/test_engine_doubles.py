"""The exactness contract on the engine's rounds, with weight-free doubles (tests/doubles.py)."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from doubles import EOS, VOCAB, HashTarget, OracleDrafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request


def engine(drafter=None, parallel=4, cache_gib=0.0, chunk=16, context=4096) -> Engine:
    return Engine(
        model=HashTarget(),
        draft_model=drafter,
        settings=Settings(parallel=parallel, context=context, prompt_cache_gib=cache_gib, chunk=chunk),
        eos_ids=(EOS,),
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


def solo(req: Request, **kw) -> list[int]:
    return engine(**kw).generate(req).tokens


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafted_equals_plain_at_every_acceptance_length(temperature):
    oracle = OracleDrafter(block=6)
    drafted = engine(oracle, parallel=1)
    plain = engine(None, parallel=1)
    for i, p in enumerate(prompts(20)):
        req = dict(prompt=p, max_tokens=40, temperature=temperature, seed=i if temperature else None)
        a = drafted.generate(Request(**req))
        b = plain.generate(Request(**req, draft=False))
        assert a.tokens == b.tokens, f"prompt {i}"
        assert a.finish == b.finish
        assert b.stats.tokens_per_round == 1.0 or b.stats.rounds == 0
    assert set(oracle.proposed_k) == set(range(6)), "every acceptance length 0..B-1 must occur"


def test_draft_false_beside_drafting_streams_equals_plain_alone():
    reqs = [Request(p, max_tokens=30, draft=(i % 2 == 0)) for i, p in enumerate(prompts(4, seed=1))]
    together = engine(OracleDrafter(), parallel=4).run(reqs)
    for req, got in zip(reqs, together):
        assert got.tokens == solo(Request(req.prompt, max_tokens=30, draft=False))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_concurrent_staggered_streams_equal_each_alone(temperature):
    reqs = [Request(p, max_tokens=35, temperature=temperature, seed=7) for p in prompts(4, seed=2)]
    together = engine(OracleDrafter(), parallel=4).run(reqs, arrivals=[0, 1, 3, 6])
    for req, got in zip(reqs, together):
        alone = solo(Request(req.prompt, max_tokens=35, temperature=temperature, seed=7), drafter=OracleDrafter())
        assert got.tokens == alone


def test_more_requests_than_lanes_wait_and_still_equal_alone():
    reqs = [Request(p, max_tokens=12) for p in prompts(7, seed=3)]
    got = engine(OracleDrafter(), parallel=2).run(reqs)
    assert [g.tokens for g in got] == [solo(Request(r.prompt, max_tokens=12)) for r in reqs]


def test_resumed_prompt_equals_fresh_and_reports_cached_tokens():
    prompt = prompts(1, seed=4)[0] * 3 + [5, 6, 7]
    e = engine(OracleDrafter(), parallel=1, cache_gib=0.01, chunk=16)
    first = e.generate(Request(prompt, max_tokens=20))
    second = e.generate(Request(prompt, max_tokens=20))
    assert first.stats.cached_tokens == 0
    assert second.stats.cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert second.tokens == first.tokens == solo(Request(prompt, max_tokens=20, draft=False))
    longer = e.generate(Request(prompt + [9, 9, 9], max_tokens=20))
    assert longer.stats.cached_tokens > 0
    assert longer.tokens == solo(Request(prompt + [9, 9, 9], max_tokens=20))


def test_cancelled_streams_leave_others_unchanged_and_memory_at_baseline():
    refs = [Request(p, max_tokens=40) for p in prompts(2, seed=5)]
    expected = [solo(Request(r.prompt, max_tokens=40)) for r in refs]
    e = engine(OracleDrafter(), parallel=4, chunk=8)
    mx.eval(mx.zeros(1))
    baseline = mx.get_active_memory()
    handles = [e.submit(Request(r.prompt, max_tokens=40)) for r in refs]
    mid_draft = e.submit(Request(prompts(1, seed=6)[0][:5], max_tokens=200))
    mid_prefill = e.submit(Request(prompts(1, seed=7)[0] * 20, max_tokens=10))
    for round_no in range(200):
        if round_no == 4:
            mid_draft.cancel()
            assert e.status().streams[2].prefill_done, "the first victim should be decoding"
            mid_prefill.cancel()
            assert not e.status().streams[3].prefill_done, "the second victim should be mid-prompt"
        if not e.status().busy:
            break
        e.step()
    assert [h.result().tokens for h in handles] == expected
    assert mid_draft.result().finish == "cancelled"
    assert mid_prefill.result().finish == "cancelled"
    assert e.status().streams == ()
    assert mx.get_active_memory() <= baseline
    # later requests are unaffected too
    assert e.generate(Request(refs[0].prompt, max_tokens=40)).tokens == expected[0]


def test_eos_and_max_tokens_end_a_stream():
    e = engine(OracleDrafter(), parallel=1)
    for p in prompts(20, seed=8):
        r = e.generate(Request(p, max_tokens=60))
        assert EOS not in r.tokens
        assert r.finish == "length" and len(r.tokens) == 60 or r.finish == "stop" and len(r.tokens) < 60
        ignored = e.generate(Request(p, max_tokens=60, ignore_eos=True))
        assert len(ignored.tokens) == 60


def test_a_window_past_the_context_is_refused():
    from dflash_bench.engine.errors import ContextExceeded

    with pytest.raises(ContextExceeded):
        engine(context=64).submit(Request([5] * 60, max_tokens=10))
