"""How many operations one decode forward asks MLX for, and how long Python takes to build them.

usage: python3 tools/forward_ops.py [--streams 1,4] [--drafter] [--layers 8]

On a GPU a decode forward pays per launch (docs/gpu-round-profile.md), so the number of operations
that are not views, and the Python time to build them, are what a change to the forward should cut.
It counts them and times the build of a one-row step and of a 16-row window (a drafted round's verify, as a
ratio to the step's taken in the same run: a shared host moves both; its census also at a device start, where a
drafted round queued ahead places it), and counts those of rolling a 16-row
window back to its first row (`keep`, and at a device length as a drafted round keeps every stream's window:
cache.py's `keep_windows`, whose build is timed too), on any machine:
the 9B-shaped `tiny` preset (fixture qwen3_5-9b-4bit's layer pattern, 8 layers, or `--layers 32` as the 9B) in the gpu mode,
each of our four CUDA kernels (the row kernel, attention, the recurrence, norms and RoPE:
targets/norm_rope_kernel.py) stood in for by one node (the self-check runs first on reference arithmetic for
them), `mx.fast.rms_norm` and `mx.fast.rope` one node each, as they are on a GPU (on a CPU MLX composes them
from several: counts before session 50 hold those), and the fused chains compiled as they are on a GPU
(engine/fused.py). `--drafter` counts a drafted round's drafter work instead: the fixture dflash-9b drafter's
(`tiny` preset, bf16) absorbing of a window's 16 tap rows and its block pass for 15 drafts, a stream at a
device length (as a drafted round queued ahead runs them, lanes.py), its CUDA launches one node each beside
the operations their Python makes; it prints those
operations and every node, views included (each still a node for MLX to encode on a GPU). Run it at two revisions
(PYTHONPATH=a checkout) to compare.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import re
import statistics
import struct
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine import fused, matmul_kernel, tiles
from dflash_bench.engine.cache import keep_windows, tiles_for
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.targets import attention_kernel, delta_kernel, dense, norm_rope_kernel, qwen3_5
from dflash_bench.engine.targets.base import Segment, rope_rows
from dflash_bench.engine.tiles import attention, key_mask, pad_queries, query_positions
from dflash_bench.fixtures.big import PRESETS, write_big

# the engine's own launching Python, which `reference_stand_ins` replaces for the load and `one_node_stand_ins` puts back
ENGINE_ATTENTION = attention_kernel.decode_attention, attention_kernel.decode_call
ENGINE_QUERIES_AND_KEYS = norm_rope_kernel.queries_and_keys
REPS = 40  # timed builds a measurement; the first 5 are dropped
VIEWS = {"Broadcast", "Reshape", "Slice", "Squeeze", "ExpandDims", "Transpose", "Split", "AsStrided"}


def census(outputs: list[mx.array]) -> collections.Counter:
    """The nodes of the (not yet evaluated) graph of `outputs`, by primitive (`mx.export_to_dot`)."""
    dot = Path(tempfile.mkdtemp()) / "graph.dot"
    mx.export_to_dot(str(dot), *outputs)
    return collections.Counter(label.split()[0] for label in re.findall(r'label ="([^"]+)"', dot.read_text()))


def reference_attention(segments, scale, meta=None, queries=None, layer=None, block=None):
    """decode_attention's result by tiles.py's attention, for the host starts this tool uses (`meta` unused; the
    segments' q rows are the packed `queries`' rows; a joint cache, v None, read as its keys and values, those of
    `layer` where every layer's are stacked: stacked_cache.py; with `block`, a segment's keys from its start on are
    its rows of it)."""
    outs, lo = [], 0
    for q, k, v, start in segments:
        if v is None:
            k, v = (k[0], k[1]) if layer is None else (k[2 * layer], k[2 * layer + 1])
        n, kr = q.shape[0], tiles_for(start + q.shape[0])
        if block is not None:  # (the cache may not hold these rows' positions yet: padded to the key tiles)
            k, v = (mx.pad(mx.concatenate([c[:, :start], b[:, lo : lo + n]], axis=1), [(0, 0), (0, kr - start - n), (0, 0)])
                    for c, b in ((k, block[0]), (v, block[1])))
        lo += n
        seen = key_mask(query_positions(start, n), 0, kr, start + n)
        outs.append(attention(pad_queries(q.transpose(1, 0, 2)), k[:, :kr], v[:, :kr], seen, scale=scale)[:, :n]
                    .transpose(1, 0, 2))
    return mx.concatenate(outs).astype(segments[0][0].dtype)


def reference_packed(qkv, g, beta, states, starts):
    q, k, v = qkv.views()
    res = qwen3_5.per_window_ops([(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s)
                                  for s, a, b in zip(states, starts, starts[1:])])
    return mx.concatenate([y for y, _ in res]), [s for _, s in res]


def reference_rollback(parts, starts, counts, conv_starts, span):
    """delta_kernel.rollback by mlx-lm's ops: each layer's windows' states after their counts, and conv tails."""
    out = []
    for qkv, g, beta, states, conv in parts:
        kept = [qwen3_5.prefix_by_rerun(qwen3_5.per_window_ops, *qkv[a:b].views(), g[a:b], beta[a:b], state, counts[i])
                for i, (state, a, b) in enumerate(zip(states, starts, starts[1:]))]
        out.append((kept, [qwen3_5.conv_tail(conv[c:], counts[i], span) for i, c in enumerate(conv_starts)]))
    return out


def one_node_launch(inputs, output_shapes, output_dtypes, **_) -> list[mx.array]:
    """A kernel object of ours called as the engine calls it (a BakedKernel's call: delta_kernel.py's forward and
    rollback, attention_kernel.py's passes, norm_rope_kernel.py's launches) as the one node its launch is, on all of
    its inputs: its first output that node, the others views tied to it (`Depends` is not counted). The Python that
    builds the call runs as the engine's own."""
    first = mx.depends([mx.zeros(output_shapes[0], dtype=output_dtypes[0])], inputs)[0]
    return [first] + [mx.depends([mx.broadcast_to(mx.array(0, dtype=dtype), shape)], [first])[0]
                      for shape, dtype in zip(output_shapes[1:], output_dtypes[1:])]


class Launch:
    """Stands in for `mx.fast.cuda_kernel`'s row matmul: the reference product, or one node."""

    def __init__(self, one_node: bool):
        self.one_node, self.zeros = one_node, {}

    def __call__(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        x, w, scales, biases, _, residual, norm = inputs[:7]
        t = dict(template)
        if t["NORM"] and not self.one_node:  # the rows normed in the launch (the reference: MLX's norm first)
            x = mx.fast.rms_norm(x, norm, struct.unpack("<f", struct.pack("<i", t["EPS"]))[0])
        if self.one_node:  # a stacked weight's parts are outputs of the one launch: the first the node, the rest tied to it
            key = (t["K"], output_shapes[0][-1])
            if key not in self.zeros:
                self.zeros[key] = mx.zeros(key, dtype=mx.bfloat16)
            if t["RESID"]:  # the residual added in the same launch: still one node
                return [mx.addmm(residual, x, self.zeros[key])]
            if "HQ" in t:  # a `rope` launch: its queries (rows, heads, d) float32 the node, keys and values tied to them
                first = mx.depends([mx.full(output_shapes[0], 0.0, dtype=mx.float32)], [x] + inputs[7:])[0]
            else:
                first = x @ self.zeros[key]
            return [first] + [mx.depends([mx.broadcast_to(mx.array(0, dtype=dtype), shape)], [first])[0]
                              for shape, dtype in zip(output_shapes[1:], output_dtypes[1:])]
        y = x @ w.T if t["BITS"] == 16 else mx.quantized_matmul(x, w, scales, biases, transpose=True,
                                                                group_size=t["G"], bits=t["BITS"])
        y = y.astype(mx.bfloat16)
        if t["RESID"]:
            y = residual + y
        if t["GLU"]:  # gate and up interleaved (tiles.SwiGLU)
            return [fused._swiglu(y[:, 0::2], y[:, 1::2])]
        if len(output_shapes) == 1:
            return [y]
        starts = sorted({0, t["P1"], t["P2"], t["P3"], t["N"]})  # a stacked weight's parts (rows_matmul's `parts`)
        parts = [mx.contiguous(y[:, a:b]) for a, b in zip(starts, starts[1:])]
        if "HQ" in t:  # a `rope` launch: q and k back in each head's order, then the norm-and-RoPE reference
            q, k = (mx.take(p, mx.array(matmul_kernel.in_order(matmul_kernel.head_rows(p.shape[1] // t["D"], t["D"], t["R"]))),
                            axis=1) for p in parts[:2])
            positions, log2_theta = inputs[7:]
            return list(reference_norm_rope(q, k, parts[2], None, None, positions, 2 ** log2_theta[0].item(), 0.0,
                                            head_dim=t["D"], rope_dims=t["R"]))
        return parts


def reference_call(segs, scale, meta=None, causal=True, window=None, block=None, queries=None, layer=None):
    """attention_kernel.decode_call by `reference_attention` (each segment's q rows from the layer's queries)."""
    def call(q, blk=None, at=None):
        rows = list(itertools.accumulate((s[0].shape[0] for s in segs), initial=0))
        return reference_attention([(q[a:b], *s[1:]) for s, a, b in zip(segs, rows, rows[1:])], scale, layer=at, block=blk)
    return call


def reference_norm_rope(q, k, v, qw, kw, positions, theta, eps, head_dim=None, rope_dims=None, gated=False):
    """norm_rope_kernel.queries_and_keys by MLX's norms and RoPE (the self-check's arithmetic for it): float32
    queries (rows, heads, d), and keys and values (2, heads, rows, d)."""
    rows, d = q.shape[0], head_dim or qw.shape[0]
    qh = q.reshape(rows, -1, 2 * d)[..., :d] if gated else q.reshape(rows, -1, d)
    kh = k.reshape(rows, -1, d)
    if qw is not None:
        qh, kh = mx.fast.rms_norm(qh, qw, eps), mx.fast.rms_norm(kh, kw, eps)
    turned = [rope_rows(x, positions, rope_dims or d, theta) for x in (qh, kh)]
    return turned[0].transpose(1, 0, 2).astype(mx.float32), mx.stack([turned[1], v.reshape(rows, -1, d).transpose(1, 0, 2)])


def drafter_ops(target, root: Path, streams: list[int], preset: str) -> None:
    """Operations of the drafter's absorb and block pass (module docstring), each stream at a device length."""
    from dflash_bench.engine.drafters.dflash import Proposal, load_drafter
    from dflash_bench.engine.sampling import SamplingParams

    drafter = load_drafter(write_big("dflash-9b", root / "drafter", preset), target, dtype=mx.bfloat16)
    drafter.kernel_attention = True  # as on a CUDA GPU (dense.kernel_runs_here)
    taps = mx.zeros((16, len(drafter.taps) * target.config.hidden_size), dtype=mx.bfloat16)
    for n in streams:
        states = [drafter.new_state() for _ in range(n)]
        drafter.absorb([(st, taps) for st in states])
        # a block pass reads the rows absorbed, as a stream's first proposal does (a state of every layer in one
        # array writes them there: stacked_cache.py)
        mx.eval(drafter.propose_queued([Proposal(st, 5, 15, SamplingParams(0.0)) for st in states]))
        mx.eval([st.arrays() for st in states])
        for st in states:
            st.keep_at(mx.array(10, dtype=mx.int32), 16, 1)
        graph = []
        absorb = drafter.absorb
        drafter.absorb = lambda items: absorb(items) or graph.extend(a for st, _ in items for a in st.arrays())
        drafter.absorb([(st, taps) for st in states])
        drafter.absorb = absorb
        counts = census(graph)
        print(f"{n} stream(s), drafter absorbing 16 rows: {ops(counts)} operations that are not views, "
              f"{nodes(counts)} nodes in all", flush=True)
        mx.eval(graph)
        drafts = drafter.propose_queued([Proposal(st, mx.array(5, dtype=mx.int32), 15, SamplingParams(0.0)) for st in states])
        counts = census(drafts)
        print(f"{n} stream(s), drafter block pass for 15 drafts: {ops(counts)} operations that are not views, "
              f"{nodes(counts)} nodes in all "
              f"({dict((k, c) for k, c in counts.most_common() if k not in VIEWS and k != 'Depends')})", flush=True)


def nodes(counts: collections.Counter) -> int:
    """A census's nodes, views included, but not `Depends` (what the stand-ins tie their inputs in with)."""
    return sum(c for k, c in counts.items() if k != "Depends")


def ops(counts: collections.Counter) -> int:
    """The operations of a census that launch work: not views, not `Depends` (drafter_ops's rope stand-in)."""
    return sum(c for k, c in counts.items() if k not in VIEWS and k != "Depends")


def reference_stand_ins() -> tuple:
    """The gpu mode's kernel paths on any machine, each kernel by reference arithmetic (for the engine's load and
    self-check; `attention_kernel`'s reference takes host starts only, so the self-check's checks at device lengths
    fail under it, which leaves an engine undrafting). Returns the recurrence's own launches, for
    `one_node_stand_ins`."""
    dense.kernel_runs_here = lambda heads, device, cuda: attention_kernel.fits(*heads)
    qwen3_5.decode_recurrence = lambda heads, device, cuda: "delta_kernel" if delta_kernel.fits(*heads) else "gated_delta_ops"
    tiles.available = lambda dtype: dtype == mx.bfloat16
    matmul_kernel._kernel = lambda parts=0, rope=False: Launch(one_node=False)
    attention_kernel.decode_attention, attention_kernel.decode_call = reference_attention, reference_call
    norm_rope_kernel.queries_and_keys = reference_norm_rope  # a target's decode rows on the kernel path (dense.py)
    qwen3_5.RECURRENCES["delta_kernel"] = qwen3_5.per_window_ops
    launches = delta_kernel.delta_packed, delta_kernel.rollback
    delta_kernel.delta_packed = reference_packed
    delta_kernel.rollback = reference_rollback  # a rollback to device lengths (qwen3_5.py's redo_fn, PackedRedo)
    return launches


def one_node_stand_ins(launches: tuple) -> None:
    """Each CUDA kernel one node, as a launch is on a GPU, and MLX's norms, RoPE and fused chains as many nodes as
    they are there (after an engine loaded under `reference_stand_ins`, whose return is `launches`). The row kernel's,
    the attention's, the norm-and-RoPE's and the recurrence's kernel objects are stood in for, not the Python that
    launches them: that is part of a round's host work."""
    stand_in = Launch(one_node=True)
    matmul_kernel._kernel = lambda parts=0, rope=False: stand_in
    attention_kernel.decode_attention, attention_kernel.decode_call = ENGINE_ATTENTION
    attention_kernel._partial_kernel = lambda *key, **kinds: one_node_launch
    attention_kernel._combine_kernel = lambda: one_node_launch
    norm_rope_kernel.queries_and_keys = ENGINE_QUERIES_AND_KEYS
    for name in ("_qk_kernel", "_keys_kernel", "_layer_keys_kernel"):
        setattr(norm_rope_kernel, name, lambda *key: one_node_launch)
    # MLX's own norm and RoPE one node each, as on a GPU (`Depends` only ties an array offset in, and is not counted)
    mx.fast.rms_norm = lambda x, w, eps: mx.abs(x) if w is None else x * w
    mx.fast.rope = lambda x, dims, **kw: (mx.depends([x * 1.5], [kw["offset"]])[0] if isinstance(kw.get("offset"), mx.array)
                                          else x * 1.5)
    # the recurrence kernel's own launches, each one node (what their Python asks for beside them is counted)
    delta_kernel.delta_packed, delta_kernel.rollback = launches
    delta_kernel._kernel = lambda *key: one_node_launch
    # one node for the recurrence, depending on all of its inputs as the kernel does
    qwen3_5.RECURRENCES["delta_kernel"] = lambda ws: [
        tuple(mx.depends([mx.abs(w[2]).astype(mx.float32), mx.abs(w[5])], list(w[:5]))) for w in ws]
    # the chains engine/fused.py compiles on a GPU
    tiles.swiglu, qwen3_5.conv_silu = mx.compile(fused._swiglu), mx.compile(fused._conv)
    qwen3_5.gated, dense.sigmoid_gate = mx.compile(fused._gated), mx.compile(fused._sigmoid_gate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--drafter", action="store_true", help="count the drafter's absorb and block pass")
    parser.add_argument("--target", default="tiny", help="`tiny` (the 9B's pattern, --layers of it) or any target the "
                        "engine loads, e.g. `default` (the default model)")
    parser.add_argument("--layers", type=int, default=8,
                        help="the target's layers: the 9B's pattern (3 GatedDeltaNet, 1 attention) repeated; the 9B has 32")
    args = parser.parse_args()
    if args.layers < 8 or args.layers % 4:
        parser.error(f"--layers must be a multiple of 4 from 8 (the tiny drafter taps layer 7), not {args.layers}")
    preset = "tiny" if args.layers == 8 else f"tiny-{args.layers}"
    PRESETS.setdefault(preset, replace(PRESETS["tiny"], layers=args.layers))
    launches = reference_stand_ins()
    root = Path(tempfile.mkdtemp())
    path = write_big("qwen3_5-9b-4bit", root / "target", preset) if args.target == "tiny" else args.target
    target = Engine(path, None, Settings(parallel=4, context=256, chunk=32, backend="gpu")).target
    one_node_stand_ins(launches)
    if args.drafter:
        drafter_ops(target, root, [int(s) for s in args.streams.split(",")], preset)
        return
    for streams in (int(s) for s in args.streams.split(",")):
        states = [target.new_state() for _ in range(streams)]
        for st in states:
            out = target.forward([Segment(list(range(10, 42)), 0, st, [31], prefill=True)])
            mx.eval(out[0].logits, st.arrays())
            st.keep(32)
        measure(target, states)


def measure(target, states: list) -> None:
    """The census and build times of one decode step, a 16-row window and its rollbacks (module docstring)
    for `states`' streams, each after its prompt."""
    streams = len(states)

    def evaluated(outs) -> None:
        mx.eval([o.logits for o in outs], [st.arrays() for st in states])

    def step():
        return target.forward([Segment([5], st.length, st, [0]) for st in states])

    def windows():  # a 16-row window of each stream, as a drafted round verifies it
        return target.forward([Segment([5] * 16, st.length, st, list(range(16))) for st in states])

    def keep_at_device() -> None:  # each window kept to its first row at a device length (cache.py's keep_windows)
        keep_windows([(st, (mx.array(st.length - 15, dtype=mx.int32), st.length, st.length - 15)) for st in states])

    def settled() -> None:  # the host reads the kept lengths
        mx.eval([st.arrays() for st in states])
        for st in states:
            st.settle(st.length - 15)

    step_s = median_seconds(step, after=evaluated)
    outs = step()
    counts = census([o.logits for o in outs] + [a for st in states for a in st.arrays()])
    print(f"{streams} stream(s), {target.config.num_layers} layers: {ops(counts)} operations that are not views "
          f"({counts.total()} nodes; {counts.get('Matmul', 0)} products), graph build {1e3 * step_s:.2f} ms "
          f"(median of {REPS - 5})", flush=True)
    evaluated(outs)
    # its build beside the step's (same run)
    window_s = median_seconds(windows, after=lambda outs: (evaluated(outs), [st.keep(st.length - 15) for st in states]))
    print(f"{streams} stream(s), 16-row windows: graph build {1e3 * window_s:.2f} ms, {window_s / step_s:.2f}x the "
          "step's", flush=True)
    # the same windows at a device start, as a drafted round queued ahead places them (lanes.py): its writes
    # are scatters at the device positions (cache.py); the last timed window's keep evaluated first, so the census
    # holds this forward alone
    mx.eval([st.arrays() for st in states])
    for st in states:
        st.keep_at(mx.array(st.length, dtype=mx.int32), st.length, st.length)
    outs = target.forward([Segment([5] * 16, st.length, st, list(range(16)), at=st.at) for st in states])
    counts = census([o.logits for o in outs] + [a for st in states for a in st.arrays()])
    print(f"{streams} stream(s), 16-row windows at a device start: {ops(counts)} operations that are not views "
          f"({counts.total()} nodes)", flush=True)
    evaluated(outs)
    for st in states:
        st.keep(st.length - 16)
    # the window evaluated, then kept to its first row (a rejected round): what `keep` asks the device for
    # (qwen3_5.py's rollback)
    evaluated(windows())
    for st in states:
        st.keep(st.length - 15)
    counts = census([a for st in states for a in st.arrays()])
    print(f"{streams} stream(s), a 16-row window kept to its first row: {ops(counts)} operations that are not views",
          flush=True)
    # the same at a device length, as a drafted round keeps its windows (lanes.py's round)
    mx.eval([st.arrays() for st in states])
    evaluated(windows())
    keep_at_device()
    counts = census([a for st in states for a in st.arrays()])
    settled()
    keep_s = median_seconds(keep_at_device, before=lambda: evaluated(windows()), after=lambda _: settled())
    print(f"{streams} stream(s), 16-row windows kept to their first row at a device length: {ops(counts)} operations "
          f"that are not views, graph build {1e3 * keep_s:.2f} ms", flush=True)


def median_seconds(timed, before=None, after=None) -> float:
    """The median seconds `timed()` takes over REPS reps (the first 5 dropped), `before()` run untimed ahead of
    each rep and `after(what timed returned)` behind it (the graph evaluated, a window kept back to a row)."""
    times = []
    for _ in range(REPS):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = timed()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(out)
    return statistics.median(times[5:])


if __name__ == "__main__":
    main()
