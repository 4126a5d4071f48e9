"""The engine's warm-up: every forward shape serving will run, once, on scratch states, before ready.

On a CUDA GPU kernels compile at their first use: ours (matmul_kernel.py, one variant per weight shape
and row-tile count; targets/attention_kernel.py, one per segment count and row bucket;
targets/delta_kernel.py) and MLX's own (its matmuls pick a kernel by row count, and one of them is
compiled at first use: docs/gpu-round-profile.md). Left to the first requests, that wait lands on a
client after /health has said ready. So the engine runs, after its self-check and before it serves:

- decode rounds of 1..parallel segments, each of 1 row and of every attention row bucket up to the
  drafter's block (`window_rows`), every segment then kept to its first row as a device value, as a
  drafted round that kept no draft does (verify.py, lanes.py's `keep_verdict`, cache.py's `keep_at`), and the next
  round's windows placed at it; each again with its attention in two launches (`Shape.split`), as a stream past
  attention_kernel.ONEPASS_PARTS partitions of keys runs it (the scratch streams here hold a few keys);
- rounds of 0..parallel-1 such windows beside one prompt chunk of 1, 16 and `chunk` rows (a prompt's
  last chunk has any length: these are meant to reach MLX's matrix-vector, small- and large-tile
  matmuls; the row counts MLX switches at are its own and not checked here), and a prompt's second
  chunk (its attention sees more keys than it has rows);
- the sampler, greedy and sampled, on every round's logits;
- with a drafter, a drafter pass for 1..parallel streams after each round of full windows (every row
  absorbed, one kept on the device, the anchor a device value, as lanes.py runs it).

Where the process's kernel cache is on (kernel_cache.py: MLX proven to launch our kept kernel code), the
plan is first built without being evaluated, so every kernel variant it launches compiles on the cache's
workers side by side before the evaluated run, which then loads them.

Every state is a scratch one, dropped at the end, so no stream's output and no prompt-cache entry can
depend on it (tests/test_warmup.py). On a CPU nothing compiles at first use, so `every=False` keeps the
same code path to two forwards (a full window then a drafter pass; a one-row step beside a 16-row
prompt chunk), which CI runs with every engine it builds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import mlx.core as mx

from dflash_bench.engine import kernel_cache, selfcheck
from dflash_bench.engine.backend import on_cuda
from dflash_bench.engine.cache import TargetState, keep_windows
from dflash_bench.engine.drafters.dflash import DFlashDrafter, Proposal
from dflash_bench.engine.sampling import SamplingParams, accepted, choose
from dflash_bench.engine.targets import attention_kernel
from dflash_bench.engine.targets.base import Segment, SegmentOut, Target
from dflash_bench.engine.targets.dense import SelfAttention
from dflash_bench.engine.targets.qwen3_5 import GatedDeltaNet
from dflash_bench.engine.verify import Window, verify

PROMPT_ROWS = (1, 16)  # short prompt chunks beside the full one
SAMPLERS = (SamplingParams(), SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1))


@dataclass(frozen=True)
class Shape:
    """One warm-up forward: decode windows of these rows, a prompt chunk of `prompt` rows beside them (0:
    none) from position `after`, and (`draft`) then a drafter pass for the windows, as a round of
    drafting streams runs."""

    windows: tuple[int, ...]
    prompt: int = 0
    draft: bool = False
    after: int = 0  # the prompt chunk's first position: a later chunk attends to the keys before it too
    split: bool = False  # decode attention in two launches, as a long context takes it (attention_kernel.split_launches)


@dataclass(frozen=True)
class Warmup:
    shapes: int  # target forwards run
    drafter_passes: int
    seconds: float
    ahead: float | None = None  # seconds of them building every forward first and compiling its kernels, if done

    def line(self) -> str:
        passes = ""
        if self.drafter_passes:
            passes = f" and {self.drafter_passes} drafter pass{'es' if self.drafter_passes > 1 else ''}"
        ahead = "" if self.ahead is None else f" ({self.ahead:.1f} s of it compiling their kernels ahead)"
        return f"warmed {self.shapes} shapes{passes} in {self.seconds:.1f} s{ahead}"


def window_rows(block: int | None) -> list[int]:
    """A plain step's 1 row and, when drafting, the powers of two below the block and the block: one
    window in each of the attention kernel's row buckets (attention_kernel.geometry) and the full window."""
    rows = {1}
    if block:
        r = 2
        while r < block:
            rows.add(r)
            r *= 2
        rows.add(block)
    return sorted(rows)


def shapes(parallel: int, block: int | None, chunk: int, every: bool) -> list[Shape]:
    """The forwards to warm: all of them (`every`, on a GPU), or the two that keep the code path covered
    (a full window and a drafter pass; a plain step beside a short prompt chunk)."""
    full, short = block or 1, min(chunk, PROMPT_ROWS[-1])
    if not every:
        return [Shape((full,), draft=block is not None), Shape((1,) * min(1, parallel - 1), short)]
    decode = [Shape((r,) * n, draft=r == block) for n in range(1, parallel + 1) for r in window_rows(block)]
    split = [Shape(s.windows, draft=s.draft, split=True) for s in decode]
    prompts = sorted({min(p, chunk) for p in (*PROMPT_ROWS, chunk)})
    later = Shape((), chunk, after=chunk)  # a long prompt's second chunk: more keys than queries
    return decode + split + [Shape((full,) * n, p) for n in range(parallel) for p in prompts] + [later]


def warm(target: Target, drafter: DFlashDrafter | None, parallel: int, chunk: int, every: bool) -> Warmup:
    """Run `shapes(...)` on scratch states, evaluating each; every state is gone when `run` returns, and
    MLX's buffer cache then drops their memory. On a CUDA GPU whose MLX launches our kept kernel code
    (kernel_cache.py), every forward is first only built, never evaluated, so each kernel variant's first
    launch hands its compile to the cache's workers, which compile them side by side; the evaluated run
    after them then finds every variant compiled, where MLX would compile them one after another."""
    start = time.perf_counter()
    plan = shapes(parallel, drafter.block if drafter is not None else None, chunk, every)
    ahead = None
    cache = kernel_cache.active() if every and on_cuda() else None
    if cache is not None:
        run(target, drafter, parallel, plan, evaluate=False)
        cache.wait()
        ahead = time.perf_counter() - start
    passes = run(target, drafter, parallel, plan)
    mx.clear_cache()
    return Warmup(len(plan), passes, time.perf_counter() - start, ahead)


def ahead_of_check(target: Target, parallel: int, chunk: int) -> Callable[[], None] | None:
    """What the engine hands `selfcheck.check` to run first where the process's kernel cache is on (a CUDA
    GPU whose MLX launches our kept code: kernel_cache.py), else None. It builds, never evaluating, every
    launch of the check's first choices (selfcheck's `build_only`: the row kernel's calls, the attention
    kernel's, the recurrence's) and then the serving forwards with each weight and attention layer on those
    choices (`first_choices`; windows up to a drafter's block), and waits for the cache's workers: the check
    then finds its kernel variants compiled, where MLX would compile each at its first evaluation, one after
    another (tests/test_warmup.py)."""
    cache = kernel_cache.active() if on_cuda() else None
    if cache is None:
        return None

    def build() -> None:
        dtype = target.dtype
        with first_choices(target):
            for w in {selfcheck.weight_key(w): w for w in target.projections()}.values():
                if w.fits_kernel(dtype):
                    selfcheck.projection_fault(w, selfcheck.KERNEL, dtype, build_only=True)
            mixers = target.mixer_layers()
            for a in {selfcheck.attention_key(m): m for m in mixers if isinstance(m, SelfAttention)}.values():
                if a.path == "kernel":
                    selfcheck.kernel_fault(a, dtype, build_only=True)
            for m in {selfcheck.recurrence_key(m): m for m in mixers if isinstance(m, GatedDeltaNet)}.values():
                selfcheck.recurrence_fault(m, build_only=True)
            run(target, None, parallel, shapes(parallel, selfcheck.WINDOW, chunk, every=True), evaluate=False)
        cache.wait()

    return build


@contextmanager
def first_choices(target: Target) -> Iterator[None]:
    """Each weight on the first tile the self-check tries and each attention layer on its first path (on a
    CUDA GPU: the row kernel where a weight fits it, the attention kernel), each put back as it was after."""
    weights = [(w, w.kernel, w.tile_rows) for w in target.projections()]
    layers = [(m, m.path) for m in target.mixer_layers() if isinstance(m, SelfAttention)]
    try:
        tiles = {selfcheck.weight_key(w): selfcheck.tile_candidates(w, target.dtype)[0] for w, _, _ in weights}
        selfcheck.choose(target, tiles, {selfcheck.attention_key(m): selfcheck.attention_paths(m)[0] for m, _ in layers})
        yield
    finally:
        for w, kernel, rows in weights:
            w.kernel, w.tile_rows = kernel, rows
        for m, path in layers:
            m.path = path


def run(target: Target, drafter: DFlashDrafter | None, parallel: int, plan: list[Shape], evaluate: bool = True) -> int:
    """The plan's forwards on `parallel` scratch streams (each window kept to its first row on the device,
    as a drafted round that kept no draft does); returns the drafter passes run. With `evaluate` False the
    forwards, samplers and drafter passes are built and dropped, never evaluated or read."""
    taps = drafter.taps if drafter is not None else ()
    states = [target.new_state() for _ in range(parallel)]
    passes = 0
    for shape in plan:
        with attention_kernel.split_launches() if shape.split else nullcontext():
            segments = [window(states[i], rows, bool(taps)) for i, rows in enumerate(shape.windows)]
            if shape.prompt:
                segments.append(prompt_chunk(target, shape.prompt, shape.after, bool(taps)))
            outs = target.forward(segments, taps)
            if evaluate:
                sample(segments, outs)
            # kept together, as lanes.py keeps a round's windows (several streams' in one rollback launch)
            keep_windows([(seg.state, (mx.array(1, dtype=mx.int32) + seg.origin, seg.start + len(seg.tokens),
                                       seg.start + 1)) for seg in segments[: len(shape.windows)]])
            if drafter is not None and shape.draft:
                propose(drafter, outs[: len(shape.windows)], read=evaluate)
                passes += 1
    return passes


def prompt_chunk(target: Target, rows: int, after: int, want_taps: bool) -> Segment:
    """A prompt chunk of `rows` rows from position `after` on a fresh scratch state (its earlier chunk run
    first, untimed and unsampled, as the stream's previous round would have)."""
    state = target.new_state()
    if after:
        target.forward([Segment([0] * after, 0, state, [], False, prefill=True)])
        state.keep(after)
    return Segment([0] * rows, after, state, [rows - 1], want_taps, prefill=True)


def window(state: TargetState, rows: int, want_taps: bool) -> Segment:
    """A decode window of `rows` rows at the state's end (its device value, where it is one), every row's
    logits wanted (as lanes.py asks)."""
    return Segment([0] * rows, state.length, state, list(range(rows)), want_taps, at=state.at)


def sample(segments: list[Segment], outs: list[SegmentOut]) -> None:
    """Each segment's logits through the sampler, greedy and sampled, and the accepted count of drafts
    from the picks, then the round's greedy windows verified as lanes.py verifies them (verify.py: several
    windows of one width together), evaluated with the forward."""
    picks = []
    for seg, out in zip(segments, outs):
        if out.logits is not None:
            positions = mx.arange(1, 1 + out.logits.shape[0], dtype=mx.int32) + seg.origin
            for params in SAMPLERS:
                chosen = choose(out.logits, positions, params).astype(mx.int32)
                picks += [chosen, accepted(chosen[1:], chosen)]
    windows = [Window(SAMPLERS[0], seg, out, mx.zeros((len(seg.tokens) - 1,), dtype=mx.int32))
               for seg, out in zip(segments, outs)
               if out.logits is not None and len(seg.logit_rows) == len(seg.tokens) > 1 and not seg.prefill]
    picks += [a for v in verify(windows) for a in (v.values, v.anchor)]
    mx.eval(picks)


def propose(drafter: DFlashDrafter, outs: list[SegmentOut], read: bool = True) -> None:
    """A round's drafter pass for these streams: absorb each window's rows and keep the first on the device,
    then draft a block from a device anchor (its drafts read back, as a round reads them, unless not `read`)."""
    dstates = [drafter.new_state() for _ in outs]
    drafter.absorb([(d, out.taps) for d, out in zip(dstates, outs)])
    for d, out in zip(dstates, outs):
        d.keep_at(mx.array(1, dtype=mx.int32), out.taps.shape[0], 1)
    anchor = mx.array(0, dtype=mx.int32)
    proposals = [Proposal(d, anchor, drafter.block - 1, SAMPLERS[0]) for d in dstates]
    if read:
        drafter.propose(proposals)  # its drafts are read: evaluated
    else:
        drafter.propose_queued(proposals)
