"""The memory planner prices what this engine holds: its figures, its cache growth, its admission."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from conftest import PUBLISHED
from tiny_targets import canonical_weights, config_dict, reference_model, tiny_target

from dflash_bench.cli import app
from dflash_bench.engine.checkpoint import expected_shapes, read_target_config
from dflash_bench.engine.constants import CHUNK, GIB
from dflash_bench.engine.draft_config import parse_draft_config
from dflash_bench.engine.drafters.dflash import DFlashDrafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.inventory import expected_inventory
from dflash_bench.engine.backend import CPU, GPU
from dflash_bench.engine.planner import (
    ATTN_ROW,
    SDPA_SCORES,
    PlanInputs,
    admit,
    cache_rows,
    most_prefill_rows,
    plan,
    prefill_rows,
    request_refusal,
    streams_fit,
    tap_row_bytes,
)
from dflash_bench.engine.preload import check_pair
from dflash_bench.engine.request import Request
from dflash_bench.engine.target_config import parse_target_config
from dflash_bench.engine.targets import build_target

KIB = 1024


def published(name: str) -> dict:
    return json.loads((PUBLISHED / name).read_text())


def qwen35_9b() -> tuple:
    """Qwen3.5-9B and its DFlash drafter from the facts in SOURCES.md (their config.json files are not stored)."""
    target = parse_target_config({
        "model_type": "qwen3_5", "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text", "num_hidden_layers": 32, "full_attention_interval": 4,
            "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 16, "num_key_value_heads": 4,
            "head_dim": 256, "vocab_size": 248320, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25}, "eos_token_id": 248046,
        },
    }, name="Qwen3.5-9B")
    cfg = published("qwen3.5-4b-dflash.config.json") | {
        "hidden_size": 4096, "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 12288,
    }
    return target, parse_draft_config(cfg)


# --- the figures the issue pins ------------------------------------------------------------------


def test_eight_tap_fusing_v1_drafter_prompt_taps_cost_2t_plus_2_hidden_rows():
    d = parse_draft_config(published("qwen3.5-4b-dflash.config.json"))
    assert len(d.taps) == 8 and not d.is_dflash2
    assert tap_row_bytes(d, act_bytes=2) == (2 * 8 + 2) * d.hidden_size * 2 == 18 * 2560 * 2
    target = parse_target_config(published("qwen3.5-4b.config.json"))
    p = plan(PlanInputs(target, d, context=8192, backend=GPU))
    assert p.term("prompt tap rows").prompt == 18 * 2560 * 2 * CHUNK  # a whole prompt chunk


def test_dflash2_prompt_taps_cost_what_the_engine_holds_for_its_five_taps():
    """The engine fuses DFlash2's five tap planes as v1's (drafters/dflash2.py): the planes, their
    row-major copy, fc's rows and the fused row."""
    d = parse_draft_config(published("qwen3.8-27b-dflash2.config.json"))
    assert d.is_dflash2 and len(d.taps) == 5
    assert tap_row_bytes(d, act_bytes=2) == 12 * d.hidden_size * 2
    g = parse_draft_config(published("muse-glimmer-30b-dflash2.config.json"))
    assert tap_row_bytes(g, act_bytes=2) == 12 * 6656 * 2


def test_a_drafterless_plan_has_no_drafter_terms_and_equals_the_target_only_plan():
    """The default model without a drafter: exactly the target's terms, at the figures the engine holds."""
    t = read_target_config("default")
    p = plan(PlanInputs(t, parallel=4, context=2048))
    assert [x.name for x in p.terms] == ["target weights", "round logits", "attention K/V", "prompt pass work",
                                         "decode window work"]
    assert not any(x.drafter for x in p.terms)
    assert p.term("target weights").prompt == 134_515_008 * 4
    kv_row = 30 * 2 * 3 * 64 * 4  # 30 layers, K and V, 3 heads of 64, float32
    assert p.term("attention K/V").prompt == kv_row * 2048  # the chunked prompt pass grows it to 2048 rows
    assert p.term("attention K/V").decode == kv_row * (2048 + 256)  # whole tiles plus the slack
    assert p.total_bytes == p.shared_bytes + 4 * p.stream_bytes
    # A drafter adds its own terms and leaves the target's held terms as they were.
    _, d = tiny_drafter_for(t)
    with_drafter = plan(PlanInputs(t, d, parallel=4, context=2048))
    for name in ("target weights", "attention K/V", "prompt pass work"):
        assert with_drafter.term(name) == p.term(name)
    assert {x.name for x in with_drafter.terms if x.drafter} == {
        "drafter weights", "drafter context K/V", "prompt tap rows", "drafter pass work"}


# --- weights: the planner's parameter counts are the checkpoints' ------------------------------


def test_planned_target_weights_are_what_the_loader_holds():
    from dflash_bench.engine.checkpoint import load_target

    loaded = load_target("default")
    held = sum(w.nbytes for w in loaded.weights.values())
    assert plan(PlanInputs(loaded.config)).term("target weights").prompt == held == 538_060_032


def test_planned_drafter_weights_count_the_published_parameters():
    v1 = parse_draft_config(published("qwen3.5-4b-dflash.config.json"))
    assert sum(math.prod(s) for s in expected_inventory(v1).values()) == 634_425_856
    header = published("muse-glimmer-30b-dflash2.safetensors-header.json")
    counted = sum(math.prod(e["shape"]) for k, e in header.items() if k != "__metadata__")
    v2 = parse_draft_config(published("muse-glimmer-30b-dflash2.config.json"))
    assert sum(math.prod(s) for s in expected_inventory(v2).values()) == counted == 2_772_159_744
    target = parse_target_config(published("qwen3.5-4b.config.json"))
    float_plan = plan(PlanInputs(target, v1))
    assert float_plan.term("drafter weights").prompt == 634_425_856 * 4
    q4 = plan(PlanInputs(target, v1, drafter_bits=4))
    assert q4.term("drafter weights").prompt < float_plan.term("drafter weights").prompt / 6
    assert q4.term("drafter float staging").scope == "load"
    assert q4.load_bytes == q4.term("target weights").prompt + q4.term("drafter weights").prompt + \
        q4.term("drafter float staging").prompt


def test_qwen35_9b_plan_prices_the_gated_delta_net_state_in_fp32_and_its_conv_inputs_as_activations():
    target, d = qwen35_9b()
    p = plan(PlanInputs(target, d, parallel=4, context=65536, backend=GPU))
    state = 32 * 128 * 128 * 4  # value heads x value dim x key dim, float32
    conv = 3 * (2 * 16 * 128 + 32 * 128) * 2  # kernel - 1 inputs of the conv's 8192 channels, bf16 in the gpu mode
    assert p.term("GatedDeltaNet state").prompt == 24 * (state + conv)
    assert p.term("attention K/V").prompt == 8 * 2 * 4 * 256 * 2 * most_prefill_rows(65536)


# --- the engine's caches grow exactly as the planner says ----------------------------------------


def tiny_drafter_for(target_cfg, seed: int = 0, block: int = 4):
    """A random two-layer DFlash drafter (sliding + full) shaped for `target_cfg`."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "hidden_size": target_cfg.hidden_size, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
        "vocab_size": target_cfg.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 32,
        "dflash_config": {"block_size": block, "mask_token_id": 3,
                          "target_layer_ids": [1, target_cfg.num_layers - 1]},
    }
    d = parse_draft_config(cfg)
    key = mx.random.key(seed)
    weights = {}
    for name, shape in expected_inventory(d).items():
        key, sub = mx.random.split(key)
        weights[name] = 1.0 + 0.1 * mx.random.normal(shape, key=sub) if len(shape) == 1 else \
            mx.random.normal(shape, key=sub) * shape[-1] ** -0.5
    return weights, d


def engine_with(family: str, context: int, parallel: int = 1, drafter: bool = True, cache_gib: float = 0.0):
    target, _ = tiny_target(family, "small", layers=4)
    draft = None
    if drafter:
        weights, d = tiny_drafter_for(target.config)
        draft = DFlashDrafter(d, weights, target)
    return Engine(model=target, draft_model=draft, eos_ids=(), settings=Settings(parallel, context, cache_gib))


@pytest.mark.parametrize("prompt_tokens", [1, 63, 256, 257, 600, 1025, 1300])
def test_a_prompt_pass_grows_every_cache_to_prefill_rows(prompt_tokens):
    engine = engine_with("qwen3_5", context=prompt_tokens + 8)
    handle = engine.submit(Request(list(range(5, 5 + prompt_tokens)), max_tokens=2, ignore_eos=True))
    engine.step()
    while engine.lanes.streams[0].pending is None:  # until the prompt pass is done
        engine.step()
    s = engine.lanes.streams[0]
    rows = prefill_rows(prompt_tokens)
    attention = [c for c in s.segment_state.layers if hasattr(c, "k")]
    assert {c.k.shape[1] for c in attention} == {rows}
    assert {c.k.shape[1] for c in s.drafter_state.layers} == {rows}
    # and the planner's held terms are those arrays' bytes, for the longest prompt of a context
    p = plan(PlanInputs(engine.target.config, engine.drafter.config, context=prompt_tokens + 1))
    assert p.term("attention K/V").prompt + p.term("GatedDeltaNet state").prompt == s.segment_state.nbytes
    assert p.term("drafter context K/V").prompt == s.drafter_state.nbytes
    while engine.lanes.busy:
        engine.step()
    assert handle.result().finish == "length"


def test_no_cache_grows_past_cache_rows_of_the_served_span():
    context, block = 200, 4
    engine = engine_with("llama", context=context, parallel=2)
    reqs = [Request(list(range(7, 7 + n)), max_tokens=context - n, ignore_eos=True, draft=draft)
            for n, draft in ((120, True), (65, False))]
    handles = [engine.submit(r) for r in reqs]
    target_rows, drafter_rows = set(), set()
    while engine.lanes.busy:
        engine.step()
        for s in engine.lanes.streams:
            target_rows |= {c.k.shape[1] for c in s.segment_state.layers}
            if s.drafter_state is not None:
                drafter_rows |= {c.k.shape[1] for c in s.drafter_state.layers}
    assert [h.result().finish for h in handles] == ["length", "length"]
    assert max(target_rows) <= cache_rows(context - 1)
    assert max(drafter_rows) <= cache_rows(context + block - 3)
    p = plan(PlanInputs(engine.target.config, engine.drafter.config, parallel=2, context=context))
    kv_row = 4 * 2 * 2 * 16 * 4
    assert p.term("attention K/V").decode == kv_row * cache_rows(context - 1) >= kv_row * max(target_rows)


def test_most_prefill_rows_covers_every_prompt_and_every_resume():
    for context in (2, 64, 257, 1000, 2048, 3000):
        fresh = max(prefill_rows(n) for n in range(1, context))
        assert most_prefill_rows(context) == fresh
        resumed = max(prefill_rows(n, s) for n in range(1, context) for s in range(0, n, 256))
        assert most_prefill_rows(context, resumes=True) == resumed
        assert resumed <= cache_rows(context - 1)


# --- streams that fit, and admission -------------------------------------------------------------


def test_streams_fit_is_the_most_streams_whose_plan_fits():
    t = read_target_config("default")
    inputs = PlanInputs(t, context=8192, memory_bytes=3 * GIB)
    n = streams_fit(inputs)
    assert n and plan(replace(inputs, parallel=n)).total_bytes <= 3 * GIB
    assert plan(replace(inputs, parallel=n + 1)).total_bytes > 3 * GIB


def test_admission_lowers_the_streams_to_what_fits_and_says_so():
    t = read_target_config("default")
    inputs = PlanInputs(t, parallel=64, context=8192, memory_bytes=3 * GIB)
    decision = admit(inputs)
    assert decision.refused_reason is None and 0 < decision.streams == streams_fit(inputs) < 64
    assert decision.lowered and "lowered from --parallel 64" in decision.line()
    assert f"{decision.streams} streams of 8192 tokens" in decision.line()
    assert admit(replace(inputs, parallel=1)).streams == 1 and not admit(replace(inputs, parallel=1)).lowered


def test_admission_refuses_a_context_that_cannot_fit_one_stream():
    t = read_target_config("default")
    decision = admit(PlanInputs(t, parallel=4, context=200_000, memory_bytes=2 * GIB))
    assert decision.streams == 0
    assert decision.refused_reason.startswith("--context 200000 does not fit one stream")
    assert request_refusal(decision, 10, 10) == decision.refused_reason


def test_a_request_past_the_lane_is_refused_in_one_clear_line():
    decision = admit(PlanInputs(read_target_config("default"), parallel=2, context=2048, memory_bytes=4 * GIB))
    assert request_refusal(decision, 2000, 48) is None
    assert request_refusal(decision, 2000, 49) == \
        "prompt (2000 tokens) plus max_tokens (49) is 2049, past the context window of 2048"


# --- the command ---------------------------------------------------------------------------------


def test_plan_command_prints_every_term_as_json_from_configs_alone():
    result = CliRunner().invoke(app, ["plan", str(PUBLISHED / "qwen3.5-4b.config.json"), "--drafter",
                                      str(PUBLISHED / "qwen3.5-4b-dflash.config.json"), "--parallel", "2",
                                      "--context", "4096", "--memory-gib", "64", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["drafter"] == "DFlash" and data["fits"] is True
    assert data["total_bytes"] == data["shared_bytes"] + 2 * data["stream_bytes"]
    assert {t["name"] for t in data["terms"] if t["drafter"]} >= {"drafter weights", "prompt tap rows"}


def test_plan_command_exits_1_when_the_streams_do_not_fit():
    result = CliRunner().invoke(app, ["plan", "default", "--parallel", "8", "--context", "65536", "--memory-gib", "2"])
    assert result.exit_code == 1
    assert "does not fit" in result.output


def test_backends_price_bytes_per_element():
    t = read_target_config("default")
    assert CPU.act_bytes == 4 and GPU.act_bytes == 2
    cpu, gpu = plan(PlanInputs(t, context=2048)), plan(PlanInputs(t, context=2048, backend=GPU))
    assert cpu.term("attention K/V").prompt == 2 * gpu.term("attention K/V").prompt
    shapes = expected_shapes(t)
    assert gpu.term("target weights").prompt == 2 * sum(math.prod(s) for s in shapes.values())


@pytest.mark.parametrize("backend", [CPU, GPU], ids=["cpu", "gpu"])
def test_the_gated_delta_net_state_term_is_what_a_stream_holds_in_each_mode(backend):
    """A qwen3_5 stream's GatedDeltaNet layers in the mode's activation dtype (the gpu mode's bf16, here on
    the CPU) hold exactly the planner's term: float32 states, conv inputs as the projection writes them."""
    cfg = config_dict("qwen3_5", "small", 4, False)
    target = build_target(parse_target_config(cfg), canonical_weights(reference_model(cfg, 0)),
                          mx.bfloat16 if backend is GPU else mx.float32)
    held = sum(c.nbytes for c in target.new_state().layers if not hasattr(c, "k"))
    assert plan(PlanInputs(target.config, backend=backend)).term("GatedDeltaNet state").prompt == held


def test_a_prompt_chunk_is_priced_as_one_sdpa_over_its_keys_and_a_window_as_tiles():
    """The default model at 2048: a 256-row prompt chunk's sdpa over exactly 2047 keys holds
    SDPA_SCORES float32 score arrays on both backends (MLX's CUDA sdpa was measured unfused at a prompt
    chunk's shape), beside rows at the backend's activation width; a one-row window's tiles hold
    2 + 64/64 score arrays over 8 padded queries and 2048 tiled keys."""
    t = read_target_config("default")
    cpu, gpu = plan(PlanInputs(t, context=2048)), plan(PlanInputs(t, context=2048, backend=GPU))
    assert cpu.term("prompt pass work").prompt == int(SDPA_SCORES * 9 * 256 * 2047 * 4 + ATTN_ROW * 576 * 256 * 4)
    assert gpu.term("prompt pass work").prompt == int(SDPA_SCORES * 9 * 256 * 2047 * 4 + ATTN_ROW * 576 * 256 * 2)
    assert cpu.term("decode window work").decode == int(3 * 9 * 8 * 2048 * 4 + ATTN_ROW * 576 * 4)


def test_plan_command_refuses_a_drafter_for_another_target_in_one_line():
    result = CliRunner().invoke(app, ["plan", "default", "--drafter", str(PUBLISHED / "qwen3.5-4b-dflash.config.json")])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("DraftForAnotherTarget: ")


def test_plan_of_the_default_model_prices_its_shipped_drafter_as_serve_loads_it():
    """`plan default` prices what `serve default` runs (the shipped drafter); --no-drafter and
    --drafter none price the target alone."""
    def planned(*extra: str) -> dict:
        result = CliRunner().invoke(app, ["plan", "default", "--context", "2048", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    drafted = planned()
    assert drafted["drafter"] == "DFlash" and any(t["drafter"] for t in drafted["terms"])
    for alone in (planned("--no-drafter"), planned("--drafter", "none")):
        assert alone["drafter"] is None and not any(t["drafter"] for t in alone["terms"])
        assert alone["total_bytes"] == drafted["total_bytes"] - drafted["drafter_added_bytes"]


PEAK_PROBE = """
from dflash_bench.checks.memory import peak_rss_bytes, release_freed_heap, reset_peak_rss, rss_bytes
from dflash_bench.engine.constants import MIB as MB
before = rss_bytes()
blocks = [bytearray(b"x" * 4000) for _ in range(50_000)]  # 190 MB of small heap blocks, touched
kept = blocks[::16]  # live blocks between the freed ones: free() alone gives nothing back
assert peak_rss_bytes() >= before + 150 * MB
del blocks
assert rss_bytes() >= before + 150 * MB, "freed blocks left the heap without a trim"
release_freed_heap()
assert rss_bytes() < before + 50 * MB, "the trim gave the freed blocks back"
assert reset_peak_rss()
assert peak_rss_bytes() < before + 50 * MB, "the peak mark starts from now"
print(len(kept))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the peak-RSS mark resets on Linux only")
def test_plan_check_measures_the_serving_peak_not_loadings_freed_buffers():
    """What loading touched and freed (a packed drafter's dequantization buffers) neither counts as
    held beside MLX (the heap is trimmed) nor as the peak (the mark is reset once loaded). In a fresh
    interpreter: a long test process's heap already holds freed pages of its own."""
    done = subprocess.run([sys.executable, "-c", PEAK_PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "3125", done.stderr
