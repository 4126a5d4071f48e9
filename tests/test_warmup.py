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
    decode = [(s.windows, s.draft, s.split) for s in every if not s.prompt]
    assert len(decode) == len(set(decode)) == 30
    assert set(decode) == {((r,) * n, r == 16, split) for n in (1, 2, 3) for r in (1, 2, 4, 8, 16)
                           for split in (False, True)}  # each again with its attention in two launches
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
    assert done.drafter_passes == 4  # full windows of 1 and 2 streams, each also with its attention in two launches
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


def test_where_mlx_launches_kept_kernels_the_self_checks_launches_are_built_first_on_its_first_choices(pair, monkeypatch):
    """warmup.ahead_of_check, which a check that runs runs first (selfcheck.check): with the process's kernel cache
    on, every projection's row-kernel calls of the check (KERNEL_ROWS rows, one row, a 16-row slice) and the
    serving forwards are built on the check's first choices, nothing evaluated, then the cache waited for; each
    weight's and layer's choice is put back after. Off CUDA, or with no proven cache, there is nothing to run."""
    from dflash_bench.engine import selfcheck, tiles

    engine = Engine(*pair, Settings(parallel=2, context=256, backend="gpu", warm=False))
    target = engine.target
    before = [(w.kernel, w.tile_rows) for w in target.projections()]
    paths = [m.path for m in target.mixer_layers() if hasattr(m, "path")]
    monkeypatch.setattr(warmup, "on_cuda", lambda: False)
    assert warmup.ahead_of_check(target, 2, engine.settings.chunk) is None  # no CUDA
    monkeypatch.setattr(warmup, "on_cuda", lambda: True)
    monkeypatch.setattr(warmup.kernel_cache, "active", lambda: None)
    assert warmup.ahead_of_check(target, 2, engine.settings.chunk) is None  # no proven cache
    calls = []

    class Kept:  # the process's kernel cache, proven
        def wait(self):
            calls.append("wait")

    def product(self, x, parts=(), residual=None, norm=None, glu=False):  # the row kernel's launch, as a CUDA GPU builds it
        assert self.kernel, "a launch built ahead of the check is not on the check's first choice"
        calls.append((self.out_features, x.shape[0]))
        if parts:
            return [mx.zeros((x.shape[0], p), dtype=x.dtype) for p in parts]
        out = mx.zeros((x.shape[0], self.out_features // 2 if glu else self.out_features), dtype=x.dtype)
        return out if residual is None else residual + out

    def refuse(*_):
        raise AssertionError("a launch built ahead of the check was evaluated or read")

    monkeypatch.setattr(warmup.kernel_cache, "active", lambda: Kept())
    monkeypatch.setattr(tiles.Weight, "fits_kernel", lambda self, dtype: True)
    monkeypatch.setattr(tiles.Weight, "kernel_product", product)
    monkeypatch.setattr(mx, "eval", refuse)
    monkeypatch.setattr(mx.array, "item", refuse)
    monkeypatch.setattr(mx.array, "tolist", refuse)
    warmup.ahead_of_check(target, 2, engine.settings.chunk)()
    monkeypatch.undo()
    assert calls[-1] == "wait" and "wait" not in calls[:-1]
    rows = {(out, n) for out, n in calls[:-1]}
    for w in {selfcheck.weight_key(w): w for w in target.projections()}.values():
        assert {(w.out_features, n) for n in (selfcheck.KERNEL_ROWS, 1, tiles.ROW_TILE)} <= rows
    assert len(calls) - 1 > sum(3 for _ in {selfcheck.weight_key(w) for w in target.projections()})  # and forwards
    assert [(w.kernel, w.tile_rows) for w in target.projections()] == before
    assert [m.path for m in target.mixer_layers() if hasattr(m, "path")] == paths


def test_the_engine_hands_a_check_that_runs_the_build_ahead_and_names_its_seconds(pair, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_BENCH_CACHE", str(tmp_path))  # no cached verdict: the check runs
    handed = []
    monkeypatch.setattr(warmup, "ahead_of_check", lambda target, parallel, chunk: lambda: handed.append(parallel))
    engine = Engine(*pair, Settings(parallel=2, context=256, backend="gpu"))
    assert handed == [2] and engine.selfcheck.ahead is not None
    assert "s of it compiling its kernels ahead)" in engine.startup_line()
    Engine(*pair, Settings(parallel=3, context=256, backend="gpu", warm=False, fresh_selfcheck=True))
    assert handed == [2], "an engine that does not warm up built ahead of its check"


def test_the_split_shapes_build_their_attention_in_two_launches(pair, monkeypatch):
    """Each decode shape's twin (`Shape.split`) is built inside attention_kernel.split_launches, so on a GPU the
    two-launch variants a long context takes compile before ready; the other shapes are built outside it."""
    from contextlib import contextmanager

    from dflash_bench.engine.targets import attention_kernel

    engine = Engine(*pair, Settings(parallel=2, context=256, warm=False))
    inside, forwards = [], []
    split = attention_kernel.split_launches

    @contextmanager
    def counted():
        inside.append(True)
        with split():
            yield
        inside.pop()

    forward = engine.target.forward
    monkeypatch.setattr(attention_kernel, "split_launches", counted)
    monkeypatch.setattr(engine.target, "forward", lambda *a, **kw: forwards.append(bool(inside)) or forward(*a, **kw))
    plan = warmup.shapes(2, engine.drafter.block, engine.settings.chunk, True)
    warmup.run(engine.target, engine.drafter, 2, plan)
    # a later prompt chunk's shape runs its earlier chunk first (one forward more), outside
    assert forwards == [s.split for s in plan for _ in range(1 + (s.after > 0))]
    assert sum(forwards) == sum(not s.prompt for s in plan) // 2 > 0
