"""Chain windows verified together equal each verified alone (verify.py), in one launch a step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import mlx.core as mx

from dflash_bench.engine.sampling import SamplingParams
from dflash_bench.engine.targets.base import Segment, SegmentOut
from dflash_bench.engine.verify import Window, alone, verify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from forward_ops import census  # noqa: E402  (tools/: the operation census the GPU figures were counted with)

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.7, seed=3)
VOCAB = 50


def forward_windows(widths: list[int], params: list[SamplingParams], accept: list[int], device: list[bool],
                    gaps: list[int] | None = None) -> list[Window]:
    """Windows over one forward's logits (rows of random logits, `gaps[i]` other rows before window i), each
    with drafts that equal its greedy choices for the first `accept[i]` rows and differ after."""
    gaps = gaps or [0] * len(widths)
    firsts, cursor = [], 0
    for width, gap in zip(widths, gaps):
        firsts.append(cursor + gap)
        cursor += gap + width
    logits = mx.random.normal((cursor, VOCAB), key=mx.random.key(len(widths) + sum(accept)))
    picks = mx.argmax(logits, axis=-1).tolist()
    windows = []
    for i, (width, first) in enumerate(zip(widths, firsts)):
        choices = picks[first : first + width]
        drafts = tuple(choices[d] if d < accept[i] else (choices[d] + 1) % VOCAB for d in range(width - 1))
        seg = Segment([0] * width, 40 + 7 * i, None, list(range(width)))
        out = SegmentOut(logits[first : first + width], None, joint=logits, first=first)
        windows.append(Window(params[i], seg, out, mx.array(drafts, dtype=mx.int32) if device[i] else drafts))
    return windows


def same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.values.tolist() == w.values.tolist() and g.values.dtype == w.values.dtype == mx.int32
        assert g.kept.item() == w.kept.item() and g.kept.shape == w.kept.shape == ()
        assert g.values[0].item() == g.kept.item() and g.anchor.item() == g.values[g.kept.item()].item()
        assert g.anchor.item() == w.anchor.item() and g.anchor.shape == w.anchor.shape == ()


@pytest.mark.parametrize("device", ([True] * 4, [False] * 4, [True, False, False, True]))
def test_greedy_windows_of_one_width_are_verified_together_as_alone(device: list[bool]) -> None:
    windows = forward_windows([5] * 4, [GREEDY] * 4, [0, 2, 4, 3], device)
    got, each = verify(windows), [alone(w) for w in windows]
    ops = census([a for g in got for a in (g.values, g.kept, g.anchor)])  # before anything is evaluated
    assert ops["ArgReduce"] == 1 and ops["Min"] == 1 and ops["Gather"] == 0  # a window's row: a view
    assert census([a for g in each for a in (g.values, g.kept, g.anchor)])["ArgReduce"] == 4
    same(got, each)
    assert [g.kept.item() for g in got] == [1, 3, 5, 4]  # the pending token and the drafts accepted


def test_a_sampled_window_a_width_or_a_gap_ends_a_run_and_each_part_equals_alone() -> None:
    widths, accept = [4, 4, 4, 3, 3, 3, 3], [3, 1, 0, 2, 1, 0, 2]
    params = [GREEDY, GREEDY, SAMPLED, GREEDY, GREEDY, GREEDY, GREEDY]
    windows = forward_windows(widths, params, accept, [True] * 7, gaps=[0, 0, 0, 0, 0, 1, 0])
    got = verify(windows)
    # runs: [0, 1] together, 2 alone (sampled), [3, 4] (a width change), [5, 6] (a gap before 5)
    assert census([a for g in got for a in (g.values, g.kept, g.anchor)])["ArgReduce"] == 4
    same(got, [alone(w) for w in windows])


def test_a_window_without_drafts_is_verified_alone() -> None:
    windows = forward_windows([1, 1], [GREEDY, GREEDY], [0, 0], [False, False])
    got = verify(windows)
    same(got, [alone(w) for w in windows])
    assert [g.kept.item() for g in got] == [1, 1]


def test_a_windows_kept_length_is_one_addition_from_a_device_origin() -> None:
    """The rows a window keeps come out of the verify counted with its pending token (k + 1), so a stream whose
    window sits at a device length (a drafted round queued ahead: lanes.py's `keep_verdict`) keeps k + 1 + origin
    with one addition, not two (k + (origin + 1)); the host reads k + 1 and the choices."""
    from types import SimpleNamespace

    from dflash_bench.engine.lanes import Lanes

    (window,) = forward_windows([5], [GREEDY], [2], [True])
    origin = mx.array(40, dtype=mx.int32) + 0
    seg = Segment([0] * 5, 44, None, list(range(5)), at=origin)
    (v,) = verify([Window(GREEDY, seg, window.out, window.drafts)])
    mx.eval(v.values, v.kept, v.anchor, origin)
    s = SimpleNamespace(known=44, lattice=None, anchor=None, verdict=None, drafts=(), draft_ids=None)
    Lanes.keep_verdict(None, s, seg, window.out, v)
    kept_length, bound, low = s.verdict.keep
    assert census([kept_length]) == {"Add": 1}
    assert kept_length.item() == 40 + 3 and (bound, low) == (49, 45)
    assert s.verdict.values.tolist()[0] == 3 and s.anchor.item() == s.verdict.values.tolist()[3]
