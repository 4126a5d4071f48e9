"""The exactness contract end to end in the engine: real targets and a real DFlash drafter.

Random fixture checkpoints in the published layouts (dflash_bench.fixtures.small) for each
family, with a DFlash v1 drafter matched to them. A random drafter is rarely right, so these tests
prove the real arithmetic (taps, fused rows, rollback of partial windows) keeps drafted == plain,
concurrent == solo and resumed == fresh; tests/test_engine_doubles.py drives every acceptance
length with an oracle.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.engine.tiles import Weight
from dflash_bench.fixtures.small import write_fixture

FAMILIES = ["llama", "qwen3", "qwen3_5"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    target = write_fixture(request.param, root / "target", seed=1)
    drafter = write_fixture("dflash", root / "drafter", seed=2, target=request.param)
    return target, drafter


def prompts(n: int, seed: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(rng.randrange(1, 90))] for _ in range(n)]


def make(pair, **settings) -> Engine:
    target, drafter = pair
    return Engine(target, drafter, Settings(**{"parallel": 4, "context": 512, "chunk": 32, **settings}))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafted_equals_plain_over_20_prompts(pair, temperature):
    engine = make(pair)
    accepted = 0
    for i, p in enumerate(prompts(20, seed=10)):
        req = dict(prompt=p, max_tokens=20, temperature=temperature, seed=100 + i, ignore_eos=True)
        drafted = engine.generate(Request(**req))
        plain = engine.generate(Request(**req, draft=False))
        assert drafted.tokens == plain.tokens, f"prompt {i}"
        assert plain.stats.tokens_per_round == 1.0
        assert drafted.stats.drafted > 0
        accepted += drafted.stats.accepted
    assert accepted >= 0  # a random drafter may never be right; exactness may not depend on it


def test_four_staggered_streams_equal_each_alone(pair):
    reqs = [Request(p, max_tokens=24, ignore_eos=True, draft=(i != 2)) for i, p in enumerate(prompts(4, seed=11))]
    together = make(pair).run(reqs, arrivals=[0, 2, 3, 5])
    alone = make(pair, parallel=1)
    for req, got in zip(reqs, together):
        assert got.tokens == alone.generate(Request(req.prompt, max_tokens=24, ignore_eos=True)).tokens


def test_resumed_prompt_equals_fresh(pair):
    prompt = prompts(1, seed=12)[0] * 3
    engine = make(pair, prompt_cache_gib=0.05)
    fresh = engine.generate(Request(prompt, max_tokens=16, ignore_eos=True))
    resumed = engine.generate(Request(prompt, max_tokens=16, ignore_eos=True))
    assert fresh.stats.cached_tokens == 0
    assert resumed.stats.cached_tokens == (len(prompt) - 1) // 32 * 32 > 0
    assert resumed.tokens == fresh.tokens
    plain = make(pair).generate(Request(prompt, max_tokens=16, ignore_eos=True, draft=False))
    assert plain.tokens == fresh.tokens


def test_cancel_mid_draft_and_mid_prefill_leaves_others_and_memory_unchanged(pair):
    refs = prompts(2, seed=13)
    expected = [make(pair, parallel=1).generate(Request(p, max_tokens=20, ignore_eos=True)).tokens for p in refs]
    engine = make(pair)
    mx.eval(mx.zeros(1))
    mx.clear_cache()
    baseline = mx.get_active_memory()
    handles = [engine.submit(Request(p, max_tokens=20, ignore_eos=True)) for p in refs]
    drafting = engine.submit(Request([9, 10, 11], max_tokens=200, ignore_eos=True))
    prefilling = engine.submit(Request(prompts(1, seed=14)[0] * 5 + [7] * 200, max_tokens=4))
    for round_no in range(300):
        if round_no == 3:
            streams = engine.status().streams
            assert streams[2].prefill_done and not streams[3].prefill_done
            drafting.cancel()
            prefilling.cancel()
        if not engine.status().busy:
            break
        engine.step()
    assert [h.result().tokens for h in handles] == expected
    assert drafting.result().finish == prefilling.result().finish == "cancelled"
    mx.clear_cache()
    assert mx.get_active_memory() <= baseline


def test_a_rounds_weights_are_each_product_once_and_the_drafters_with_the_lm_head(pair):
    """Engine.weight_bytes, engine-speed's "weights a round reads": a plain round reads every projection of the
    checkpoint once (a stacked weight's parts are its projections' bytes), the embedding only where it is the lm_head
    too; a drafting round adds every array of the drafter and the lm_head again, which the drafts go through."""
    engine = make(pair)

    def size(w) -> int:
        return sum(a.nbytes for a in (w.arrays() if isinstance(w, Weight) else [w]))

    weights = engine.loaded.weights
    products = sum(size(w) for name, w in weights.items() if "proj" in name.split(".")[-2])
    head = size(weights.get("lm_head.weight", weights["embed_tokens.weight"]))
    assert engine.target.weight_bytes() == products + head
    assert engine.weight_bytes() == products + 2 * head + engine.drafter.nbytes
    assert engine.drafter.nbytes == sum(a.nbytes for a in engine.drafter.parameters()) > 0
