"""Where a plain decode round's time goes in the engine: the forward's Python, queuing it, and the rest.

usage: python3 tools/round_split.py [TARGET] [--backend auto|cpu|gpu] [--streams N] [--tokens T]
       [--parallel P] [--no-warm] [--with-mlx-lm | --layers DRAFTER]
(on the GPU machine: PYTHONPATH=/tmp/site:$PWD python3 tools/round_split.py /root/t9 --backend gpu)

On the H200 a 9B step built and evaluated on its own costs 13.8 ms (tools/build_eval_split.py) but the
engine's plain round 24.9 ms (receipts/engine-speed-qwen3.5-9b-4bit-gpu-h200.json): this splits the
round (Engine.step) into the target forward's graph building, the `mx.async_eval` that queues it
(lanes.py's look_ahead), and everything else (sampling, reading the token back, keep, emitting),
with the lookahead on and off and Python's garbage collector on and off. Medians over the decode
rounds of one request of T tokens a stream. `--parallel`, the warm-up and `--with-mlx-lm` reproduce
how `engine-speed` runs the engine, one difference at a time; `--layers DRAFTER` instead adds what
engine-speed holds beside the plain engine one at a time in one process (mlx-lm's model, a drafting
engine on the same target, an mlx-lm decode, a drafted decode) and re-times the plain round after each,
both as above and as engine-speed times it (a request's decode seconds over its rounds, on the code probe).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request


def split(engine: Engine, prompt: list[int], streams: int, tokens: int) -> dict[str, float]:
    """Median ms a round of each part, over the rounds after the prompt's."""
    build: list[float] = []
    queue: list[float] = []
    forward, async_eval = engine.target.forward, mx.async_eval

    def timed_forward(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        build.append(time.perf_counter() - t0)
        return out

    def timed_async_eval(*args):
        t0 = time.perf_counter()
        async_eval(*args)
        queue.append(time.perf_counter() - t0)

    engine.target.forward, mx.async_eval = timed_forward, timed_async_eval
    try:
        for i in range(streams):
            engine.submit(Request(prompt, max_tokens=tokens, ignore_eos=True, seed=i, draft=False))
        rounds = []
        while engine.lanes.busy:
            build.clear()
            queue.clear()
            t0 = time.perf_counter()
            engine.step()
            rounds.append((time.perf_counter() - t0, sum(build), sum(queue)))
    finally:
        engine.target.forward, mx.async_eval = forward, async_eval
    decode = rounds[2:]  # the prompt's round and the first queued one
    total = statistics.median(r[0] for r in decode)
    built = statistics.median(r[1] for r in decode)
    queued = statistics.median(r[2] for r in decode)
    return {"round": 1e3 * total, "build": 1e3 * built, "queue": 1e3 * queued, "rest": 1e3 * (total - built - queued)}


def layers(engine: Engine, drafter_path: str, tokens: int) -> None:
    """Re-time one plain stream after each thing engine-speed adds to the process."""
    from dflash_bench.checks import engine_speed, mlx_lm_speed
    from dflash_bench.checks import prompts as prompt_sets
    from dflash_bench.engine.drafters.dflash import load_drafter

    probe = engine_speed.chat_ids(engine.loaded, prompt_sets.probes()["code"])
    held: dict[str, object] = {}

    def timed(label: str) -> None:
        got = split(engine, list(range(100, 356)), 1, tokens)
        level = engine_speed.run_level(engine, probe, 1, tokens, False)
        print(f"{label}: round {got['round']:.2f} ms (build {got['build']:.2f}, queue {got['queue']:.2f}, "
              f"rest {got['rest']:.2f}); engine-speed's round {1e3 * level['seconds_per_round'][0]:.2f} ms",
              flush=True)

    def with_mlx_lm() -> None:
        held["mlx-lm"] = mlx_lm_speed.load(engine.loaded.path)

    def with_drafting_engine() -> None:
        drafter = load_drafter(drafter_path, engine.target, dtype=engine.backend.dtype)
        held["drafted"] = Engine(model=engine.target, draft_model=drafter, settings=engine.settings,
                                 loaded=engine.loaded)

    steps = [("plain engine alone", lambda: None), ("+ mlx-lm's model held", with_mlx_lm),
             ("+ a drafting engine on the same target", with_drafting_engine),
             ("+ after an mlx-lm decode", lambda: mlx_lm_speed.decode(held["mlx-lm"], probe, 1, tokens)),
             ("+ after a drafted decode",
              lambda: engine_speed.run_level(held["drafted"], probe, 1, tokens, True))]
    for label, add in steps:
        add()
        timed(label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", default="default")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=0, help="the engine's lanes (default: --streams)")
    parser.add_argument("--no-warm", action="store_true", help="skip the engine's warm-up (the first split warms)")
    residents = parser.add_mutually_exclusive_group()  # --layers loads mlx-lm's model itself, as one of its steps
    residents.add_argument("--with-mlx-lm", action="store_true",
                           help="hold mlx-lm's model of TARGET in the process too, as engine-speed does")
    residents.add_argument("--layers", metavar="DRAFTER",
                           help="add engine-speed's other residents one at a time (a drafter for its drafting engine)")
    args = parser.parse_args()
    engine = Engine(args.target, None, Settings(parallel=args.parallel or args.streams, context=4096,
                                                warm=not args.no_warm,
                                                backend=None if args.backend == "auto" else args.backend))
    print(engine.startup_line(), flush=True)
    held = None
    if args.with_mlx_lm:
        from dflash_bench.checks.mlx_lm_speed import load

        held = load(engine.loaded.path)
    prompt = list(range(100, 356))
    split(engine, prompt, args.streams, 8)  # warm
    if args.layers:
        layers(engine, args.layers, args.tokens)
        return
    for lookahead in (True, False):
        for collect in (True, False):
            engine.lanes.lookahead = lookahead
            gc.enable() if collect else gc.disable()
            got = split(engine, prompt, args.streams, args.tokens)
            print(f"{args.streams} stream(s), lookahead {'on' if lookahead else 'off'}, gc {'on' if collect else 'off'}: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in got.items()), flush=True)
    gc.enable()
    del held


if __name__ == "__main__":
    main()
