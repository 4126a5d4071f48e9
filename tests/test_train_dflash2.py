"""DFlash2 in the drafter training tool (tools/train_drafter): its training model is the engine's
DFlash2 drafter (convs, selector walk), a v1 drafter becomes a DFlash2 one without changing what it
computes, the selector's loss sees the gold token, and a whole smoke run serves drafted == plain.

Tolerances for logits (training lays blocks out unlike the engine's tiles), equality for drafts and
for the identity start, as in tests/test_train_smoke.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.draft_config import parse_draft_config
from dflash_bench.engine.drafters.dflash import load_drafter
from dflash_bench.engine.engine import Engine
from dflash_bench.engine.request import Request
from dflash_bench.engine.targets import build_target
from dflash_bench.fixtures.small import write_fixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from train_drafter.__main__ import main as train_main  # noqa: E402
from train_drafter.model import Drafter, drafter_config, export, load, start_from  # noqa: E402
from train_drafter.recipe import SMOKE_DFLASH2  # noqa: E402
from train_drafter.target import TrainTarget  # noqa: E402
from train_drafter.train import selector_loss  # noqa: E402
from test_train_smoke import engine_proposal  # noqa: E402

SHAPE = replace(SMOKE_DFLASH2.shape, window=12)


@pytest.fixture(scope="module")
def fixture_target(tmp_path_factory):
    return load_target(write_fixture("llama", tmp_path_factory.mktemp("target")))


def randomized(model: Drafter, seed: int) -> None:
    """Every DFlash2 tensor away from its identity start, so the comparison covers the convs and the
    pairwise term."""
    params = dict(tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(params))
    for key, name in zip(keys, sorted(params)):
        if "conv" in name or "candidate_selector" in name:
            params[name] = 0.3 * mx.random.normal(params[name].shape, key=key)
    model.load_weights(list(params.items()))


def test_training_dflash2_computes_the_engine_dflash2(fixture_target, tmp_path) -> None:
    """Convs and selector away from the identity: the export, loaded by the engine, gives the training
    model's logits (float tolerance) and the same selector walk (drafts equal), and the walk differs
    from the rows' argmax somewhere, so the selector is what the drafts compare."""
    config = drafter_config(SHAPE, fixture_target.config)
    model = Drafter(parse_draft_config(config))
    model.init(seed=3, std=0.5)
    randomized(model, 8)
    export(model, config, tmp_path / "drafter")
    back = load(tmp_path / "drafter")  # bf16 as stored, like the engine's copy
    target = build_target(fixture_target.config, fixture_target.weights)
    drafter = load_drafter(tmp_path / "drafter", target)
    assert drafter.kind == "DFlash2"
    mx.random.seed(4)
    tokens = mx.random.randint(8, 512, (48,)).tolist()
    anchors = [3, 11, 30, 40]
    trainer = TrainTarget(fixture_target)
    taps = trainer.taps(mx.array([tokens]), SHAPE.taps)
    a = mx.array([anchors])
    hidden = back(taps, mx.array([tokens]), a, trainer.embed)
    logits = back.logits(hidden, trainer.head)
    walked = back.drafts(hidden, logits, mx.take_along_axis(mx.array([tokens]), a, axis=1))[0]
    argmax_differs = False
    for n, anchor in enumerate(anchors):
        ref, drafts = engine_proposal(drafter, target, tokens, anchor)
        err = mx.abs(logits[0, n] - ref).max().item()
        assert err <= 1e-3 * max(1.0, mx.abs(ref).max().item()), f"anchor {anchor}: max |training - engine| = {err:.3g}"
        assert walked[n].tolist() == drafts, f"anchor {anchor}: the selector walks differ"
        argmax_differs |= drafts != mx.argmax(ref, axis=-1).tolist()
    assert argmax_differs, "the pairwise term never changed a pick: the test would not see the selector"


def test_a_v1_drafter_becomes_dflash2_without_changing_what_it_drafts(fixture_target, tmp_path) -> None:
    """`--init` with a v1 export of the same dimensions (every layer sliding, bidirectional): the DFlash2
    drafter's hidden states are the v1's bit for bit (identity convs, zero pairwise term) and so are
    its drafts; its new tensors can learn (the selector loss has a gradient on the hidden projection)."""
    v1_shape = replace(SHAPE, variant="dflash")
    v1_config = drafter_config(v1_shape, fixture_target.config) | {"is_causal": False}
    v1 = Drafter(parse_draft_config(v1_config))
    v1.init(seed=3, std=0.5)
    export(v1, v1_config, tmp_path / "v1")
    config = drafter_config(SHAPE, fixture_target.config)
    model = Drafter(parse_draft_config(config))
    model.init(seed=5, std=0.5)
    how = start_from(model, config, tmp_path / "v1")
    assert how.startswith("DFlash2 from the v1 drafter")
    before = load(tmp_path / "v1")
    trainer = TrainTarget(fixture_target)
    mx.random.seed(7)
    tokens = mx.array([mx.random.randint(8, 512, (40,)).tolist()])
    taps = trainer.taps(tokens, SHAPE.taps)
    anchors = mx.array([[5, 20, 33]])
    ours, theirs = model(taps, tokens, anchors, trainer.embed), before(taps, tokens, anchors, trainer.embed)
    assert mx.array_equal(ours, theirs)
    logits = model.logits(ours, trainer.head)
    first = mx.take_along_axis(tokens, anchors, axis=1)
    assert mx.array_equal(model.drafts(ours, logits, first), before.drafts(theirs, before.logits(theirs, trainer.head), first))

    labels = mx.argmax(logits, axis=-1)
    previous = mx.concatenate([first[..., None], labels[..., :-1]], axis=-1)

    def loss(m: Drafter) -> mx.array:
        return selector_loss(m, ours[:, :, 1:], logits, labels, previous).sum()

    grads = dict(tree_flatten(nn.value_and_grad(model, loss)(model)[1]))
    assert mx.abs(grads["candidate_selector.hidden_projection.weight"]).max().item() > 0
    wider = drafter_config(replace(SHAPE, intermediate=128), fixture_target.config)
    with pytest.raises(ValueError, match="intermediate_size"):
        start_from(Drafter(parse_draft_config(wider)), wider, tmp_path / "v1")


def test_the_selector_loss_puts_the_gold_token_among_the_candidates(fixture_target) -> None:
    """A gold token outside a row's top-k takes the weakest candidate's place: its loss is the
    cross-entropy over the k candidates with the gold one among them; inside the top-k nothing moves."""
    config = drafter_config(SHAPE, fixture_target.config)
    model = Drafter(parse_draft_config(config))
    model.init(seed=1)
    vocab, k = 512, SHAPE.selector_top_k
    logits = mx.zeros((1, 1, 2, vocab))
    logits[..., :k] = mx.arange(1, k + 1, dtype=mx.float32)  # top-k: tokens 0..k-1; the weakest is token 0
    labels = mx.array([[[k + 7, 2]]])  # row 0: gold outside the top-k; row 1: inside
    hidden = mx.zeros((1, 1, 2, fixture_target.config.hidden_size))  # a zero hidden row: no pairwise term
    got = selector_loss(model, hidden, logits, labels, mx.array([[[5, k + 7]]]))[0, 0]
    outside = mx.concatenate([mx.arange(2, k + 1, dtype=mx.float32), mx.array([0.0])])  # token 0 swapped for gold (logit 0)
    inside = mx.arange(1, k + 1, dtype=mx.float32)
    want0 = mx.logsumexp(outside) - 0.0
    want1 = mx.logsumexp(inside) - 3.0
    assert mx.allclose(got, mx.stack([want0, want1]), atol=1e-5).item()


def test_dflash2_smoke_run_trains_exports_and_serves(tmp_path) -> None:
    """`python -m train_drafter all --recipe smoke-dflash2`: a DFlash2 receipt and a drafter the engine
    loads as DFlash2 and drafts with, drafted == plain."""
    target_dir = write_fixture("llama", tmp_path / "target")
    out = tmp_path / "out"
    train_main(["all", "--recipe", "smoke-dflash2", "--target", str(target_dir), "--out", str(out),
                "--data", str(tmp_path / "data.npz")])
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["what"] == "training receipt of a DFlash2 drafter (tools/train_drafter)"
    assert receipt["architecture"]["variant"] == "DFlash2" and receipt["architecture"]["selector_rank"] == 4
    assert receipt["held_out"]["tokens_per_round"] >= 1.0
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    engine = Engine(target_dir, out / "drafter")
    assert engine.drafter.kind == "DFlash2"
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    for temperature in (0.0, 0.7):
        drafted = engine.generate(Request(prompt, max_tokens=20, ignore_eos=True, temperature=temperature, seed=3))
        plain = engine.generate(Request(prompt, max_tokens=20, ignore_eos=True, temperature=temperature, seed=3, draft=False))
        assert drafted.tokens == plain.tokens and drafted.stats.rounds > 0

    # `--trains selector` on that drafter, at another rank: the body ships as it was stored, bit for bit;
    # only a fresh selector of the new rank trained, and the engine drafts with it, drafted == plain
    again = tmp_path / "selector"
    train_main(["train", "--recipe", "smoke-dflash2", "--target", str(target_dir), "--out", str(again),
                "--data", str(tmp_path / "data.npz"), "--init", str(out / "drafter"), "--trains", "selector",
                "--selector-rank", "6", "--lr", "0.05"])
    before, after = (mx.load(str(d / "model.safetensors")) for d in (out / "drafter", again / "drafter"))
    body = sorted(k for k in before if not k.startswith("candidate_selector."))
    assert body == sorted(k for k in after if not k.startswith("candidate_selector."))
    assert all(mx.array_equal(before[k], after[k]).item() and before[k].dtype == after[k].dtype for k in body)
    assert after["candidate_selector.predecessor_codebook"].shape == (512, 6)
    assert mx.abs(after["candidate_selector.hidden_projection.weight"]).max().item() > 0  # it trained from zero
    receipt = json.loads((again / "receipt.json").read_text())
    assert receipt["recipe"]["trains"] == "selector" and receipt["architecture"]["selector_rank"] == 6
    assert "every drafter tensor but the selector's" in receipt["architecture"]["frozen"]
    assert receipt["trained_params"] == sum(after[k].size for k in after if k.startswith("candidate_selector."))
    engine = Engine(target_dir, again / "drafter")
    for temperature in (0.0, 0.7):
        drafted = engine.generate(Request(prompt, max_tokens=20, ignore_eos=True, temperature=temperature, seed=3))
        plain = engine.generate(Request(prompt, max_tokens=20, ignore_eos=True, temperature=temperature, seed=3, draft=False))
        assert drafted.tokens == plain.tokens and drafted.stats.rounds > 0

def test_trains_selector_without_a_body_to_keep_is_refused_before_any_work(tmp_path, capsys) -> None:
    """`--trains selector` without --init, or on a v1 recipe, stops at the argument check with one line
    naming what is missing, before the target is loaded or any tap plane computed."""
    for argv in (["--recipe", "smoke-dflash2"], ["--recipe", "smoke", "--init", str(tmp_path)]):
        with pytest.raises(SystemExit) as stop:
            train_main(["train", *argv, "--target", str(tmp_path / "no-target"), "--data", str(tmp_path / "no.npz"),
                        "--trains", "selector"])
        assert stop.value.code == 2
        assert "--trains selector needs a DFlash2 recipe and --init" in capsys.readouterr().err
