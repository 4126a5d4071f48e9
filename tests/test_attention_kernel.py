"""Decode attention as our CUDA kernel (engine/targets/attention_kernel.py, dense.py's kernel path).

On any machine: a layer runs the kernel only when MLX computes on a GPU of a CUDA build and the launch
covers its heads; the launch's geometry and argument checks; every decode segment of a forward goes
through one call a layer (a prompt chunk keeps MLX's SDPA) and the outputs land on their own rows;
the self-check tries the kernel first where it runs, keys it, and falls back to the tile products when
it is row-dependent or fails. Where g++ is (any machine): the kernel's CUDA source, run on the CPU by
tests/cuda_emulator.py, is exact and right at a small shape. On a CUDA GPU only (skipped elsewhere),
with fresh random inputs each run (the seed is in every failure message): the kernel agrees with a
float64 reference (bf16 within 8e-3 and float32 within 2e-5 of the largest output: twice the bf16
output's rounding of 2^-8, and float32 sums over a few thousand keys); a window's rows equal the same rows one at a time bit
for bit, starting inside a chunk, across a chunk, across a partition, deep in the cache, with junk in
the cache after each step's position; segments launched together equal each alone; every output
element is written; and the fixtures in gpu mode draft exactly what they decode plainly.
"""

from __future__ import annotations

import random
import secrets

import cuda_emulator
from gpu import ON_CUDA, on_cuda
import numpy as np
import pytest
from tiny_targets import FAMILIES, canonical_weights, config_dict, reference_model, tiny_target

import mlx.core as mx

from dflash_bench.engine import selfcheck
from dflash_bench.engine.cache import tiles_for
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.engine.target_config import parse_target_config
from dflash_bench.engine.targets import Segment, attention_kernel, build_target, norm_rope_kernel
from dflash_bench.engine.targets.attention_kernel import CHUNK, PARTITION, decode_attention, fits, geometry
from dflash_bench.engine.targets.dense import SelfAttention, kernel_runs_here
from dflash_bench.engine.tiles import attention, key_mask, pad_queries, query_positions
from dflash_bench.fixtures.big import write_big

# (Hq, Hkv, D): Qwen3.5-9B's full-attention layers, qwen3's, SmolLM2-135M's (the default model), a
# group of one at the smallest head dim, a group of eight
HEADS = {"9b": (16, 4, 256), "qwen3": (32, 8, 128), "smol": (9, 3, 64), "mha": (4, 4, 32), "g8": (16, 2, 128)}
TOLERANCE = {mx.bfloat16: 8e-3, mx.float32: 2e-5}  # of the largest |output|, against float64


def attention_layers(target) -> list[SelfAttention]:
    return [m for m in target.mixer_layers() if isinstance(m, SelfAttention)]


def tiled(segments: list[attention_kernel.Rows], scale: float, meta: mx.array | None = None,
          queries: mx.array | None = None, block: None = None, layer: int | None = None) -> mx.array:
    """What the kernel computes, as dense.py's tiled path does it per segment (exact on CPU); where `meta`
    (the launch's layout) places a segment at a device start, at that start (its `start` an upper bound). Packed
    `queries`, where given, must be the segments' query rows in order; with `layer`, each joint cache is every
    layer's (stacked_cache.py's) and the layer's is read."""
    assert block is None, "the stand-in reads keys from the caches alone"
    if queries is not None:
        assert mx.array_equal(queries, mx.concatenate([q for q, _, _, _ in segments])).item()
    outs = []
    rows = sum(q.shape[0] for q, _, _, _ in segments)
    for i, (q, k, v, start) in enumerate(segments):
        if v is None:  # a joint cache: keys then values (cache.py's JointCache), of layer `layer` where given
            k, v = k[2 * (layer or 0)], k[2 * (layer or 0) + 1]
        n, kr = q.shape[0], tiles_for(start + q.shape[0])
        at = start if meta is None else meta[2 + rows + 4 * i + 1]
        seen = key_mask(query_positions(at, n), 0, kr, at + n)
        o = attention(pad_queries(q.transpose(1, 0, 2)), k[:, :kr], v[:, :kr], seen, scale=scale)[:, :n]
        outs.append(o.transpose(1, 0, 2))
    return mx.concatenate(outs)


# -- everywhere: which path, the launch's shape, and that the engine and the self-check run it --------
def test_the_kernel_runs_only_where_mlx_computes_on_a_cuda_gpu() -> None:
    cpu, gpu = mx.Device(mx.DeviceType.cpu), mx.Device(mx.DeviceType.gpu)
    for heads in HEADS.values():
        assert fits(*heads)
        assert kernel_runs_here(heads, gpu, cuda=True)
        assert not kernel_runs_here(heads, cpu, cuda=True)  # a CUDA build told to use its CPU
        assert not kernel_runs_here(heads, gpu, cuda=False)  # a Metal GPU
    for heads in ((6, 4, 64), (8, 2, 96), (8, 2, 512), (34, 2, 64)):  # a partial group, head dims, a group of 17
        assert not fits(*heads) and not kernel_runs_here(heads, gpu, cuda=True), heads
    for family in ("llama", "qwen3", "qwen3_5"):
        for size, covered in (("small", False), ("smol", ON_CUDA)):  # heads of 16, which no lane split covers; of 64
            target, _ = tiny_target(family, size, layers=4, seed=30)
            layers = attention_layers(target)
            assert layers and {(m.kernel, m.path) for m in layers} == {(covered, "kernel" if covered else "tiled")}


def test_the_geometry_covers_every_row_with_whole_blocks() -> None:
    for group in range(1, attention_kernel.MAX_GROUP + 1):
        for rows in (1, 2, 3, 5, 8, 9, 16, 17, 40):
            g = geometry(group, rows)
            assert g.rb in (1, 2, 4, 8) and g.rb <= max(1, 64 // group), (group, rows, g)
            assert g.rb * g.rg >= rows and g.rb * (g.rg - 1) < rows
            assert g.nw * g.qpw >= g.rb * group and g.qpw <= 8 and g.nw in (4, 8)
    assert geometry(4, 1) == attention_kernel.Geometry(rb=1, nw=4, qpw=1, rg=1)  # a plain step: one pair a warp
    assert geometry(4, 16) == attention_kernel.Geometry(rb=8, nw=8, qpw=4, rg=2)  # a 9B verify window
    for group, rows in ((0, 1), (17, 1), (4, 0)):
        with pytest.raises(ValueError):
            geometry(group, rows)


def test_a_launch_shape_is_checked_and_made_once_then_kept(monkeypatch) -> None:
    """Every attention layer of a forward launches the same shape: its segments are checked and its two launches'
    options made at the first (`prepare`), and the later ones launch the kept kernel objects with the same options
    (MLX's `cuda_kernel` stood in for: no constants at a call). Another start is another shape; launch objects made
    again (a stand-in installed, the caches cleared) are not served a kept launch of the old ones."""
    made, calls, checks = [], [], []

    def cuda_kernel(**spec):
        made.append(spec["name"])
        return lambda **launch: calls.append((spec["name"], launch)) or [
            mx.zeros(s, dtype=d) for s, d in zip(launch["output_shapes"], launch["output_dtypes"])]

    check = attention_kernel.check_segments
    monkeypatch.setattr(attention_kernel, "check_segments", lambda *a: checks.append(1) or check(*a))
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    monkeypatch.setattr(attention_kernel, "ONEPASS_PARTS", 0)  # two launches a call (one: the one-pass tests)
    monkeypatch.setattr(attention_kernel, "_LAUNCHES", {})
    for cache in (attention_kernel._partial_kernel, attention_kernel._combine_kernel):
        cache.cache_clear()
    q, kv = mx.zeros((1, 8, 64), dtype=mx.bfloat16), mx.zeros((2, 2, 256, 64), dtype=mx.bfloat16)
    for _ in range(3):
        out = decode_attention([(q, kv, None, 130)], 0.125, queries=q)
        assert out.shape == (1, 8, 64)
    assert len(checks) == 1 and len(made) == 2 and len(calls) == 6
    assert all("template" not in launch for _, launch in calls)
    assert calls[0][1]["grid"][0] == 2 * calls[0][1]["threadgroup"][0]  # two partitions reach position 130
    decode_attention([(q, kv, None, 100)], 0.125, queries=q)
    assert len(checks) == 2 and calls[-2][1]["grid"][0] == calls[-2][1]["threadgroup"][0]  # one partition
    for cache in (attention_kernel._partial_kernel, attention_kernel._combine_kernel):
        cache.cache_clear()
    decode_attention([(q, kv, None, 130)], 0.125, queries=q)
    assert len(checks) == 3 and len(made) == 4
    for cache in (attention_kernel._partial_kernel, attention_kernel._combine_kernel):
        cache.cache_clear()


def test_a_short_context_takes_one_launch_and_split_launches_makes_it_two(monkeypatch) -> None:
    """Rows reaching at most ONEPASS_PARTS partitions take one launch (its block walking them all: one block along
    x) and more take two (a block a partition, then pass 2); `split_launches` makes even a short context's two, as
    the warm-up builds its decode shapes so that a long context's variants are compiled before ready (warmup.py)."""
    calls = []

    def cuda_kernel(**spec):
        return lambda **launch: calls.append((spec["name"], launch["grid"][0] // launch["threadgroup"][0])) or [
            mx.zeros(s, dtype=d) for s, d in zip(launch["output_shapes"], launch["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    monkeypatch.setattr(attention_kernel, "_LAUNCHES", {})
    for cache in (attention_kernel._partial_kernel, attention_kernel._combine_kernel):
        cache.cache_clear()
    q, kv = mx.zeros((1, 8, 64), dtype=mx.bfloat16), mx.zeros((2, 2, 1024, 64), dtype=mx.bfloat16)
    parts = attention_kernel.ONEPASS_PARTS
    short, long = PARTITION * parts - 1, PARTITION * parts
    decode_attention([(q, kv, None, short)], 0.125, queries=q)
    assert [("onepass" in name, blocks) for name, blocks in calls] == [(True, 1)]
    calls.clear()
    decode_attention([(q, kv, None, long)], 0.125, queries=q)  # its row at key 512: a fifth partition
    assert [("onepass" in name, blocks) for name, blocks in calls] == [(False, attention_kernel.ONEPASS_PARTS + 1),
                                                                        (False, 1)]
    calls.clear()
    with attention_kernel.split_launches():
        decode_attention([(q, kv, None, short)], 0.125, queries=q)
    assert [("onepass" in name, blocks) for name, blocks in calls] == [(False, attention_kernel.ONEPASS_PARTS), (False, 1)]
    assert attention_kernel.ONEPASS_PARTS == parts  # put back
    for cache in (attention_kernel._partial_kernel, attention_kernel._combine_kernel):
        cache.cache_clear()


def test_bad_arguments_are_refused_before_any_launch() -> None:
    """Checked on the host, so these run on a CPU too: nothing is launched."""
    q, k = mx.zeros((2, 8, 64)), mx.zeros((2, 64, 64))
    bad = {
        "no segment": [],
        "heads not a group": [(mx.zeros((2, 6, 64)), mx.zeros((4, 64, 64)), mx.zeros((4, 64, 64)), 0)],
        "a head dim the lanes do not split": [(mx.zeros((2, 8, 48)), mx.zeros((2, 64, 48)), mx.zeros((2, 64, 48)), 0)],
        "mixed dtypes": [(q.astype(mx.bfloat16), k, k, 0)],
        "v unlike k": [(q, k, mx.zeros((2, 128, 64)), 0)],
        "another segment's heads": [(q, k, k, 0), (mx.zeros((1, 4, 64)), k, k, 0)],
        "rows past the cache": [(q, k, k, 63)],
        "a capacity not in whole chunks": [(q, mx.zeros((2, 40, 64)), mx.zeros((2, 40, 64)), 0)],
        "no rows": [(mx.zeros((0, 8, 64)), k, k, 0)],
        "a cache without heads": [(q, mx.zeros((64, 64)), mx.zeros((64, 64)), 0)],
        "a second segment's cache without heads": [(q, k, k, 0), (q, mx.zeros((2, 64)), mx.zeros((2, 64)), 0)],
        "a joint cache without its values": [(q, mx.zeros((1, 2, 64, 64)), None, 0)],
        "a joint cache without heads": [(q, mx.zeros((2, 64, 64)), None, 0)],
        "a joint cache beside two arrays": [(q, k, k, 0), (q, mx.stack([k, k]), None, 0)],
        "another segment's joint cache heads": [(q, mx.stack([k, k]), None, 0), (q, mx.zeros((2, 4, 64, 64)), None, 0)],
    }
    for why, segments in bad.items():
        with pytest.raises(ValueError):
            decode_attention(segments, 0.125)
            pytest.fail(why)
    for why, packed in {"packed queries of other rows": mx.zeros((3, 8, 64)), "packed queries in bf16 beside a float32 "
                        "cache": mx.zeros((2, 8, 64), dtype=mx.bfloat16)}.items():
        with pytest.raises(ValueError, match="packed queries"):
            decode_attention([(q, k, k, 0)], 0.125, queries=packed)
            pytest.fail(why)
    for why, (segments, layer) in {"a layer of two arrays": ([(q, k, k, 0)], 0), "a layer past the caches": (
            [(q, mx.stack([k, k, k, k]), None, 0)], 2), "a negative layer": ([(q, mx.stack([k, k]), None, 0)], -1),
            "layers of an odd count": ([(q, mx.stack([k, k, k]), None, 0)], 0)}.items():
        with pytest.raises(ValueError):
            decode_attention(segments, 0.125, layer=layer)
            pytest.fail(why)
    for why, block in {"a block of other rows": mx.zeros((2, 2, 3, 64)), "a block in another dtype": mx.zeros(
            (2, 2, 2, 64), dtype=mx.bfloat16), "a block without its values": mx.zeros((1, 2, 2, 64))}.items():
        with pytest.raises(ValueError):
            decode_attention([(q, k, k, 0)], 0.125, block=block)
            pytest.fail(why)


def test_every_decode_segment_goes_through_one_launch_a_layer_onto_its_own_rows(monkeypatch) -> None:
    """On the kernel path each layer makes one call with every decode segment (a prompt chunk takes SDPA),
    each with its stream's whole cache and start; with the call standing in as the tiled path, the
    forward's logits are those of the tiled path bit for bit (qwen3_5's output gate included). A target's
    cache holds keys and values in one array (cache.py's JointCache), which the launch reads as it is."""
    calls: list[list[tuple[int, int, int]]] = []

    def spy(segments, scale, meta=None, queries=None, block=None, layer=None):
        assert all(v is None and k.ndim == 4 for _, k, v, _ in segments)
        calls.append([(q.shape[0], start, k.shape[2]) for q, k, v, start in segments])
        return tiled(segments, scale, meta, queries, block, layer)

    monkeypatch.setattr(attention_kernel, "decode_attention", spy)
    for family in ("qwen3", "qwen3_5"):
        target, _ = tiny_target(family, "small", layers=4, seed=31)
        layers = attention_layers(target)
        logits = {}
        for path in ("tiled", "kernel"):
            for m in layers:
                m.path = path
            window_state, step_state = target.new_state(), target.new_state()
            for state, prompt in ((window_state, list(range(30, 50))), (step_state, list(range(60, 69)))):
                target.forward([Segment(prompt, 0, state, prefill=True)])
                state.keep(len(prompt))
            calls.clear()
            outs = target.forward([Segment(list(range(100, 140)), 0, target.new_state(), [39], prefill=True),
                                   Segment([7, 8, 9, 10, 11], 20, window_state, list(range(5))),
                                   Segment([12], 9, step_state, [0])])
            logits[path] = [o.logits for o in outs]
        i = target.mixer_layers().index(layers[0])
        whole = window_state.layers[i].k.shape[1], step_state.layers[i].k.shape[1]  # the caches, not views
        assert whole[0] > tiles_for(25) and calls == [[(5, 20, whole[0]), (1, 9, whole[1])]] * len(layers)
        assert all(mx.array_equal(a, b).item() for a, b in zip(logits["tiled"], logits["kernel"])), family


def test_a_segment_at_a_device_start_is_launched_at_it(monkeypatch) -> None:
    """A window placed at a device start (cache.py's keep_at: its host start an upper bound) goes into the
    launch's layout at that start, every row's position with it, while the bound sizes the launch: the
    layout equals the one of the same rows at a host start but for pmax, and with the call standing in as
    the tiled path the forward's logits are the host start's bit for bit."""
    monkeypatch.setattr(attention_kernel, "decode_attention", tiled)
    target, _ = tiny_target("qwen3", "small", layers=2, seed=33)
    for m in attention_layers(target):
        m.path = "kernel"
    prompt, window = list(range(30, 90)), [7, 8, 9, 10, 11]
    logits, metas = [], []
    for device in (False, True):
        state = target.new_state()
        target.forward([Segment(prompt, 0, state, prefill=True)])
        state.keep(len(prompt))
        target.forward([Segment(list(range(200, 216)), len(prompt), state)])  # a window, then 3 of it kept
        if device:
            state.keep_at(mx.array(len(prompt) + 3, dtype=mx.int32), len(prompt) + 16, len(prompt) + 1)
        else:
            state.keep(len(prompt) + 3)
        seg = Segment(window, state.length, state, list(range(len(window))), at=state.at)
        c = state.layers[0]
        metas.append(attention_kernel.launch_meta([(mx.zeros((5, 4, 16)), c.k, c.v, seg.start)], [seg.at]).tolist())
        logits.append(target.forward([seg])[0].logits)
    host, device = metas
    assert host[2:] == [63, 64, 65, 66, 67, 0, 63, 5, host[-1]] and device[2:] == host[2:] and device[0] >= host[0]
    assert mx.array_equal(logits[0], logits[1]).item()


@pytest.mark.parametrize("causal", [True, False])
def test_a_layout_at_device_starts_is_the_host_layout_in_a_few_operations(causal: bool) -> None:
    """`launch_meta` with some segments' starts on the device (cache.py's keep_at) holds the values of the
    layout at those starts on the host, whichever segments they are, and costs the host two operations for
    one device start and three for several (a decode round pays per operation), by the census the GPU
    figures were counted with (tools/forward_ops.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from forward_ops import VIEWS, census

    cache = mx.zeros((2, 512, 16))
    rows = [mx.zeros((n, 4, 16)) for n in (16, 1, 9, 16)]
    starts = [300, 41, 7, 128]
    host = attention_kernel.launch_meta([(q, cache, cache, s) for q, s in zip(rows, starts)], None, causal).tolist()
    for on_device in [(0,), (3,), (1, 2), (0, 1, 2, 3)]:
        ats = [mx.array(s, dtype=mx.int32) if i in on_device else None for i, s in enumerate(starts)]
        meta = attention_kernel.launch_meta([(q, cache, cache, s) for q, s in zip(rows, starts)], ats, causal)
        ops = sum(n for name, n in census([meta]).items() if name not in VIEWS)
        assert ops == (2 if len(on_device) == 1 else 3), (on_device, census([meta]))
        assert meta.tolist() == host, on_device


def test_the_self_check_tries_the_kernel_first_keys_it_and_falls_back(monkeypatch) -> None:
    target, _ = tiny_target("qwen3", "small", layers=2, seed=32)
    a = attention_layers(target)[0]
    before = selfcheck.attention_key(a)
    a.kernel = True
    assert selfcheck.attention_key(a) != before and selfcheck.attention_paths(a)[0] == "kernel"
    monkeypatch.setattr(attention_kernel, "decode_attention", tiled)
    assert selfcheck.attention_fault(a, mx.float32, "kernel") is None

    def skewed(segments, scale):  # rows that follow how many rows share the launch
        return tiled(segments, scale) + sum(q.shape[0] for q, *_ in segments) * 2**-10

    def broken(segments, scale):
        raise RuntimeError("nvrtc: no such device")

    def two_launches_off(segments, scale):  # right in one launch, off where a launch takes two (a long context)
        out = tiled(segments, scale)
        return out + 2**-10 if attention_kernel.partitions(segments) > attention_kernel.ONEPASS_PARTS else out

    far = attention_kernel.PARTITION * attention_kernel.ONEPASS_PARTS - selfcheck.WINDOW // 2
    for impostor, why in ((skewed, "kernel window rows"), (broken, "the kernel failed"),
                          (two_launches_off, f"kernel window rows [0, 1, 2, 3]... from position {far}")):
        monkeypatch.setattr(attention_kernel, "decode_attention", impostor)
        fault = selfcheck.attention_fault(a, mx.float32, "kernel")
        assert fault is not None and fault.startswith(why), fault
        path, result = selfcheck._first_exact("attention", selfcheck.attention_paths(a),
                                              lambda p: selfcheck.attention_fault(a, mx.float32, p), str)
        assert path == "tiled" and result.passed and why in result.choice


# -- on any machine with g++: the kernel's CUDA source, run by tests/cuda_emulator.py ------------------
@cuda_emulator.needs_gxx
def test_the_kernel_source_run_on_a_cpu_is_exact_and_right(monkeypatch) -> None:
    """The source's indexing, staging, masking and barriers, without a GPU: a 4-row window across a
    partition and a chunk equals its rows one at a time (junk in the cache after each), segments together
    equal each alone and their queries handed packed (bf16 or float32) the same, every element is written, and
    it agrees with the float64 reference."""
    cuda_emulator.install(monkeypatch)
    seed = secrets.randbits(31)
    heads, scale = (4, 2, 64), 64**-0.5
    segments = inputs(heads, [4, 1, 4], [PARTITION - 2, 9, 300], mx.bfloat16, seed)
    together = decode_attention(segments, scale)
    assert mx.all(mx.isfinite(together)).item(), f"seed {seed}: elements left unwritten"
    want = reference(segments, scale)
    error = np.abs(np.array(together.astype(mx.float32), dtype=np.float64) - want).max() / np.abs(want).max()
    assert error <= TOLERANCE[mx.bfloat16], f"seed {seed}: {error:.2e} relative"
    assert same(together, mx.concatenate([decode_attention([s], scale) for s in segments])), f"seed {seed}"
    # the segments' query rows handed packed (as one forward holds them): read as they are, the same bits
    packed = mx.concatenate([q for q, _, _, _ in segments])
    assert same(decode_attention(segments, scale, queries=packed), together), f"seed {seed}"
    assert same(decode_attention(segments, scale, queries=packed.astype(mx.float32)), together), f"seed {seed}"
    q, k, v, start = segments[0]
    [(_, junk_k, junk_v, _)] = inputs(heads, [4], [start], mx.bfloat16, seed + 1)
    positions = mx.arange(k.shape[1])[None, :, None]
    for t in range(4):
        seen = positions <= start + t
        step = decode_attention([(q[t : t + 1], mx.where(seen, k, junk_k), mx.where(seen, v, junk_v), start + t)], scale)
        assert same(step, together[t : t + 1]), f"seed {seed}: row {t}"


ONEPASS_CASES = [  # (rows a segment, starts, causal, window, block): targets' windows and steps, a drafter's blocks
    ([4, 1, 4], [PARTITION - 2, 9, 300], True, None, False),
    ([16], [3 * PARTITION + 5], True, None, False),
    ([8, 8], [40, 2 * PARTITION - 3], False, 40, True),
    ([8], [PARTITION + 20], False, PARTITION + 3, True),
]


def onepass_equals_two(monkeypatch, dtype: mx.Dtype, rows: list[int], starts: list[int], causal: bool,
                       window: int | None, block: bool) -> None:
    """A launch run as one (every partition walked by one block, then combined: ONEPASS_PARTS) and as two (a block a
    partition, then pass 2) gives the same bits, and the one launch is one (float32 caches: every bit of the
    combine's float32 arithmetic reaches the output, where bf16's rounding hides most)."""
    seed = secrets.randbits(31)
    heads, scale = (4, 2, 64), 64**-0.5
    segments = inputs(heads, rows, starts, dtype, seed)
    kv = None
    if block:  # a drafter's block: its rows' own keys and values beside the caches
        kv = mx.random.normal((2, 2, sum(rows), 64), key=mx.random.key(seed + 1)).astype(dtype)
    launches: list[str] = []
    partial = attention_kernel._partial_kernel

    def counted(*args, **kwargs):
        launches.append("onepass" if kwargs.get("onepass", args[4] if len(args) > 4 else False) else "partial")
        return partial(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "_partial_kernel", counted)
    results = {}
    for parts in (0, 64):
        monkeypatch.setattr(attention_kernel, "ONEPASS_PARTS", parts)
        launches.clear()
        results[parts] = decode_attention(segments, scale, causal=causal, window=window, block=kv)
        assert launches == ["onepass" if parts else "partial"], launches
    assert mx.all(mx.isfinite(results[64])).item(), f"seed {seed}: elements left unwritten"
    assert same(results[64], results[0]), f"seed {seed}"


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", ONEPASS_CASES, ids=["windows", "past-three-partitions", "blocks-window", "block-wide"])
def test_one_launch_walking_every_partition_equals_two_bit_for_bit(monkeypatch, case, dtype) -> None:
    """Under the emulator: the one-pass launch (a block walks every partition its rows reach, stores each one's
    partials as pass 1 does, then each warp combines its own rows and heads with pass 2's arithmetic) equals pass 1
    and pass 2, bit for bit, for targets' windows and steps across partitions and for a drafter's blocks with
    their masks."""
    cuda_emulator.install(monkeypatch)
    onepass_equals_two(monkeypatch, dtype, *case)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", ONEPASS_CASES, ids=["windows", "past-three-partitions", "blocks-window", "block-wide"])
def test_on_the_device_one_launch_equals_two_bit_for_bit(monkeypatch, case, dtype) -> None:
    """The one-pass launch equals the two on a CUDA GPU, bit for bit (the device's own `expf` in both)."""
    onepass_equals_two(monkeypatch, dtype, *case)


@cuda_emulator.needs_gxx
def test_the_kernel_source_at_device_starts_equals_host_starts(monkeypatch) -> None:
    """Segments whose starts are device values (cache.py's keep_at) with upper bounds up to a partition
    and a chunk past them, launched through `launch_meta`'s device layout: the rows of the same segments
    at their host starts, bit for bit (blocks past a row's keys return at once; the combine reads the
    row's own partitions)."""
    cuda_emulator.install(monkeypatch)
    seed = secrets.randbits(31)
    heads, scale = (4, 2, 64), 64**-0.5
    segments = inputs(heads, [4, 1, 4], [PARTITION - 2, 9, 300], mx.bfloat16, seed)
    want = decode_attention(segments, scale)
    bounds = [(q, k, v, start + extra) for (q, k, v, start), extra in zip(segments, (15, 31, 0))]
    ats = [mx.array(start, dtype=mx.int32) for _, _, _, start in segments]
    got = decode_attention(bounds, scale, attention_kernel.launch_meta(bounds, ats))
    assert same(got, want), f"seed {seed}"


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("causal, window", [(False, None), (True, 40), (False, 40), (False, PARTITION + 3)],
                         ids=["bidirectional", "causal-window", "bidirectional-window", "window-past-a-partition"])
def test_the_kernel_source_runs_a_drafter_blocks_masks(monkeypatch, causal, window) -> None:
    """A drafter's block pass (drafters/dflash.py) takes the kernel with its layers' masks: every row of a
    segment seeing all of it, and a sliding window back from each row's own position. The source agrees
    with the float64 reference under those masks (partitions below a row's window combine as exact zeros,
    so none is NaN), writes every element, and at device starts (`launch_meta` of the same causality)
    equals host starts bit for bit."""
    cuda_emulator.install(monkeypatch)
    seed = secrets.randbits(31)
    heads, scale = (4, 2, 64), 64**-0.5
    segments = inputs(heads, [4, 1, 5], [PARTITION - 2, 300, 9], mx.bfloat16, seed)
    got = decode_attention(segments, scale, causal=causal, window=window)
    assert mx.all(mx.isfinite(got)).item(), f"seed {seed}: elements left unwritten"
    want = reference(segments, scale, causal, window)
    error = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - want).max() / np.abs(want).max()
    assert error <= TOLERANCE[mx.bfloat16], f"seed {seed}: {error:.2e} relative"
    if causal and window is None:
        return
    other = reference(segments, scale, True, None)  # the masks matter at these shapes
    assert np.abs(other - want).max() > 10 * TOLERANCE[mx.bfloat16] * np.abs(want).max()
    bounds = [(q, k, v, start + extra) for (q, k, v, start), extra in zip(segments, (15, 31, 0))]
    ats = [mx.array(start, dtype=mx.int32) for _, _, _, start in segments]
    meta = attention_kernel.launch_meta(bounds, ats, causal)
    assert same(decode_attention(bounds, scale, meta, causal, window), got), f"seed {seed}"


BLOCK_MASKS = pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 40), (False, PARTITION + 3)],
                                      ids=["causal", "bidirectional", "causal-window", "window-past-a-partition"])


@cuda_emulator.needs_gxx
@BLOCK_MASKS
def test_the_kernel_source_reads_a_blocks_keys_from_its_own_rows_as_from_the_cache(monkeypatch, causal, window) -> None:
    """`block`: a drafter's block K/V read from the launch's own (2, Hkv, rows, D) rows, keys before each
    segment's start from its cache, give the bits of the same block written into the caches at its start first,
    at host starts and at device starts (the stale rows past each block left as junk in the caches); a cache
    need not hold the block (the third's capacity ends at its start); each stream's keys and values in one joint
    cache (a drafter's) give the bits of the two arrays. The control changes one block value: the rows that see
    it change (`block_rows_as_written`)."""
    cuda_emulator.install(monkeypatch)
    block_rows_as_written(causal, window)


@BLOCK_MASKS
@on_cuda
def test_on_the_device_a_blocks_keys_from_its_own_rows_equal_them_written_first(causal, window) -> None:
    """The same on the device: the launch that reads a drafter's block K/V from its own rows has the bits of
    the block written into the caches first, and from joint caches those of two arrays (`block_rows_as_written`)."""
    block_rows_as_written(causal, window)


def block_rows_as_written(causal: bool, window: int | None) -> None:
    """`decode_attention` with `block` against the same block written into the caches, at host and device
    starts, from two arrays a stream and from one joint cache, and a changed block value moving exactly the
    rows that see it."""
    seed = secrets.randbits(31)
    heads, scale = (4, 2, 64), 64**-0.5
    segments = inputs(heads, [4, 1, 5], [PARTITION - 2, 300, 64], mx.bfloat16, seed)
    [(_, block_k, block_v, _)] = inputs(heads, [10], [0], mx.bfloat16, seed + 1)
    block = mx.stack([block_k[:, :10], block_v[:, :10]])  # every segment's rows' keys, then values
    written, bare, row0 = [], [], 0
    for q, k, v, start in segments:
        n = q.shape[0]
        written.append((q, mx.concatenate([k[:, :start], block_k[:, row0 : row0 + n], k[:, start + n :]], axis=1),
                        mx.concatenate([v[:, :start], block_v[:, row0 : row0 + n], v[:, start + n :]], axis=1), start))
        cap = start if start % CHUNK == 0 else k.shape[1]  # the third: no room for its block
        bare.append((q, k[:, :cap], v[:, :cap], start))
        row0 += n
    want = decode_attention(written, scale, causal=causal, window=window)
    got = decode_attention(bare, scale, attention_kernel.launch_meta(bare, causal=causal), causal, window, block=block)
    assert same(got, want), f"seed {seed}"
    bounds = [(q, k, v, start + extra) for (q, k, v, start), extra in zip(bare, (15, 0, 0))]
    ats = [mx.array(start, dtype=mx.int32) for _, _, _, start in bare]
    meta = attention_kernel.launch_meta(bounds, ats, causal)
    assert same(decode_attention(bounds, scale, meta, causal, window, block=block), want), f"seed {seed}"
    for segs in (bare, bounds):  # each stream's keys and values in one joint cache: the launch reads both from it
        joint = [(q, mx.stack([k, v]), None, start) for q, k, v, start in segs]
        ats_or_none = None if segs is bare else ats
        meta = attention_kernel.launch_meta(joint, ats_or_none, causal)
        assert meta.tolist() == attention_kernel.launch_meta(segs, ats_or_none, causal).tolist()
        assert same(decode_attention(joint, scale, meta, causal, window, block=block), want), f"seed {seed}"
        # every layer's joint caches (stacked_cache.py's), the stream's as layer 1 of 3: read at its offset in place
        layered = [(q, mx.concatenate([kv + 1, kv, kv - 1]), None, start) for q, kv, _, start in joint]
        assert same(decode_attention(layered, scale, meta, causal, window, block=block, layer=1), want), f"seed {seed}"
        assert not same(decode_attention(layered, scale, meta, causal, window, block=block, layer=2), want)
    changed = mx.array(block)
    changed[0, 1, 4 + 1 + 2, 3] = changed[0, 1, 4 + 1 + 2, 3] + 4.0  # the third segment's row 2, kv head 1
    moved = mx.all(decode_attention(bare, scale, None, causal, window, block=changed) == got, axis=(1, 2)).tolist()
    seen = [r >= 2 or not causal for r in range(5)]  # the third's rows that see its row 2
    assert moved == [True] * 5 + [not s for s in seen], f"seed {seed}: {moved}"


# -- on a CUDA GPU: the kernel itself ------------------------------------------------------------------
def inputs(heads: tuple[int, int, int], rows: list[int], starts: list[int], dtype: mx.Dtype, seed: int):
    """Segments of fresh normal queries and caches, each cache a whole number of 64-key tiles."""
    hq, hkv, d = heads
    keys = iter(mx.random.split(mx.random.key(seed), 3 * len(rows)))
    out = []
    for n, start in zip(rows, starts):
        cap = tiles_for(start + n) + 64
        q = mx.random.normal((n, hq, d), key=next(keys)).astype(dtype)
        k = mx.random.normal((hkv, cap, d), key=next(keys)).astype(dtype)
        v = mx.random.normal((hkv, cap, d), key=next(keys)).astype(dtype)
        out.append((q, k, v, start))
    return out


def reference(segments: list[attention_kernel.Rows], scale: float, causal: bool = True,
              window: int | None = None) -> np.ndarray:
    """Attention in float64 numpy: causal (or every row seeing its whole segment), within `window`
    positions back from each row's own where given."""
    outs = []
    for q, k, v, start in segments:
        q64, k64, v64 = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, k, v))
        n, hq, d = q64.shape
        hkv, keys = k64.shape[0], start + n
        s = np.einsum("nkgd,kld->nkgl", q64.reshape(n, hkv, hq // hkv, d), k64[:, :keys]) * scale
        key, row = np.arange(keys)[None, :], start + np.arange(n)[:, None]
        unseen = (key > row) if causal else np.zeros((n, keys), dtype=bool)  # (rows, keys)
        if window is not None:
            unseen |= row - key >= window
        s = np.where(unseen[:, None, None, :], -np.inf, s)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        outs.append(np.einsum("nkgl,kld->nkgd", w, v64[:, :keys]).reshape(n, hq, d))
    return np.concatenate(outs)


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_the_kernel_agrees_with_a_float64_reference_and_writes_every_element(heads, dtype) -> None:
    seed = secrets.randbits(31)
    segments = inputs(heads, [1, 16, 5, 3], [0, 250, 1000, 4090], dtype, seed)
    scale = heads[2] ** -0.5
    rows = sum(q.shape[0] for q, *_ in segments)
    # poison: freed NaN buffers of the output's size, which the allocator hands to the launch's outputs
    poison = [mx.full((rows, heads[0], heads[2]), float("nan"), dtype=dtype) for _ in range(4)]
    mx.eval(poison)
    del poison
    got = decode_attention(segments, scale)
    mx.eval(got)
    assert got.shape == (rows, heads[0], heads[2]) and got.dtype == dtype
    assert mx.all(mx.isfinite(got)).item(), f"seed {seed}: elements left unwritten"
    want = reference(segments, scale)
    error = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - want).max() / np.abs(want).max()
    assert error <= TOLERANCE[dtype], f"seed {seed}: {error:.2e} relative"


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("start", [0, 3, CHUNK - 5, PARTITION - 8, 1000, 4080], ids=lambda s: f"from{s}")
def test_a_window_equals_its_rows_one_at_a_time_bit_for_bit(heads, dtype, start) -> None:
    """Each step sees junk in its cache after its own position (what a step's cache holds is never the
    window's later rows), and a prefix window of every length equals the window's first rows."""
    seed = secrets.randbits(31)
    [(q, k, v, _)] = inputs(heads, [16], [start], dtype, seed)
    [(_, junk_k, junk_v, _)] = inputs(heads, [16], [start], dtype, seed + 1)
    scale = heads[2] ** -0.5
    window = decode_attention([(q, k, v, start)], scale)
    positions = mx.arange(k.shape[1])[None, :, None]
    for t in range(16):
        seen = positions <= start + t
        step = decode_attention([(q[t : t + 1], mx.where(seen, k, junk_k * 4), mx.where(seen, v, junk_v * 4), start + t)], scale)
        assert same(step, window[t : t + 1]), f"seed {seed}: row {t} from {start}"
        assert same(decode_attention([(q[: t + 1], k, v, start)], scale), window[: t + 1]), f"seed {seed}: prefix {t + 1}"


@on_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_segments_launched_together_equal_each_alone(heads, dtype) -> None:
    seed = secrets.randbits(31)
    rng = random.Random(seed)
    rows = [1, 16, 5, 2, 9, 1, 16, 3]
    starts = [rng.randrange(0, 3000) for _ in rows]
    segments = inputs(heads, rows, starts, dtype, seed)
    scale = heads[2] ** -0.5
    for count in (2, 3, 8):
        together = decode_attention(segments[:count], scale)
        alone = mx.concatenate([decode_attention([s], scale) for s in segments[:count]])
        assert same(together, alone), f"seed {seed}: {count} segments from {starts[:count]}"
    shuffled = list(range(8))
    rng.shuffle(shuffled)
    out = decode_attention([segments[i] for i in shuffled], scale)
    offsets = np.cumsum([0] + rows)
    cursor = 0
    for i in shuffled:
        alone = out[cursor : cursor + rows[i]]
        assert same(alone, decode_attention([segments[i]], scale)), f"seed {seed}: segment {i} in order {shuffled}"
        cursor += rows[i]
    assert cursor == offsets[-1]


def bf16_layer(family: str, seed: int) -> tuple[int, SelfAttention]:
    """A SmolLM2-sized target of `family` in bf16 (the gpu mode's activations) and its first attention layer."""
    cfg = config_dict(family, "smol", layers=4 if family == "qwen3_5" else 1)
    weights = {name: w.astype(mx.bfloat16) for name, w in canonical_weights(reference_model(cfg, seed)).items()}
    target = build_target(parse_target_config(cfg), weights, dtype=mx.bfloat16)
    return next((i, m) for i, m in enumerate(target.mixer_layers()) if isinstance(m, SelfAttention)), target


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_layers_decode_rows_take_one_norm_and_rope_launch_and_equal_its_steps(family: str, monkeypatch) -> None:
    """On the kernel path in bf16 (a CUDA GPU's gpu mode; here both launches' CUDA source under the emulator) a
    layer's decode rows take their q/k norms (none for llama), RoPE (qwen3_5's partial, its gated q rows read in
    place), the K/V stack and the queries' cast in one norm_rope_kernel.py launch: a 5-row window after 40 cached
    positions equals its rows decoded one at a time, bit for bit, and the chain it replaced (MLX's norms and
    RoPE, then the tile products) to bf16 accuracy; the control turns the rows one position on, which moves them."""
    cuda_emulator.install(monkeypatch)
    cuda_emulator.install_norm_rope(monkeypatch)
    (i, attn), target = bf16_layer(family, seed=41)
    attn.path = "kernel"
    launch = norm_rope_kernel.queries_and_keys
    turned: list[int] = []
    monkeypatch.setattr(norm_rope_kernel, "queries_and_keys",
                        lambda q, *a, **kw: turned.append(q.shape[0]) or launch(q, *a, **kw))
    rows, start, d = 5, 40, attn.head_dim
    mx.random.seed(7)
    q = mx.random.normal((rows, attn.heads * d * (2 if attn.gated else 1))).astype(mx.bfloat16)
    k, v = (mx.random.normal((rows, attn.kv_heads * d)).astype(mx.bfloat16) for _ in range(2))
    prefix = mx.random.normal((2, attn.kv_heads, start, d)).astype(mx.bfloat16)

    def decoded(spans: list[tuple[int, int]], shift: int = 0) -> mx.array:
        state = target.new_state()
        state.layers[i].write_joint(0, prefix)
        outs = [attn.decode(q[lo:hi], k[lo:hi], v[lo:hi], [(Segment([0] * (hi - lo), start + lo + shift, state),
                                                            (0, hi - lo))], i) for lo, hi in spans]
        return mx.concatenate(outs)

    window = decoded([(0, rows)])
    assert turned == [rows]
    assert same(window, decoded([(t, t + 1) for t in range(rows)])) and turned[1:] == [1] * rows
    attn.path = "tiled"
    chain = decoded([(0, rows)])
    assert len(turned) == 1 + rows  # the tiled path keeps MLX's norms and RoPE
    error = (mx.linalg.norm((window - chain).astype(mx.float32)) / mx.linalg.norm(chain.astype(mx.float32))).item()
    assert error < 2e-2, error
    attn.path = "kernel"
    moved = decoded([(0, rows)], shift=1)
    assert not mx.array_equal(moved, window).item()


# -- on a CUDA GPU: the engine with it -----------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    if not ON_CUDA:
        pytest.skip("the kernel runs only where MLX computes on a CUDA GPU")
    root = tmp_path_factory.mktemp("attention-kernel")
    pair = write_big("qwen3_5-9b-4bit", root / "target", "tiny"), write_big("dflash-9b", root / "drafter", "tiny")
    return Engine(*pair, Settings(parallel=2, context=512, chunk=32, backend="gpu"))


@on_cuda
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafted_equals_plain_with_the_kernel_in_gpu_mode(gpu_engine: Engine, temperature: float) -> None:
    assert {m.path for m in attention_layers(gpu_engine.target)} == {"kernel"}
    assert gpu_engine.selfcheck.passed, gpu_engine.selfcheck.line()
    rng = random.Random(int(temperature * 10))
    reqs = [dict(prompt=[rng.randrange(8, 1000) for _ in range(rng.randrange(20, 300))], max_tokens=12,
                 temperature=temperature, seed=i, ignore_eos=True) for i in range(2)]
    plain = [gpu_engine.generate(Request(**r, draft=False)).tokens for r in reqs]
    alone = [gpu_engine.generate(Request(**r)) for r in reqs]
    assert [r.tokens for r in alone] == plain and all(r.stats.drafted > 0 for r in alone)
    together = gpu_engine.run([Request(**r) for r in reqs])  # two streams' segments in one launch a layer
    assert [r.tokens for r in together] == plain
