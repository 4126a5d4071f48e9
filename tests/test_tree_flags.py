"""`--tree-nodes` travels from `serve` and every check to the bundled server and its receipt, and a bad
value is refused in one line naming the option, before anything loads."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from dflash_bench.cli import app
from dflash_bench.cli import checks as checks_cli
from dflash_bench.checks.server import ServeSettings
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.fixtures.small import write_fixture


def test_the_bundled_servers_command_line_carries_tree_nodes() -> None:
    argv = ServeSettings(tree_nodes=16, verify_budget="auto").argv("127.0.0.1", 8123)
    assert argv[argv.index("--tree-nodes") + 1] == "16" and argv[argv.index("--verify-budget") + 1] == "auto"
    assert "--tree-nodes" not in ServeSettings().argv("127.0.0.1", 8123)  # unset: the server's default (chains)


@pytest.mark.parametrize("command", ["exactness", "concurrent", "decode", "resume", "cancel", "prefill", "stress"])
def test_every_check_passes_tree_nodes_to_the_bundled_server(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[ServeSettings] = []

    def captured(kind, out, url, serve, *args, **kwargs):
        seen.append(serve)
        raise typer.Exit(0)

    monkeypatch.setattr(checks_cli, "execute", captured)
    result = CliRunner().invoke(app, [command, "--tree-nodes", "24", "--verify-budget", "auto"])
    assert result.exit_code == 0, result.output
    assert seen and seen[0].tree_nodes == 24 and seen[0].verify_budget == "auto"


@pytest.mark.parametrize("command", ["serve", "exactness", "decode"])
@pytest.mark.parametrize("value", ["-1", "many"])
def test_a_bad_tree_nodes_value_is_refused_naming_the_option(command: str, value: str) -> None:
    result = CliRunner().invoke(app, [command, "--tree-nodes", value])
    assert result.exit_code == 2
    assert "--tree-nodes" in result.output


def test_the_engine_refuses_negative_tree_nodes_and_names_trees_in_its_startup_line(tmp_path) -> None:
    target = write_fixture("llama", tmp_path / "t", seed=1)
    drafter = write_fixture("dflash", tmp_path / "d", seed=2, target="llama")
    with pytest.raises(ValueError, match="tree nodes -2"):
        Engine(target, drafter, Settings(context=256, tree_nodes=-2))
    engine = Engine(target, drafter, Settings(context=256, tree_nodes=16))
    assert engine.lanes.tree_nodes == 16 and "draft trees of 16 nodes" in engine.startup_line()
    assert "draft trees" not in Engine(target, drafter, Settings(context=256)).startup_line()
