"""engine-speed: the mode it loads in and records, mlx-lm's batched loop, the ratios and the table."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import mlx.core as mx

from dflash_bench.checks import aggregates as agg
from dflash_bench.checks import engine_speed, mlx_lm_speed, tables
from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.receipt import Receipt, summary
from dflash_bench.cli import app
from dflash_bench.engine import backend as backends
from dflash_bench.engine import gguf
from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.targets import Segment, build_target
from dflash_bench.engine.tiles import Weight
from dflash_bench.fixtures.small import write_fixture


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("speed")
    return {kind: write_fixture(kind, root / kind) for kind in ("llama", "qwen3_5", "llama-gguf", "dflash")}


@pytest.fixture
def one_probe(monkeypatch):
    """The code probe alone: half the decoding, the same code path."""
    probes = prompt_sets.probes()
    monkeypatch.setattr(engine_speed.prompt_sets, "probes", lambda: {"code": probes["code"]})


def text(receipt: Receipt) -> str:
    console = tables.Console(width=tables.CI_WIDTH, record=True)
    console.print(tables.render(receipt))
    return console.export_text()


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "llama-gguf"])
def test_batched_loop_gives_generate_steps_greedy_tokens(files, family):
    model = mlx_lm_speed.load(load_target(files[family]))
    prompt = [3, 17, 5, 9, 250, 41, 7]
    one = mlx_lm_speed.generate_one(model, prompt, 12)
    assert len(one["tokens"][0]) == 12
    for streams in (1, 3):
        batched = mlx_lm_speed.generate_batched(model, prompt, streams, 12)
        assert batched["tokens"] == one["tokens"] * streams
        assert batched["aggregate_tok_s"] == pytest.approx(streams * batched["stream_tok_s"])


def test_ratios_come_from_the_medians():
    def c(tok_s: float, per_round: float | None = None) -> dict:
        out = {"aggregate_tok_s": summary([tok_s])}
        if per_round is not None:
            out["seconds_per_round"] = summary([per_round])
        return out

    cells = {"plain": {"1": c(10, 0.1), "4": c(30, 0.13)}, "drafted": {"1": c(25, 0.14), "4": c(50, 0.26)},
             engine_speed.MLX_LM: {"1": c(20), "4": c(60)}}
    engine_speed.derive(cells)
    plain, drafted = cells["plain"], cells["drafted"]
    assert drafted["1"]["round_over_plain"] == pytest.approx(1.4)
    assert drafted["4"]["round_over_plain"] == pytest.approx(2.0)
    assert plain["4"]["round_over_plain"] is None
    assert plain["1"]["over_mlx_lm"] == pytest.approx(0.5) and drafted["4"]["over_mlx_lm"] == pytest.approx(50 / 60)
    assert plain["4"]["scaling"] == pytest.approx(3.0) and drafted["4"]["scaling"] == pytest.approx(2.0)
    del cells[engine_speed.MLX_LM], cells["plain"]["1"]
    engine_speed.derive(cells)
    assert cells["plain"]["4"]["over_mlx_lm"] is None and cells["plain"]["4"]["scaling"] is None


def test_gpu_mode_on_this_cpu_recorded_beside_mlx_lm_at_every_level(files, one_probe):
    s = engine_speed.SpeedSettings(target=str(files["llama"]), drafter=str(files["dflash"]), levels=(1, 2),
                                   tokens=6, reps=1, backend="gpu")
    receipt = Receipt.new("engine-speed", ["test"], s.__dict__)
    engine_speed.run(s, receipt)
    receipt.finish(True)
    assert receipt.server["backend"] == receipt.environment["backend"] == "gpu"
    line = receipt.server["startup_line"]
    assert line.startswith("serving llama: DFlash drafts") and "gpu mode" in line and "warmed" in line
    assert receipt.passed, receipt.failures
    cells = receipt.aggregates["code"]
    assert set(cells) == {"plain", "drafted", engine_speed.MLX_LM}
    for streams in ("1", "2"):
        assert cells["drafted"][streams]["equals_plain"] is True
        assert cells["drafted"][streams]["round_over_plain"] > 0 and cells["plain"][streams]["over_mlx_lm"] > 0
        assert cells[engine_speed.MLX_LM][streams]["aggregate_tok_s"]["median"] > 0
    assert receipt.aggregates["load_seconds"] > 0 and receipt.aggregates["first_request_seconds"] > 0
    # each mode's time to ready served alone: the plain engine's load; the drafting one's load, check and warm-up
    ready = receipt.aggregates["ready_seconds"]
    assert set(ready) == {"plain", "drafted"} and ready["plain"] == receipt.aggregates["load_seconds"]
    assert ready["drafted"] > 0
    shown = text(Receipt.from_dict(receipt.to_dict()))
    assert "gpu mode" in shown and "round/plain round" in shown and "equal" in shown
    assert " ".join(shown.split()).count("each stream's at T 0.7") == 1  # the caption: what "= plain" held
    assert "first request" in shown
    assert [line.split("│")[2].strip() for line in shown.splitlines() if "ready after" in line] == ["plain", "drafted"]
    # the weights each mode's round reads, and their ratio beside round/plain round
    size = receipt.aggregates["weight_bytes"]
    assert set(size) == {"plain", "drafted"} and size["drafted"] > size["plain"] > 0
    rows = [line.split("│") for line in shown.splitlines() if "weights a round reads (at least)" in line]
    assert [r[2].strip() for r in rows] == ["plain", "drafted"]
    assert rows[1][9].strip() == f"{size['drafted'] / size['plain']:.2f}x" and rows[0][9].strip() == "1.00x"


def test_reps_are_taken_in_turns_so_a_drift_in_host_speed_reaches_both_sides(files, one_probe):
    s = engine_speed.SpeedSettings(target=str(files["llama"]), drafter=str(files["dflash"]), levels=(1, 2),
                                   tokens=4, reps=2, backend="gpu")
    receipt = Receipt.new("engine-speed", ["test"], s.__dict__)
    engine_speed.run(s, receipt)
    order = [(r["streams"], r["mode"], r["rep"]) for r in receipt.records if not r.get("temperature")]
    sides = ["plain", "drafted", engine_speed.MLX_LM]
    assert order == [(n, mode, rep) for n in (1, 2) for rep in (0, 1) for mode in sides]


def test_a_gguf_target_runs_beside_mlx_lm_on_the_weights_we_load(files, one_probe):
    """mlx-lm cannot read a GGUF file, so its model is built on the weights our loader read (mlx_lm_speed's
    `from_loaded`): the receipt has its cells and ratios, and nothing is noted or failed."""
    s = engine_speed.SpeedSettings(target=str(files["llama-gguf"]), levels=(1, 2), tokens=4, reps=1)
    receipt = Receipt.new("engine-speed", ["test"], s.__dict__)
    engine_speed.run(s, receipt)
    receipt.finish(True)
    assert receipt.server["backend"] == backends.device_backend().name
    assert "mlx_lm_note" not in receipt.aggregates and not receipt.failures and not receipt.warnings
    cells = receipt.aggregates["code"]
    assert set(cells[engine_speed.MLX_LM]) == {"1", "2"} and cells["plain"]["1"]["over_mlx_lm"] > 0


def mlx_lm_logits(model, prompt: list[int]) -> mx.array:
    return model(mx.array([prompt]))[0, -1].astype(mx.float32)


def test_mlx_lms_model_on_a_ggufs_weights_is_its_model_on_the_same_safetensors_bit_for_bit(files):
    """The llama-gguf fixture holds the llama fixture's weights exactly (fixtures/small.py), so mlx-lm's model built
    on what our loader reads from the GGUF (bf16, as the gpu mode loads it: llama.cpp's Q/K row order put back,
    the config from the file's metadata) gives the logits of mlx-lm loading the safetensors folder itself, bit for
    bit. The control leaves one layer's q rows in llama.cpp's order: other logits."""
    prompt = [3, 17, 5, 9, 250, 41, 7]
    own = mlx_lm_logits(mlx_lm_speed.load(load_target(files["llama"], dtype=mx.bfloat16, packed=True)), prompt)
    loaded = load_target(files["llama-gguf"], dtype=mx.bfloat16, packed=True)
    assert mx.array_equal(mlx_lm_logits(mlx_lm_speed.load(loaded), prompt), own).item()
    name = "layers.0.self_attn.q_proj.weight"
    loaded.weights[name] = gguf.permute_qk(loaded.weights[name], loaded.config.num_heads)
    assert not mx.array_equal(mlx_lm_logits(mlx_lm_speed.from_loaded(loaded), prompt), own).item()


def test_mlx_lms_model_on_the_default_ggufs_packed_weights_agrees_with_our_target():
    """The default model's GGUF (Q4_1 projections, a Q8_0 embedding), loaded packed in bf16 as the gpu mode loads
    it: mlx-lm's model on those weights, each projection quantized as its triple is, and our target on the same
    arrays give a prompt's last logits to bf16 accuracy; the control (one layer's k rows in llama.cpp's order)
    does not."""
    loaded = load_target("default", dtype=mx.bfloat16, packed=True)
    prompt = loaded.tokenizer.encode("The capital of France is")
    target = build_target(loaded.config, loaded.weights, dtype=mx.bfloat16)

    def ours() -> mx.array:
        out = target.forward([Segment(prompt, 0, target.new_state(), [len(prompt) - 1], prefill=True)])
        return out[0].logits[0].astype(mx.float32)

    def error(got: mx.array, want: mx.array) -> float:
        return (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()

    want = ours()
    assert error(mlx_lm_logits(mlx_lm_speed.load(loaded), prompt), want) < 2e-2
    name = "layers.0.self_attn.k_proj.weight"
    w = loaded.weights[name]
    loaded.weights[name] = Weight.packed(*(gguf.permute_qk(a, loaded.config.num_kv_heads) for a in (w.w, w.scales, w.biases)),
                                         w.group_size, w.bits)
    assert error(mlx_lm_logits(mlx_lm_speed.from_loaded(loaded), prompt), want) > 5e-2


def test_bad_backend_refused_before_loading_anything():
    result = CliRunner().invoke(app, ["engine-speed", "--backend", "tpu"])
    assert result.exit_code == 2 and "--backend" in result.output


def test_the_backend_option_reaches_the_run_and_the_receipts_settings(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(engine_speed, "run", lambda s, receipt, progress: seen.append(s))
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["engine-speed", "--backend", "gpu", "--no-mlx-lm", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert seen[0].backend == "gpu" and not seen[0].mlx_lm
    assert Receipt.load(out).settings["backend"] == "gpu"


def test_mlx_lms_tokens_are_not_held_to_ours_but_a_drafted_cell_is():
    """mlx-lm runs its own kernels, so its greedy tokens may differ from ours (random 9B-shaped weights
    on the H200 gave other hashes): only our drafted cells must equal plain."""
    receipt = Receipt.new("engine-speed", ["test"], {})
    receipt.records = [{"probe": "code", "mode": mode, "streams": 1, "token_sha": [sha]}
                       for mode, sha in (("plain", "aa"), ("drafted", "aa"), (engine_speed.MLX_LM, "bb"))]
    cells = {mode: {"1": {}} for mode in ("plain", "drafted", engine_speed.MLX_LM)}
    engine_speed.check_equal(receipt, "code", cells, (1,))
    assert receipt.failures == [] and cells["drafted"]["1"]["equals_plain"] is True
    receipt.records[1]["token_sha"] = ["cc"]
    engine_speed.check_equal(receipt, "code", cells, (1,))
    assert [f["subject"] for f in receipt.failures] == ["code drafted x1"]


def test_a_sampled_drafted_stream_is_held_to_plains_stream_of_its_seed():
    """At a sampled temperature stream i has seed i in both modes: drafted must equal plain stream for stream (the
    same hashes in another order are two streams that differ), and plain's seed must keep its hash at every level;
    greedy records beside them are not mixed in."""
    receipt = Receipt.new("engine-speed", ["test"], {})
    records = [("plain", 1, ["g"], 0.0), ("drafted", 1, ["g"], 0.0), ("plain", 2, ["g", "g"], 0.0),
               ("drafted", 2, ["g", "g"], 0.0), ("plain", 1, ["a"], 0.7), ("drafted", 1, ["a"], 0.7),
               ("plain", 2, ["a", "b"], 0.7), ("drafted", 2, ["a", "b"], 0.7)]
    receipt.records = [{"probe": "code", "mode": m, "streams": n, "token_sha": shas, "temperature": t}
                       for m, n, shas, t in records]
    cells = {mode: {"1": {}, "2": {}} for mode in ("plain", "drafted")}
    engine_speed.check_equal(receipt, "code", cells, (1, 2))
    engine_speed.check_sampled(receipt, "code", cells, (1, 2), (0.7,))
    assert receipt.failures == [] and cells["drafted"]["2"]["equals_plain_sampled"] == {"0.7": True}
    receipt.records[7]["token_sha"] = ["b", "a"]  # the same hashes, each on the other seed's stream
    engine_speed.check_sampled(receipt, "code", cells, (1, 2), (0.7,))
    assert [f["subject"] for f in receipt.failures] == ["code drafted x2 T=0.7"]
    assert cells["drafted"]["2"]["equals_plain_sampled"] == {"0.7": False}
    receipt.failures.clear()
    receipt.records[6]["token_sha"] = ["c", "b"]  # plain's seed 0 at 2 streams is not its stream at 1
    engine_speed.check_sampled(receipt, "code", cells, (1, 2), (0.7,))
    assert "code plain T=0.7 seed 0" in [f["subject"] for f in receipt.failures]
    # the table's "= plain": equal only where greedy and every sampled temperature were
    verdict = tables.plain_verdict
    assert verdict(agg.SpeedCell(equals_plain=True, equals_plain_sampled={"0.7": True})).plain == "equal"
    assert verdict(agg.SpeedCell(equals_plain=True, equals_plain_sampled={"0.7": False})).plain == "DIFFER (T 0.7)"
    assert verdict(agg.SpeedCell(equals_plain=False)).plain == "DIFFER (greedy)"


def test_every_side_decodes_the_timed_length_once_untimed_before_its_reps(files, one_probe, monkeypatch):
    """A short untimed pass left a side's first timed rep growing its caches (engine_speed.run's docstring):
    each side's first call at a level is untimed and as long as a rep; only the first request is short. After
    the reps, each of our modes decodes once more at the sampled temperature (mlx-lm does not)."""
    calls: list[tuple[str, int, int]] = []
    ours, theirs = engine_speed.run_level, engine_speed.mlx_lm_record

    def run_level(engine, prompt, streams, tokens, draft, temperature=0.0):
        calls.append(("drafted" if draft else "plain", streams, tokens) + ((temperature,) if temperature else ()))
        return ours(engine, prompt, streams, tokens, draft, temperature)

    def mlx_lm_record(reference, ids, streams, tokens):
        calls.append((engine_speed.MLX_LM, streams, tokens))
        return theirs(reference, ids, streams, tokens)

    monkeypatch.setattr(engine_speed, "run_level", run_level)
    monkeypatch.setattr(engine_speed, "mlx_lm_record", mlx_lm_record)
    s = engine_speed.SpeedSettings(target=str(files["llama"]), drafter=str(files["dflash"]), levels=(1, 2),
                                   tokens=7, reps=1, backend="gpu")
    receipt = Receipt.new("engine-speed", ["test"], s.__dict__)
    engine_speed.run(s, receipt)
    sides = ["plain", "drafted", engine_speed.MLX_LM]
    assert calls == [("plain", 1, engine_speed.FIRST_TOKENS)] + [
        call for n in (1, 2) for call in [(mode, n, 7) for _ in ("untimed", "rep 0") for mode in sides]
        + [("plain", n, 7, 0.7), ("drafted", n, 7, 0.7)]]
    assert len(receipt.records) == 2 * (len(sides) + 2) and receipt.aggregates["first_request_seconds"] > 0
    cells = receipt.aggregates["code"]["drafted"]
    assert all(cells[n]["equals_plain"] and cells[n]["equals_plain_sampled"] == {"0.7": True} for n in ("1", "2"))
    sampled = [r for r in receipt.records if r.get("temperature") == 0.7 and r["streams"] == 2]
    greedy = [r for r in receipt.records if not r.get("temperature") and r["streams"] == 2 and r["mode"] == "plain"]
    # sampling happened: seeds 0 and 1 part ways, and neither stream is the greedy one
    assert len(set(sampled[0]["token_sha"])) == 2 and greedy[0]["token_sha"][0] not in sampled[0]["token_sha"]
    assert not receipt.failures


def test_a_run_cut_short_keeps_the_checks_and_ratios_of_the_levels_it_finished(files, one_probe, monkeypatch):
    """A job's time limit stops engine-speed mid-level (SIGTERM is taken as Ctrl-C): the levels already
    measured keep their equality verdicts and ratios, the level cut short has no cell."""
    ours = engine_speed.run_level

    def run_level(engine, prompt, streams, tokens, draft, temperature=0.0):
        if streams == 2:
            raise KeyboardInterrupt("SIGTERM")
        return ours(engine, prompt, streams, tokens, draft, temperature)

    monkeypatch.setattr(engine_speed, "run_level", run_level)
    s = engine_speed.SpeedSettings(target=str(files["llama"]), drafter=str(files["dflash"]), levels=(1, 2),
                                   tokens=4, reps=1, backend="gpu")
    receipt = Receipt.new("engine-speed", ["test"], s.__dict__)
    with pytest.raises(KeyboardInterrupt):
        engine_speed.run(s, receipt)
    cells = receipt.aggregates["code"]
    assert set(cells["drafted"]) == {"1"} and cells["drafted"]["1"]["equals_plain"] is True
    assert cells["drafted"]["1"]["round_over_plain"] > 0 and cells["plain"]["1"]["over_mlx_lm"] > 0
    assert not receipt.failures


@pytest.mark.parametrize("sampled", ["0,0.7", "-1", "warm"])
def test_sampled_temperatures_are_above_zero_or_the_command_says_which_option(sampled):
    """The timed reps are greedy; `--sampled` names the temperatures of the untimed equality pass, so 0 (and
    anything not a number above 0) is refused with the option's name, before any model loads."""
    out = CliRunner().invoke(app, ["engine-speed", "--sampled", sampled])
    assert out.exit_code == 2 and "--sampled" in out.output
