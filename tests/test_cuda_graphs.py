"""MLX's CUDA graph limits: the engine sets them on a CUDA device before its first GPU work, leaves a value the
environment names alone, and says in its startup line (which receipts keep) what it serves with (backend.py)."""

from __future__ import annotations

import os

import pytest
from tiny_targets import tiny_target

from dflash_bench.engine import backend as backends
from dflash_bench.engine import engine as engine_module
from dflash_bench.engine.engine import Engine, Settings

OPS, MB = backends.CUDA_GRAPH_LIMITS


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither limit in os.environ, and both put back as they were after the test (whatever the engine set)."""
    for name in backends.CUDA_GRAPH_LIMITS:
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    return monkeypatch


def test_on_cuda_the_limits_fill_what_the_environment_does_not_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "on_cuda", lambda: True)
    environ = {OPS: "100", "PATH": "/bin"}
    assert backends.size_cuda_graphs(environ) == {OPS: "100", MB: backends.CUDA_GRAPH_LIMITS[MB]}
    assert environ == {OPS: "100", MB: backends.CUDA_GRAPH_LIMITS[MB], "PATH": "/bin"}
    monkeypatch.setattr(backends, "on_cuda", lambda: False)
    untouched = {"PATH": "/bin"}
    assert backends.size_cuda_graphs(untouched) == {} and untouched == {"PATH": "/bin"}


def test_the_engine_sets_them_before_it_loads_a_target(unset: pytest.MonkeyPatch) -> None:
    unset.setattr(backends, "on_cuda", lambda: True)
    seen: dict[str, str | None] = {}

    def load_target(*args: object, **kwargs: object) -> None:
        seen.update({name: os.environ.get(name) for name in backends.CUDA_GRAPH_LIMITS})
        raise RuntimeError("stop before loading")

    unset.setattr(engine_module, "preload", lambda target, drafter: None)
    unset.setattr(engine_module, "load_target", load_target)
    with pytest.raises(RuntimeError, match="stop before loading"):
        Engine("default", settings=Settings(warm=False))
    assert seen == backends.CUDA_GRAPH_LIMITS


def test_the_startup_line_names_the_limits_on_cuda_and_only_there(unset: pytest.MonkeyPatch) -> None:
    target, _ = tiny_target("llama", "small", layers=2, seed=3)
    unset.setattr(backends, "on_cuda", lambda: False)  # (this test runs on a CUDA machine too)
    plain = Engine(model=target, eos_ids=(), settings=Settings(context=64, warm=False))
    assert plain.graph_limits == {} and "MLX CUDA graphs" not in plain.startup_line()
    assert OPS not in os.environ
    unset.setattr(backends, "on_cuda", lambda: True)
    unset.setenv(OPS, "100")  # an A/B at MLX's own operation limit
    engine = Engine(model=target, eos_ids=(), settings=Settings(context=64, warm=False))
    mb = backends.CUDA_GRAPH_LIMITS[MB]
    assert f"MLX CUDA graphs of up to 100 operations and {mb} MB" in engine.startup_line()
