"""Prompt chunks: deterministic per chunk, bit for bit (targets/base.py's second regime).

A prefill segment (every row a prompt row of a chunk starting at a chunk boundary) takes attention
and the GatedDeltaNet recurrence whole, so its rows are not single steps; the contract needs only
that they are a function of the chunk and its stream's state. For llama, qwen3 and qwen3_5, at
hidden 64 and at SmolLM2's 576:
- a prompt chunk's logits, taps and the state it leaves are the same bits whether it runs alone or
  packed with other streams' windows, steps and chunks (concurrent == solo);
- a prompt resumed from a chunk-boundary snapshot computes the fresh prompt's bits (resumed == fresh);
- the per-chunk path computes what the tiled / per-token path computes, to float32 rounding;
- the lanes mark prompt chunks, and only them, as prefill segments, each starting at a boundary.
"""

from __future__ import annotations

import pytest
from test_rows import (
    SIZES, assert_same_state, count_dependent, differing_rows, prefilled, random_tokens, target_for,
)
from tiny_targets import FAMILIES, tiny_target

import mlx.core as mx

from dflash_bench.engine.cache import TargetState
from dflash_bench.engine.constants import CHUNK
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.engine.targets import Segment, Target

TAPS = (0, 1)


def chunks(n: int, start: int = 0) -> list[tuple[int, int]]:
    """The lanes' prompt chunks of an n-token prompt from `start` (0 or a boundary)."""
    out, pos = [], start
    while pos < n:
        end = min(n, (pos // CHUNK + 1) * CHUNK)
        out.append((pos, end))
        pos = end
    return out


def prefill(target: Target, state: TargetState, tokens: list[int], start: int = 0, tiled: bool = False):
    """Feed tokens[start:] in the lanes' chunks; each chunk's (logits of every row, taps), kept whole."""
    outs = []
    for a, b in chunks(len(tokens), start):
        seg = Segment(tokens[a:b], a, state, list(range(b - a)), want_taps=True, prefill=not tiled)
        out = target.forward([seg], TAPS)[0]
        state.keep(b)
        mx.eval(out.logits, out.taps, state.arrays())
        outs.append((out.logits, out.taps))
    return outs


def prefilled_chunked(target: Target, tokens: list[int]) -> TargetState:
    state = target.new_state()
    prefill(target, state, tokens)
    return state


def differences(got, want, what: str) -> list[str]:
    diffs = []
    for i, ((gl, gt), (wl, wt)) in enumerate(zip(got, want)):
        for name, g, w in (("logits", gl, wl), ("taps", gt, wt)):
            if bad := differing_rows(g, w):
                diffs.append(f"{what}: chunk {i} {name} rows {bad}")
    return diffs


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_chunk_packed_with_other_streams_equals_it_alone(family: str, size: str) -> None:
    """The second chunk of a 300-token prompt (44 rows from 256) beside a 5-row window, a one-row
    step and another stream's first chunk, in both orders: the same bits as alone."""
    target = target_for(family, size)
    prompt = random_tokens(300, 30)
    first = prefilled_chunked(target, prompt[:CHUNK])
    window_base = prefilled(target, random_tokens(70, 31))
    step_base = prefilled(target, random_tokens(9, 32))
    window, step, other = random_tokens(5, 33), random_tokens(1, 34), random_tokens(100, 35)

    def segments(states: list[TargetState]) -> list[Segment]:
        return [
            Segment(prompt[CHUNK:], CHUNK, states[0], list(range(300 - CHUNK)), want_taps=True, prefill=True),
            Segment(window, 70, states[1], list(range(5)), want_taps=True),
            Segment(step, 9, states[2], [0], want_taps=True),
            Segment(other, 0, states[3], [99], want_taps=True, prefill=True),
        ]

    def fresh() -> list[TargetState]:
        return [first.snapshot(CHUNK), window_base.snapshot(70), step_base.snapshot(9), target.new_state()]

    alone_states = fresh()
    alone = target.forward(segments(alone_states)[:1], TAPS)[0]
    alone_state = alone_states[0]
    alone_state.keep(300)
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        states = fresh()
        segs = segments(states)
        out = dict(zip(order, target.forward([segs[i] for i in order], TAPS)))[0]
        states[0].keep(300)
        what = f"{family} {size} order {order}"
        assert differences([(out.logits, out.taps)], [(alone.logits, alone.taps)], what) == []
        assert_same_state(states[0], alone_state, what)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_resumed_prompt_equals_fresh(family: str, size: str) -> None:
    """A 600-token prompt fresh, and from its state at the 256 boundary as the prompt cache keeps it
    (a snapshot of 256 key rows, so its caches then grow differently from the fresh stream's): every
    row of the remaining chunks and the final state are the same bits."""
    target = target_for(family, size)
    prompt = random_tokens(600, 40)
    fresh_state = target.new_state()
    fresh = prefill(target, fresh_state, prompt)
    boundary = prefilled_chunked(target, prompt[:CHUNK]).snapshot(CHUNK)
    resumed = prefill(target, boundary, prompt, start=CHUNK)
    assert differences(resumed, fresh[1:], f"{family} {size}") == []
    assert_same_state(boundary, fresh_state, f"{family} {size} final state")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_resume_check_can_fail_when_a_chunk_boundary_moves(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt rows depend on the chunk they sit in: with a matmul whose bits follow the call's row
    count (made here, not left to the BLAS), the same prompt resumed from position 200 (not a
    boundary; the lanes never do it) computes rows 200-255 in a call of another size, and the keys
    they leave change the later chunks' rows. (The hidden-64 qwen3_5 fixture's only attention layer
    is its last, so its keys do not reach later chunks' rows.)"""
    count_dependent(monkeypatch)
    target = target_for(family, "small")
    prompt = random_tokens(600, 40)
    fresh = prefill(target, target.new_state(), prompt)
    assert differences(prefill(target, target.new_state(), prompt), fresh, family) == [], "not deterministic"
    moved = prefill(target, prefilled_chunked(target, prompt[:200]).snapshot(200), prompt, start=200)
    assert differences(moved[1:], fresh[1:], family), "every row after the moved boundary still matched"


def close(got: mx.array, want: mx.array, what: str, tol: float = 1e-4) -> None:
    err, scale = mx.abs(got - want).max().item(), mx.abs(want).max().item()
    assert err <= tol * max(scale, 1.0), f"{what}: max |per-chunk - tiled| = {err:.3g} (values up to {scale:.3g})"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_computes_what_the_tiled_path_computes(family: str, size: str) -> None:
    """Correctness, not exactness: a 300-token prompt through the per-chunk path and through the
    tiled / per-token path agrees to float32 rounding in every row's logits and taps and in the state."""
    target = target_for(family, size)
    prompt = random_tokens(300, 50)
    fast_state, tiled_state = target.new_state(), target.new_state()
    fast, tiled = prefill(target, fast_state, prompt), prefill(target, tiled_state, prompt, tiled=True)
    for i, ((fl, ft), (tl, tt)) in enumerate(zip(fast, tiled)):
        close(fl, tl, f"{family} {size} chunk {i} logits")
        close(ft, tt, f"{family} {size} chunk {i} taps")
    for j, (a, b) in enumerate(zip(fast_state.committed(), tiled_state.committed())):
        close(a, b, f"{family} {size} cache array {j}")


def test_prefill_segments_take_the_per_chunk_calls_and_windows_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt chunk calls sdpa once per attention layer and the chunked delta rule once per linear
    layer; a window beside it calls neither (it keeps the tiles and the per-token loop)."""
    from dflash_bench.engine.targets import qwen3_5

    target = target_for("qwen3_5", "small")  # 3 linear layers and 1 attention layer
    base = prefilled(target, random_tokens(20, 61))
    calls = {"sdpa": [], "gdu": [], "loop": []}
    sdpa, gdu, loop = mx.fast.scaled_dot_product_attention, qwen3_5.chunked_gated_delta, qwen3_5.gated_delta_ops
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda q, *a, **kw: calls["sdpa"].append(q.shape[2]) or sdpa(q, *a, **kw))
    monkeypatch.setattr(qwen3_5, "chunked_gated_delta", lambda q, *a, **kw: calls["gdu"].append(q.shape[0]) or gdu(q, *a, **kw))
    monkeypatch.setattr(qwen3_5, "gated_delta_ops", lambda q, *a, **kw: calls["loop"].append(q.shape[1]) or loop(q, *a, **kw))
    target.forward([Segment(random_tokens(40, 62), 0, target.new_state(), [39], prefill=True),
                    Segment(random_tokens(5, 63), 20, base, list(range(5)))])
    assert calls == {"sdpa": [40], "gdu": [40, 40, 40], "loop": [5, 5, 5]}


def test_the_lanes_mark_prompt_chunks_and_only_them_as_prefill() -> None:
    """Fresh and resumed prompts (prompt cache on), drafted and plain, beside each other: every
    prefill segment holds prompt rows from a chunk boundary to the next boundary or the prompt's
    end; every decode window is not prefill."""
    from test_planner import tiny_drafter_for

    from dflash_bench.engine.drafters.dflash import DFlashDrafter

    target, _ = tiny_target("llama", "small", layers=4)
    weights, d = tiny_drafter_for(target.config)
    engine = Engine(model=target, draft_model=DFlashDrafter(d, weights, target), eos_ids=(),
                    settings=Settings(parallel=3, context=512, prompt_cache_gib=0.05, chunk=32))
    seen: list[tuple[bool, int, int]] = []
    forward = target.forward

    def spy(segments, taps=(), **kwargs):
        seen.extend((seg.prefill, seg.start, len(seg.tokens)) for seg in segments)
        return forward(segments, taps, **kwargs)

    target.forward = spy
    prompts = [random_tokens(n, 70 + n) for n in (75, 40, 5)]
    first = engine.run([Request(p, max_tokens=6, ignore_eos=True, draft=i != 1) for i, p in enumerate(prompts)])
    again = engine.generate(Request(prompts[0], max_tokens=6, ignore_eos=True))
    assert again.stats.cached_tokens == 64 and again.tokens == first[0].tokens
    prompt_chunks = sorted((start, n) for prefill_, start, n in seen if prefill_)
    # 75 fresh, 40, 5, then 75 resumed from its 64 boundary
    assert prompt_chunks == sorted([(0, 32), (32, 32), (64, 11), (0, 32), (32, 8), (0, 5), (64, 11)])
    windows = {n for prefill_, _, n in seen if not prefill_}
    assert 1 in windows and max(windows) == d.block_size  # plain steps and drafted windows, none prefill
