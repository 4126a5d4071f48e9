"""Decode attention for every decode segment of a forward at once (a launch for per-partition partials,
one to combine them; or, where the rows reach few partitions, one launch doing both), row-independent by
construction.

What it computes: for each segment (one stream's decode rows: its pending token plus its drafts, or a
one-row step), softmax(q k^T * scale) v over that stream's AttentionCache (cache.py), row r of a
segment starting at position `start` seeing the keys [0, start + r]. It replaces `tiles.attention`'s
per-segment tile products on a CUDA GPU (dense.py's `kernel_runs_here`), which cost 0.57-0.64 ms
a layer per stream at 1,024 keys on an H200 (docs/gpu-round-profile.md), once per stream. A drafter's
block pass takes it too (drafters/dflash.py), with its layers' other masks: bidirectional inside the
block, and a sliding window (`decode_attention`'s `causal` and `window`), and reads its block's K/V from
its own rows (`block`) where the target's rows are in the caches; a drafter needs only determinism, which the
kernel has. The CUDA source is attention_source.py's; this module picks and makes the launches.

Why a row's bits do not depend on its segment's row count, its place in it, or the other segments of
the launch (what drafted == plain needs, targets/base.py): a row's arithmetic is a fixed function of
its own query, its own position p and its stream's keys [0, p]:

- keys are cut at ABSOLUTE positions: partitions of P keys (one block each), each cut into chunks of
  32 keys, one key per lane. A row takes part in exactly the partitions and chunks holding a key
  <= p (a chunk past p is skipped for that row, never added as zeros);
- a score is a float32 sum over the head dim in ascending order, one explicit fused multiply-add a
  term (`__fmaf_rn`; every other step is `__fmul_rn`, `__fadd_rn`, `__fsub_rn`, `__fdiv_rn`, `expf`:
  explicit intrinsics the compiler neither contracts nor splits, so each rounding is the source's),
  times the scale; a key after p gets -inf and weight exactly 0, decided by p alone; the chunk's max
  and weight sum are xor butterflies (1, 2, ..., 16) that leave the same bits in every lane;
- within a partition the chunks are combined by an online softmax in ascending order; the weighted
  values are summed per output element over the chunk's keys in ascending order, one fused
  multiply-add a key (a key after p is skipped by a predicate, so stale cache rows, whatever they
  hold, never reach the sum);
- a second launch combines a row's partitions 0 .. p / P in ascending order (max first, then the
  rescaled sums), and divides. Where the launch's latest row reaches at most ONEPASS_PARTS partitions, one
  launch does both (`partial_source`'s `onepass`): its block walks the partitions in turn, writes each one's
  partials as pass 1's blocks do, and each warp then combines its own (row, head) pairs with pass 2's
  arithmetic in pass 2's order. The same sums in the same order, so the same bits (tests/test_attention_kernel.py,
  float32 and bf16, under the emulator and on a CUDA GPU), whichever a launch takes.

Which warp or register slot holds a row, how many rows share its block, which row group or segment
the block serves: none of it enters a row's arithmetic. So a 16-row verify window equals 16 one-row
steps bit for bit, and segments launched together equal each alone (tests/test_attention_kernel.py on a
CUDA GPU; the engine's self-check proves it again where it serves, selfcheck.py). It differs from
`tiles.attention` in the last bits (another summation order), so a layer runs one or the other for
all its decode rows.

Launch geometry (pass 1, grid in threads as MLX's `cuda_kernel` takes it): (Pmax * NT, Hkv * RG, S),
block NT = 32 * NW threads: block (partition, kv head + row group, segment) stages each 32-key chunk
of its kv head's K and V in shared memory with 16-byte loads (the chunk is 32 * D contiguous elements
of the cache) and serves all G = Hq / Hkv query heads of up to RB rows from it, so K/V are read once
per (segment, kv head, row group). Warp w holds the (row, head) pairs w, w + NW, ... (QPW of them) in
registers. Queries are converted to float32 once, before the launch, not in every block. Pass 2:
(D, Hq, rows) threads, one per output element. Partials are float32: (rows, Hq, Pmax, 2) for (max,
weight sum), (rows, Hq, Pmax, D) for the unnormalized outputs.

Why one launch up to ONEPASS_PARTS = 4 partitions (512 keys): a GPU host pays every launch twice, building it and
encoding it (about 17 us a layer's two launches to build on session 56's H100 host, docs/gpu-round-profile.md), and
a decode step of the default model waits on the host, not the device. One block walking 4 partitions reads what 4
blocks did, in turn: a few microseconds of device time a layer at the benchmarks' contexts, against the host's
cost of a launch. Past 512 keys the partitions' blocks spread a long context over the SMs again.

Why P = 128 keys a block: a stream at 4,096 keys then gives 32 blocks a kv head, enough to spread a
one-row step over the GPU's SMs, while a block's partials stay a fraction of what it reads (at
Qwen3.5-9B's heads, 8 rows x 4 heads x 256 floats, 32 KB, against 128 KB of bf16 K and V). Chunks of 32 keys: one a lane, and K and V of a
chunk fit in the 48 KB of static shared memory MLX's launch allows without an opt-in (at D = 256 in
float32 V is staged into K's buffer after the scores instead).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import mlx.core as mx

from dflash_bench.engine.baked_kernel import BakedKernel, bind
from dflash_bench.engine.device_values import constant, per_round
from dflash_bench.engine.targets.attention_source import (COMBINE, HEADER, partial_inputs, partial_name, partial_outputs,
                                                          partial_source)

PARTITION = 128  # keys per pass-1 block, at absolute positions (a multiple of CHUNK)
# A launch whose latest row reaches at most this many partitions runs as one launch (module docstring)
ONEPASS_PARTS = 4
CHUNK = 32  # keys per staged chunk: one per lane
HEAD_DIMS = (32, 64, 128, 256)  # D / 32 elements a lane, each a power of two
MAX_GROUP = 16  # query heads per kv head a block serves
# One decode segment as the kernel takes it: q (n, Hq, D), its cache k and v (Hkv, capacity, D), start; or,
# with v None, k one joint cache (2, Hkv, capacity, D): keys then values (cache.py's JointCache), or with a `layer`
# every layer's (2 * layers, Hkv, capacity, D: stacked_cache.py's, a dense target's and a drafter's)
Rows = tuple[mx.array, mx.array, mx.array | None, int]

@dataclass(frozen=True)
class Geometry:
    """Pass 1's block shape for a launch: RB rows of a segment a block, NW warps, QPW (row, head) pairs a
    warp, RG row groups (blocks along a segment's rows). None of it enters a row's arithmetic."""

    rb: int
    nw: int
    qpw: int
    rg: int


def fits(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel covers these heads: whole query groups of at most MAX_GROUP, and a head dim in
    HEAD_DIMS (whole lanes of a power-of-two width, a 32-key chunk within shared memory)."""
    return heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and head_dim in HEAD_DIMS


def geometry(group: int, max_rows: int) -> Geometry:
    """Rows a block: the power of two up to 8 covering the longest segment (so few variants compile), at
    most 64 (row, head) pairs a block; 8 warps when a block holds more than 4 pairs, else 4 (enough
    threads to keep a chunk's 16-byte loads many and in flight)."""
    if not 1 <= group <= MAX_GROUP or max_rows < 1:
        raise ValueError(f"no geometry for {group} query heads a kv head and {max_rows} rows")
    most = 8
    while most * group > 64:
        most //= 2
    rb = 1
    while rb < min(max_rows, most):
        rb *= 2
    pairs = rb * group
    nw = 8 if pairs > 4 else 4
    return Geometry(rb=rb, nw=nw, qpw=-(-pairs // nw), rg=-(-max_rows // rb))


@lru_cache(maxsize=16)
def _partial_kernel(segments: int, block: bool = False, joint: bool = False, layered: bool = False,
                    onepass: bool = False):
    """Pass 1 for `segments` caches (with the block's rows apart; joint caches; every layer's joint caches, read at
    a layer's offset; or walking every partition and combining them, `onepass`), under its own name (the source
    differs by segment count, block, joint, layered and onepass)."""
    return BakedKernel(partial_name(segments, block, joint, layered, onepass),
                       partial_inputs(segments, block, joint, layered), partial_outputs(onepass),
                       partial_source(segments, block, joint, layered, onepass), HEADER)


@lru_cache(maxsize=1)
def _combine_kernel():
    """Pass 2: one source for every launch (its templates differ by dtype and head dim alone)."""
    return BakedKernel("dflash_attention_combine", ["meta", "ml", "part_out"], ["out"], COMBINE, HEADER)


def _scale(scale: float) -> mx.array:
    """The launch's softmax scale, in device memory (device_values.constant)."""
    return constant((scale,), mx.float32)


@lru_cache(maxsize=64)
def _meta(values: tuple[int, ...]) -> mx.array:
    """The launch's int32 layout, made once per forward: every attention layer of it has the same one."""
    return mx.array(values, dtype=mx.int32)


def check_segments(segments: list[Rows], block: mx.array | None = None, layer: int | None = None
                   ) -> tuple[int, int, int, mx.Dtype]:
    """(Hq, Hkv, D, dtype) shared by every segment, or ValueError: each segment has rows, one dtype
    and one head layout the kernel covers, a cache of CHUNK-multiple capacity holding its rows (with `block`,
    the keys before its start, and `block` (2, Hkv, rows, D) in K's dtype holding every segment's rows), and
    every segment's caches two arrays or every segment's one joint array (with `layer`, every layer's joint
    arrays, (2 * layers, Hkv, capacity, D), holding that layer's)."""
    if not segments:
        raise ValueError("decode attention needs at least one segment")
    joint = segments[0][2] is None
    if layer is not None and not joint:
        raise ValueError("a layer's keys are read from every layer's joint caches, not two arrays")
    for q, k, v, _ in segments:
        if (v is None) != joint:
            raise ValueError("every segment's caches are two arrays, or every segment's one joint array")
        if joint:
            stacked = k.ndim == 4 and (k.shape[0] == 2 if layer is None else
                                       0 <= layer and k.shape[0] % 2 == 0 and k.shape[0] >= 2 * layer + 2)
        if q.ndim != 3 or (not stacked if joint else k.ndim != 3 or v.ndim != 3):
            raise ValueError(f"queries are (n, Hq, D) and caches (Hkv, capacity, D), or one joint (2, Hkv, capacity, "
                             f"D), or every layer's (2 * layers, ..) holding layer {layer}, got {q.shape}, {k.shape}, "
                             f"{None if v is None else v.shape}")
    q0, k0 = segments[0][0], segments[0][1]
    hq, d, hkv, dtype = q0.shape[1], q0.shape[2], cache_shape(segments[0])[0], k0.dtype
    if not fits(hq, hkv, d):
        raise ValueError(f"no launch for {hq}/{hkv} heads of {d}")
    for seg in segments:
        q, k, v, start = seg
        (heads, cap, dim), n = cache_shape(seg), q.shape[0]
        if q.shape[1:] != (hq, d) or (v is not None and k.shape != v.shape) or heads != hkv or dim != d:
            raise ValueError(f"mismatched heads: q {q.shape}, k {k.shape}, v {None if v is None else v.shape} "
                             f"against {hq}/{hkv} of {d}")
        if not k.dtype == (k if v is None else v).dtype == dtype or q.dtype not in (dtype, mx.float32):
            raise ValueError(f"one dtype for K and V, and q in it or float32, got {q.dtype}, {k.dtype} (and {dtype})")
        if n < 1 or start < 0 or (start if block is not None else start + n) > cap or cap % CHUNK:
            raise ValueError(f"{n} rows from {start} need a cache of a multiple of {CHUNK} rows holding them, got {cap}")
    rows = sum(q.shape[0] for q, _, _, _ in segments)
    if block is not None and (block.shape != (2, hkv, rows, d) or block.dtype != dtype):
        raise ValueError(f"a block's K/V are (2, {hkv}, {rows}, {d}) in {dtype}, got {block.shape} in {block.dtype}")
    return hq, hkv, d, dtype


def cache_shape(segment: Rows) -> tuple[int, int, int]:
    """A segment's K (and V) cache shape (Hkv, capacity, D): its k's, or its joint cache's last three axes."""
    k, v = segment[1], segment[2]
    return tuple(k.shape[1:] if v is None else k.shape)


def last_keys(n: int, causal: bool) -> list[int]:
    """The last key each of a segment's n rows sees, from its start: its own position (causal), else the
    segment's last (a drafter's block, bidirectional inside it)."""
    return list(range(n)) if causal else [n - 1] * n


def device_meta(head: tuple[int, ...], lengths: list[int], starts: list[int], ats: list[mx.array | None],
                seg_meta: list[int], causal: bool = True) -> mx.array:
    """The launch's layout where some segments start at a device value (cache.py's keep_at): the same
    int32 values `_meta` holds, each device start added where it goes (its rows' last keys, its segment's
    start) to a constant layout holding 0 there: a product and a sum for one such segment, a join, a take
    and a sum for several. A drafted round builds one for the target's forward and one or two for the
    drafter's pass, and pays per operation (docs/gpu-round-profile.md); built piecewise it took four or
    more."""
    devices = [at.astype(mx.int32) for at in ats if at is not None]
    # each segment's device start, 1-based in `devices`, or 0 for a host start
    slots = [sum(a is not None for a in ats[: i + 1]) if at is not None else 0 for i, at in enumerate(ats)]
    values, which = list(head), [0] * len(head)  # which: the device start added to each value, or 0
    for n, start, d in zip(lengths, starts, slots):
        values += [k + (0 if d else start) for k in last_keys(n, causal)]
        which += [d] * n
    for i, d in enumerate(slots):  # (row0, start, n, capacity) a segment, a device start in its start slot
        row0, start, n, cap = seg_meta[4 * i : 4 * i + 4]
        values += [row0, 0 if d else start, n, cap]
        which += [0, d, 0, 0]
    base = _meta(tuple(values))
    if len(devices) == 1:
        return base + devices[0] * _meta(tuple(int(w > 0) for w in which))
    joined = mx.concatenate([_meta((0,)), *(at.reshape(1) for at in devices)])
    return base + joined[_meta(tuple(which))]


def launch_meta(segments: list[Rows], ats: list[mx.array | None] | None = None, causal: bool = True) -> mx.array:
    """The launch's int32 layout (pmax, rows, the last key each row sees, then (row0, start, n, capacity) a
    segment), the same for every attention layer of a forward (of a kind: `causal`, as `decode_attention`).
    Where `ats` gives a segment a device start, its `start` is that start's upper bound and the layout is
    computed on the device (`device_meta`)."""
    lengths = [q.shape[0] for q, _, _, _ in segments]
    offsets = (0, *accumulate(lengths))
    pmax = partitions(segments)
    starts = [start for _, _, _, start in segments]
    seg_meta = [x for seg, n, row0 in zip(segments, lengths, offsets) for x in (row0, seg[3], n, cache_shape(seg)[1])]
    if ats is not None and any(at is not None for at in ats):
        return device_meta((pmax, offsets[-1]), lengths, starts, ats, seg_meta, causal)
    positions = [start + r for start, n in zip(starts, lengths) for r in last_keys(n, causal)]
    return per_round([pmax, offsets[-1], *positions, *seg_meta])


MAX_LAUNCHES = 64  # launch shapes kept (`_LAUNCHES`): a server's forwards take a few dozen


@dataclass(frozen=True)
class Launch:
    """`decode_attention`'s launches for one shape of segments (their queries', caches' and block's shapes and
    dtypes, starts, mask), two or one (`combine` None: `ONEPASS_PARTS`): the kernel objects bound to their constants
    and the launch options, made once (`prepare`)
    and kept (`_LAUNCHES`). Every attention layer of a forward launches the same shape, and checking the segments
    and making the options again cost each layer about 6 of the 12 us its launches took to build on this project's
    CPU (docs/gpu-round-profile.md, session 53)."""

    kernels: tuple[BakedKernel, BakedKernel | None]  # pass 1's and pass 2's (a kept launch holds for these alone)
    joint: bool
    partial: object  # pass 1's kernel object, called without constants (BakedKernel.bound)
    combine: object | None  # pass 2's, or None where pass 1 combines its partitions itself
    partial_options: dict
    combine_options: dict


_LAUNCHES: dict[tuple, Launch] = {}


def prepare(segments: list[Rows], causal: bool, window: int | None, block: mx.array | None,
            queries: mx.array | None, kernels: tuple[BakedKernel, BakedKernel], layer: int | None = None) -> Launch:
    """The segments checked (`check_segments`) and their launch made: pass 1's grid over the partitions the
    latest row reaches, its geometry, and both passes' constants and outputs."""
    hq, hkv, d, dtype = check_segments(segments, block, layer)
    lengths = [q.shape[0] for q, _, _, _ in segments]
    rows = sum(lengths)
    if queries is not None and (queries.shape != (rows, hq, d) or queries.dtype not in (dtype, mx.float32)):
        raise ValueError(f"packed queries are ({rows}, {hq}, {d}) in {dtype} or float32, got {queries.shape} in "
                         f"{queries.dtype}")
    pmax = partitions(segments)
    group = hq // hkv
    geo = geometry(group, max(lengths))
    nt = 32 * geo.nw
    joint = segments[0][2] is None
    partial_template = (("T", dtype), ("D", d), ("G", group), ("HQ", hq), ("HKV", hkv), ("RB", geo.rb), ("NW", geo.nw),
                        ("QPW", geo.qpw), ("P", PARTITION), ("CAUSAL", int(causal)), ("WINDOW", window or 0),
                        ("BLOCK", int(block is not None)))
    caches = len(segments) * (1 if joint else 2) + (block is not None)
    onepass = kernels[1] is None
    shapes, dtypes = [(rows, hq, pmax, 2), (rows, hq, pmax, d)], [mx.float32, mx.float32]
    if onepass:  # the rows' attention first, then the partials it combined
        shapes, dtypes = [(rows, hq, d), *shapes], [dtype, *dtypes]
    pass1 = bind(kernels[0], partial_template,
                 [mx.float32, mx.int32, mx.float32] + [dtype] * caches + [mx.int32] * (layer is not None), dtypes)
    pass2 = None if onepass else bind(kernels[1], (("T", dtype), ("D", d), ("P", PARTITION)),
                                      [mx.int32, mx.float32, mx.float32], [dtype])
    return Launch(kernels, joint, pass1, pass2,
                  dict(grid=((1 if onepass else pmax) * nt, hkv * geo.rg, len(segments)), threadgroup=(nt, 1, 1),
                       output_shapes=shapes, output_dtypes=dtypes),
                  dict(grid=(d, hq, rows), threadgroup=(d, 1, 1), output_shapes=[(rows, hq, d)], output_dtypes=[dtype]))


@contextmanager
def split_launches() -> Iterator[None]:
    """Every launch made in two (pass 1 a block a partition, then pass 2) at any length, as past ONEPASS_PARTS
    partitions: the engine's warm-up builds its decode shapes so too, so the variants a long context takes are
    compiled before ready without running one (warmup.py)."""
    global ONEPASS_PARTS
    kept, ONEPASS_PARTS = ONEPASS_PARTS, 0
    try:
        yield
    finally:
        ONEPASS_PARTS = kept


def partitions(segments: list[Rows]) -> int:
    """The partitions the launch's latest row reaches (its grid's width in pass-1 blocks)."""
    return max(-(-(start + q.shape[0]) // PARTITION) for q, _, _, start in segments)


def decode_attention(segments: list[Rows], scale: float, meta: mx.array | None = None, causal: bool = True,
                     window: int | None = None, block: mx.array | None = None, queries: mx.array | None = None,
                     layer: int | None = None) -> mx.array:
    """Every segment's attention over its own cache, in two launches: (sum n_i, Hq, D) in K's dtype,
    the segments' rows in order.

    A segment is (q, k, v, start): q (n, Hq, D) after RoPE and norms, in K's dtype or already float32 (a
    drafter's, targets/norm_rope_kernel.py); k and v the stream's whole cache
    arrays (Hkv, capacity, D), row j at position j (not slices: a slice along the positions is not row-
    contiguous, so MLX would copy it); or, with v None, k the stream's joint cache (2, Hkv, capacity, D), keys
    then values (cache.py's JointCache): the launch reads both from it, where two views of it would
    be four operations a layer and stream for the host to build and encode (docs/gpu-round-profile.md); the same
    memory read, so the same bits. Row r sits at position start + r and sees keys [0, start + r].
    Query head h reads kv head h // (Hq / Hkv). `meta` is `launch_meta`'s (made here if not given, of the
    same `causal`): where it places a segment at a device start, `start` is that start's upper bound and
    sizes the launch (a block past a row's keys returns at once), so the rows' bits are those of the rows
    launched at a host start. A drafter's block pass (drafters/dflash.py) takes the other two masks its
    layers have: `causal` False, every row of a segment seeing all of it, and a sliding `window`, a row
    seeing only the last `window` positions up to its own (a partition below a row's window is combined
    as an exact zero: pass 1 writes it as having seen nothing).

    With `block` (2, Hkv, sum n_i, D: every segment's rows' keys, then their values, in the segments' order), a
    segment's keys from its start on are its rows of `block`, not its cache's: a drafter's block K/V, which only
    its pass reads, need no write into the cache first (one scatter a layer and stream). The same values at the
    same positions, so the same bits as the cache written first.

    With `queries` (sum n_i, Hq, D: every segment's query rows in the segments' order, as one forward or pass
    holds them), the launch reads them, and a segment's q gives only its row count: the segments' q rows are
    not joined again (with several segments a copy launched a layer, and a slice a segment, for the host to build
    and encode). The same values, so the same bits.

    With `layer`, each segment's joint cache is every layer's (2 * layers, Hkv, capacity, D: stacked_cache.py's
    StackedState) and the launch reads layer `layer`'s rows 2 * layer and 2 * layer + 1 of it in place: a view of
    them would be an operation a layer and stream. The same memory read, so the same bits."""
    call = decode_call(segments, scale, meta, causal, window, block, queries, layer)
    q = queries if queries is not None else mx.concatenate([s[0] for s in segments]) if len(segments) > 1 else segments[0][0]
    return call(q, block, layer)


def decode_call(segments: list[Rows], scale: float, meta: mx.array | None = None, causal: bool = True,
                window: int | None = None, block: mx.array | None = None, queries: mx.array | None = None,
                layer: int | None = None) -> "Call":
    """`decode_attention`'s launches for these segments (its arguments, checked), to call with each layer's
    queries, block and layer (`Call`)."""
    if not segments:  # its refusal, before the key reads a first segment
        check_segments(segments)
    key = (tuple((q.shape, q.dtype, k.shape, k.dtype, None if v is None else (v.shape, v.dtype), start)
                 for q, k, v, start in segments), None if block is None else (block.shape, block.dtype),
           None if queries is None else (queries.shape, queries.dtype), causal, window, layer is not None)
    onepass = partitions(segments) <= ONEPASS_PARTS
    kernels = (_partial_kernel(len(segments), block is not None, segments[0][2] is None, layer is not None, onepass),
               None if onepass else _combine_kernel())
    launch = _LAUNCHES.get(key)
    if launch is None or launch.kernels != kernels:
        launch = _LAUNCHES[key] = prepare(segments, causal, window, block, queries, kernels, layer)
        if len(_LAUNCHES) > MAX_LAUNCHES:
            _LAUNCHES.pop(next(iter(_LAUNCHES)))
    meta = launch_meta(segments, causal=causal) if meta is None else meta
    caches = [s[1] for s in segments] + ([] if launch.joint else [s[2] for s in segments])
    return Call(launch, meta, _scale(scale), caches, None if block is None else block.shape, layer is not None)


@dataclass(frozen=True)
class Call:
    """`decode_attention` for one forward's segments, made once and called for each of its layers (DenseTarget.layers,
    whose layers launch the same segments over the same caches, each with its own queries, block and layer): the
    launch, its layout and the caches, so a layer's call only checks its inputs' shapes (where `decode_attention`
    builds its launch key each call: about a third of a 4-stream default-model step's build on this project's CPU,
    docs/gpu-round-profile.md, session 55)."""

    launch: Launch
    meta: mx.array
    scale: mx.array
    caches: list[mx.array]
    block: tuple[int, ...] | None  # the block's shape, or None: a call without one
    layered: bool

    def __call__(self, queries: mx.array, block: mx.array | None = None, layer: int | None = None) -> mx.array:
        """The launches for these packed queries (rows, Hq, D), block (of the shape the call was made for) and layer."""
        options = self.launch.partial_options
        if (queries.shape[0] != options["output_shapes"][0][0] or (block is None) != (self.block is None)
                or (block is not None and block.shape != self.block) or (layer is not None) != self.layered):
            raise ValueError(f"a call made for {options['output_shapes'][0][0]} rows, block {self.block}, "
                             f"layered {self.layered}, given {queries.shape[0]}, {None if block is None else block.shape}, "
                             f"layer {layer}")
        if layer is not None and not 0 <= 2 * layer < self.caches[0].shape[0]:
            raise ValueError(f"no layer {layer} in joint caches of shape {self.caches[0].shape}")
        # float32 queries: converted once here (no operation where they come in float32), not at every key chunk of
        # every block
        inputs = [queries.astype(mx.float32), self.meta, self.scale, *self.caches]
        if block is not None:
            inputs.append(block)
        if layer is not None:
            inputs.append(constant((layer,), mx.int32))
        if self.launch.combine is None:  # one launch: its first output is the rows' attention
            return self.launch.partial(inputs=inputs, **options)[0]
        ml, part_out = self.launch.partial(inputs=inputs, **options)
        (out,) = self.launch.combine(inputs=[self.meta, ml, part_out], **self.launch.combine_options)
        return out
