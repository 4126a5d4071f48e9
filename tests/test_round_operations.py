"""What a drafted round builds a stream: its positions at a device length come from kept host arrays (row_ids.py),
so no `arange` but the tiled attention's key masks (which a GPU's attention kernel does not build), and the next
round's windows' ids are joined once for every stream (lanes.py's look_ahead_windows) and looked up as joined; the same
tokens."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
from test_planner import tiny_drafter_for
from tiny_targets import tiny_target

import mlx.core as mx

from dflash_bench.engine.drafters.dflash import DFlashDrafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.engine.row_ids import row_ids
from dflash_bench.engine.targets.base import Segment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from forward_ops import census  # noqa: E402  (tools/: the operation census the GPU figures were counted with)


def test_row_ids_are_aranges_values_kept_and_no_operation() -> None:
    at = mx.array(7, dtype=mx.int32)
    assert row_ids(5) is row_ids(5) and row_ids(5) is not row_ids(5, 1)
    assert row_ids(5).dtype == mx.int32 and mx.array_equal(row_ids(5), mx.arange(5, dtype=mx.int32)).item()
    assert row_ids(4, 1).tolist() == [1, 2, 3, 4] and row_ids(3, zeros=2).tolist() == [0, 1, 2, 0, 0]
    assert "Arange" not in census([row_ids(6) + at]) and census([mx.arange(6, dtype=mx.int32) + at])["Arange"] == 1


def round_graphs(engine: Engine, rounds: int, monkeypatch: pytest.MonkeyPatch) -> tuple[collections.Counter, list[str],
                                                                                      list[str]]:
    """The primitives of every graph `rounds` rounds hand to MLX's eval and async_eval, summed, and the functions
    that called `mx.arange` and `mx.concatenate` meanwhile."""
    seen: collections.Counter = collections.Counter()
    callers: list[str] = []
    joins: list[str] = []
    for name in ("eval", "async_eval"):
        real = getattr(mx, name)

        def evaluate(*args: object, real=real) -> object:
            flat = [a for group in args for a in (group if isinstance(group, list) else [group])
                    if isinstance(a, mx.array)]
            seen.update(census(flat) if flat else {})
            return real(*args)

        monkeypatch.setattr(mx, name, evaluate)
    arange = mx.arange

    def recorded(*args: object, **kwargs: object) -> mx.array:
        callers.append(sys._getframe(1).f_code.co_name)
        return arange(*args, **kwargs)

    concatenate = mx.concatenate

    def joined(*args: object, **kwargs: object) -> mx.array:
        joins.append(sys._getframe(1).f_code.co_name)
        return concatenate(*args, **kwargs)

    monkeypatch.setattr(mx, "arange", recorded)
    monkeypatch.setattr(mx, "concatenate", joined)
    for _ in range(rounds):
        engine.step()
    monkeypatch.undo()
    return seen, callers, joins


@pytest.mark.parametrize("streams", (1, 2))
def test_a_drafted_round_builds_no_arange_but_the_tiled_key_masks_and_joins_the_next_ids_once(
        streams: int, monkeypatch: pytest.MonkeyPatch) -> None:
    target, _ = tiny_target("llama", "small", layers=2, seed=5)
    weights, d = tiny_drafter_for(target.config)
    engine = Engine(model=target, draft_model=DFlashDrafter(d, weights, target), eos_ids=(),
                    settings=Settings(parallel=2, context=256, warm=False))
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]][:streams]
    alone = [engine.generate(Request(p, max_tokens=24, ignore_eos=True, draft=False)).tokens for p in prompts]
    handles = [engine.submit(Request(p, max_tokens=24, ignore_eos=True, draft=True)) for p in prompts]
    for _ in range(3):  # the prompts, then rounds placed at device lengths (queued ahead)
        engine.step()
    graphs, callers, joins = round_graphs(engine, 4, monkeypatch)
    # windows written at device lengths, the rounds this is about (a layer's rows of a state's one array:
    # stacked_cache.py's scatter on three axes)
    assert graphs["Scatter"] > 0
    assert set(callers) <= {"key_mask"}  # (none where the GPU's attention kernel runs: it builds no masks)
    assert joins.count("look_ahead_windows") == 4  # one a round, whatever the streams
    assert "embed_segments" not in joins  # the forward looks that join up as it is
    while engine.lanes.busy:
        engine.step()
    assert [h.result().tokens for h in handles] == alone


def test_joined_ids_of_another_length_are_refused_by_name() -> None:
    target, _ = tiny_target("llama", "small", layers=2, seed=5)
    state = target.new_state()
    with pytest.raises(ValueError, match=r"joined ids have shape \(2,\), expected \(3,\)"):
        target.forward([Segment([1, 2, 3], 0, state, [2])], ids=mx.array([1, 2], dtype=mx.int32))
