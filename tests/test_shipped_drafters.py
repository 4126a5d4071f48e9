"""The drafters shipped for the default model, by the names `--drafter` takes: `dflash` (v1, the
default) and `dflash2`. Each passes the pre-load checks against the default model, is what its
training recipe describes, fits the 16 MB budget, and is what `serve`, `plan` and `inspect` resolve
the name to; a name the target does not ship is refused in one line, and a folder of that name wins.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_bench.cli import app
from dflash_bench.engine.checkpoint import read_target_config
from dflash_bench.engine.defaults import UnknownDrafterName, chosen_drafter, default_drafter_for, shipped_drafters
from dflash_bench.engine.draft_config import read_draft_config
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.preload import check_pair
from dflash_bench.engine.request import Request

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from train_drafter.model import drafter_config  # noqa: E402
from train_drafter.recipe import SMOLLM2, SMOLLM2_DFLASH2  # noqa: E402

runner = CliRunner()


def test_the_default_model_ships_dflash_and_dflash2() -> None:
    shipped = shipped_drafters("default")
    assert set(shipped) == {"dflash", "dflash2"} and default_drafter_for("default") == shipped["dflash"]
    target = read_target_config("default")
    for name, recipe, kind in (("dflash", SMOLLM2, "DFlash"), ("dflash2", SMOLLM2_DFLASH2, "DFlash2")):
        draft = read_draft_config(shipped[name])
        check_pair(target, draft)
        assert draft.kind == kind
        assert json.loads((shipped[name] / "config.json").read_text()) == drafter_config(recipe.shape, target)
        assert sum(f.stat().st_size for f in shipped[name].iterdir()) <= 16_000_000
    assert shipped_drafters("/some/other/model") == {}


def test_names_resolve_to_the_shipped_folders_unless_a_folder_of_that_name_exists(tmp_path, monkeypatch) -> None:
    shipped = shipped_drafters("default")
    assert chosen_drafter("default", "dflash2") == str(shipped["dflash2"])
    assert chosen_drafter("default", "dflash") == str(shipped["dflash"])
    assert chosen_drafter("default", None) == str(shipped["dflash"])
    assert chosen_drafter("default", "dflash2", no_drafter=True) is None
    with pytest.raises(UnknownDrafterName, match="ships no such drafter"):
        chosen_drafter("/some/other/model", "dflash2")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dflash2").mkdir()
    assert chosen_drafter("default", "dflash2") == "dflash2"


def test_cli_names_both_and_refuses_a_name_the_target_lacks(tmp_path) -> None:
    listed = json.loads(runner.invoke(app, ["inspect", "default", "--json"]).output)["shipped_drafters"]
    assert {n: (d["kind"], d["default"]) for n, d in listed.items()} == {"dflash": ("DFlash", True),
                                                                          "dflash2": ("DFlash2", False)}
    picked = json.loads(runner.invoke(app, ["inspect", "default", "--drafter", "dflash2", "--json"]).output)
    assert picked["drafter"]["kind"] == "DFlash2" and picked["drafter"]["selector"] == "rank 8, top-k 16"
    plan = runner.invoke(app, ["plan", "default", "--drafter", "dflash2", "--json"])
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.output) != json.loads(runner.invoke(app, ["plan", "default", "--json"]).output)
    other = tmp_path / "model"
    other.mkdir()
    refused = runner.invoke(app, ["serve", str(other), "--drafter", "dflash2"])
    assert refused.exit_code == 1
    assert refused.output.strip().splitlines()[-1].startswith("UnknownDrafterName: --drafter dflash2:")


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_shipped_dflash2_drafts_and_equals_plain(temperature) -> None:
    """The trained DFlash2 keeps more than one token a round on a code prompt and its reply equals plain."""
    engine = Engine("default", str(shipped_drafters("default")["dflash2"]), Settings(parallel=1, context=1024))
    assert engine.drafter_kind == "DFlash2"
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a Python function that sorts a list."}]))
    req = dict(prompt=ids, max_tokens=48, temperature=temperature, seed=4, ignore_eos=True)
    drafted, plain = engine.generate(Request(**req)), engine.generate(Request(**req, draft=False))
    assert drafted.tokens == plain.tokens
    assert drafted.stats.tokens_per_round > 1.5
