"""The exactness check catches a broken engine: an off-by-one in keep, served over HTTP.

The bundled server runs in-process (the real app under uvicorn, a real Engine on the llama fixture
and a DFlash drafter made for it). Breaking `Lanes.after_window` so that a window whose drafts are
not all accepted keeps one row too many (the first rejected draft's K/V stays in the cache and every
later position shifts by one) corrupts only the drafted path: the fixture drafter's guesses are
never right, but it proposes in every round, so every drafted reply goes wrong within a few tokens
while `"draft": false` replies (one-row windows, nothing rejected) stay right. `dflash-bench
exactness --url` must then fail, naming each prompt and its first differing token; unbroken, it passes.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from conftest import write_short_prompts
from dflash_bench.checks import prompts
from dflash_bench.cli import app
from dflash_bench.engine import lanes
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.server import warm_up
from dflash_bench.fixtures.small import write_fixture
from test_server_api import LiveServer

pytestmark = pytest.mark.slow

CHECK = "drafted_equals_plain"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken-engine")
    target, drafter = write_fixture("llama", root / "target"), write_fixture("dflash", root / "drafter")
    engine = Engine(target, drafter, Settings(parallel=1, context=2048, prompt_cache_gib=0.0))
    warm_up(engine)
    engine.start()
    with LiveServer(engine) as s:
        s.checkpoints = (target, drafter)
        yield s


@pytest.fixture(scope="module")
def few_prompts(tmp_path_factory):
    """Two known-answer prompts, the code and chat probes, and a two-paragraph long prompt (past the
    drafter's 32-token window and 512 fixture tokens)."""
    return write_short_prompts(tmp_path_factory.mktemp("prompts"))


def exactness(url: str, out, folder, monkeypatch) -> tuple[int, dict]:
    monkeypatch.setattr(prompts, "PROMPTS_DIR", folder)
    res = CliRunner().invoke(app, ["exactness", "--url", url, "--out", str(out), "--known-tokens", "12",
                                   "--probe-tokens", "24", "--long-tokens", "12"], env={"COLUMNS": "200"})
    data = json.loads(out.read_text())
    assert data["complete"], data["incomplete_reason"]
    return res.exit_code, data


@pytest.fixture(scope="module")
def unbroken(server, few_prompts, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        return exactness(server.url, tmp_path_factory.mktemp("unbroken") / "exactness.json", few_prompts, mp)


def keep_one_row_too_many(monkeypatch) -> None:
    """lanes.py, broken: when a window's drafts are not all accepted (kept length short of the window's
    end), keep one more row than the accepted ones plus the pending token (a device value, as the
    engine's own keep: cache.py's keep_windows, which a round runs for its windows after `keep_verdict`)."""
    ends: dict[int, mx.array] = {}
    keep_verdict, keep_windows = lanes.Lanes.keep_verdict, lanes.keep_windows

    def noting(self, s, seg, out, verified):
        ends[id(s.segment_state)] = seg.origin + len(seg.tokens)
        return keep_verdict(self, s, seg, out, verified)

    def off_by_one(kept: list) -> None:
        keep_windows([(state, (mx.where(k < ends[id(state)], k + 1, k), bound, low)) for state, (k, bound, low) in kept])

    monkeypatch.setattr(lanes.Lanes, "keep_verdict", noting)
    monkeypatch.setattr(lanes, "keep_windows", off_by_one)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def test_exactness_passes_on_the_unbroken_engine(unbroken):
    code, data = unbroken
    assert code == 0, data["verdict"]
    rows = data["aggregates"]["prompts"]
    assert len(rows) == 5 and all(r["equal"] is True for r in rows)
    assert all(r["drafted"] > 0 for r in data["records"] if r["draft"] is True and r["labels"].get("kind"))


def test_the_receipt_names_the_served_weights_by_their_sha256(server, unbroken):
    """/health gives both hashes (over the safetensors files' bytes) and the receipt's server block copies them."""
    target, drafter = server.checkpoints
    expected = {"target_sha256": hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest(),
                "drafter_sha256": hashlib.sha256((drafter / "model.safetensors").read_bytes()).hexdigest()}
    assert expected["target_sha256"] != expected["drafter_sha256"]
    block = unbroken[1]["server"]
    assert {k: block[k] for k in expected} == expected
    assert {k: block["health"][k] for k in expected} == expected


def test_exactness_fails_on_an_off_by_one_keep_naming_prompt_and_first_differing_token(
        server, few_prompts, unbroken, tmp_path, monkeypatch):
    keep_one_row_too_many(monkeypatch)
    code, data = exactness(server.url, tmp_path / "exactness.json", few_prompts, monkeypatch)
    assert code == 1 and data["verdict"]["passed"] is False

    failures = {f["subject"]: f["message"] for f in data["verdict"]["failures"] if f["check"] == CHECK}
    rows = {r["prompt_id"]: r for r in data["aggregates"]["prompts"]}
    replies = {(r["prompt_id"], r["labels"]["mode"]): r["token_ids"] for r in data["records"] if r["labels"].get("kind")}
    assert set(failures) == set(rows)  # every prompt drafted, so every prompt went wrong
    for prompt_id, message in failures.items():
        index = first_difference(replies[prompt_id, "drafted"], replies[prompt_id, "plain"])
        assert index is not None and rows[prompt_id]["first_diff"] == index and rows[prompt_id]["equal"] is False
        assert message.startswith(f"{prompt_id}: ") and f"first differing token at index {index} " in message

    # the breakage is in the draft path only: the plain replies are what the unbroken engine gave
    reference = {r["prompt_id"]: r["plain_sha"] for r in unbroken[1]["aggregates"]["prompts"]}
    assert {p: r["plain_sha"] for p, r in rows.items()} == reference
