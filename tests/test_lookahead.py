"""Plain rounds queued ahead (lanes.py's lookahead): the same tokens and endings as rounds read one at a
time, whatever ends a stream meanwhile (max_tokens, eos, a cancel) or joins while a round is queued."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from dflash_bench.engine.drafters.dflash import draft_positions
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.fixtures.small import write_fixture


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def target(request, tmp_path_factory) -> Path:
    return write_fixture(request.param, tmp_path_factory.mktemp(request.param) / "target", seed=1)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 500) for _ in range(rng.randrange(3, 70))] for _ in range(n)]


def engine(target: Path, lookahead: bool) -> tuple[Engine, list[int]]:
    """An engine with the lookahead on or off, and a list that counts the rounds it queued."""
    e = Engine(target, None, Settings(parallel=3, context=512, chunk=32))
    e.lanes.lookahead = lookahead
    queued: list[int] = []
    look_ahead = e.lanes.look_ahead

    def counted(picks):
        ahead = look_ahead(picks)
        queued.append(0 if ahead is None else len(ahead))
        return ahead

    e.lanes.look_ahead = counted
    return e, queued


def requests() -> list[Request]:
    return [Request(p, max_tokens=m, temperature=t, seed=i, ignore_eos=True)
            for i, (p, m, t) in enumerate(zip(prompts(4, seed=5), (12, 21, 9, 16), (0.0, 0.7, 0.0, 0.7)))]


def test_queued_rounds_equal_rounds_read_one_at_a_time(target):
    on, queued = engine(target, True)
    off, _ = engine(target, False)
    arrivals = [0, 0, 2, 7]  # the fourth waits for a lane: admitted after a queued round
    got, want = on.run(requests(), arrivals), off.run(requests(), arrivals)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [len(r.tokens) for r in got] == [12, 21, 9, 16]
    assert sum(n > 0 for n in queued) > 20  # the rounds were queued ahead, not read one at a time


def run_with_endings(e: Engine, eos: int) -> list[tuple[list[int], str]]:
    """Stream 0 may end on `eos`, stream 1 is cancelled mid-decode, a late request joins at round 12."""
    e.lanes.eos = frozenset({eos})
    reqs = requests()
    reqs[0].ignore_eos = False
    handles = [e.submit(r) for r in reqs[:3]]
    for round_no in range(200):
        if round_no == 9:
            handles[1].cancel()
        if round_no == 12:
            handles.append(e.submit(reqs[3]))
        if round_no > 12 and not e.lanes.busy:
            break
        e.step()
    return [(r.tokens, r.finish) for r in (h.result() for h in handles)]


def test_eos_cancel_and_a_late_request_while_a_round_is_queued(target):
    off, _ = engine(target, False)
    first = off.generate(requests()[0]).tokens
    eos = next(t for t in first[4:] if t not in first[:4])  # ends stream 0 after at least four tokens
    on, queued = engine(target, True)
    got = run_with_endings(on, eos)
    assert got == run_with_endings(engine(target, False)[0], eos)
    assert got[0][1] == "stop" and got[1][1] == "cancelled" and got[2][1] == got[3][1] == "length"
    assert any(n > 0 for n in queued)
    assert on.lanes.ahead is None and not on.lanes.streams


def test_a_rounds_choices_are_queued_apart_from_the_next_forward(target, monkeypatch):
    """Reading an array waits for everything queued with it, so the choices a round reads must be queued
    before and apart from the next round's forward: else the host's building of a round could not
    overlap the device's forward (lanes.py's look_ahead)."""
    e, _ = engine(target, True)
    calls: list[list[mx.array]] = []
    real = mx.async_eval

    def recorded(*arrays):
        calls.append([a for _, a in tree_flatten(list(arrays)) if isinstance(a, mx.array)])
        return real(*arrays)

    look_ahead = e.lanes.look_ahead
    seen: list[tuple[list[int], list[int]]] = []  # (ids of the picks, ids queued with each forward)

    def watched(picks):
        before = len(calls)
        ahead = look_ahead(picks)
        if ahead is not None:
            ids = [id(p) for p in picks]
            seen.append((ids, [[id(a) for a in c] for c in calls[before:]]))
        return ahead

    monkeypatch.setattr(mx, "async_eval", recorded)
    e.lanes.look_ahead = watched
    e.run(requests()[:2], [0, 0])
    assert len(seen) > 10
    for picks, queued in seen:
        assert queued[0] == picks  # the choices alone, first
        assert all(p not in later for later in queued[1:] for p in picks)  # not again with the forward


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def drafted_pair(request, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(request.param)
    return write_fixture("qwen3_5", root / "t", seed=1), write_fixture(request.param, root / "d", seed=2, target="qwen3_5")


def test_drafts_stay_on_the_device_until_the_verify_reads_them(drafted_pair, monkeypatch):
    """With the lookahead on, a drafter pass's drafts are not read back: the next verify window is built
    on them as device ids (lanes.py's docstring), and the replies equal those of rounds that read the
    drafts first (lookahead off), greedy and sampled, so the queued drafts change no token."""
    def run(lookahead: bool) -> tuple[list[list[int]], int]:
        e = Engine(*drafted_pair, Settings(parallel=2, context=512, chunk=32))
        e.lanes.lookahead = lookahead
        forward, queued = e.lanes.target.forward, []

        def spied(segments, *args, **kw):
            queued.extend(seg.ids is not None for seg in segments if not seg.prefill and len(seg.tokens) > 1)
            return forward(segments, *args, **kw)

        monkeypatch.setattr(e.lanes.target, "forward", spied)
        got = e.run(requests()[:3], [0, 0, 1])
        return [r.tokens for r in got], sum(queued)

    on, queued_on = run(True)
    off, queued_off = run(False)
    assert on == off
    assert queued_on > 10 and queued_off == 0


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafted_rounds_queued_ahead_equal_rounds_read_one_at_a_time(drafted_pair, temperature, monkeypatch):
    """With the lookahead on, a drafted round queues the next round's verify before it reads its own
    choices: the accepted count, each state's kept length and the drafter's anchor stay device values
    (lanes.py, cache.py's keep_at). The drafts are steered to the plain reply's next k tokens and one wrong
    one, k cycling through every acceptance length; beside a plain stream and a stream that ends on
    max_tokens mid-reply, the replies and their stats (rounds, kept drafts by length) equal those of
    rounds read one at a time, and the drafted replies equal plain decoding."""
    prompt = list(range(20, 60))
    reqs = [Request(prompt, max_tokens=m, temperature=temperature, seed=9, ignore_eos=True, draft=d)
            for m, d in ((150, True), (23, True), (30, False))]

    def run(lookahead: bool) -> tuple[list, int]:
        e = Engine(*drafted_pair, Settings(parallel=3, context=512, chunk=32))
        e.lanes.lookahead = lookahead
        plain = e.generate(Request(prompt, max_tokens=150, temperature=temperature, seed=9, ignore_eos=True,
                                   draft=False)).tokens
        sequence, rounds, walk = prompt + plain, {}, e.drafter.drafts

        def steered(x, logits, items):
            out = []
            for picks, p in zip(walk(x, logits, items), items):
                rounds[id(p.state)] = k = rounds.get(id(p.state), -1) + 1  # each stream's own cycle
                k, start, picks = k % e.drafter.block, draft_positions(p)[0].item(), picks.tolist()
                want = sequence[start : start + len(picks)]
                out.append(mx.array([w if j < k else (w + 1) % 500 for j, w in enumerate(want)] + picks[len(want):],
                                    dtype=mx.int32))
            return out

        monkeypatch.setattr(e.drafter, "drafts", steered)
        windows = e.lanes.look_ahead_windows
        queued = []
        monkeypatch.setattr(e.lanes, "look_ahead_windows", lambda: queued.append(windows()) or queued[-1])
        got = e.run(reqs, [0, 0, 0])
        assert [r.tokens for r in got[:2]] == [plain, plain[:23]] and got[2].tokens == plain[:30]
        return [(r.tokens, r.finish, r.stats.rounds, r.stats.accepted_counts, r.stats.drafted) for r in got], \
            sum(q is not None for q in queued)

    on, queued_on = run(True)
    off, queued_off = run(False)
    assert on == off
    assert queued_on >= on[0][2] - 2 and queued_off == 0  # all but the first and last rounds were queued ahead
    assert all(on[0][3]), f"acceptance lengths seen: {on[0][3]}"
