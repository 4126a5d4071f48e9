"""compare: ratios, noisy cells, drops beyond the runs' own spread, and exit codes, on hand-written receipts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_bench.checks.compare import compare
from dflash_bench.checks.receipt import Receipt, summary
from dflash_bench.cli import app


def decode_receipt(code_reps: dict, chat_x4: dict | None = None, peak: float = 20e9) -> Receipt:
    """A decode receipt whose single-stream code cells have the given per-rep values by mode."""
    r = Receipt.new("decode", ["dflash-bench", "decode"], {"levels": [1, 4]})
    r.aggregates = {
        "modes": list(code_reps),
        "single_tps": {"code": {m: summary(v) for m, v in code_reps.items()}},
        "aggregate_tps": {"chat": {"4": {m: summary(v) for m, v in (chat_x4 or {}).items()}}},
        "tokens_per_round": {"code": {"1": {m: (5.8 if m == "drafted" else 1.0) for m in code_reps}}},
    }
    r.server = {"peak_memory_bytes": peak}
    r.finish(True)
    return r


def write(tmp_path, name: str, r: Receipt):
    path = tmp_path / name
    r.write(path)
    return path


def cell(result, section: str, row: str, mode: str):
    return next(c for c in result.cells if (c.section, c.row, c.mode) == (section, row, mode))


def test_ratio_is_after_median_over_before_median(tmp_path):
    b = write(tmp_path, "b.json", decode_receipt({"drafted": [93.0, 93.3, 92.9], "plain": [93.1, 93.0, 93.2]}))
    a = write(tmp_path, "a.json", decode_receipt({"drafted": [306.2, 306.4, 306.0], "plain": [93.0, 93.1, 93.2]}))
    result = compare(b, a)
    assert cell(result, "single-stream tok/s", "code", "drafted").ratio == pytest.approx(306.2 / 93.0)
    assert cell(result, "tokens per round", "code x1", "drafted").ratio == pytest.approx(1.0)
    assert result.exit_code == 0 and not result.drops


def test_a_noisy_cell_is_marked_and_left_out_of_ratios_and_verdict(tmp_path):
    # the seed PR's M5 "before 3" chat reps: 123.15 / 19.63 / 21.32
    b = write(tmp_path, "b.json", decode_receipt({"plain": [123.0, 123.2, 122.9]}, {"plain": [464.9, 463.0, 466.0]}))
    a = write(tmp_path, "a.json", decode_receipt({"plain": [123.15, 19.63, 21.32]}, {"plain": [464.0, 465.0, 463.5]}))
    result = compare(b, a, noise=0.10)
    c = cell(result, "single-stream tok/s", "code", "plain")
    assert c.noisy and c.ratio is None and not c.drop and "noisy" in c.note
    assert not cell(result, "aggregate tok/s", "chat x4", "plain").noisy
    assert result.exit_code == 0


def test_a_drop_beyond_both_runs_spread_fails(tmp_path):
    b = write(tmp_path, "b.json", decode_receipt({"plain": [100.0, 101.0, 99.0]}))
    a = write(tmp_path, "a.json", decode_receipt({"plain": [95.0, 96.0, 94.5]}))
    result = compare(b, a)
    c = cell(result, "single-stream tok/s", "code", "plain")
    assert c.drop and not c.noisy and c.ratio == pytest.approx(0.95)
    assert result.exit_code == 1


def test_a_drop_within_the_runs_spread_passes(tmp_path):
    b = write(tmp_path, "b.json", decode_receipt({"plain": [100.0, 104.0, 97.0]}))
    a = write(tmp_path, "a.json", decode_receipt({"plain": [97.0, 99.0, 96.0]}))
    result = compare(b, a)
    assert not cell(result, "single-stream tok/s", "code", "plain").drop and result.exit_code == 0


def test_one_rep_has_no_spread_and_is_never_a_drop(tmp_path):
    b = write(tmp_path, "b.json", decode_receipt({"plain": [100.0]}))
    a = write(tmp_path, "a.json", decode_receipt({"plain": [50.0]}))
    result = compare(b, a)
    c = cell(result, "single-stream tok/s", "code", "plain")
    assert not c.drop and c.ratio == pytest.approx(0.5) and "one rep" in c.note
    assert result.exit_code == 0


def test_footprint_and_tokens_per_round_never_fail(tmp_path):
    b = write(tmp_path, "b.json", decode_receipt({"drafted": [100.0, 100.5, 99.5]}, peak=20e9))
    after = decode_receipt({"drafted": [100.0, 100.5, 99.5]}, peak=26e9)
    after.aggregates["tokens_per_round"]["code"]["1"]["drafted"] = 1.7
    a = write(tmp_path, "a.json", after)
    result = compare(b, a)
    assert cell(result, "peak footprint", "decode", "-").ratio == pytest.approx(1.3)
    assert cell(result, "tokens per round", "code x1", "drafted").ratio < 1
    assert result.exit_code == 0


def test_a_before_without_drafted_runs_lets_its_plain_run_stand_in(tmp_path):
    b = write(tmp_path, "b.json", decode_receipt({"plain": [93.0, 93.2, 92.9]}))
    a = write(tmp_path, "a.json", decode_receipt({"drafted": [306.0, 306.2, 306.4], "plain": [93.0, 93.1, 93.0]}))
    c = cell(compare(b, a), "single-stream tok/s", "code", "drafted")
    assert c.ratio == pytest.approx(306.2 / 93.0) and "before has no drafted run" in c.note


def prefill_receipt(tps: dict[str, list[float]]) -> Receipt:
    r = Receipt.new("prefill", ["dflash-bench", "prefill"], {"sizes": [2048]})
    r.aggregates = {"sizes": {"2048": {m: {"tps": summary(v), "seconds": summary([2048 / x for x in v])}
                                       for m, v in tps.items()}}}
    r.finish(True)
    return r


def test_prefill_cells_compare_tok_s_and_seconds_per_size(tmp_path):
    b = write(tmp_path, "b.json", prefill_receipt({"plain": [1248.9, 1250.0, 1247.0]}))
    a = write(tmp_path, "a.json", prefill_receipt({"plain": [1082.5, 1083.0, 1081.0]}))
    result = compare(b, a)
    assert cell(result, "prefill tok/s", "2048", "plain").drop
    assert cell(result, "prefill seconds", "2048", "plain").ratio > 1
    assert result.exit_code == 1


def exactness_receipt(failed: bool) -> Receipt:
    r = Receipt.new("exactness", ["dflash-bench", "exactness"], {})
    if failed:
        r.fail("drafted_equals_plain", "capital-france", "capital-france: differ at token 7")
    r.finish(True)
    return r


def suite_folder(tmp_path, name: str, decode: Receipt, exact: Receipt):
    folder = tmp_path / name
    decode.write(folder / "decode.json")
    exact.write(folder / "exactness.json")
    (folder / "prefill.prefill-arrays.json").parent.mkdir(exist_ok=True)
    (folder / "prefill.prefill-arrays.json").write_text('{"512": [1, 2]}')
    return folder


def test_an_exactness_failure_in_after_fails_the_comparison(tmp_path):
    reps = {"plain": [100.0, 100.5, 99.5]}
    b = suite_folder(tmp_path, "before", decode_receipt(reps), exactness_receipt(False))
    a = suite_folder(tmp_path, "after", decode_receipt(reps), exactness_receipt(True))
    result = compare(b, a)
    assert result.exit_code == 1 and "token 7" in result.failures[0]["message"]


def test_an_exactness_failure_in_before_does_not_fail_the_comparison(tmp_path):
    reps = {"plain": [100.0, 100.5, 99.5]}
    b = suite_folder(tmp_path, "before", decode_receipt(reps), exactness_receipt(True))
    a = suite_folder(tmp_path, "after", decode_receipt(reps), exactness_receipt(False))
    assert compare(b, a).exit_code == 0


def test_an_incomplete_receipt_exits_2(tmp_path):
    reps = {"plain": [100.0, 100.5, 99.5]}
    after = decode_receipt(reps)
    after.finish(False, "interrupted (Ctrl-C)")
    result = compare(write(tmp_path, "b.json", decode_receipt(reps)), write(tmp_path, "a.json", after))
    assert result.exit_code == 2 and "interrupted" in result.incomplete[0]


def test_cli_prints_the_table_and_exits_with_the_verdict(tmp_path):
    b = write(tmp_path, "b.json", decode_receipt({"plain": [100.0, 101.0, 99.0]}))
    a = write(tmp_path, "a.json", decode_receipt({"plain": [95.0, 96.0, 94.5]}))
    res = CliRunner().invoke(app, ["compare", str(b), str(a)], env={"COLUMNS": "200"})
    assert res.exit_code == 1 and "single-stream tok/s" in res.output and "FAILED" in res.output
    res = CliRunner().invoke(app, ["compare", str(b), str(a), "--json"])
    data = json.loads(res.stdout)
    assert res.exit_code == 1 and data["drops"] == ["single-stream tok/s code plain"]


def test_cli_refuses_a_file_that_is_not_a_receipt_in_one_line(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    res = CliRunner().invoke(app, ["compare", str(tmp_path / "x.json"), str(tmp_path / "x.json")])
    assert res.exit_code == 1 and res.output.strip().startswith("BadReceipt:")


def engine_speed_receipt(plain: list, drafted: list, mlx_lm: list, round_over_plain: float) -> Receipt:
    """An engine-speed receipt with the code probe at one stream: plain, drafted (its round over plain's) and
    mlx-lm's aggregate tok/s by rep."""
    r = Receipt.new("engine-speed", ["dflash-bench", "engine-speed"], {"levels": [1]})
    r.aggregates = {"code": {
        "plain": {"1": {"aggregate_tok_s": summary(plain), "stream_tok_s": summary(plain)}},
        "drafted": {"1": {"aggregate_tok_s": summary(drafted), "stream_tok_s": summary(drafted),
                          "round_over_plain": round_over_plain, "equals_plain": True}},
        "mlx-lm": {"1": {"aggregate_tok_s": summary(mlx_lm), "stream_tok_s": summary(mlx_lm)}}}}
    r.finish(True)
    return r


def test_engine_speed_cells_judge_our_modes_and_show_mlx_lm_and_the_round_ratio(tmp_path):
    """engine-speed pairs (a kernel change measured before and after on one GPU machine): each mode's aggregate
    tok/s judged by the rule, a drafted round over a plain one shown with its ratio, and mlx-lm's tok/s shown
    and never judged, even where it fell, since it measures the machine, not the change."""
    b = write(tmp_path, "b.json", engine_speed_receipt([120.0, 121.0, 119.0], [75.0, 76.0, 74.0], [110.0, 111.0, 109.0], 1.6))
    a = write(tmp_path, "a.json", engine_speed_receipt([120.5, 121.0, 119.5], [83.0, 84.0, 82.0], [90.0, 91.0, 89.0], 1.45))
    result = compare(b, a)
    assert cell(result, "engine aggregate tok/s", "code x1", "drafted").ratio == pytest.approx(83.0 / 75.0)
    assert cell(result, "round / plain round", "code x1", "drafted").ratio == pytest.approx(1.45 / 1.6)
    machine = cell(result, "mlx-lm tok/s, the machine (never judged)", "code x1", "mlx-lm")
    assert machine.ratio == pytest.approx(90.0 / 110.0) and not machine.drop
    assert [c.mode for c in result.cells if c.section == "engine aggregate tok/s"] == ["plain", "drafted"]
    assert result.exit_code == 0
    slower = write(tmp_path, "s.json", engine_speed_receipt([120.0, 121.0, 119.0], [65.0, 66.0, 64.0], [110.0, 111.0, 109.0], 1.8))
    result = compare(b, slower)
    assert result.exit_code == 1 and [c.mode for c in result.drops] == ["drafted"]


def test_cli_refuses_receipts_with_nothing_to_compare_in_one_line(tmp_path):
    """A pair with no speed kind in common (here exactness before, engine-speed after) is an error naming what
    each side holds, not an empty table that passes."""
    b = write(tmp_path, "b.json", exactness_receipt(True))
    a = write(tmp_path, "a.json", engine_speed_receipt([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], 1.0))
    res = CliRunner().invoke(app, ["compare", str(b), str(a)])
    line = res.output.strip()
    assert res.exit_code == 1 and "\n" not in line and "BEFORE holds exactness and AFTER engine-speed" in line


def runner_receipt(kind: str, shas: dict[str, str], failed_request: str | None = None) -> Receipt:
    """A runner receipt (exactness, concurrent) whose records are one plain and one drafted request a prompt with
    these token hashes (`plain:` / `drafted:` prefixes pick the request), the drafted one a repeated seed."""
    r = Receipt.new(kind, ["dflash-bench", kind], {})
    for prompt, sha in ((p, sha) for p, sha in shas.items() if ":" not in p):
        for draft in (False, True):
            name = f"{'drafted' if draft else 'plain'}:{prompt}"
            r.records.append({"prompt_id": prompt, "endpoint": "/v1/completions", "draft": draft, "temperature": 0.0,
                              "seed": 7, "max_tokens": 64, "labels": {"mode": "drafted" if draft else "plain"},
                              "status": "error" if name == failed_request else "ok",
                              "token_sha": shas.get(name, sha), "elapsed": 0.1 + draft})
    r.finish(True)
    return r


def test_requests_pair_by_what_they_asked_and_changed_tokens_show(tmp_path):
    """Each request both sides ran is the same tokens or changed (whatever it took: elapsed differs), a failed one is
    left out; changed tokens fail only with --same-tokens, and receipts without speed cells compare by them alone."""
    b = write(tmp_path, "b.json", runner_receipt("exactness", {"red-planet": "aaa", "sky": "bbb", "gone": "ccc"}))
    same = write(tmp_path, "s.json", runner_receipt("exactness", {"red-planet": "aaa", "sky": "bbb"}))
    result = compare(b, same, same_tokens=True)
    assert not result.cells and result.exit_code == 0 and not result.changed_tokens
    assert [(r.before, r.after) for r in result.tokens if "gone" in r.request] == [("ccc", None), ("ccc", None)]
    from dflash_bench.checks.tokens import summary_line

    assert summary_line(result.tokens) == "tokens: 4 of 4 requests the same, 0 changed, 2 run on one side only"
    moved = write(tmp_path, "m.json", runner_receipt("exactness", {"red-planet": "aaa", "sky": "bbb",
                                                                   "plain:sky": "ddd", "drafted:sky": "ddd"},
                                                     failed_request="plain:red-planet"))
    result = compare(b, moved)
    changed = [r.request for r in result.changed_tokens]
    assert changed == ["prompt_id=sky endpoint=/v1/completions draft=False temperature=0.0 seed=7 max_tokens=64 "
                       "mode=plain", "prompt_id=sky endpoint=/v1/completions draft=True temperature=0.0 seed=7 "
                       "max_tokens=64 mode=drafted"]
    assert [r.after for r in result.tokens if "red-planet" in r.request] == [None, "aaa"]  # the failed one left out
    assert result.exit_code == 0 and compare(b, moved, same_tokens=True).exit_code == 1
    res = CliRunner().invoke(app, ["compare", str(b), str(moved), "--same-tokens", "--json"])
    data = json.loads(res.stdout)
    assert res.exit_code == 1 and data["same_tokens"] and data["tokens_changed"] == [f"exactness {c}" for c in changed]
    res = CliRunner().invoke(app, ["compare", str(b), str(moved), "--markdown"])
    assert res.exit_code == 0 and "tokens: 1 of 3 requests the same, 2 changed, 3 run on one side only" in res.output
    assert "changed: exactness prompt_id=sky" in res.output and "bbb -> ddd" in res.output


def test_a_comparison_keeps_its_tokens_through_out_and_show(tmp_path):
    b = write(tmp_path, "b.json", runner_receipt("concurrent", {"p": "aaa"}))
    a = write(tmp_path, "a.json", runner_receipt("concurrent", {"p": "aaa", "drafted:p": "eee"}))
    res = CliRunner().invoke(app, ["compare", str(b), str(a), "--same-tokens", "--out", str(tmp_path / "c.json")],
                             env={"COLUMNS": "250"})
    assert res.exit_code == 1 and "requests whose tokens changed" in res.output and "aaa" in res.output
    shown = CliRunner().invoke(app, ["show", str(tmp_path / "c.json")], env={"COLUMNS": "250"})
    assert shown.exit_code == 0 and "tokens: 1 of 2 requests the same, 1 changed" in shown.output
    assert "eee" in shown.output
