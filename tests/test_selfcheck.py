"""The self-check of the row rule (engine/selfcheck.py): it passes here for every family under either
BLAS, it catches a row-dependent kernel made by the test itself (then picks a smaller tile, the
elementwise attention, or refuses drafting), and its verdict reaches the startup line, /health,
the receipt and the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_short_prompts
from test_planner import tiny_drafter_for
from test_rows import count_dependent, packed_vs_alone, position_dependent, window_vs_steps
from test_server_api import LiveServer
from tiny_targets import FAMILIES, tiny_target
from typer.testing import CliRunner

import mlx.core as mx

from dflash_bench.checks import prompts
from dflash_bench.cli import app
from dflash_bench.engine import blas, selfcheck, tiles
from dflash_bench.engine.cache import AttentionCache
from dflash_bench.engine.drafters.dflash import DFlashDrafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.engine.targets import dense
from dflash_bench.engine.targets.base import Segment
from dflash_bench.fixtures.small import write_fixture

UNDER_REFERENCE = os.environ.get("DFLASH_BENCH_BLAS") == "reference"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> None:
    """Each test its own verdict cache: verdicts proven under a test's broken kernels stay in it."""
    monkeypatch.setenv("DFLASH_BENCH_CACHE", str(tmp_path / "cache"))


def nondeterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every matmul call adds 2^-12 times a call counter: no tile, not even one row a call, is exact."""
    tile, calls = tiles.Weight.tile, [0]

    def drifting(self: tiles.Weight, x: mx.array) -> mx.array:
        calls[0] += 1
        return tile(self, x) + calls[0] * 2**-12

    monkeypatch.setattr(tiles.Weight, "tile", drifting)


@pytest.mark.parametrize("size", ("small", "smol"))
@pytest.mark.parametrize("family", FAMILIES)
def test_the_self_check_passes_here_for_every_family(family: str, size: str) -> None:
    target, _ = tiny_target(family, size, layers=2, tied=family != "qwen3", seed=7)
    verdict = selfcheck.check(target, fresh=True)
    assert verdict.passed, verdict.line() + "".join(f"\n{p}" for p in verdict.failures)
    weights = {selfcheck.weight_key(w) for w in target.projections()}
    assert set(verdict.tiles) == weights and all(t in (1, 2, 4, 8, 16) for t in verdict.tiles.values())
    kinds = {p.path.split()[0] for p in verdict.paths}
    assert {"projection", "attention", "model:"} <= kinds
    assert ("recurrence" in kinds) == (family == "qwen3_5")
    assert verdict.machine["blas"] == blas.choice().kind


def test_the_self_check_passes_under_the_reference_blas() -> None:
    """The same verdicts in a fresh process on the wheel's own BLAS (OpenBLAS not loaded)."""
    if UNDER_REFERENCE:
        pytest.skip("already running under the reference BLAS")
    env = dict(os.environ, DFLASH_BENCH_BLAS="reference")
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-k", "passes_here and small", "-p", "no:cacheprovider"]
    done = subprocess.run(cmd, cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"{len(FAMILIES)} passed" in done.stdout.strip().splitlines()[-1], done.stdout[-1000:]


def test_a_position_dependent_kernel_is_caught_and_a_smaller_tile_restores_exactness(monkeypatch) -> None:
    """A kernel that shifts rows 8-15 of a call (a 16-row tile's upper half) fails 16-row tiles; the
    check falls back to 8 rows for those weights, and the model's rows are then exact again."""
    tile = tiles.Weight.tile

    def upper_half_shifted(self: tiles.Weight, x: mx.array) -> mx.array:
        out = tile(self, x)
        return out + (mx.arange(x.shape[0]) >= 8).astype(out.dtype)[:, None] * 2**-6

    monkeypatch.setattr(tiles.Weight, "tile", upper_half_shifted)
    target, _ = tiny_target("qwen3_5", "smol", layers=2, seed=8)
    assert window_vs_steps(target, 16), "the shifted kernel did not break the default tiles"
    verdict = selfcheck.check(target, fresh=True)
    assert verdict.passed, verdict.line()
    assert set(verdict.tiles.values()) == {8}, verdict.tiles
    for w in target.projections():
        assert w.tile_rows == 8
        if tiles.row_tile(w.in_features, w.out_features) == 16:  # the small products' default is 8 already
            choice = next(p.choice for p in verdict.paths if p.path == f"projection {selfcheck.weight_key(w)}")
            assert choice.startswith("8-row tiles; 16-row tiles: rows rolled by"), choice
    assert window_vs_steps(target, 16) == [] and packed_vs_alone(target, [0, 1, 2, 3]) == []


def test_a_row_dependent_tiled_attention_falls_back_to_the_elementwise_path(monkeypatch) -> None:
    """Tiled attention whose bits follow the query count (made here) fails window == steps; the
    elementwise path passes and is chosen for every attention layer, and the model is exact with it."""
    real = tiles.attention

    def skewed(q, k, v, seen, *, scale, path="tiled"):
        out = real(q, k, v, seen, scale=scale, path=path)
        return out + q.shape[1] * 2**-8 if path == "tiled" else out

    monkeypatch.setattr(selfcheck, "attention", skewed)
    monkeypatch.setattr(dense, "attention", skewed)
    target, _ = tiny_target("llama", "small", layers=2, seed=9)
    assert window_vs_steps(target, 16), "the skewed attention did not break window == steps"
    verdict = selfcheck.check(target, fresh=True)
    assert verdict.passed, verdict.line()
    assert set(verdict.attention.values()) == {"elementwise"}
    assert all(m.path == "elementwise" for m in target.mixer_layers())
    assert window_vs_steps(target, 16) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_the_elementwise_attention_is_exact_and_computes_what_the_tiled_one_does(family: str) -> None:
    """The fallback path keeps the contract (window == steps, packed == alone) and agrees with the
    tiled path to float32 rounding."""
    target, _ = tiny_target(family, "small", layers=4, seed=10)
    tokens = mx.random.randint(0, target.config.vocab_size, (20,), key=mx.random.key(1)).tolist()
    want = target.forward([Segment(tokens, 0, target.new_state(), list(range(20)))])[0].logits
    for m in target.mixer_layers():
        if isinstance(m, dense.SelfAttention):
            m.path = "elementwise"
    got = target.forward([Segment(tokens, 0, target.new_state(), list(range(20)))])[0].logits
    assert mx.abs(got - want).max().item() <= 1e-4 * max(mx.abs(want).max().item(), 1.0)
    assert window_vs_steps(target, 16) == [] and packed_vs_alone(target, [0, 1, 2, 3]) == []


def test_a_nondeterministic_kernel_fails_the_check_and_the_engine_serves_without_drafting(monkeypatch) -> None:
    nondeterministic(monkeypatch)
    target, _ = tiny_target("llama", "small", layers=2, seed=11)
    weights, d = tiny_drafter_for(target.config)
    engine = Engine(model=target, draft_model=DFlashDrafter(d, weights, target), eos_ids=(),
                    settings=Settings(parallel=2, context=256, fresh_selfcheck=True))
    assert not engine.selfcheck.passed
    assert all(not p.passed for p in engine.selfcheck.paths if p.path.startswith("projection"))
    assert "the call repeated" in engine.selfcheck.failures[0].detail
    assert engine.drafter is None and engine.drafter_kind is None
    assert engine.drafting_refused.startswith("drafting is off: self-check FAILED")
    line = engine.startup_line()
    assert "no drafter," in line and "; drafting is off: self-check FAILED" in line and "1-row tiles: the call repeated" in line
    result = engine.generate(Request([5, 6, 7], max_tokens=6, ignore_eos=True, draft=True))
    assert result.stats.drafter is None and result.stats.drafted == 0 and len(result.tokens) == 6


@pytest.mark.parametrize("family", ("llama", "qwen3_5"))
def test_a_kept_length_placed_wrong_on_the_device_fails_the_model_check(family: str, monkeypatch) -> None:
    """The model check places a window at a length kept as a device value (cache.py's keep_at), as a
    drafted round queued ahead does, and two streams' windows kept together so (keep_windows): with the
    kept length off by one, it names both."""
    target, _ = tiny_target(family, "small", layers=2, seed=13)
    assert selfcheck.model_faults(target) == []
    keep_at = AttentionCache.keep_at
    monkeypatch.setattr(AttentionCache, "keep_at", lambda self, kept, bound, low: keep_at(self, kept + 1, bound, low))
    faults = selfcheck.model_faults(target)
    assert len(faults) == 2 and faults[0].startswith("a window at a kept length on the device"), faults
    assert faults[1].startswith("two streams' windows kept together at lengths on the device"), faults


def test_a_count_dependent_kernel_passes_because_every_call_has_the_same_rows(monkeypatch) -> None:
    """The self-check proves the engine's own configuration, not a stricter one: a kernel whose bits
    follow the call's row count is harmless at fixed tiles, and the check says so (no false alarm)."""
    count_dependent(monkeypatch)
    target, _ = tiny_target("qwen3", "small", layers=2, seed=12)
    assert selfcheck.check(target, fresh=True).passed


def test_the_verdict_is_cached_per_machine_and_shapes(monkeypatch) -> None:
    target, _ = tiny_target("qwen3", "small", layers=2, seed=13)
    first = selfcheck.check(target, fresh=True)
    again = selfcheck.check(tiny_target("qwen3", "small", layers=2, seed=14)[0])
    assert again.cached and again.key == first.key and again.tiles == first.tiles
    assert (selfcheck.cache_dir() / f"{first.key}.json").exists()
    nondeterministic(monkeypatch)
    assert not selfcheck.check(tiny_target("qwen3", "small", layers=2, seed=15)[0], fresh=True).passed
    assert selfcheck.check(target).passed, "a failed verdict replaced the cached pass"
    monkeypatch.undo()
    monkeypatch.setenv("DFLASH_BENCH_CACHE", str(selfcheck.cache_dir().parent))
    # another BLAS core than this machine's, whichever that is (on a SkylakeX machine "SkylakeX" moved nothing)
    other_core = dict(first.machine, blas_core="Haswell" if first.machine.get("blas_core") != "Haswell" else "Zen")
    monkeypatch.setattr(selfcheck, "machine", lambda dtype: other_core)
    moved = selfcheck.check(target)
    assert not moved.cached and moved.key != first.key
    deeper = selfcheck.check(tiny_target("qwen3", "small", layers=3, seed=13)[0])
    assert not deeper.cached, "a model of other shapes reused another's verdict"


def test_the_code_key_covers_the_fused_chains_and_the_checks_themselves(monkeypatch, tmp_path) -> None:
    """engine/fused.py's chains are part of every GPU row's arithmetic, and selfcheck.py says what is proven:
    a change to either re-runs the check."""
    from dflash_bench.engine import fused, verdict

    for module in (fused, selfcheck):
        before = verdict._code_hash()
        edited = tmp_path / f"{module.__name__}.py"
        edited.write_bytes(Path(module.__file__).read_bytes() + b"\n# edited\n")
        monkeypatch.setattr(module, "__file__", str(edited))
        assert verdict._code_hash() != before, module.__name__


def test_selfcheck_command_prints_each_path_and_writes_a_receipt(tmp_path) -> None:
    target = write_fixture("qwen3_5", tmp_path / "t")
    out = tmp_path / "selfcheck.json"
    res = CliRunner().invoke(app, ["selfcheck", str(target), "--out", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "self-check passed" in res.output and "recurrence" in res.output and "model: window == steps" in res.output
    data = json.loads(out.read_text())
    assert data["kind"] == "selfcheck" and data["verdict"]["passed"]
    assert data["environment"]["selfcheck"]["passed"] and data["aggregates"]["tiles"]
    shown = CliRunner().invoke(app, ["show", str(out)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "recurrence" in shown.output, shown.output


def test_a_failed_self_check_reaches_health_and_the_exactness_receipt(tmp_path, monkeypatch) -> None:
    """The server refuses drafting with the reason in /health; exactness against it is not run (exit
    2), with the server's verdict in the receipt's environment, never a pass."""
    checkpoints = write_fixture("llama", tmp_path / "target"), write_fixture("dflash", tmp_path / "drafter")
    monkeypatch.setattr(prompts, "PROMPTS_DIR", write_short_prompts(tmp_path / "prompts"))
    nondeterministic(monkeypatch)
    engine = Engine(checkpoints[0], checkpoints[1], Settings(parallel=2, context=2048, fresh_selfcheck=True))
    engine.start()
    with LiveServer(engine) as live:
        health = live.http.get("/health").json()
        assert health["drafter"] is None and health["drafting_refused"].startswith("drafting is off: self-check FAILED")
        assert health["selfcheck"]["passed"] is False and "self-check FAILED" in health["startup_line"]
        out = tmp_path / "exactness.json"
        res = CliRunner().invoke(app, ["exactness", "--url", live.url, "--out", str(out), "--known-tokens", "8",
                                       "--probe-tokens", "8", "--long-tokens", "8"], env={"COLUMNS": "200"})
    data = json.loads(out.read_text())
    assert res.exit_code == 2, res.output
    assert not data["verdict"]["passed"]
    assert any(n["check"] == "drafting" and "self-check FAILED" in n["reason"] for n in data["not_run"]), data["not_run"]
    assert data["environment"]["selfcheck"]["passed"] is False


def test_a_passing_engine_states_its_verdict(tmp_path) -> None:
    checkpoints = write_fixture("llama", tmp_path / "target"), write_fixture("dflash", tmp_path / "drafter")
    engine = Engine(checkpoints[0], checkpoints[1], Settings(parallel=2, context=512))
    assert engine.selfcheck.passed and engine.drafter is not None and engine.drafting_refused is None
    assert "DFlash drafts" in engine.startup_line() and "self-check passed" in engine.startup_line()


def test_a_check_that_runs_runs_what_it_is_handed_first_and_a_cached_one_does_not(monkeypatch) -> None:
    """engine.py hands `check` the build of its launches (warmup.ahead_of_check) where kernels compile at first use:
    run once, before the check, when the check runs; its seconds are part of the check's and named on its line."""
    target, _ = tiny_target("qwen3", "small", layers=2, seed=13)
    calls = []
    real_run = selfcheck._run
    monkeypatch.setattr(selfcheck, "_run", lambda *a: calls.append("check") or real_run(*a))
    first = selfcheck.check(target, fresh=True, ahead=lambda: calls.append("ahead"))
    assert calls == ["ahead", "check"] and first.passed
    assert first.ahead is not None and first.seconds >= first.ahead
    assert first.line().endswith(f"({first.seconds:.1f} s, {first.ahead:.1f} s of it compiling its kernels ahead)")
    again = selfcheck.check(target, ahead=lambda: calls.append("ahead again"))
    assert again.cached and calls == ["ahead", "check"] and again.line().endswith("(cached)")
    assert selfcheck.Verdict.from_dict(first.as_dict()).ahead == first.ahead

    def broken() -> None:
        raise RuntimeError("no kernel here")

    noted = selfcheck.check(target, fresh=True, ahead=broken)  # a build that fails costs the head start, no more
    assert noted.passed and noted.notes == ["building its launches ahead failed: RuntimeError: no kernel here"]
