"""The engine's gpu mode (backend.py), run on this CPU at tiny shapes: MLX-quantized weights stay packed,
activations and attention caches are bf16, the exactness contract holds, and the planner's gpu pricing
is what the mode holds, byte for byte.

The target and drafter are big_fixtures' `tiny` preset: Qwen3.5-9B's layout (MLX 4-bit, groups of 64,
untied, 8 taps scaled down to 4) at hidden 128. bf16 and quantized matmuls are slow on this CPU (a
256-row 4-bit matmul at hidden 128 takes ~0.3 s), so prompts stay short. The peak itself is not
compared here: on a CPU MLX runs bf16 products through float32 copies a GPU never makes, so only a
GPU run can check the working-set terms (`plan --check` on the H200); what holds everywhere is that
weights and caches are the bytes the plan prices.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from dflash_bench.cli import app
from dflash_bench.engine.backend import GPU
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.planner import PlanInputs, plan
from dflash_bench.engine.request import Request
from dflash_bench.engine.targets import Segment
from dflash_bench.engine.tiles import Weight
from dflash_bench.fixtures.big import write_big
from tiny_targets import tiny_target

pytestmark = pytest.mark.gpu  # run on this CPU in CI, and with `pytest -m gpu` on the GPU machine


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpu-mode")
    return write_big("qwen3_5-9b-4bit", root / "target", "tiny"), write_big("dflash-9b", root / "drafter", "tiny")


@pytest.fixture(scope="module")
def engine(pair: tuple[Path, Path]) -> Engine:
    return Engine(*pair, Settings(parallel=2, context=256, chunk=32, backend="gpu"))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 1000) for _ in range(rng.randrange(20, 50))] for _ in range(n)]


def test_the_gpu_mode_stacks_the_projections_that_share_their_input(engine: Engine) -> None:
    """qwen3_5's in_proj qkv/z/b/a, gated attention's q/k/v and each MLP's gate/up are one weight and
    one matmul call each in the gpu mode (gate/up interleaved: tiles.SwiGLU), and the stacked product's columns
    are each part's product."""
    target = engine.target
    linear_attn, attn = target.mixers[0], target.mixers[3]
    gate_up, _ = target.mlps[0]
    for stacked in (linear_attn.in_proj, attn.qkv):
        assert len(stacked.weights) == 1 and stacked.weights[0].out_features == sum(stacked.widths)
    assert len(gate_up.weights) == 1 and gate_up.weights[0].out_features == 2 * target.config.intermediate_size
    assert len(target.projections()) == len({id(w) for w in target.projections()})
    x = (mx.random.normal((16, target.config.hidden_size), key=mx.random.key(3))).astype(mx.bfloat16)
    parts = linear_attn.in_proj(x)
    assert [p.shape for p in parts] == [(16, w) for w in linear_attn.in_proj.widths]
    whole = linear_attn.in_proj.weights[0]
    lo = 0
    for part, width in zip(parts, linear_attn.in_proj.widths):
        alone = Weight.packed(whole.w[lo : lo + width], whole.scales[lo : lo + width], whole.biases[lo : lo + width],
                              whole.group_size, whole.bits)
        assert mx.allclose(part.astype(mx.float32), alone.tile(x).astype(mx.float32), rtol=2e-2, atol=2e-2).item()
        lo += width


def test_the_cpu_mode_keeps_one_call_a_projection() -> None:
    target, _ = tiny_target("qwen3_5", "small", layers=4, seed=2)  # float32
    assert len(target.mixers[0].in_proj.weights) == 4 and len(target.mlps[0][0].weights) == 2
    assert len(target.mixers[3].qkv.weights) == 3


def test_quantized_weights_stay_packed_and_everything_else_is_bf16(engine: Engine, pair: tuple[Path, Path]) -> None:
    target = engine.target
    projections = [target.embed, target.lm_head, *target.projections()]
    assert all(isinstance(w, Weight) and (w.bits, w.group_size) == (4, 64) for w in projections)
    assert all(w.w.dtype == mx.uint32 and w.scales.dtype == mx.bfloat16 for w in projections)
    assert target.lm_head is not target.embed  # untied: both packed
    assert target.norm.dtype == mx.bfloat16 and target.mixers[0].A_log.dtype == mx.float32
    state = target.new_state()
    out = target.forward([Segment(prompts(1, 1)[0], 0, state, [0], want_taps=True, prefill=True)], (1, 5))[0]
    assert out.taps.dtype == mx.bfloat16 and out.logits.dtype == mx.float32
    assert state.layers[3].k.dtype == mx.bfloat16 and state.layers[0].state.dtype == mx.float32
    assert engine.drafter.new_state().layers[0].k.dtype == mx.bfloat16
    # the cpu mode reads the same checkpoint dequantized to float32
    dense = Engine(*pair, Settings(backend="cpu")).target
    assert dense.embed.bits == 0 and dense.embed.w.dtype == mx.float32


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafted_equals_plain(engine: Engine, temperature: float) -> None:
    for i, p in enumerate(prompts(1, seed=int(temperature * 10))):
        req = dict(prompt=p, max_tokens=6, temperature=temperature, seed=i, ignore_eos=True)
        drafted, plain = engine.generate(Request(**req)), engine.generate(Request(**req, draft=False))
        assert drafted.tokens == plain.tokens and drafted.stats.drafted > 0


def test_a_prompt_chunk_and_a_window_packed_equal_each_alone(engine: Engine) -> None:
    """Row exactness in bf16 with packed weights: a prompt chunk (one call per weight) and a decode
    window (row tiles) in one forward give the bits each gives alone."""
    target = engine.target
    base = target.new_state()
    target.forward([Segment(list(range(40, 72)), 0, base, [], prefill=True)])
    base.keep(32)
    chunk, window = list(range(100, 130)), list(range(200, 205))

    def run(which: list[int]) -> dict[int, mx.array]:
        states = [target.new_state(), base.snapshot(32)]
        segs = [Segment(chunk, 0, states[0], list(range(30)), want_taps=True, prefill=True),
                Segment(window, 32, states[1], list(range(5)), want_taps=True)]
        outs = target.forward([segs[i] for i in which], (1, 5))
        return {i: mx.concatenate([o.logits.astype(mx.float32), o.taps.astype(mx.float32)], axis=-1)
                for i, o in zip(which, outs)}

    packed, alone = run([1, 0]), {**run([0]), **run([1])}
    assert all(mx.array_equal(packed[i], alone[i]).item() for i in (0, 1))


def test_the_gpu_plan_prices_what_the_gpu_mode_holds(engine: Engine) -> None:
    """Weights, and after a prompt pass every cache, are the plan's bytes: packed 4-bit matrices with
    bf16 scales and biases, bf16 K/V, float32 GatedDeltaNet state, the drafter in bf16."""
    prompt = prompts(1, 7)[0] + list(range(300, 370))  # past two 32-row chunks
    p = plan(PlanInputs(engine.target.config, engine.drafter.config, context=len(prompt) + 1, chunk=32, backend=GPU))
    loaded = sum(a.nbytes for w in engine.loaded.weights.values() for a in (w.arrays() if isinstance(w, Weight) else [w]))
    assert p.term("target weights").prompt == loaded
    assert p.term("drafter weights").prompt == engine.drafter.nbytes
    handle = engine.submit(Request(prompt, max_tokens=2, ignore_eos=True))
    while not engine.status().streams or not engine.status().streams[0].prefill_done:
        engine.step()
    s = engine.status().streams[0]
    assert p.term("attention K/V").prompt + p.term("GatedDeltaNet state").prompt == s.target_state_bytes
    assert p.term("drafter context K/V").prompt == s.drafter_state_bytes
    while engine.status().busy:
        engine.step()
    assert handle.result().finish == "length"


def test_plan_check_runs_the_gpu_mode_and_states_the_drafter_footprint(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """`plan --check --backend gpu` loads the gpu mode, fills the stream, and its receipt holds the
    drafter's added footprint (plan with and without it) and the held bytes measured equal to the plan."""
    target, drafter = pair
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", str(target), "--drafter", str(drafter), "--context", "64",
                                      "--backend", "gpu", "--check", "--max-tokens", "3", "--out", str(out), "--json"])
    assert result.exit_code in (0, 1), result.output  # 1: the peak is beyond 10% (on a CPU it is not a GPU's)
    assert out.exists(), result.output
    agg = json.loads(out.read_text())["aggregates"]
    assert agg["measured"]["backend"] == "gpu" and agg["plan"]["backend"] == "gpu"
    for name, held in agg["held"].items():
        assert held["planned_bytes"] == held["measured_bytes"] > 0, name
    d = agg["drafter"]
    assert d["plan_added_bytes"] == agg["plan"]["total_bytes"] - d["plan_without_drafter_bytes"] > 0
    assert d["planned_held_bytes"] == d["measured_held_bytes"]
    assert "mlx" in agg["comparison"]


@pytest.mark.parametrize("inputs, cuda, narrow", [(128, True, True), (64, True, True), (192, True, False), (128, False, False)])
def test_a_narrow_packed_weight_is_dequantized_per_call_on_cuda(monkeypatch, inputs: int, cuda: bool, narrow: bool) -> None:
    """On a CUDA GPU a packed weight of fewer than 192 inputs never reaches MLX's quantized matmul,
    whose qmm_sm80 kernel reads past such rows' ends (tiles.QMM_MIN_INPUTS): it is the product with
    the dequantized weight, exactly. Wider weights, and every weight off CUDA, keep the quantized matmul.
    The off-CUDA case runs on the CPU: on a CUDA GPU its 128-input quantized matmul is that very read
    past the end, which failed this test on an H100 (an illegal memory access) in session 45."""
    from dflash_bench.engine import tiles

    with mx.stream(mx.default_device() if cuda else mx.cpu):
        w = mx.random.normal((256, inputs), key=mx.random.key(inputs)).astype(mx.bfloat16)
        weight = Weight.packed(*mx.quantize(w, group_size=64, bits=4), 64, 4)
        x = mx.random.normal((16, inputs), key=mx.random.key(1)).astype(mx.bfloat16)
        calls = []
        real = mx.quantized_matmul
        monkeypatch.setattr(tiles, "on_cuda", lambda: cuda)
        monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
        got = weight.tile(x)
        assert calls == ([] if narrow else [x.shape])
        if narrow:
            want = x @ mx.dequantize(weight.w, weight.scales, weight.biases, group_size=64, bits=4).T
        else:
            want = real(x, weight.w, weight.scales, weight.biases, transpose=True, group_size=64, bits=4)
        assert mx.array_equal(got, want).item()
