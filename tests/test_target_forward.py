"""Each target family's forward computes what mlx-lm's model computes on the same weights.

This is the one place a tolerance is right: the engine reorders some arithmetic on purpose (tiled
matmuls, tiled attention, an elementwise conv) so it cannot be bit-equal to mlx-lm; it must agree
to float32 rounding. Exactness between the engine's own paths is tests/test_rows.py's job.
"""

from __future__ import annotations

import pytest
from tiny_targets import FAMILIES, VOCAB, tiny_target

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from dflash_bench.engine.targets import Segment

CASES = [(f, "small", tied) for f in FAMILIES for tied in (False, True)] + [(f, "smol", f != "qwen3") for f in FAMILIES]


def assert_close(ours: mx.array, ref: mx.array, what: str) -> None:
    scale = mx.abs(ref).max().item()
    err = mx.abs(ours - ref).max().item()
    assert err <= 1e-4 * max(scale, 1.0), f"{what}: max |ours - mlx-lm| = {err:.3g} (logits up to {scale:.3g})"


@pytest.mark.parametrize("prefill", [False, True], ids=["tiled-prompt", "prefill-prompt"])
@pytest.mark.parametrize("family,size,tied", CASES)
def test_forward_matches_mlx_lm(family: str, size: str, tied: bool, prefill: bool) -> None:
    """A prompt (through the tiled path, or as a prefill segment), then a 5-row window, then one row:
    every row's logits match mlx-lm's with its cache."""
    target, model = tiny_target(family, size, tied=tied, seed=1)
    mx.random.seed(2)
    tokens = mx.random.randint(0, VOCAB, (77,)).tolist()
    state, cache = target.new_state(), make_prompt_cache(model)
    start = 0
    for n in (71, 5, 1):  # the prompt crosses a 64-key tile; the window and the step read both tiles
        chunk = tokens[start : start + n]
        seg = Segment(chunk, start, state, logit_rows=list(range(n)), prefill=prefill and start == 0)
        ours = target.forward([seg])[0].logits
        ref = model(mx.array([chunk]), cache=cache)[0]
        assert_close(ours, ref, f"{family} {size} rows {start}..{start + n - 1}")
        state.keep(start + n)
        start += n


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_are_the_layer_outputs(family: str) -> None:
    """The tap planes are the tapped decoder layers' outputs (the residual stream after the layer)."""
    target, model = tiny_target(family, "small", seed=3)
    mx.random.seed(4)
    tokens = mx.random.randint(0, VOCAB, (20,)).tolist()
    taps = (0, 2, 3)
    out = target.forward([Segment(tokens, 0, target.new_state(), want_taps=True)], taps=taps)[0]
    body = model.language_model.model if family == "qwen3_5" else model.model
    h, planes = body.embed_tokens(mx.array([tokens])), []
    for layer in body.layers:
        h = layer(h, mask=None if getattr(layer, "is_linear", False) else "causal", cache=None)
        planes.append(h[0])
    hidden = target.config.hidden_size
    for j, i in enumerate(taps):
        assert_close(out.taps[:, j * hidden : (j + 1) * hidden], planes[i], f"{family} tap {i}")


def test_a_rope_scaling_the_engine_does_not_run_is_refused_by_name():
    from dflash_bench.engine.errors import BadTargetConfig
    from dflash_bench.engine.target_config import parse_target_config

    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, rope_scaling={"rope_type": "llama3", "factor": 32.0})
    with pytest.raises(BadTargetConfig, match="llama3"):
        parse_target_config(cfg)
