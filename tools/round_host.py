"""Where a drafted round's host time goes, on any machine: the engine's own rounds with our CUDA kernels stood in for.

usage: python3 tools/round_host.py [--layers 32] [--streams 1] [--tokens 48] [--reps 3]

On an H100 a 9B drafted round is the host's: tools/round_split.py found 0.17 ms of a 10.26 ms drafted round
waiting for the device (docs/profiles/session-57-h100.txt), so what the bar on a drafted round's cost against a
plain one's (issue 15) needs is less host work in the parts a plain round does not have: the drafter's absorb and
block pass, the rollback (cache.py's `keep_windows`), the read of the verify's choices, and MLX encoding their
operations. This runs the engine's rounds on the CPU in the gpu mode with each CUDA kernel one node
(tools/forward_ops.py's stand-ins), on the 9B's layer pattern (`--layers` of it; 32 as the 9B) with the dflash-9b
drafter's 6 layers, every draft rejected (one add a stream, as the random fixtures' drafts are never kept), and
splits them by tools/round_split.py's phases, plain beside drafted, `--reps` times: a shared host moves every
figure, so compare within one run or run two revisions (PYTHONPATH=a checkout) back to back. Its `queue` is this
CPU computing the stand-ins, not a GPU encoding them: read build, draft, keep, read and rest. Then the operations
a round hands MLX (`mx.async_eval`'s graphs, views and the stand-ins' `Depends` left out), plain and drafted, by
kind: on a GPU each costs its build and its encoding (about 9 us an operation to encode on session 57's H100).
The stand-ins' reference attention takes host starts only, so the self-check's checks at device lengths fail under
it; its verdict is taken as passed here, since bits are not what this measures.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from dataclasses import replace
from pathlib import Path

import forward_ops  # (imports dflash_bench first: the BLAS loads before mlx.core)
import round_split

import mlx.core as mx

from dflash_bench.engine import lanes, selfcheck
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.fixtures.big import PRESETS, write_big


def passing(check):
    """`selfcheck.check` with its verdict taken as passed (the module docstring says why)."""
    def checked(*args, **kwargs):
        verdict = check(*args, **kwargs)
        verdict.passed = True
        return verdict
    return checked


def round_ops(engine: Engine, prompt: list[int], streams: int, draft: bool, rounds: int = 8) -> collections.Counter:
    """The operations `rounds` decode rounds hand MLX, by kind, a round (after the prompt's and the first
    queued round)."""
    got: collections.Counter = collections.Counter()
    queue = mx.async_eval

    def counted(*args) -> None:
        arrays = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(a, mx.array)]
        if arrays:
            mx.synchronize()  # what earlier calls queued is evaluated, so not counted again here
            got.update({k: c for k, c in forward_ops.census(arrays).items()
                        if k not in forward_ops.VIEWS and k != "Depends"})
        queue(*args)

    for i in range(streams):
        engine.submit(Request(prompt, max_tokens=rounds + 40, ignore_eos=True, seed=i, draft=draft))
    for _ in range(3):
        engine.step()
    lanes.mx.async_eval = counted
    try:
        for _ in range(rounds):
            engine.step()
    finally:
        lanes.mx.async_eval = queue
    while engine.lanes.busy:
        engine.step()
    return collections.Counter({k: c / rounds for k, c in got.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="the target's layers, the 9B's pattern (the 9B has 32)")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=48, help="tokens a request (a drafted round keeps one)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.layers < 8 or args.layers % 4:
        parser.error(f"--layers must be a multiple of 4 from 8 (the tiny drafter taps layer 7), not {args.layers}")
    preset = f"tiny-{args.layers}-drafter-6"
    PRESETS.setdefault(preset, replace(PRESETS["tiny"], layers=args.layers, draft_layers=PRESETS["9b"].draft_layers))
    launches = forward_ops.reference_stand_ins()
    root = Path(tempfile.mkdtemp())
    target, drafter = (write_big(kind, root / kind, preset) for kind in ("qwen3_5-9b-4bit", "dflash-9b"))
    selfcheck.check = passing(selfcheck.check)
    engine = Engine(target, drafter, Settings(parallel=max(4, args.streams), context=1024, chunk=32, backend="gpu"))
    forward_ops.one_node_stand_ins(launches)
    engine.lanes.drafter.kernel_attention = True  # as on a CUDA GPU (dense.kernel_runs_here)
    propose = engine.lanes.drafter.propose_queued
    engine.lanes.drafter.propose_queued = lambda items: [d + 1 for d in propose(items)]  # never the target's choice
    prompt = list(range(10, 50))
    for _ in range(args.reps):
        got = {mode: round_split.split(engine, prompt, args.streams, args.tokens, draft=mode == "drafted")
               for mode in ("plain", "drafted")}
        plain, drafted = got["plain"], got["drafted"]
        beyond = {k: drafted[k] - plain.get(k, 0.0) for k in ("build", "draft", "keep", "read", "rest")}
        for mode, parts in got.items():
            print(f"{args.streams} stream(s), {mode}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()),
                  flush=True)
        print(f"  the drafted round's host work beyond the plain round's, less the queue: {sum(beyond.values()):.2f} ms ("
              + ", ".join(f"{k} {v:+.2f}" for k, v in beyond.items()) + ")", flush=True)
    ops = {mode: round_ops(engine, prompt, args.streams, mode == "drafted") for mode in ("plain", "drafted")}
    for mode, counts in ops.items():
        print(f"{args.streams} stream(s), {mode}: {sum(counts.values()):.0f} operations a round ("
              + ", ".join(f"{k} {v:.0f}" for k, v in counts.most_common()) + ")", flush=True)
    more = {k: ops["drafted"][k] - ops["plain"][k] for k in ops["drafted"].keys() | ops["plain"].keys()}
    print("  drafted beyond plain, by kind: " + ", ".join(f"{k} {v:+.0f}" for k, v in
                                                         sorted(more.items(), key=lambda kv: -abs(kv[1])) if v), flush=True)


if __name__ == "__main__":
    main()
