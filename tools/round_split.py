"""Where a decode round's time goes in the engine: the forward's Python, queuing it, and the rest.

usage: python3 tools/round_split.py [TARGET] [--backend auto|cpu|gpu] [--streams N] [--tokens T]
       [--parallel P] [--no-warm] [--drafter-bits B] [--templated]
       [--with-mlx-lm | --layers DRAFTER | --drafter DRAFTER | --probes]
(on the GPU machine: PYTHONPATH=/tmp/site:$PWD python3 tools/round_split.py /root/t9 --backend gpu)

On the H200 a 9B step built and evaluated on its own costs 13.8 ms (tools/build_eval_split.py) but the
engine's plain round 24.9 ms (receipts/engine-speed-qwen3.5-9b-4bit-gpu-h200.json): this splits the
round (Engine.step) into the target forward's graph building, the `mx.async_eval` that queues it
(lanes.py's look_ahead), the states' `keep` (a rolled-back GatedDeltaNet window builds its redo
there), and everything else (sampling, reading the tokens back, emitting), with the lookahead on and
off and Python's garbage collector on and off. Medians over the decode rounds of one request of T
tokens a stream. `--parallel`, the warm-up and `--with-mlx-lm` reproduce how `engine-speed` runs the
engine, one difference at a time; `--layers DRAFTER` instead adds what engine-speed holds beside the
plain engine one at a time in one process (mlx-lm's model, a drafting engine on the same target, an
mlx-lm decode, a drafted decode) and re-times the plain round after each, both as above and as
engine-speed times it (a request's decode seconds over its rounds, on the code probe). `--drafter`
serves with a drafter and splits a drafted round beside a plain one in the same process, on engine-speed's
probes (the drafter's absorbing and proposing apart from the verify forward, and the read of the verify's
choices: the wait for the device), with the drafted rounds' time by accepted count; `--probes` times engine-speed's
code and chat probes' plain rounds by quarter of the decode.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine import lanes
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.cache import TargetState
from dflash_bench.engine.request import Request


# A round's host phases, (label, whose callable, its name): the target's forward, the drafter's absorb and pass, the
# states' keep (a drafted round keeps its windows at device lengths: lanes.py's keep_windows), MLX's queuing and
# evaluating, and the read of a verify's choices. round_split times them; round_timeline marks them.
PHASES = (("forward", "target", "forward"), ("drafter", "drafter", "absorb"), ("drafter", "drafter", "propose_queued"),
          ("keep", "state", "keep"), ("keep", "lanes.py", "keep_windows"), ("async_eval", "mx", "async_eval"),
          ("eval", "mx", "eval"), ("read", "lanes", "read"))


@contextlib.contextmanager
def around_phases(engine: Engine, wrap):
    """Each of PHASES' callables replaced by `wrap(callable, label)` while the block runs, then put back (an
    attribute the owner did not hold itself, an instance's method or a class's inherited one, is deleted again)."""
    owners = {"target": engine.target, "state": TargetState, "lanes": type(engine.lanes), "lanes.py": lanes, "mx": mx}
    if engine.lanes.drafter is not None:
        owners["drafter"] = engine.lanes.drafter
    saved = []
    for label, whose, name in PHASES:
        if whose in owners:
            owner = owners[whose]
            saved.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, wrap(getattr(owner, name), label))
    try:
        yield
    finally:
        for owner, name, own in reversed(saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def split(engine: Engine, prompt: list[int], streams: int, tokens: int, draft: bool = False,
          by_accepted: dict[int, list[float]] | None = None) -> dict[str, float]:
    """Median ms a round of each part, over the rounds after the prompt's. Drafted (`draft`), the
    build is split into the verify forward's and the drafter's (absorbing taps, the block pass), and
    `read` is reading a verify's choices back (lanes.py: after the next round is queued, so it is the
    wait for the device, less what the host built meanwhile). `by_accepted` collects each drafted
    round's ms under the accepted count its read found (the first stream's)."""
    build: list[float] = []
    drafting: list[float] = []
    queue: list[float] = []
    kept: list[float] = []
    reading: list[float] = []
    accepted: list[int] = []
    buckets = {"forward": build, "drafter": drafting, "keep": kept, "async_eval": queue, "eval": queue, "read": reading}

    def timer(fn, into: list[float]):
        """`fn` timed into `into`, less what evaluations it queued took (those count as queuing)."""
        def timed(*args, **kwargs):
            t0, queued = time.perf_counter(), sum(queue)
            out = fn(*args, **kwargs)
            into.append(time.perf_counter() - t0 - (sum(queue) - queued if into is not queue else 0.0))
            return out
        return timed

    def wrap(fn, label: str):
        timed = timer(fn, buckets[label])
        if label != "read":
            return timed

        def counted_read(lanes, windows):
            before = windows[0].stats.accepted
            timed(lanes, windows)
            accepted.append(windows[0].stats.accepted - before)
        return counted_read

    with around_phases(engine, wrap):
        for i in range(streams):
            engine.submit(Request(prompt, max_tokens=tokens, ignore_eos=True, seed=i, draft=draft))
        rounds = []
        while engine.lanes.busy:
            for part in (build, drafting, queue, kept, reading, accepted):
                part.clear()
            t0 = time.perf_counter()
            engine.step()
            rounds.append((time.perf_counter() - t0, sum(build), sum(drafting), sum(queue), sum(kept),
                           sum(reading), accepted[0] if accepted else None))
    decode = rounds[2:]  # the prompt's round and the first queued one
    total, built, drafted, queued, kept_, read_ = (statistics.median(r[i] for r in decode) for i in range(6))
    out = {"round": total, "build": built, "draft": drafted, "queue": queued, "keep": kept_, "read": read_,
           "rest": total - built - drafted - queued - kept_ - read_}
    if not draft:
        del out["draft"], out["read"]
    for r in decode:
        if by_accepted is not None and r[6] is not None:
            by_accepted.setdefault(r[6], []).append(r[0])
    return {k: 1e3 * v for k, v in out.items()}


def probe_ids(engine: Engine) -> dict[str, list[int]]:
    """engine-speed's code and chat probes as the token ids it sends the engine; none where the target has no
    tokenizer."""
    from dflash_bench.checks import engine_speed
    from dflash_bench.checks import prompts as prompt_sets

    if engine.loaded is None or engine.loaded.tokenizer is None:
        return {}
    return {name: engine_speed.chat_ids(engine.loaded, prompt) for name, prompt in prompt_sets.probes().items()}


def drafted_rounds(engine: Engine, prompt: list[int], streams: int, tokens: int) -> None:
    """A plain and a drafted split on each of engine-speed's probes (the numbers prompt where the target
    has no tokenizer), and the drafted rounds' median ms by how many drafts the round accepted."""
    prompts = probe_ids(engine) or {"numbers": prompt}
    for name, ids in prompts.items():
        by_accepted: dict[int, list[float]] = {}
        got = {mode: split(engine, ids, streams, tokens, draft=mode == "drafted",
                           by_accepted=by_accepted if mode == "drafted" else None)
               for mode in ("plain", "drafted")}
        ratio = got["drafted"]["round"] / got["plain"]["round"]
        for mode, parts in got.items():
            print(f"{name}, {streams} stream(s), {mode}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
                  + (f" ({ratio:.2f}x the plain round)" if mode == "drafted" else ""), flush=True)
        print(f"{name}, drafted round ms by drafts accepted: " + ", ".join(
            f"{k}: {1e3 * statistics.median(v):.2f} ({len(v)})" for k, v in sorted(by_accepted.items())), flush=True)


def probes(engine: Engine, tokens: int) -> None:
    """One plain stream on engine-speed's code and chat probes: the round's median ms by the decode's
    quarter, to see whether a probe's round cost moves with its context."""
    for name, ids in probe_ids(engine).items():
        engine.submit(Request(ids, max_tokens=tokens, ignore_eos=True, seed=0, draft=False))
        times = []
        while engine.lanes.busy:
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        quarter = max(1, len(times) // 4)
        parts = [statistics.median(times[i : i + quarter]) * 1e3 for i in range(0, len(times) - quarter + 1, quarter)]
        print(f"{name}: {len(ids)} prompt tokens, {len(times)} rounds, median ms by quarter "
              + " ".join(f"{p:.2f}" for p in parts), flush=True)


def layers(engine: Engine, drafter_path: str, tokens: int) -> None:
    """Re-time one plain stream after each thing engine-speed adds to the process."""
    from dflash_bench.checks import engine_speed, mlx_lm_speed
    from dflash_bench.engine.drafters.dflash import load_drafter

    probe = probe_ids(engine)["code"]
    held: dict[str, object] = {}

    def timed(label: str) -> None:
        got = split(engine, list(range(100, 356)), 1, tokens)
        level = engine_speed.run_level(engine, probe, 1, tokens, False)
        print(f"{label}: round {got['round']:.2f} ms (build {got['build']:.2f}, queue {got['queue']:.2f}, "
              f"rest {got['rest']:.2f}); engine-speed's round {1e3 * level['seconds_per_round'][0]:.2f} ms",
              flush=True)

    def with_mlx_lm() -> None:
        held["mlx-lm"] = mlx_lm_speed.load(engine.loaded)

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


def templated_kernels() -> None:
    """Our three kernels launched as before engine/baked_kernel.py: one `mx.fast.cuda_kernel` object for every
    shape, the constants passed as template arguments on each call. The same compiled code, so the same bits:
    run the split with and without `--templated` to see what baking the constants saves a round."""
    from functools import lru_cache

    from dflash_bench.engine import matmul_kernel
    from dflash_bench.engine.targets import attention_kernel, delta_kernel

    def templated(baked):
        kernel = mx.fast.cuda_kernel(name=baked.name, input_names=baked.input_names, output_names=baked.output_names,
                                     source=baked.source, header=baked.header, ensure_row_contiguous=True)
        return lambda inputs, template, **launch: kernel(inputs=inputs, template=list(template), **launch)

    for module, name in ((matmul_kernel, "_kernel"), (delta_kernel, "_kernel"), (attention_kernel, "_combine_kernel"),
                         (attention_kernel, "_partial_kernel")):  # each launch object made from its key, as baked
        setattr(module, name, lru_cache(maxsize=64)(lambda *key, make=getattr(module, name): templated(make(*key))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", default="default")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=0, help="the engine's lanes (default: --streams)")
    parser.add_argument("--no-warm", action="store_true", help="skip the engine's warm-up (the first split warms)")
    parser.add_argument("--drafter-bits", type=int, default=0, help="with --drafter: its precision (0 = float, 4 = 4-bit)")
    parser.add_argument("--templated", action="store_true",
                        help="launch our kernels with template arguments, as before engine/baked_kernel.py")
    modes = parser.add_mutually_exclusive_group()  # --layers loads mlx-lm's model itself, as one of its steps
    modes.add_argument("--with-mlx-lm", action="store_true",
                       help="hold mlx-lm's model of TARGET in the process too, as engine-speed does")
    modes.add_argument("--layers", metavar="DRAFTER",
                       help="add engine-speed's other residents one at a time (a drafter for its drafting engine)")
    modes.add_argument("--drafter", help="serve with this drafter: split drafted rounds beside plain ones")
    modes.add_argument("--probes", action="store_true", help="time engine-speed's probes' plain rounds by quarter")
    args = parser.parse_args()
    if args.templated:
        templated_kernels()
    engine = Engine(args.target, args.drafter, Settings(parallel=args.parallel or args.streams, context=4096,
                                                        warm=not args.no_warm, drafter_bits=args.drafter_bits,
                                                        backend=None if args.backend == "auto" else args.backend))
    print(engine.startup_line(), flush=True)
    held = None
    if args.with_mlx_lm:
        from dflash_bench.checks.mlx_lm_speed import load

        held = load(engine.loaded)
    prompt = list(range(100, 356))
    split(engine, prompt, args.streams, 8, draft=args.drafter is not None)  # warm
    if args.layers:
        layers(engine, args.layers, args.tokens)
        return
    if args.probes:
        probes(engine, args.tokens)
    elif args.drafter:
        drafted_rounds(engine, prompt, args.streams, args.tokens)
    else:
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
