"""The drafter training tool (tools/train_drafter): its model is the engine's drafter, its target
gives the engine's taps, and a whole run (data, training, export, receipt) works on a fixture
target in seconds on a CPU.

Tolerances, not bit equality, are right here: training lays blocks out differently from the
engine's fixed tiles (tests/test_rows.py proves the engine's own exactness); what must hold is that
both compute the same function, so the logits agree to float32 rounding and the drafts are equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import mlx.core as mx
import numpy as np

from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.draft_config import parse_draft_config
from dflash_bench.engine.drafters.dflash import Proposal, load_drafter
from dflash_bench.engine.engine import Engine
from dflash_bench.engine.request import Request
from dflash_bench.engine.sampling import SamplingParams
from dflash_bench.engine.targets import Segment, build_target
from dflash_bench.fixtures.small import write_fixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from train_drafter.__main__ import main as train_main  # noqa: E402
from train_drafter.model import Drafter, Shape, drafter_config, export, load, read_weights, start_from  # noqa: E402
from train_drafter.target import TrainTarget  # noqa: E402

SHAPE = Shape(taps=(1, 3, 5), block=8, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=64, window=12,
              mask_token_id=3)


@pytest.fixture(scope="module")
def fixture_target(tmp_path_factory):
    return load_target(write_fixture("llama", tmp_path_factory.mktemp("target")))


def engine_proposal(drafter, target, tokens: list[int], anchor: int) -> tuple[mx.array, list[int]]:
    """The engine's draft logits and greedy drafts for a stream whose context is tokens[:anchor] and
    last token tokens[anchor]."""
    state = target.new_state()
    taps = target.forward([Segment(tokens[:anchor], 0, state, want_taps=True)], drafter.taps)[0].taps
    dstate = drafter.new_state()
    drafter.absorb([(dstate, taps)])
    seen = []
    original = drafter.logits
    drafter.logits = lambda x: seen.append(original(x)) or seen[-1]
    drafts = drafter.propose([Proposal(dstate, tokens[anchor], drafter.block - 1, SamplingParams())])[0]
    return seen[0], drafts


def engine_logits(drafter, target, tokens: list[int], anchor: int) -> mx.array:
    """The engine's v1 draft logits at `anchor`, whose greedy drafts are their argmax."""
    logits, drafts = engine_proposal(drafter, target, tokens, anchor)
    assert drafts == mx.argmax(logits, axis=-1).tolist()
    return logits


@pytest.mark.parametrize("is_causal", [None, False], ids=["sliding-causal-full-bidirectional", "all-bidirectional"])
def test_training_drafter_computes_the_engine_drafter(fixture_target, tmp_path, is_causal) -> None:
    """Blocks at several anchors in one training pass, exported, give the engine's logits and drafts
    for a stream at each anchor; anchors past the sliding window exercise it."""
    config = drafter_config(SHAPE, fixture_target.config)
    if is_causal is not None:
        config["is_causal"] = is_causal
    model = Drafter(parse_draft_config(config))
    model.init(seed=3, std=0.5)
    export(model, config, tmp_path / "drafter")
    target = build_target(fixture_target.config, fixture_target.weights)
    drafter = load_drafter(tmp_path / "drafter", target)
    model.load_weights([(k, v.astype(mx.float32)) for k, v in mx.load(str(tmp_path / "drafter/model.safetensors")).items()])

    mx.random.seed(4)
    tokens = mx.random.randint(8, 512, (48,)).tolist()
    anchors = [3, 11, 30, 40]
    trainer = TrainTarget(fixture_target)
    taps = trainer.taps(mx.array([tokens]), SHAPE.taps)
    hidden = model(taps, mx.array([tokens]), mx.array([anchors]), trainer.embed)
    ours = model.logits(hidden, trainer.head)[0]
    varied = set()
    for n, anchor in enumerate(anchors):
        ref = engine_logits(drafter, target, tokens, anchor)
        err = mx.abs(ours[n] - ref).max().item()
        assert err <= 1e-3 * max(1.0, mx.abs(ref).max().item()), f"anchor {anchor}: max |training - engine| = {err:.3g}"
        assert mx.argmax(ours[n], axis=-1).tolist() == mx.argmax(ref, axis=-1).tolist(), f"anchor {anchor}: drafts differ"
        varied.update(mx.argmax(ref, axis=-1).tolist())
    assert len(varied) > 3, "the random drafter proposes one token everywhere: the comparison would prove little"


def test_an_8_bit_export_is_what_the_engine_drafts_with(fixture_target, tmp_path) -> None:
    """Stored in mlx-lm's 8-bit layout, the drafter the engine loads computes what the training
    model computes from the same export (both dequantize it), and its drafts are equal."""
    shape = Shape(**{**SHAPE.__dict__, "bits": 8})
    config = drafter_config(shape, fixture_target.config)
    model = Drafter(parse_draft_config(config))
    model.init(seed=3, std=0.5)
    export(model, config, tmp_path / "drafter")
    stored = mx.load(str(tmp_path / "drafter/model.safetensors"))
    assert stored["fc.weight"].dtype == mx.uint32 and "fc.scales" in stored and "fc.biases" in stored
    assert stored["norm.weight"].dtype == mx.bfloat16
    target = build_target(fixture_target.config, fixture_target.weights)
    drafter = load_drafter(tmp_path / "drafter", target)
    back = load(tmp_path / "drafter")
    mx.random.seed(6)
    tokens = mx.random.randint(8, 512, (40,)).tolist()
    trainer = TrainTarget(fixture_target)
    taps = trainer.taps(mx.array([tokens]), SHAPE.taps)
    ours = back.logits(back(taps, mx.array([tokens]), mx.array([[9, 30]]), trainer.embed), trainer.head)[0]
    for n, anchor in enumerate([9, 30]):
        ref = engine_logits(drafter, target, tokens, anchor)
        assert mx.abs(ours[n] - ref).max().item() <= 1e-3 * max(1.0, mx.abs(ref).max().item())
        assert mx.argmax(ours[n], axis=-1).tolist() == mx.argmax(ref, axis=-1).tolist()
    # 8 bits lose little: the dequantized weights are within one step (a group's scale, its range / 255)
    # of the float ones (mx.quantize itself errs up to 0.75 of one; float16 scales keep the rest small)
    err = mx.abs(back.fc.weight - model.fc.weight).max().item()
    assert 0 < err <= stored["fc.scales"].astype(mx.float32).abs().max().item()


def test_growing_a_drafter_keeps_what_it_computes(fixture_target, tmp_path) -> None:
    """`--init` with a 2-layer export into a 4-layer recipe: the source's layers at both ends, the two
    inserted ones the identity, so the grown drafter's hidden states are the source's, bit for bit;
    a drafter that differs in anything else is refused."""
    small = drafter_config(SHAPE, fixture_target.config)
    source = Drafter(parse_draft_config(small))
    source.init(seed=3, std=0.5)
    export(source, small, tmp_path / "small")
    kinds = ("sliding_attention",) * 3 + ("full_attention",)
    big = drafter_config(Shape(**{**SHAPE.__dict__, "layers": 4, "layer_types": kinds, "bits": 8}), fixture_target.config)
    grown = Drafter(parse_draft_config(big))
    grown.init(seed=4, std=0.5)
    how = start_from(grown, big, tmp_path / "small")
    assert how.startswith("grown from 2 to 4 layers") and "[0, 3]" in how
    before = load(tmp_path / "small")
    trainer = TrainTarget(fixture_target)
    mx.random.seed(7)
    tokens = mx.array([mx.random.randint(8, 512, (40,)).tolist()])
    taps = trainer.taps(tokens, SHAPE.taps)
    anchors = mx.array([[5, 20, 33]])
    assert mx.array_equal(grown(taps, tokens, anchors, trainer.embed), before(taps, tokens, anchors, trainer.embed))
    assert mx.abs(grown.layers[1].self_attn.q_proj.weight).max().item() > 0  # the new layers can learn
    wider = drafter_config(Shape(**{**SHAPE.__dict__, "layers": 4, "intermediate": 128}), fixture_target.config)
    with pytest.raises(ValueError, match="intermediate_size"):
        start_from(Drafter(parse_draft_config(wider)), wider, tmp_path / "small")


def test_training_target_taps_are_the_engine_taps(fixture_target) -> None:
    trainer = TrainTarget(fixture_target)
    target = build_target(fixture_target.config, fixture_target.weights)
    mx.random.seed(5)
    tokens = mx.random.randint(8, 512, (70,)).tolist()
    ours = trainer.taps(mx.array([tokens]), (1, 3, 5))[0]
    ref = target.forward([Segment(tokens, 0, target.new_state(), want_taps=True)], (1, 3, 5))[0].taps[:70]
    assert mx.abs(ours - ref).max().item() <= 1e-4 * mx.abs(ref).max().item()


def test_generation_is_the_targets_greedy_reply(fixture_target) -> None:
    """Batched, left-padded greedy generation gives each prompt the engine's own greedy reply."""
    trainer = TrainTarget(fixture_target)
    prompts = [[5, 40, 41, 42, 43, 44, 45, 46, 47], [9, 100, 200], [300, 301, 302, 303, 304]]
    replies = trainer.generate(prompts, 12, [0.0, 0.0, 0.0], seed=0)
    engine = Engine(model=build_target(fixture_target.config, fixture_target.weights), eos_ids=())
    for prompt, reply in zip(prompts, replies):
        assert engine.generate(Request(prompt, max_tokens=12)).tokens == reply.tolist()


def test_smoke_run_trains_exports_and_serves(tmp_path) -> None:
    """`python -m train_drafter all --recipe smoke` on the fixture target: a receipt with data, loss
    curve and held-out figures, and a drafter the engine loads and drafts with, drafted == plain."""
    target_dir = write_fixture("llama", tmp_path / "target")
    out = tmp_path / "out"
    train_main(["all", "--recipe", "smoke", "--target", str(target_dir), "--out", str(out),
                "--data", str(tmp_path / "data.npz")])
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["data"]["reply_tokens"] == 12 * 24 and receipt["data"]["held_out_sequences"] == 2
    assert receipt["training"]["steps"] == 8 and receipt["training"]["loss_curve"][-1]["step"] == 8
    assert receipt["held_out"]["tokens_per_round"] >= 1.0
    assert set(receipt["files"]) == {"config.json", "model.safetensors"}
    again = tmp_path / "again"
    train_main(["train", "--recipe", "smoke", "--target", str(target_dir), "--out", str(again),
                "--data", str(tmp_path / "data.npz"), "--init", str(out / "drafter"), "--steps", "2",
                "--logits-dtype", "bfloat16"])
    continued = json.loads((again / "receipt.json").read_text())
    assert continued["init"] == {"from": str(out / "drafter"), "how": "same architecture"}
    assert continued["recipe"]["logits_dtype"] == "bfloat16" and receipt["recipe"]["logits_dtype"] == "float32"
    mean = tmp_path / "mean"
    train_main(["average", "--recipe", "smoke", "--target", str(target_dir), "--out", str(mean), "--data",
                str(tmp_path / "data.npz"), "--drafter", str(out / "drafter"), str(again / "drafter"),
                "--receipts", str(again / "receipt.json")])
    averaged = json.loads((mean / "receipt.json").read_text())
    assert averaged["held_out"]["drafters"][str(again / "drafter")] == continued["held_out"]  # same rows, same figures
    assert set(averaged["held_out"]["drafters"]) == {"mean", str(out / "drafter"), str(again / "drafter")}
    assert averaged["source_receipts"][str(again / "receipt.json")] == continued
    for drafter in (out / "drafter", grown_from_two_data_files(target_dir, tmp_path, out / "drafter")):
        engine = Engine(target_dir, drafter)
        prompt = engine.tokenizer.encode("def fibonacci(n):")
        drafted = engine.generate(Request(prompt, max_tokens=20, ignore_eos=True))
        plain = engine.generate(Request(prompt, max_tokens=20, ignore_eos=True, draft=False))
        assert drafted.tokens == plain.tokens and drafted.stats.rounds > 0


def grown_from_two_data_files(target_dir: Path, tmp_path: Path, source: Path) -> Path:
    """`train --data A B --init <2 layers> --layers 3 --bits 6`: both files train (less the held-out
    rows), the drafter grows by a layer, and it is stored in 6 bits."""
    train_main(["data", "--recipe", "smoke", "--target", str(target_dir), "--seed", "1",
                "--data", str(tmp_path / "data1.npz")])
    out = tmp_path / "grown"
    train_main(["train", "--recipe", "smoke", "--target", str(target_dir), "--out", str(out), "--steps", "2",
                "--data", str(tmp_path / "data.npz"), str(tmp_path / "data1.npz"), "--init", str(source),
                "--layers", "3", "--bits", "6"])
    receipt = json.loads((out / "receipt.json").read_text())
    assert [f["file"] for f in receipt["data"]["files"]] == ["data.npz", "data1.npz"]
    assert receipt["data"]["train_sequences"] == 2 * 12 - 2 and receipt["data"]["reply_tokens"] == 2 * 12 * 24
    assert receipt["architecture"]["layers"] == 3 and receipt["init"]["how"].startswith("grown from 2 to 3")
    assert json.loads((out / "drafter" / "config.json").read_text())["quantization"]["bits"] == 6
    return out / "drafter"


def test_receipts_name_the_tools_code_by_hash(tmp_path) -> None:
    """A receipt's tool_sha256 follows the training tool's sources, wherever the tree was copied
    (a copied tree's .git can name an older commit than the code that ran)."""
    import shutil
    import subprocess

    tools = Path(__file__).resolve().parents[1] / "tools" / "train_drafter"
    for copy in ("same", "changed"):
        shutil.copytree(tools, tmp_path / copy / "train_drafter", ignore=shutil.ignore_patterns("__pycache__"))
    recipe = tmp_path / "changed" / "train_drafter" / "recipe.py"
    recipe.write_text(recipe.read_text() + "\n# changed\n")
    probe = "import json; from train_drafter.__main__ import _source; print(json.dumps(_source()))"
    here, same, changed = (
        json.loads(subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONPATH": str(cwd)}).stdout)["tool_sha256"]
        for cwd in (tools.parent, tmp_path / "same", tmp_path / "changed"))
    assert here == same != changed and len(here) == 64


def test_average_is_the_mean_of_the_sources_weights(tmp_path) -> None:
    """`average`: the mean of the float32 weights, stored as the sources are (bf16 here); a drafter
    averaged with itself is itself; drafters of other configs are refused by name."""
    target = load_target(write_fixture("llama", tmp_path / "target"))
    exports = []
    for seed in (1, 2):
        model = Drafter(parse_draft_config(drafter_config(SHAPE, target.config)))
        model.init(seed)
        exports.append(export(model, drafter_config(SHAPE, target.config), tmp_path / f"d{seed}"))
    train_main(["average", "--out", str(tmp_path / "avg"), "--drafter", *map(str, exports)])
    _, a = read_weights(exports[0])
    _, b = read_weights(exports[1])
    _, mean = read_weights(tmp_path / "avg" / "drafter")
    assert all(mx.array_equal(mean[k], ((a[k] + b[k]) / 2).astype(mx.bfloat16).astype(mx.float32)) for k in a)
    assert any(not mx.array_equal(mean[k], a[k]) for k in a)
    receipt = json.loads((tmp_path / "avg" / "receipt.json").read_text())
    assert [s["path"] for s in receipt["sources"]] == list(map(str, exports))
    assert receipt["what"].startswith("mean of exported DFlash drafters'")  # the sources' kind, not a fixed one
    train_main(["average", "--out", str(tmp_path / "self"), "--drafter", str(exports[0]), str(exports[0])])
    _, same = read_weights(tmp_path / "self" / "drafter")
    assert all(mx.array_equal(same[k], a[k]) for k in a)
    deeper = drafter_config(Shape(**{**SHAPE.__dict__, "layers": 3}), target.config)
    other = export(Drafter(parse_draft_config(deeper)), deeper, tmp_path / "d3")
    with pytest.raises(ValueError, match="d3"):
        train_main(["average", "--out", str(tmp_path / "bad"), "--drafter", str(exports[0]), str(other)])


def test_tap_store_batches_carry_each_sequences_own_taps(fixture_target) -> None:
    """Length-sorted chunks, each as wide as its longest row: a batch drawn across chunks gives
    every sequence its own taps (to bf16 rounding), tokens and length, padded to the full width."""
    from train_drafter.data import Sequences, TapStore

    trainer = TrainTarget(fixture_target)
    rng = np.random.default_rng(3)
    lengths = np.array([30, 12, 25, 18, 40, 9, 33])
    tokens = np.zeros((len(lengths), 40), dtype=np.int32)
    for i, n in enumerate(lengths):
        tokens[i, :n] = rng.integers(8, 512, n)
    seqs = Sequences(tokens, np.full(len(lengths), 4, dtype=np.int32), lengths.astype(np.int32), ["x"] * 7,
                     np.zeros(7, dtype=np.float32))
    store = TapStore(trainer, seqs, (1, 3, 5), chunk=3, batch=2, log=lambda _: None)
    assert [p.shape[1] for p in store.planes] == [18, 33, 40]  # not 40 each
    taps, toks, targets, anchors, length = store.batch(np.random.default_rng(0), 6, 2)
    assert taps.shape == (6, 40, 3 * 64) and taps.dtype == mx.float32
    for r in range(6):
        n = int(length[r].item())
        i = int(np.flatnonzero(lengths == n)[0])
        assert np.array_equal(np.array(toks[r]), tokens[i])
        ref, choices = trainer.taps_and_choices(mx.array(tokens[i : i + 1, :n]), (1, 3, 5))
        assert mx.abs(taps[r, :n] - ref[0]).max().item() <= 1e-2 * mx.abs(ref).max().item()
        assert np.array_equal(np.array(targets[r, :n]), np.array(choices[0]))  # the target's own choices
        assert int(anchors[r].min().item()) >= 4 and int(anchors[r].max().item()) < n - 1


def test_bf16_logits_train_what_float32_logits_train(fixture_target) -> None:
    """A bf16 lm_head product (`--logits-dtype bfloat16`) gives the float32 loss and gradient to bf16
    rounding: same loss to 1e-3, gradients pointing the same way; the softmax itself stays float32."""
    from functools import partial

    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from train_drafter.train import block_loss

    trainer = TrainTarget(fixture_target)
    config = parse_draft_config(drafter_config(SHAPE, fixture_target.config))
    model = Drafter(config)
    model.init(5)
    rng = np.random.default_rng(5)
    tokens = mx.array(rng.integers(8, 512, (2, 30)).astype(np.int32))
    taps, targets = trainer.taps_and_choices(tokens, SHAPE.taps)
    anchors, length = mx.array([[4, 11, 20], [6, 9, 25]], dtype=mx.int32), mx.array([30, 28], dtype=mx.int32)
    results = []
    for dtype in (mx.float32, mx.bfloat16):
        f = nn.value_and_grad(model, partial(block_loss, embed=trainer.embed, head=trainer.head.astype(dtype), gamma=7.0))
        loss, grads = f(model, taps, tokens, targets, anchors, length)
        assert loss.dtype == mx.float32
        results.append((loss.item(), np.concatenate([np.array(g).ravel() for _, g in tree_flatten(grads)])))
    (l32, g32), (l16, g16) = results
    assert abs(l16 - l32) <= 1e-3 * abs(l32) and l16 != l32  # bf16 did run: not the float32 numbers
    assert g32 @ g16 / (np.linalg.norm(g32) * np.linalg.norm(g16)) > 0.999


def test_bf16_generation_leaves_the_taps_float32(fixture_target) -> None:
    """gen_dtype: replies come from a bf16 copy; taps, embedding and head stay the float32 model's."""
    plain, fast = TrainTarget(fixture_target), TrainTarget(fixture_target, gen_dtype=mx.bfloat16)
    assert fast.gen_model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16
    assert fast.embed.dtype == mx.float32 and fast.model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    tokens = mx.array([list(range(20, 60))])
    assert mx.array_equal(fast.taps(tokens, (1, 3, 5)), plain.taps(tokens, (1, 3, 5)))
    replies = fast.generate([[5, 40, 41], [9, 100, 200, 7]], 6, [0.0, 0.7], seed=1)
    assert replies.shape == (2, 6) and replies.min() >= 0 and replies.max() < fixture_target.config.vocab_size


def test_held_out_rows_follow_the_data_not_the_run_seed() -> None:
    """A drafter continued from another on the same data (another --seed) holds out the same rows."""
    from train_drafter.__main__ import split
    from train_drafter.data import Sequences

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (40, 30)).astype(np.int32)
    seqs = Sequences(tokens, np.full(40, 5, dtype=np.int32), np.full(40, 30, dtype=np.int32), ["x"] * 40,
                     np.where(np.arange(40) % 4 == 0, 0.7, 0.0).astype(np.float32))
    train_a, held_a = split(seqs, 6)
    train_b, held_b = split(seqs, 6)
    assert np.array_equal(held_a.tokens, held_b.tokens) and len(train_a.length) == 34
    assert (held_a.temperature == 0).all()
    assert not {r.tobytes() for r in held_a.tokens} & {r.tobytes() for r in train_a.tokens}


def test_choices_are_the_float32_targets_greedy_tokens(fixture_target) -> None:
    """taps_and_choices: position t holds the float32 target's argmax given tokens < t, so on a
    float32 greedy reply the choices are the reply itself, and on a bf16 reply they are what
    greedy verification would accept."""
    plain, fast = TrainTarget(fixture_target), TrainTarget(fixture_target, gen_dtype=mx.bfloat16)
    prompt = [5, 40, 41, 42, 43, 44]
    reply = plain.generate([prompt], 20, [0.0], seed=0)[0].tolist()
    taps, choices = plain.taps_and_choices(mx.array([prompt + reply]), (1, 3, 5))
    assert mx.array_equal(taps, plain.taps(mx.array([prompt + reply]), (1, 3, 5)))
    assert np.array(choices[0, len(prompt):]).tolist() == reply
    other = prompt + fast.generate([prompt], 20, [0.0], seed=0)[0].tolist()
    _, picks = plain.taps_and_choices(mx.array([other]), (1, 3, 5))
    h, _ = plain.hidden(mx.array([other]), "causal")
    assert np.array(picks[0, 1:]).tolist() == np.array(mx.argmax(plain.logits(h[:, :-1]), axis=-1)[0]).tolist()


def test_mix_sets_the_prompt_kinds_and_refuses_a_bad_one(tmp_path) -> None:
    from train_drafter import corpus
    from train_drafter.recipe import parse_mix

    mix = parse_mix("chat-question=3,code-chat=1,prose-raw=0")
    assert mix == {"chat-question": 3.0, "code-chat": 1.0}  # a share of 0 draws nothing
    prompts = corpus.build_prompts(Path(sysconfig.get_paths()["stdlib"]), 40, 0, mix)
    assert {p.kind for p in prompts} == {"chat-question", "code-chat"}
    for bad, says in (("chat=1", "not KIND=SHARE"), ("code-chat=x", "not a number"), ("code-chat=-1", ">= 0"),
                      ("code-chat=1,code-chat=2", "given twice"), ("code-chat=0", "every share is 0")):
        with pytest.raises(ValueError, match=says):
            parse_mix(bad)
    out = subprocess.run([sys.executable, "-m", "train_drafter", "data", "--mix", "chat=1", "--out", str(tmp_path)],
                         cwd=Path(__file__).resolve().parents[1] / "tools", capture_output=True, text=True)
    assert out.returncode == 2 and "argument --mix" in out.stderr.strip().splitlines()[-1]
