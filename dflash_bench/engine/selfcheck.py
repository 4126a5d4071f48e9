"""The row rule proven on the machine that serves, before it serves (README.md, "The self-check").

Drafted == plain and concurrent == solo hold only if a decode row's bits do not depend on how many
rows share its forward or where it sits (tiles.py). Whether a kernel keeps that depends on the
BLAS build, the core type it picks, the thread count, the MLX version, the device and the dtype:
a rule measured on one processor (16-row tiles, 8 for small products) failed on another, and
float32 on CUDA broke drafted == plain. So at load the engine runs this check on the loaded
target, on the device and dtype that will serve:

- projections: every distinct weight (kind and shape) at its row tile: each row rolled through
  every position of the tile, beside other rows, alone among zero rows, and the call repeated. A
  tile that fails is halved (16, 8, 4, 2, 1 rows a call) until one passes: one row a call can only
  fail by being non-deterministic. On a CUDA GPU the row-independent kernel (matmul_kernel.py) is
  tried first, over KERNEL_ROWS rows (three 16-row MMA tiles, the last partial): rows rolled, beside
  other rows, a row alone in a one-row call, a 16-row slice alone, the call repeated;
- decode attention, per attention shape: a 16-row window whose positions cross a key tile equals
  the same queries fed one at a time; on a CUDA GPU our kernel first (attention_kernel.py: also
  segments launched together equal each alone, keys past a row do not move it, and a window past the
  one-launch bound, in two launches, equals its steps in one and two), then the tiled
  path, then the elementwise one (tiles.py);
- qwen3_5's conv and decode recurrence, per shape: a window equals single rows, in the recurrence
  the layers run on this device (qwen3_5.py's `decode_recurrence`: the CUDA kernel on a CUDA GPU,
  mlx-lm's `gated_delta_ops` elsewhere; no other path is tried);
- the model itself with those choices: a window of 16 tokens equals 16 single steps (logits and
  the state after keeping all of it, or part of it; and the window after keeping part of it as a
  device value, placed at that length: cache.py's keep_at), and a window packed beside another stream's
  equals each alone, and so do the rows after both are kept together at lengths on the device
  (cache.py's keep_windows, one rollback launch a GatedDeltaNet layer on a GPU); on a dense target,
  every node of a 15-node draft tree equals its path's single steps, and keeping a path leaves their
  state (tree_attention.py).

A failure with no passing alternative makes the verdict fail, and the engine then serves without
drafting (engine.py). A passing verdict is cached on disk, keyed by everything it depends on
(verdict.py: `machine`, the shapes, the code), so a restart costs a file read; a failing one is run again at
every load; `dflash-bench selfcheck` runs it fresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Callable, Iterator, TypeVar

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g

from dflash_bench.engine.cache import TargetState, keep_windows, tiles_for
from dflash_bench.engine.targets import attention_kernel
from dflash_bench.engine.targets.base import Segment, Target
from dflash_bench.engine.targets.dense import DecodePath, SelfAttention
from dflash_bench.engine.targets.qwen3_5 import RECURRENCES, GatedDeltaNet
from dflash_bench.engine.tree import Tree
from dflash_bench.engine.tiles import (
    KEY_TILE, ROW_TILE, AttentionPath, Weight, attention, key_mask, pad_queries, query_positions, row_tile,
)
from dflash_bench.engine.verdict import (
    KERNEL, VERSION, PathResult, Verdict, attention_key, cache_dir, machine, recurrence_key, shapes, weight_key,
)

WINDOW = ROW_TILE  # the widest decode window a stream feeds (a drafter's block of 16)
PROMPT = KEY_TILE - WINDOW // 2  # so a window's positions cross a key tile boundary
KERNEL_ROWS = 2 * ROW_TILE + 3
ATTENTION_PATHS: tuple[AttentionPath, ...] = ("tiled", "elementwise")
T = TypeVar("T")


def attention_paths(a: SelfAttention) -> list[DecodePath]:
    """The decode paths tried for a layer, in order: the kernel where it runs, then the tile products."""
    return (["kernel"] if a.kernel else []) + list(ATTENTION_PATHS)


# -- the checks ---------------------------------------------------------------------------------------
def _rand(shape: tuple[int, ...], seed: int, dtype: mx.Dtype) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def _differing(got: mx.array, want: mx.array) -> list[int]:
    """Rows (first axis) whose bits differ."""
    same = mx.all(got == want, axis=tuple(range(1, got.ndim))) if got.ndim > 1 else got == want
    return [i for i, ok in enumerate(same.tolist()) if not ok]


def projection_fault(w: Weight, tile: int, dtype: mx.Dtype, seed: int = 0, build_only: bool = False) -> str | None:
    """What moves a row's bits in `tile`-row calls against `w` (KERNEL: the row kernel's calls of any
    row count), or None: each row at other positions (rolled), row 0 beside other rows and alone
    (among zero rows in a tile; in a one-row call of the kernel), the call repeated. `build_only`:
    every call built, none evaluated (warmup.ahead_of_check), and None."""
    call, n = (w.kernel_product, KERNEL_ROWS) if tile == KERNEL else (w.tile, tile)
    x = _rand((n, w.in_features), seed, dtype)
    ref = call(x)

    def cases() -> Iterator[tuple[str, mx.array, mx.array]]:
        """Built and compared one at a time: together, the lm_head's (16 x vocab rows each) held
        more than a serving round does (plan --check measures the load too)."""
        yield "the call repeated", call(x), ref
        for s in range(1, n) if tile != KERNEL else (1, 5, 8, 15, 16, 17, n - 1):
            yield f"rows rolled by {s}", call(mx.roll(x, s, axis=0)), mx.roll(ref, s, axis=0)
        if n > 1:
            company = mx.concatenate([x[:1], _rand((n - 1, w.in_features), seed + 1, dtype)])
            alone = x[:1] if tile == KERNEL else mx.concatenate([x[:1], mx.zeros((n - 1, w.in_features), dtype=dtype)])
            yield "row 0 beside other rows", call(company)[:1], ref[:1]
            yield "row 0 alone", call(alone)[:1], ref[:1]
        if tile == KERNEL:
            yield "a 16-row call", call(x[ROW_TILE : 2 * ROW_TILE]), ref[ROW_TILE : 2 * ROW_TILE]

    if build_only:
        for _ in cases():
            pass
        return None
    mx.eval(ref)
    for what, got, want in cases():
        if bad := _differing(got, want):
            return f"{what}: rows {bad[:4]}{'...' if len(bad) > 4 else ''} differ"
    return None


def attention_fault(a: SelfAttention, dtype: mx.Dtype, path: DecodePath, seed: int = 0) -> str | None:
    """A WINDOW-row window at positions PROMPT.. against the engine's key view, beside the same
    queries fed one at a time (each over its own, shorter, view): which rows differ."""
    if path == "kernel":
        return kernel_fault(a, dtype, seed)
    end = PROMPT + WINDOW
    k = _rand((a.kv_heads, tiles_for(end), a.head_dim), seed, dtype)
    v = _rand((a.kv_heads, tiles_for(end), a.head_dim), seed + 1, dtype)
    q = _rand((a.heads, WINDOW, a.head_dim), seed + 2, dtype)

    def rows(start: int, n: int) -> mx.array:
        kr = tiles_for(start + n)
        seen = key_mask(query_positions(start, n), 0, kr, start + n)
        return attention(pad_queries(q[:, start - PROMPT : start - PROMPT + n]), k[:, :kr], v[:, :kr], seen,
                         scale=a.scale, path=path)[:, :n]

    window = rows(PROMPT, WINDOW)
    steps = mx.concatenate([rows(PROMPT + t, 1) for t in range(WINDOW)], axis=1)
    mx.eval(window, steps)
    if bad := _differing(window.swapaxes(0, 1), steps.swapaxes(0, 1)):
        return f"window rows {bad[:4]}{'...' if len(bad) > 4 else ''} differ from single queries"
    return None


def kernel_fault(a: SelfAttention, dtype: mx.Dtype, seed: int = 0, build_only: bool = False) -> str | None:
    """attention_kernel.py on this device: a WINDOW-row window whose positions cross a partition (and so
    a chunk and a key tile) beside the same queries one at a time, each step seeing junk in the cache
    rows after its position; the same past attention_kernel.ONEPASS_PARTS partitions, where the window takes two
    launches and its steps before that bound one (so one form is proven against the other); and the first window
    launched between two other streams' segments (a step, and a 3-row window) beside each alone. A kernel that
    fails to build or run is a fault, not a crash. `build_only`: the launches built, none evaluated, and None
    (what failed is the check's to say)."""
    d, hkv, hq = a.head_dim, a.kv_heads, a.heads
    run = attention_kernel.decode_attention
    starts = (attention_kernel.PARTITION - WINDOW // 2,
              attention_kernel.PARTITION * attention_kernel.ONEPASS_PARTS - WINDOW // 2)
    cap = tiles_for(starts[-1] + WINDOW)
    k, v = _rand((hkv, cap, d), seed, dtype), _rand((hkv, cap, d), seed + 1, dtype)
    q = _rand((WINDOW, hq, d), seed + 2, dtype)
    junk_k, junk_v = _rand((hkv, cap, d), seed + 3, dtype) * 8, _rand((hkv, cap, d), seed + 4, dtype) * 8
    other_step = (_rand((1, hq, d), seed + 5, dtype), junk_k, junk_v, 9)
    other_window = (_rand((3, hq, d), seed + 6, dtype), v, k, starts[0] + 30)
    try:
        windows, stepped = [], []
        for start in starts:
            windows.append(run([(q, k, v, start)], a.scale))
            steps = []
            for t in range(WINDOW):
                seen = (mx.arange(cap) <= start + t)[None, :, None]
                steps.append(run([(q[t : t + 1], mx.where(seen, k, junk_k), mx.where(seen, v, junk_v), start + t)],
                                 a.scale))
            stepped.append(mx.concatenate(steps))
        together = run([other_step, (q, k, v, starts[0]), other_window], a.scale)
        alone = mx.concatenate([run([other_step], a.scale), windows[0], run([other_window], a.scale)])
        if build_only:
            return None
        mx.eval(windows, stepped, together, alone)
    except (RuntimeError, ValueError) as err:
        return None if build_only else f"the kernel failed: {err}"
    for start, window, steps in zip(starts, windows, stepped):
        if bad := _differing(window, steps):
            return (f"kernel window rows {bad[:4]}{'...' if len(bad) > 4 else ''} from position {start} differ from "
                    "single queries")
    if bad := _differing(together, alone):
        return f"kernel rows {bad[:4]}{'...' if len(bad) > 4 else ''} launched beside other streams' differ from alone"
    return None


def recurrence_fault(m: GatedDeltaNet, seed: int = 0, build_only: bool = False) -> str | None:
    """qwen3_5's conv and the layer's own decode recurrence (`m.recurrence`) over a WINDOW-row window
    beside the same rows one at a time. `build_only`: the recurrence's launches built, none evaluated
    (the conv's comparison reads values, so it is left out), and None."""
    span = m.kernel - 1
    inputs = _rand((span + WINDOW, m.conv_dim), seed, mx.float32)
    q, k, v = m.mix(inputs, WINDOW)
    stepped = [] if build_only else [m.mix(inputs[t : t + span + 1], 1) for t in range(WINDOW)]
    conv_bad = [t for t, (qs, ks, vs) in enumerate(stepped)
                if not all(mx.array_equal(a[t : t + 1], b).item() for a, b in ((q, qs), (k, ks), (v, vs)))]
    if conv_bad:
        return f"conv rows {conv_bad[:4]} differ from single rows"
    recurrence = RECURRENCES[m.recurrence]
    g = compute_g(m.A_log, _rand((WINDOW, m.hv), seed + 1, mx.float32), m.dt_bias)
    beta = mx.sigmoid(_rand((WINDOW, m.hv), seed + 2, mx.float32))
    state0 = _rand((m.hv, m.dv, m.dk), seed + 3, mx.float32) * 0.1
    [(y, state)] = recurrence([(q, k, v, g, beta, state0)])
    ys, s = [], state0
    for t in range(WINDOW):
        [(yt, s)] = recurrence([(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)])
        ys.append(yt)
    steps = mx.concatenate(ys)
    if build_only:
        return None
    mx.eval(y, steps, state, s)
    if bad := _differing(y, steps):
        return f"recurrence rows {bad[:4]} differ from single rows"
    if not mx.array_equal(state, s).item():
        return "the state after a window differs from the state after single rows"
    return None


def _same_state(a: TargetState, b: TargetState) -> bool:
    xs, ys = a.committed(), b.committed()
    return len(xs) == len(ys) and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys))


def model_faults(target: Target, seed: int = 0) -> list[str]:
    """The target with the chosen tiles and paths: window == single steps (logits, the state after keeping
    all of it and after keeping half), a window packed beside another stream's == each alone, and the two
    kept together at device lengths (cache.py's keep_windows) == single steps after them."""
    vocab = target.config.vocab_size

    def tokens(n: int, s: int) -> list[int]:
        return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed * 100 + s)).tolist()

    def prefilled(prompt: list[int]) -> TargetState:
        state = target.new_state()
        target.forward([Segment(prompt, 0, state, prefill=True)])
        state.keep(len(prompt))
        return state

    def logits(state: TargetState, feed: list[int]) -> mx.array:
        """`feed`'s logits from the state's length (its device value, where it is one: cache.py's keep_at)."""
        out = target.forward([Segment(feed, state.length, state, list(range(len(feed))), at=state.at)])[0].logits
        mx.eval(out)
        return out

    base, window_tokens = prefilled(tokens(PROMPT, 1)), tokens(WINDOW, 2)
    # each check's states are dropped before the next check's are made (the window's go with
    # window_faults, the packed check's are deleted): a state grows its cache by a slack of key tiles
    # (cache.py), and all of them held at once took more than a serving round does (plan --check
    # measures the load too)
    faults, window = window_faults(base, window_tokens, logits)
    other, other_tokens = prefilled(tokens(9, 3)), tokens(4, 4)
    alone = logits(other.snapshot(9), other_tokens)
    packed_window_state, packed_other_state = base.snapshot(PROMPT), other.snapshot(9)
    outs = target.forward([Segment(other_tokens, 9, packed_other_state, list(range(4))),
                           Segment(window_tokens, PROMPT, packed_window_state, list(range(WINDOW)))])
    mx.eval([o.logits for o in outs])
    if _differing(outs[0].logits, alone) or _differing(outs[1].logits, window):
        faults.append("rows packed with another stream's differ from the same rows alone")
    # both kept at lengths on the device, together, as a drafted round of several streams keeps them
    # (cache.py's keep_windows: one rollback launch a GatedDeltaNet layer); the rows after each kept
    # length equal the single steps there (window == steps above)
    keep_windows([(packed_other_state, (mx.array(10, dtype=mx.int32), 13, 10)),
                  (packed_window_state, (mx.array(PROMPT + WINDOW // 2, dtype=mx.int32), PROMPT + WINDOW, PROMPT + 1))])
    if (_differing(logits(packed_other_state, other_tokens[1:]), alone[1:])
            or _differing(logits(packed_window_state, window_tokens[WINDOW // 2 :]), window[WINDOW // 2 :])):
        faults.append("two streams' windows kept together at lengths on the device: the rows after them differ "
                      "from single steps")
    del other, packed_window_state, packed_other_state, outs
    if target.supports_trees:
        faults += tree_faults(target, base, window_tokens, logits)
    return faults


def window_faults(base: TargetState, window_tokens: list[int],
                  logits: Callable[[TargetState, list[int]], mx.array]) -> tuple[list[str], mx.array]:
    """A window from `base` against its rows fed one at a time: the logits, the state after keeping
    all of it and after keeping half, and the rows after the half from a length kept on the device.
    Also returns the window's logits."""
    faults = []
    stepped, half_stepped = base.snapshot(PROMPT), None
    steps = []
    for t, tok in enumerate(window_tokens):
        steps.append(logits(stepped, [tok]))
        stepped.keep(stepped.length)
        if t + 1 == WINDOW // 2:
            half_stepped = stepped.snapshot(stepped.length)
    windowed = base.snapshot(PROMPT)
    window = logits(windowed, window_tokens)
    if bad := _differing(window, mx.concatenate(steps)):
        faults.append(f"a window's logits rows {bad[:4]} differ from single steps")
    windowed.keep(PROMPT + WINDOW)
    if not _same_state(windowed, stepped):
        faults.append("the state after keeping a whole window differs from single steps")
    del windowed, stepped
    half = base.snapshot(PROMPT)
    logits(half, window_tokens)
    half.keep(PROMPT + WINDOW // 2)
    if not _same_state(half, half_stepped):
        faults.append(f"the state after keeping {WINDOW // 2} of a window's rows differs from single steps")
    del half
    # a drafted round queued ahead (lanes.py): the kept length a device value, the next window placed at it
    placed = base.snapshot(PROMPT)
    logits(placed, window_tokens)
    placed.keep_at(mx.array(PROMPT + WINDOW // 2, dtype=mx.int32), PROMPT + WINDOW, PROMPT + 1)
    if bad := _differing(logits(placed, window_tokens[WINDOW // 2 :]), mx.concatenate(steps[WINDOW // 2 :])):
        faults.append(f"a window at a kept length on the device: logits rows {bad[:4]} differ from single steps")
    return faults, window


def tree_faults(target: Target, base: TargetState, tokens: list[int], logits: Callable) -> list[str]:
    """A draft tree (tree.py) of WINDOW - 1 nodes from PROMPT, its spine crossing a key tile: every node's
    logits equal its path's serial steps, and keeping the deepest path leaves their state."""
    spine = WINDOW // 2  # rows 1..spine a chain from PROMPT across the key tile; the rest hang off it
    parents = [-1] + [r - 1 for r in range(1, spine + 1)] + [(3 * r) % spine for r in range(spine + 1, WINDOW)]
    tree = Tree.of(tokens, parents)
    # The spine is stepped on one state; a node off it is stepped from a snapshot of its parent's
    # state taken when the spine is there, and dropped: a state per node (each grows its cache by a
    # slack of key tiles, cache.py) held more than a serving round does (plan --check measures the load).
    spine_state = base.snapshot(PROMPT)
    steps: list[mx.array | None] = [None] * len(tree.tokens)
    for row in range(spine + 1):
        steps[row] = logits(spine_state, [tree.tokens[row]])
        spine_state.keep(spine_state.length)
        for child in (c for c in range(spine + 1, WINDOW) if tree.parents[c] == row):
            steps[child] = logits(spine_state.snapshot(spine_state.length), [tree.tokens[child]])
    treed = base.snapshot(PROMPT)
    out = target.forward([Segment(list(tree.tokens), PROMPT, treed, list(range(WINDOW)), tree=tree)])[0].logits
    mx.eval(out)
    faults = []
    if bad := _differing(out, mx.concatenate(steps)):
        faults.append(f"a draft tree's nodes {bad[:4]} differ from their paths' single steps")
    deepest = tree.depths.index(tree.depth)  # the spine's last row: its state is the spine's
    treed.keep_path(PROMPT, tree.path(deepest))
    if not _same_state(treed, spine_state):
        faults.append("the state after keeping a draft tree's path differs from its single steps")
    return faults


# -- choosing, applying, caching -------------------------------------------------------------------
def tile_candidates(w: Weight, dtype: mx.Dtype) -> list[int]:
    """The row kernel where it fits, then the default tile and halves of it down to one row a call
    (each divides ROW_TILE)."""
    tile, out = row_tile(w.in_features, w.out_features), [KERNEL] if w.fits_kernel(dtype) else []
    while tile >= 1:
        out.append(tile)
        tile //= 2
    return out


def _run(target: Target, key: str, mach: dict) -> Verdict:
    start = time.perf_counter()
    dtype = target.dtype
    paths: list[PathResult] = []
    tiles: dict[str, int] = {}
    chosen_paths: dict[str, str] = {}
    weights: dict[str, Weight] = {}
    for w in target.projections():
        weights.setdefault(weight_key(w), w)
    for wkey, w in sorted(weights.items()):
        tile, result = _first_exact(f"projection {wkey}", tile_candidates(w, dtype),
                                    lambda t: projection_fault(w, t, dtype),
                                    lambda t: "the row kernel" if t == KERNEL else f"{t}-row tiles")
        paths.append(result)
        if tile is not None:
            tiles[wkey] = tile
    mixers = target.mixer_layers()
    for akey, a in sorted({attention_key(m): m for m in mixers if isinstance(m, SelfAttention)}.items()):
        path, result = _first_exact(f"attention {akey}", attention_paths(a), lambda p: attention_fault(a, dtype, p), str)
        paths.append(result)
        if path is not None:
            chosen_paths[akey] = path
    for rkey, m in sorted({recurrence_key(m): m for m in mixers if isinstance(m, GatedDeltaNet)}.items()):
        fault = recurrence_fault(m)
        paths.append(PathResult(f"recurrence {rkey}", fault is None, m.recurrence if fault is None else "", fault or ""))
    verdict = Verdict(passed=False, paths=paths, tiles=tiles, attention=chosen_paths, seconds=0.0, machine=mach, key=key)
    apply(target, verdict)
    faults = model_faults(target)
    paths.append(PathResult("model: window == steps, packed == alone, tree nodes == their paths", not faults,
                            "" if faults else "exact", "; ".join(faults)))
    verdict.passed = all(p.passed for p in paths)
    verdict.seconds = time.perf_counter() - start
    return verdict


def _first_exact(path: str, options: list[T], fault: Callable[[T], str | None],
                 name: Callable[[T], str]) -> tuple[T | None, PathResult]:
    """The first option with no fault (the verdict names those tried before it), or None and why each failed."""
    tried = []
    for option in options:
        why = fault(option)
        if why is None:
            note = f"; {', '.join(tried)}" if tried else ""
            return option, PathResult(path, True, f"{name(option)}{note}")
        tried.append(f"{name(option)}: {why}")
    return None, PathResult(path, False, "", "; ".join(tried))


def apply(target: Target, verdict: Verdict) -> None:
    """Set each weight's tile (or the row kernel) and each attention layer's path to the verdict's choices."""
    choose(target, verdict.tiles, verdict.attention)


def choose(target: Target, tiles: dict[str, int], attention: dict[str, str]) -> None:
    """Set each weight's tile (KERNEL: the row kernel) and each attention layer's path where `tiles` and
    `attention` name one for its key (a verdict's choices, or the first tried: warmup.first_choices)."""
    for w in target.projections():
        if (tile := tiles.get(weight_key(w))) is not None:
            w.kernel = tile == KERNEL
            w.tile_rows = tile or None
    for m in target.mixer_layers():
        if isinstance(m, SelfAttention) and (path := attention.get(attention_key(m))) is not None:
            m.path = path


def check(target: Target, *, fresh: bool = False, ahead: Callable[[], None] | None = None) -> Verdict:
    """The verdict for `target` on this machine: from the cache unless `fresh`, else run (and cached).
    `ahead`, where given, runs first when the check runs: on a CUDA GPU it builds the check's launches
    unevaluated so their kernels compile side by side (warmup.ahead_of_check), where each would
    otherwise compile at its first evaluation, one after another (47.3 s of the 9B's first start on an
    H100 in session 45: docs/gpu-round-profile.md).

    The choices are applied to `target` either way."""
    mach = machine(target.dtype)
    key = hashlib.sha256(json.dumps({"v": VERSION, "machine": mach, "shapes": shapes(target)}, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir() / f"{key}.json"
    if not fresh and path.exists():
        try:
            verdict = Verdict.from_dict(json.loads(path.read_text()))
            verdict.cached = True
            apply(target, verdict)
            return verdict
        except (OSError, ValueError, KeyError, TypeError):
            pass  # an unreadable cache entry is run again
    started, failed = time.perf_counter(), None
    if ahead is not None:
        try:
            ahead()
        except (RuntimeError, ValueError) as err:  # the check itself says what fails; this only cost the head start
            failed = f"building its launches ahead failed: {type(err).__name__}: {err}"
    built = time.perf_counter() - started
    verdict = _run(target, key, mach)
    if ahead is not None:
        verdict.ahead, verdict.seconds = built, built + verdict.seconds
        verdict.notes += [failed] if failed else []
    if not verdict.passed:
        return verdict  # a failure is proven again at the next load, never taken from the cache
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdict.as_dict(), sort_keys=True, indent=1))
        tmp.replace(path)
    except OSError as err:
        verdict.notes.append(f"the verdict was not cached: {err}")
    return verdict
