"""concurrent, resume, cancel, decode, prefill, suite and show against the fake server: each passes
when the server keeps the contract, fails (or is not run) when it does not, and writes its receipt."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from dflash_bench.checks.prefill import side_file
from dflash_bench.cli import app
from fake_openai import FakeServer


def run(command: str, url: str, tmp_path, *extra: str):
    out = tmp_path / f"{command}.json"
    res = CliRunner().invoke(app, [command, "--url", url, "--out", str(out), *extra], env={"COLUMNS": "200"})
    return res, json.loads(out.read_text())


def test_concurrent_equals_solo_and_serial_pass(tmp_path):
    with FakeServer() as fake:
        res, data = run("concurrent", fake.url, tmp_path, "--tokens", "8", "--reps", "2")
    assert res.exit_code == 0, res.output
    cells = data["aggregates"]["cells"]
    assert [(c["temperature"], c["level"], c["equal"], c["failed"]) for c in cells] == [
        (0.0, 1, 2, 0), (0.0, 4, 8, 0), (0.7, 1, 2, 0), (0.7, 4, 8, 0)]
    assert [(c["equal"], c["failed"]) for c in data["aggregates"]["serial"]] == [(4, 0), (4, 0)]
    assert all(c["aggregate_tps"]["n"] == 2 for c in cells)


def test_concurrent_fails_when_sampled_replies_ignore_the_seed(tmp_path):
    with FakeServer(ignore_seed=True) as fake:
        res, data = run("concurrent", fake.url, tmp_path, "--tokens", "8", "--reps", "1", "--levels", "2")
    assert res.exit_code == 1
    failed = {f["subject"] for f in data["verdict"]["failures"]}
    assert "T=0.7 x2 rep 0 stream 0" in failed and not any(s.startswith("T=0.0") for s in failed)


def test_concurrent_on_a_text_only_server_compares_its_retokenized_text(tmp_path):
    """No ids and no `draft`: the replies' text, re-tokenized by the server's /tokenize, is compared
    (marked text-level); drafted == plain stays not run."""
    with FakeServer(mlx_lm_like=True) as fake:
        res, data = run("concurrent", fake.url, tmp_path, "--tokens", "8", "--reps", "1", "--levels", "1")
    assert res.exit_code == 2
    assert {n["check"] for n in data["not_run"]} == {"solo_drafted_equals_plain"}
    assert all(c["equal"] == 1 for c in data["aggregates"]["cells"])
    assert {r["evidence"] for r in data["records"]} == {"text"}


def test_resumed_equals_fresh_and_plain(tmp_path):
    with FakeServer(context=32768) as fake:
        res, data = run("resume", fake.url, tmp_path, "--tokens", "8")
    assert res.exit_code == 0, res.output
    steps = {s["step"]: s for s in data["aggregates"]["steps"]}
    assert steps["fresh"]["cached_tokens"] == 0 and steps["resumed"]["cached_tokens"] > 0
    assert steps["fresh"]["token_sha"] == steps["resumed"]["token_sha"] == steps["plain"]["token_sha"]


def test_resume_with_the_cache_off_is_not_run_not_passed(tmp_path):
    with FakeServer(context=32768, cache=False) as fake:
        res, data = run("resume", fake.url, tmp_path, "--tokens", "8")
    assert res.exit_code == 2 and "did not resume" in data["not_run"][0]["reason"]


def test_resume_when_the_prompt_was_already_cached_is_unverified(tmp_path):
    with FakeServer(context=32768) as fake:
        run("resume", fake.url, tmp_path, "--tokens", "8")
        res, data = run("resume", fake.url, tmp_path, "--tokens", "8")
    assert res.exit_code == 2 and "already resumed" in data["verdict"]["unverified"][0]["message"]


def test_cancel_leaves_probes_and_memory_unchanged(tmp_path):
    with FakeServer(context=8192, prefill_seconds_per_token=0.0002) as fake:
        res, data = run("cancel", fake.url, tmp_path, "--probe-tokens", "8", "--prefill-tokens", "3000",
                        "--drop-after-seconds", "0.1")
        dropped = fake.fake.dropped
    assert res.exit_code == 0, res.output
    steps = [s["step"] for s in data["aggregates"]["steps"]]
    assert steps == ["reference", "drop mid-reply", "drop mid-prefill", "drop beside a probe", "past the window"]
    assert dropped == 3
    refused = next(r for r in data["records"] if r["labels"].get("step") == "past the window")
    assert refused["http_status"] == 400 and "context_length_exceeded" in refused["error"]
    prefill_drop = next(r for r in data["records"] if r["labels"].get("step") == "drop mid-prefill")
    assert prefill_drop["status"] == "dropped" and prefill_drop["ttft"] is None


def test_cancel_fails_when_a_drop_leaks_memory(tmp_path):
    with FakeServer(context=8192, leak_per_drop=5e6) as fake:
        res, data = run("cancel", fake.url, tmp_path, "--probe-tokens", "8", "--prefill-tokens", "1000",
                        "--drop-after-seconds", "0.05")
    assert res.exit_code == 1
    assert {f["check"] for f in data["verdict"]["failures"]} == {"memory_returns_to_baseline"}
    assert data["verdict"]["failures"][0]["subject"] == "drop mid-reply"


def test_cancel_fails_when_a_request_past_the_window_is_served(tmp_path):
    with FakeServer(context=8192, refuse_past_window=False) as fake:
        res, data = run("cancel", fake.url, tmp_path, "--probe-tokens", "8", "--prefill-tokens", "500")
    assert res.exit_code == 1 and data["verdict"]["failures"][0]["check"] == "past_window_refused"


def test_decode_reports_drafted_and_plain_side_by_side(tmp_path):
    with FakeServer() as fake:
        res, data = run("decode", fake.url, tmp_path, "--tokens", "12", "--reps", "2", "--levels", "1,2")
    assert res.exit_code == 0, res.output
    agg = data["aggregates"]
    assert agg["modes"] == ["drafted", "plain"]
    assert agg["single_tps"]["code"]["drafted"]["n"] == 2 and agg["single_tps"]["chat"]["plain"]["median"] > 0
    assert set(agg["aggregate_tps"]["code"]) == {"1", "2"}
    assert agg["tokens_per_round"]["chat"]["2"] == {"drafted": 3.0, "plain": 1.0}
    assert data["server"]["peak_memory_bytes"] == 2_000_000
    assert "single stream code" in res.output


def test_decode_fails_when_drafted_differs_from_plain(tmp_path):
    with FakeServer(diverge_at=3) as fake:
        res, data = run("decode", fake.url, tmp_path, "--tokens", "8", "--reps", "1", "--levels", "1")
    assert res.exit_code == 1
    assert {f["subject"] for f in data["verdict"]["failures"]} == {"fibonacci-chat", "gpu-chat"}


def test_prefill_uses_exact_arrays_with_no_cached_tokens(tmp_path):
    with FakeServer(cache=False) as fake:
        res, data = run("prefill", fake.url, tmp_path, "--sizes", "64,300", "--rounds", "2")
    assert res.exit_code == 0, res.output
    arrays = json.loads(side_file(tmp_path / "prefill.json").read_text())
    assert {k: len(v) for k, v in arrays.items()} == {"64": 64, "300": 300}
    assert arrays["300"][:64] == arrays["64"]
    assert bytes(arrays["64"]).decode().startswith("A lighthouse keeper writes in the log")
    assert data["aggregates"]["arrays"]["300"]["tokens"] == 300 and data["side_files"]["prefill_arrays"]
    measured = [r for r in data["records"] if r["labels"].get("phase") == "measure"]
    assert len(measured) == 2 * 2 * 2 and all(r["max_tokens"] == 1 and r["cached_tokens"] == 0 for r in measured)
    assert data["aggregates"]["sizes"]["300"]["drafted"]["tps"]["n"] == 2


def test_prefill_fails_when_the_prompt_cache_serves_the_array(tmp_path):
    with FakeServer(cache=True) as fake:
        res, data = run("prefill", fake.url, tmp_path, "--sizes", "64", "--rounds", "1")
    assert res.exit_code == 1 and "cached_tokens" in data["verdict"]["failures"][0]["message"]


def test_suite_writes_a_folder_and_show_reprints_it(tmp_path):
    folder = tmp_path / "suite"
    with FakeServer(context=32768, cache=False) as fake:
        res = CliRunner().invoke(app, ["suite", "--url", fake.url, "--out", str(folder), "--tokens", "8", "--reps", "1",
                                       "--sizes", "64", "--rounds", "1", "--levels", "1,2"], env={"COLUMNS": "200"})
    names = sorted(p.name for p in folder.glob("*.json"))
    assert names == ["cancel.json", "concurrent.json", "decode.json", "exactness.json", "prefill.json",
                     "prefill.prefill-arrays.json", "resume.json", "suite.json"]
    index = json.loads((folder / "suite.json").read_text())
    results = {c["kind"]: c["exit_code"] for c in index["aggregates"]["checks"]}
    assert results["resume"] == 2  # the cache is off: not run, never passed
    assert res.exit_code == 2 and index["complete"] and not index["verdict"]["passed"]
    shown = CliRunner().invoke(app, ["show", str(folder / "decode.json")], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "single stream code" in shown.output
    shown = CliRunner().invoke(app, ["show", str(folder), "--json"])
    assert shown.exit_code == 0 and shown.stdout.count('"schema_version"') == 7


@pytest.mark.parametrize("sig, reason", [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_ctrl_c_or_sigterm_mid_run_writes_an_incomplete_receipt_and_exits_130(tmp_path, sig, reason):
    out = tmp_path / "decode.json"
    with FakeServer(chunk_delay=0.02) as fake:
        proc = subprocess.Popen([sys.executable, "-m", "dflash_bench", "decode", "--url", fake.url, "--out", str(out),
                                 "--tokens", "90", "--levels", "1,2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                # a shell's background job (CI under nohup, `cmd &`) inherits SIGINT ignored,
                                # and then Ctrl-C never reaches Python; a terminal's Ctrl-C finds the default
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 60
        while fake.fake.completed < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        signalled_after = fake.fake.completed  # replies finished when the signal went
        assert proc.poll() is None, f"the run ended before the signal ({signalled_after} replies counted)"
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
        finished = fake.fake.completed
    assert proc.returncode == 130, (proc.returncode, signalled_after, finished, stderr.decode()[-1500:])
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["incomplete_reason"] == f"interrupted ({reason})"
    assert data["records"] and not data["verdict"]["passed"]
