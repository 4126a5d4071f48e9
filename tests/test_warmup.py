"""The engine's warm-up (engine/warmup.py): which shapes, named at startup, and nothing left behind."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from dflash_bench.engine import verify, warmup
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.fixtures.small import write_fixture

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 2, 41, 41, 41, 17]]


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def pair(request, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"warm-{request.param}")
    target = write_fixture(request.param, root / "t", seed=3)
    return target, write_fixture("dflash", root / "d", seed=4, target=request.param)


def test_the_plan_covers_every_segment_count_row_bucket_and_prompt_chunk():
    assert warmup.window_rows(None) == [1] and warmup.window_rows(16) == [1, 2, 4, 8, 16]
    assert warmup.window_rows(6) == [1, 2, 4, 6]
    every = warmup.shapes(3, 16, 256, every=True)
    decode = {(s.windows, s.draft) for s in every if not s.prompt}
    assert decode == {((r,) * n, r == 16) for n in (1, 2, 3) for r in (1, 2, 4, 8, 16)}
    assert {(s.windows, s.prompt, s.after, s.draft) for s in every if s.prompt} == {
        ((16,) * n, p, 0, False) for n in (0, 1, 2) for p in (1, 16, 256)} | {((), 256, 256, False)}
    assert warmup.shapes(3, None, 256, every=False) == [warmup.Shape((1,)), warmup.Shape((1,), 16)]
    assert warmup.shapes(1, 16, 8, every=False) == [warmup.Shape((16,), draft=True), warmup.Shape((), 8)]

def test_warmed_before_the_engine_serves_and_named_in_the_startup_line(pair):
    engine = Engine(*pair, Settings(parallel=2, context=256))
    assert engine.warmup is not None and engine.warmup.shapes == 2 and engine.warmup.drafter_passes == 1
    assert f", {engine.warmup.line()}; self-check passed" in engine.startup_line()
    assert engine.warmup.line().startswith("warmed 2 shapes and 1 drafter pass in ")
    cold = Engine(*pair, Settings(parallel=2, context=256, warm=False))
    assert cold.warmup is None and "warmed" not in cold.startup_line()


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_every_shape_warmed_changes_no_output_and_leaves_nothing_behind(pair, backend, monkeypatch):
    settings = Settings(parallel=2, context=256, prompt_cache_gib=0.01, backend=backend)
    cold = Engine(*pair, Settings(**{**settings.__dict__, "warm": False}))
    want = [r.tokens for r in cold.run([Request(p, max_tokens=12, ignore_eos=True, draft=False) for p in PROMPTS])]
    engine = Engine(*pair, settings)
    # a first pass makes what a process keeps for its life (row_ids.py's index arrays); the second must leave nothing
    warmup.warm(engine.target, engine.drafter, 2, engine.settings.chunk, every=True)
    mx.clear_cache()
    before = mx.get_active_memory()
    runs, joint = [], verify.joint
    monkeypatch.setattr(verify, "joint", lambda windows: (runs.append(len(windows)), joint(windows))[1])
    done = warmup.warm(engine.target, engine.drafter, 2, engine.settings.chunk, every=True)  # a GPU's whole plan
    assert 2 in runs  # two streams' windows verified together, as lanes.py verifies a round of them
    assert done.shapes == len(warmup.shapes(2, engine.drafter.block, engine.settings.chunk, True))
    assert done.drafter_passes == 2
    assert mx.get_active_memory() <= before  # every scratch state released
    assert engine.lanes.prompt_cache.nbytes == 0 and not engine.lanes.busy and engine.lanes.rounds == 0
    for draft in (True, False):
        got = engine.run([Request(p, max_tokens=12, ignore_eos=True, draft=draft) for p in PROMPTS])
        assert [r.tokens for r in got] == want


def test_where_mlx_launches_kept_kernels_every_forward_is_built_first_and_compiled_ahead(pair, monkeypatch):
    """On a CUDA GPU whose MLX launches the kernel cache's code (kernel_cache.prove), the warm-up builds the whole
    plan without evaluating or reading anything, waits for the compiles those launches started, then runs it."""
    settings = Settings(parallel=2, context=256, backend="gpu")
    cold = Engine(*pair, Settings(**{**settings.__dict__, "warm": False}))
    want = [r.tokens for r in cold.run([Request(p, max_tokens=8, ignore_eos=True, draft=True) for p in PROMPTS])]
    engine = Engine(*pair, Settings(**{**settings.__dict__, "warm": False}))
    calls = []

    class Kept:  # the process's kernel cache, proven
        def wait(self):
            calls.append("wait")

    monkeypatch.setattr(warmup, "on_cuda", lambda: True)
    monkeypatch.setattr(warmup.kernel_cache, "active", lambda: Kept())
    real_run, real_eval, real_propose = warmup.run, mx.eval, engine.drafter.propose

    def refuse(*_):
        raise AssertionError("the forwards built ahead were evaluated or read")

    def run(*args, evaluate=True):
        calls.append(("run", evaluate))
        if not evaluate:  # nothing evaluated and no drafts read while the compiles run
            monkeypatch.setattr(mx, "eval", refuse)
            monkeypatch.setattr(engine.drafter, "propose", refuse)
        try:
            return real_run(*args, evaluate=evaluate)
        finally:
            monkeypatch.setattr(mx, "eval", real_eval)
            monkeypatch.setattr(engine.drafter, "propose", real_propose)

    monkeypatch.setattr(warmup, "run", run)
    done = warmup.warm(engine.target, engine.drafter, 2, engine.settings.chunk, every=True)
    assert calls == [("run", False), "wait", ("run", True)]
    assert done.ahead is not None and "of it compiling their kernels ahead)" in done.line()
    got = engine.run([Request(p, max_tokens=8, ignore_eos=True, draft=True) for p in PROMPTS])
    assert [r.tokens for r in got] == want
    monkeypatch.setattr(warmup.kernel_cache, "active", lambda: None)  # no proven cache: one evaluated run
    calls.clear()
    assert warmup.warm(engine.target, engine.drafter, 2, engine.settings.chunk, every=True).ahead is None
    assert calls == [("run", True)]
