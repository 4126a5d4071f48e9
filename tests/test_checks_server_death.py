"""A server that dies mid-run: every check's receipt is incomplete (exit 2), keeps the prompts and
cells it finished (and prints them), and names each one it never reached in not_run with the death.

The server is the fake in a process of its own (`fake_openai.py --die-after N`): it exits at once
when a completion request arrives after N replies, as a killed server would, so where each check
stops is known to the request."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_bench.checks.server import ManagedServer, ServeSettings
from dflash_bench.cli import app

FAKE = (sys.executable, str(Path(__file__).with_name("fake_openai.py")))


def run_until_death(command: str, die_after: int, tmp_path, *extra: str, **serve) -> tuple[int, str, dict]:
    """The check against a fake that dies after `die_after` replies; exit code, printed output, receipt."""
    out = tmp_path / f"{command}.json"
    with ManagedServer(ServeSettings(**serve), tmp_path / "fake.log", startup_timeout=30,
                       command=(*FAKE, "--die-after", str(die_after))) as server:
        res = CliRunner().invoke(app, [command, "--url", server.url, "--out", str(out), *extra],
                                 env={"COLUMNS": "250"})
        assert not server.alive(), "the fake should have died mid-run"
    return res.exit_code, res.output, json.loads(out.read_text())


def unreached(data: dict) -> list[str]:
    return [e["subject"] for e in data["not_run"] if "subject" in e]


def test_exactness_names_the_prompts_never_reached_and_keeps_the_compared_ones(tmp_path):
    # 7 replies: the capability probe, then three prompts drafted and plain; the fourth's request kills it
    code, output, data = run_until_death("exactness", 7, tmp_path, "--known-tokens", "8", "--probe-tokens", "8",
                                         "--long-tokens", "8")
    assert code == 2 and data["complete"] is False
    assert "stopped answering /health" in data["incomplete_reason"]
    rows = data["aggregates"]["prompts"]
    compared = [r["prompt_id"] for r in rows]
    assert compared == ["capital-france", "capital-japan", compared[2]] and all(r["equal"] for r in rows)
    assert data["aggregates"]["compared"] == data["aggregates"]["equal"] == 3
    missing = unreached(data)
    assert len(missing) == 11 and missing[-4:] == ["fibonacci-chat", "gpu-chat", "wrenmouth-1200", "wrenmouth-2500"]
    assert not set(missing) & set(compared)
    entry = data["not_run"][0]
    assert entry["check"] == "drafted_equals_plain" and "not reached" in entry["reason"]
    assert "stopped answering /health" in entry["reason"]
    for prompt_id in compared:  # the printed table shows the compared rows
        assert prompt_id in output
    assert "INCOMPLETE" in output and f"not run: drafted_equals_plain: {missing[0]}: not reached" in output


@pytest.mark.parametrize("command, die_after, extra, serve, done, missing", [
    # probe, solo x2, serial plain x2, x1 (6 replies); x2 never answered
    ("concurrent", 6, ("--levels", "1,2", "--reps", "1", "--temperatures", "0", "--tokens", "8"), {},
     {"cells": [(0.0, 1)], "serial": [0.0]}, ["T=0.0 x2"]),
    # probe, fresh (2 replies)
    ("resume", 2, ("--tokens", "8"), {"context": 32768}, {"steps": ["fresh"]}, ["resumed", "plain"]),
    # probe, code x1 drafted + plain, code x2 drafted + plain (7 replies)
    ("decode", 7, ("--levels", "1,2", "--reps", "1", "--tokens", "8"), {}, {}, ["chat x1", "chat x2"]),
    # probe, warm-up, size 64 drafted + plain (4 replies)
    ("prefill", 4, ("--sizes", "64,300", "--rounds", "1"), {"prompt_cache_gib": 0}, {"sizes": ["64", "300"]},
     ["size 300"]),
    # probe, two references, the mid-reply drop, two probes after it (6)
    ("cancel", 6, ("--probe-tokens", "8", "--prefill-tokens", "500"), {},
     {"steps": ["reference", "drop mid-reply"]}, ["drop mid-prefill", "drop beside a probe", "past the window"]),
])
def test_every_check_keeps_what_it_finished_and_names_the_rest(tmp_path, command, die_after, extra, serve, done,
                                                                missing):
    code, output, data = run_until_death(command, die_after, tmp_path, *extra, **serve)
    assert code == 2 and data["complete"] is False, data["verdict"]
    assert unreached(data) == missing
    assert all("stopped answering /health" in e["reason"] for e in data["not_run"])
    agg = data["aggregates"]
    if "cells" in done:
        assert [(c["temperature"], c["level"]) for c in agg["cells"] if c["aggregate_tps"]["n"]] == done["cells"]
        assert [c["temperature"] for c in agg["serial"]] == done["serial"] and agg["cells"][0]["equal"] == 1
    if "steps" in done:
        assert [s["step"] for s in agg["steps"]] == done["steps"]
    if command == "decode":
        assert agg["single_tps"]["code"]["drafted"]["n"] == 1 and agg["single_tps"]["chat"]["drafted"]["n"] == 0
        assert "single stream code" in output
    if command == "prefill":
        assert agg["sizes"]["64"]["drafted"]["tps"]["n"] == 1 and agg["sizes"]["300"]["drafted"]["tps"]["n"] == 0
