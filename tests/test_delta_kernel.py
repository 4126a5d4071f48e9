"""qwen3_5's decode recurrence: the CUDA kernel on a CUDA GPU, mlx-lm's `gated_delta_ops` elsewhere
(engine/targets/delta_kernel.py, qwen3_5.py's `decode_recurrence`).

On any machine: a layer takes the kernel only when MLX computes on a GPU of a CUDA build and the
kernel's launch covers its heads; every decode segment of a forward goes through the layer's
recurrence in one call, and its rollback through the same one, which leaves for every acceptance
length the state of the kept rows fed one at a time; the self-check proves and keys the recurrence
the layer runs. Where g++ is (any machine): the kernel's CUDA source, run on the CPU by
tests/cuda_emulator.py with every buffer ending at a no-access page, stays inside its buffers, writes
every output, agrees with `gated_delta_ops` and keeps a window's rows equal to single rows and to
the same window launched alone. On a CUDA GPU only (skipped elsewhere): the kernel computes what `gated_delta_ops`
computes (1e-5 relative); a window's rows, and the state after them, are the bits of the same rows
one at a time, and so are windows of several streams in one launch; and the Qwen3.5-9B-shaped
fixture in gpu mode drafts exactly what it decodes plainly, alone and beside another stream.
"""

from __future__ import annotations

import dataclasses
import random
import shutil

import cuda_emulator
import pytest
from gpu import ON_CUDA, on_cuda
from tiny_targets import tiny_target

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from dflash_bench.engine import selfcheck
from dflash_bench.engine.cache import LinearCache, keep_windows
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.engine.targets import Segment, delta_kernel
from dflash_bench.engine.targets.delta_kernel import delta_windows, rollback, separate
from dflash_bench.engine.targets.qwen3_5 import (RECURRENCES, GatedDeltaNet, PackedRedo, decode_recurrence,
                                                 per_window_ops)
from dflash_bench.fixtures.big import write_big

# (key heads, value heads, key dim, value dim): the tiny targets', a Dv unlike Dk, Qwen3.5-9B's
HEADS = {"small": (2, 4, 16, 16), "smol": (2, 4, 64, 64), "dv48": (4, 4, 64, 48), "9b": (16, 32, 128, 128)}


def linear_layers(target) -> list[GatedDeltaNet]:
    return [m for m in target.mixer_layers() if isinstance(m, GatedDeltaNet)]


# -- everywhere: which recurrence, and that the engine and the self-check run it ----------------------
def test_the_kernel_is_chosen_only_where_mlx_computes_on_a_cuda_gpu() -> None:
    cpu, gpu = mx.Device(mx.DeviceType.cpu), mx.Device(mx.DeviceType.gpu)
    for heads in HEADS.values():
        assert decode_recurrence(heads, gpu, cuda=True) == "delta_kernel"
        assert decode_recurrence(heads, cpu, cuda=True) == "gated_delta_ops"  # a CUDA build told to use its CPU
        assert decode_recurrence(heads, gpu, cuda=False) == "gated_delta_ops"  # a Metal GPU
        assert decode_recurrence(heads, cpu, cuda=False) == "gated_delta_ops"
    # heads the launch does not cover: Hv not a multiple of Hk, Dk of 48, Dv x Dk lanes short of a warp
    for heads in ((3, 4, 16, 16), (2, 4, 48, 48), (2, 4, 8, 2)):
        assert decode_recurrence(heads, gpu, cuda=True) == "gated_delta_ops", heads
    target, _ = tiny_target("qwen3_5", "small", layers=4, seed=20)
    assert {m.recurrence for m in linear_layers(target)} == {"delta_kernel" if ON_CUDA else "gated_delta_ops"}


def test_every_decode_segment_and_the_rollback_go_through_the_layers_recurrence(monkeypatch) -> None:
    """One call per layer for all decode windows of a forward (a prompt chunk takes the chunked form),
    and `keep` of part of a window recomputes the kept rows with the same recurrence."""
    target, _ = tiny_target("qwen3_5", "small", layers=4, seed=21)  # 3 linear layers
    calls: list[list[int]] = []

    def spy(windows):
        calls.append([w[0].shape[0] for w in windows])
        return per_window_ops(windows)

    monkeypatch.setitem(RECURRENCES, "spy", spy)
    for m in linear_layers(target):
        m.recurrence = "spy"
    window_state, step_state = target.new_state(), target.new_state()
    for state, prompt in ((window_state, list(range(30, 50))), (step_state, list(range(60, 69)))):
        target.forward([Segment(prompt, 0, state, prefill=True)])
        state.keep(len(prompt))
    assert calls == []
    target.forward([Segment(list(range(100, 140)), 0, target.new_state(), [39], prefill=True),
                    Segment([7, 8, 9, 10, 11], 20, window_state, list(range(5))),
                    Segment([12], 9, step_state, [0])])
    assert calls == [[5, 1]] * 3
    window_state.keep(22)
    assert calls == [[5, 1]] * 3 + [[2]] * 3


def test_the_self_check_proves_and_keys_the_recurrence_the_layers_run(monkeypatch) -> None:
    """A recurrence whose rows follow the window's length, run by the layers, fails the check's
    recurrence path (so the check runs the layer's own, not a fixed one); a layer that changes
    recurrence changes the verdict's key."""
    target, _ = tiny_target("qwen3_5", "small", layers=2, seed=22)
    before = selfcheck.shapes(target)["recurrence"]
    assert all(key.endswith(m.recurrence) for key, m in zip(before, linear_layers(target)))

    def skewed(windows):
        return [(y + (w[0].shape[0] - 1) * 2**-10, s) for w, (y, s) in zip(windows, per_window_ops(windows))]

    monkeypatch.setitem(RECURRENCES, "skewed", skewed)
    for m in linear_layers(target):
        m.recurrence = "skewed"
    assert selfcheck.shapes(target)["recurrence"] != before
    fault = selfcheck.recurrence_fault(linear_layers(target)[0])
    assert fault is not None and fault.startswith("recurrence rows"), fault


# -- on a CUDA GPU: the kernel itself ------------------------------------------------------------------
def window(heads: tuple[int, int, int, int], n: int, seed: int) -> tuple[mx.array, ...]:
    """One stream's recurrence inputs as the layer makes them: normalized q and k, g from `compute_g`."""
    hk, hv, dk, dv = heads
    r = [mx.random.normal(shape, key=mx.random.key(seed * 10 + i))
         for i, shape in enumerate([(n, hk, dk), (n, hk, dk), (n, hv, dv), (n, hv), (n, hv), (hv, dv, dk), (hv,)])]
    q, k = normalize_qk(r[0], r[1], inv_scale=dk**-0.5, eps=1e-6)
    g = compute_g(mx.log(mx.abs(r[6]) * 8 + 1), r[3], mx.ones((hv,)))
    return q, k, r[2], g, mx.sigmoid(r[4]), r[5] * 0.1


def relative(got: mx.array, want: mx.array) -> float:
    return (mx.abs(got - want).max() / mx.abs(want).max()).item()


def delta_prefix(qkv, g: mx.array, beta: mx.array, state: mx.array, m: mx.array) -> mx.array:
    """The state `rollback` leaves after one window's first m rows (its conv tails are tested apart)."""
    conv = mx.zeros((2 + qkv.rows, 8), dtype=mx.bfloat16)
    [([kept], _)] = rollback([(qkv, g, beta, [state], conv)], (0, qkv.rows), mx.reshape(m, (1,)), (0,), 2)
    return kept


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


@on_cuda
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_the_kernel_computes_what_gated_delta_ops_computes(heads) -> None:
    windows = [window(heads, n, seed=n) for n in (1, 5, 16, 2)]
    for one in windows:
        [(y, s)], [(y_ref, s_ref)] = delta_windows([one]), per_window_ops([one])
        errors = relative(y, y_ref), relative(s, s_ref)
        assert max(errors) <= 1e-5, f"{one[0].shape[0]} rows: y {errors[0]:.2e}, state {errors[1]:.2e} relative"
    for (y, s), (y_ref, s_ref) in zip(delta_windows(windows), per_window_ops(windows)):
        assert relative(y, y_ref) <= 1e-5 and relative(s, s_ref) <= 1e-5


@on_cuda
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_a_window_equals_its_rows_one_at_a_time_bit_for_bit(heads) -> None:
    q, k, v, g, beta, state0 = window(heads, 16, seed=3)
    [(y, state)] = delta_windows([(q, k, v, g, beta, state0)])
    ys, s = [], state0
    for t in range(16):
        [(yt, s)] = delta_windows([(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)])
        ys.append(yt)
        [(_, prefix)] = delta_windows([(q[: t + 1], k[: t + 1], v[: t + 1], g[: t + 1], beta[: t + 1], state0)])
        assert same(prefix, s), f"the state after a window's first {t + 1} rows differs from single rows"
    assert same(y, mx.concatenate(ys)) and same(state, s)


@on_cuda
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_windows_of_several_streams_in_one_launch_equal_each_alone(heads) -> None:
    windows = [window(heads, n, seed=40 + i) for i, n in enumerate((1, 5, 16, 2))]
    together = delta_windows(windows)
    for one, (y, s) in zip(windows, together):
        [(y_alone, s_alone)] = delta_windows([one])
        assert same(y, y_alone) and same(s, s_alone)


# -- on any machine with g++: the kernel's CUDA source, run by tests/cuda_emulator.py ------------------
@cuda_emulator.needs_gxx
@pytest.mark.parametrize("heads", [HEADS["small"], (2, 4, 32, 32), (1, 2, 64, 16)], ids=["lanes16", "lanes32", "epl2"])
def test_the_kernel_source_run_on_a_cpu_stays_in_bounds_and_is_exact_and_right(monkeypatch, heads) -> None:
    """Windows of 1, 5 and 4 rows in one launch: every element written (finite), within 1e-5 of
    gated_delta_ops, each equal to its window launched alone, and the 4-row window's rows and state
    equal to its rows one at a time, bit for bit; any access past a buffer's end would have faulted."""
    cuda_emulator.install_delta(monkeypatch)
    windows = [window(heads, n, seed=60 + i) for i, n in enumerate((1, 5, 4))]
    together = delta_windows(windows)
    for one, (y, s), (y_ref, s_ref) in zip(windows, together, per_window_ops(windows)):
        assert mx.all(mx.isfinite(y)).item() and mx.all(mx.isfinite(s)).item(), "elements left unwritten"
        assert relative(y, y_ref) <= 1e-5 and relative(s, s_ref) <= 1e-5
        [(y_alone, s_alone)] = delta_windows([one])
        assert same(y, y_alone) and same(s, s_alone)
    q, k, v, g, beta, s = windows[2]
    ys = []
    for t in range(4):
        [(yt, s)] = delta_windows([(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)])
        ys.append(yt)
    assert same(together[2][0], mx.concatenate(ys)) and same(together[2][1], s)


@cuda_emulator.needs_gxx
def test_the_kernel_source_writes_bf16_rows_equal_to_its_float32_rows_cast(monkeypatch) -> None:
    """A QKV's `y_dtype`: the kernel's y written in bf16 (what qwen3_5.py's gated norm takes, no cast launched
    after it) equals its float32 y cast to bf16, bit for bit, for windows of 1 and 5 rows in one launch;
    the states are the float32 launch's."""
    cuda_emulator.install_delta(monkeypatch)
    windows = [window(HEADS["small"], n, seed=75 + i) for i, n in enumerate((1, 5))]
    q, k, v, g, beta = (mx.concatenate([w[i] for w in windows]) for i in range(5))
    wide, wide_states = delta_kernel.delta_packed(separate(q, k, v), g, beta, [w[5] for w in windows], (0, 1, 6))
    narrow, states = delta_kernel.delta_packed(dataclasses.replace(separate(q, k, v), y_dtype=mx.bfloat16), g, beta,
                                               [w[5] for w in windows], (0, 1, 6))
    assert wide.dtype == mx.float32 and narrow.dtype == mx.bfloat16
    assert same(narrow, wide.astype(mx.bfloat16)) and all(same(a, b) for a, b in zip(states, wide_states))


@cuda_emulator.needs_gxx
def test_the_kernel_source_launched_to_a_device_count_leaves_the_state_of_that_many_rows(monkeypatch) -> None:
    """What `keep_at` relies on (qwen3_5.py's `redo_fn`): a window launched with its end at a device
    count m (`rollback`) leaves, through the kernel's source, the state after its first m rows
    launched alone, bit for bit, for every m; at m = 0 the state it started from."""
    cuda_emulator.install_delta(monkeypatch)
    q, k, v, g, beta, state0 = window(HEADS["small"], 6, seed=70)
    for m in range(7):
        got = delta_prefix(separate(q, k, v), g, beta, state0, mx.array(m, dtype=mx.int32))
        want = state0
        if m:
            [(_, want)] = delta_windows([(q[:m], k[:m], v[:m], g[:m], beta[:m], state0)])
        assert same(got, want), f"kept {m}"


@cuda_emulator.needs_gxx
def test_the_kernel_source_reads_q_k_and_v_in_place_as_it_reads_them_apart(monkeypatch) -> None:
    """What the forward hands the kernel (qwen3_5.py's `decode`, delta_kernel.py's `in_place`): its normed
    qk and the conv's rows as they are, read at each row's stride and offset. Through the kernel's
    source, windows packed in one launch and every prefix a rollback launches (`delta_prefix`) give the
    bits the same q, k and v copied apart give; a layout that reads k where q lies does not."""
    cuda_emulator.install_delta(monkeypatch)
    hk, hv, dk, dv = HEADS["small"]
    rows, starts = 7, (0, 1, 4, 7)
    parts = [window(HEADS["small"], rows, seed=80 + i) for i in range(3)]
    q, k, v, g, beta, _ = parts[0]
    states = [p[5] for p in parts]
    qk = mx.concatenate([q, k], axis=1)  # (rows, 2 * hk, dk): q heads, then k heads
    mixed = mx.concatenate([mx.random.normal((rows, 2 * hk * dk), key=mx.random.key(9)), v.reshape(rows, hv * dv)], axis=1)
    read = delta_kernel.in_place(qk, mixed, 2 * hk * dk, hv, dv)
    assert all(same(a, b) for a, b in zip(read.views(), (q, k, v)))
    y, got = delta_kernel.delta_packed(read, g, beta, states, starts)
    y_apart, want = delta_kernel.delta_packed(separate(q, k, v), g, beta, states, starts)
    assert same(y, y_apart) and all(same(a, b) for a, b in zip(got, want))
    for m in range(4):
        kept = delta_prefix(read[1:4], g[1:4], beta[1:4], states[1], mx.array(m, dtype=mx.int32))
        assert same(kept, delta_prefix(separate(q[1:4], k[1:4], v[1:4]), g[1:4], beta[1:4], states[1],
                                       mx.array(m, dtype=mx.int32))), f"kept {m}"
    misread = dataclasses.replace(read, layout=(*read.layout[:3], 0, *read.layout[4:]))  # k read at q's offset
    assert not same(delta_kernel.delta_packed(misread, g, beta, states, starts)[0], y_apart)


@cuda_emulator.needs_gxx
def test_the_kernel_source_scales_q_and_k_as_it_loads_them_with_the_bits_of_scaling_first(monkeypatch) -> None:
    """qwen3_5.py's forward hands the kernel its q and k normed but not scaled, with the scales (`in_place`'s
    `scale`): through the kernel's source, the rows and states equal those of the same q and k scaled first
    (normalize_qk's float32 products) and read as they are, bit for bit, for packed windows and every prefix
    a rollback launches; the scales swapped give other rows, so the comparison can fail."""
    cuda_emulator.install_delta(monkeypatch)
    hk, hv, dk, dv = HEADS["small"]
    rows, starts = 6, (0, 1, 6)
    parts = [window(HEADS["small"], rows, seed=90 + i) for i in range(2)]
    q, k, v, g, beta, _ = parts[0]
    states = [p[5] for p in parts]
    normed = mx.concatenate([q, k], axis=1)  # stands for the normed, unscaled heads
    scale = mx.array([dk**-1.0, dk**-0.5], dtype=mx.float32)
    column = mx.array([dk**-1.0] * hk + [dk**-0.5] * hk, dtype=mx.float32)[:, None]
    mixed = mx.concatenate([mx.random.normal((rows, 2 * hk * dk), key=mx.random.key(8)), v.reshape(rows, hv * dv)], axis=1)
    folded = delta_kernel.in_place(normed, mixed, 2 * hk * dk, hv, dv, scale)
    first = delta_kernel.in_place(normed * column, mixed, 2 * hk * dk, hv, dv)
    assert all(same(a, b) for a, b in zip(folded.views(), first.views()))
    y, got = delta_kernel.delta_packed(folded, g, beta, states, starts)
    y_first, want = delta_kernel.delta_packed(first, g, beta, states, starts)
    assert same(y, y_first) and all(same(a, b) for a, b in zip(got, want))
    for m in range(6):
        kept = delta_prefix(folded[1:6], g[1:6], beta[1:6], states[1], mx.array(m, dtype=mx.int32))
        assert same(kept, delta_prefix(first[1:6], g[1:6], beta[1:6], states[1], mx.array(m, dtype=mx.int32))), m
    swapped = dataclasses.replace(folded, scale=scale[::-1])
    assert not same(delta_kernel.delta_packed(swapped, g, beta, states, starts)[0], y_first)


@cuda_emulator.needs_gxx
def test_a_rollback_launch_copies_each_windows_conv_tail_after_its_kept_rows(monkeypatch) -> None:
    """`rollback`'s conv tails: two windows packed (2 and 4 rows), their conv inputs laid end to end as a
    forward lays them (each its 3-row starting tail, then its rows), at every pair of kept counts: window i's
    tail is the 3 inputs from its start + its count, bit for bit (a copy), and its state is the one it leaves
    rolled back alone. A control handing the launch the other window's start gets the other rows."""
    cuda_emulator.install_delta(monkeypatch)
    q, k, v, g, beta, _ = window(HEADS["small"], 6, seed=71)
    states = [window(HEADS["small"], 1, seed=72 + i)[5] for i in range(2)]
    span, channels, starts = 3, 40, (0, 2, 6)
    conv = (mx.random.normal((2 * span + 6, channels), key=mx.random.key(73)) * 4).astype(mx.bfloat16)
    conv_starts = (0, span + 2)  # window 0's inputs: rows 0 .. 4; window 1's: rows 5 .. 11
    for m0 in range(3):
        for m1 in range(5):
            counts = mx.array([m0, m1], dtype=mx.int32)
            [(kept, tails)] = rollback([(separate(q, k, v), g, beta, states, conv)], starts, counts, conv_starts, span)
            for i, m in enumerate((m0, m1)):
                a, b = starts[i], starts[i + 1]
                assert same(tails[i], conv[conv_starts[i] + m : conv_starts[i] + m + span]), (m0, m1, i)
                alone = delta_prefix(separate(q[a:b], k[a:b], v[a:b]), g[a:b], beta[a:b], states[i],
                                     mx.array(m, dtype=mx.int32))
                assert same(kept[i], alone), (m0, m1, i)
    counts = mx.array([1, 1], dtype=mx.int32)
    [(_, swapped)] = rollback([(separate(q, k, v), g, beta, states, conv)], starts, counts, conv_starts[::-1], span)
    assert not same(swapped[0], conv[1 : 1 + span])


@cuda_emulator.needs_gxx
def test_windows_one_forward_ran_together_roll_back_in_one_launch_to_each_ones_own_state(monkeypatch) -> None:
    """cache.py's `keep_windows`: three streams' windows that one forward's kernel launch ran, kept at
    different device counts, leave through the kernel's source the conv and state each stream's own
    `keep_at` leaves, bit for bit, with one launch for both GatedDeltaNet layers and the three windows
    instead of one a layer and stream (the conv tails copied by it too); a one-row step packed first (a
    stream that does not draft) neither joins the rollback nor stops it."""
    cuda_emulator.install_delta(monkeypatch)
    target, _ = tiny_target("qwen3_5", "smol", layers=3, seed=31)
    layers = linear_layers(target)
    for m in layers:
        monkeypatch.setattr(m, "recurrence", "delta_kernel")
    launches = []  # the (layers, windows) of each rollback launch (delta_kernel.rollback: the states and the conv tails)
    monkeypatch.setattr(delta_kernel, "rollback", lambda parts, *a, run=delta_kernel.rollback: (
        launches.append((len(parts), len(parts[0][3]))), run(parts, *a))[1])

    def windows_run() -> list:
        states = [target.new_state() for _ in range(4)]
        for i, st in enumerate(states):
            mx.eval(target.forward([Segment(list(range(3 + i, 9 + i)), 0, st, [5], prefill=True)])[0].logits, st.arrays())
        outs = target.forward([Segment([10], 6, states[0], [0])]
                              + [Segment([11 + i, 12, 13, 14], 6, st, [0, 1, 2, 3]) for i, st in enumerate(states[1:])])
        mx.eval([o.logits for o in outs], [st.arrays() for st in states])
        return states

    kept, bounds = [1, 1, 4, 2], [7, 10, 10, 10]
    together, alone = windows_run(), windows_run()
    launches.clear()
    keep_windows([(st, (mx.array(6 + m, dtype=mx.int32), b, 7)) for st, m, b in zip(together, kept, bounds)])
    assert launches == [(len(layers), 4)]  # one launch for every layer, over the forward's four windows
    launches.clear()
    for st, m, b in zip(alone, kept, bounds):
        st.keep_at(mx.array(6 + m, dtype=mx.int32), b, 7)
    assert len(layers) > 1 and launches == [(1, 1)] * (3 * len(layers))
    for a, b in zip(together, alone):
        pairs = [(x, y) for x, y in zip(a.layers, b.layers) if isinstance(x, LinearCache)]
        assert len(pairs) == len(layers) and all(same(x.state, y.state) and same(x.conv, y.conv) for x, y in pairs)
        assert all(x.redo is None and x.together is None and x.length == y.length for x, y in pairs)


@cuda_emulator.needs_gxx
def test_the_self_check_fails_windows_kept_together_that_trade_their_counts(monkeypatch) -> None:
    """The model check keeps two streams' packed windows together at device lengths (cache.py's
    `keep_windows`, one rollback launch a layer) and compares the rows after each with single steps:
    with the kernel's source as the layers' recurrence it passes; a rollback that hands each window the
    other's kept count fails it."""
    cuda_emulator.install_delta(monkeypatch)
    target, _ = tiny_target("qwen3_5", "small", layers=2, seed=22)
    for m in linear_layers(target):
        monkeypatch.setattr(m, "recurrence", "delta_kernel")
    assert selfcheck.model_faults(target) == []
    many = PackedRedo.many
    monkeypatch.setattr(PackedRedo, "many", lambda jobs: many([(redo, counts[::-1], kept) for redo, counts, kept in jobs]))
    faults = selfcheck.model_faults(target)
    assert any("kept together" in f for f in faults), faults


# -- on a CUDA GPU: the engine with it -----------------------------------------------------------------
@pytest.mark.parametrize("source", ["layer", "kernel-source"])
def test_rollback_to_every_acceptance_length_equals_the_kept_rows_one_at_a_time(monkeypatch, source: str) -> None:
    """The layer's `redo` after a 16-row window (what `keep` calls) gives, for every m, the conv and
    state of its first m rows fed one at a time through the same layer: the layer's own recurrence
    (the kernel on a CUDA GPU, gated_delta_ops elsewhere), and the kernel's CUDA source run by
    tests/cuda_emulator.py on any machine with g++; m a host int, or a device value (what `keep_at`
    runs: the kernel launched to m, or gated_delta_ops over every row with g = 1 and beta = 0 past m)."""
    target, _ = tiny_target("qwen3_5", "smol", layers=2, seed=23)
    m = linear_layers(target)[0]
    assert m.recurrence == ("delta_kernel" if ON_CUDA else "gated_delta_ops")
    if source == "kernel-source":
        if shutil.which("g++") is None:
            pytest.skip("the emulator compiles the kernel source with g++")
        cuda_emulator.install_delta(monkeypatch)
        monkeypatch.setattr(m, "recurrence", "delta_kernel")
    span, n = m.kernel - 1, 16 if source == "layer" else 6  # the emulator runs each launch on one CPU thread
    keys = iter(mx.random.split(mx.random.key(5), 4))
    inputs = mx.random.normal((span + n, m.conv_dim), key=next(keys))
    a, b = mx.random.normal((n, m.hv), key=next(keys)), mx.random.normal((n, m.hv), key=next(keys))
    state0 = mx.random.normal((m.hv, m.dv, m.dk), key=next(keys)) * 0.1
    # the window's rows, as its forward computes them
    rows = m.window_rows(m.conv(inputs, n), compute_g(m.A_log, a, m.dt_bias), mx.sigmoid(b))
    redo = m.redo_fn(inputs[:span], state0, lambda: (inputs, rows))
    s = state0
    for t in range(n):
        q, k, v = m.mix(inputs[t : t + span + 1], 1)
        [(_, s)] = RECURRENCES[m.recurrence]([(q, k, v, compute_g(m.A_log, a[t : t + 1], m.dt_bias),
                                               mx.sigmoid(b[t : t + 1]), s)])
        conv, state = redo(t + 1)
        assert same(state, s) and same(conv, inputs[t + 1 : t + 1 + span]), f"redo({t + 1})"
        conv, state = redo(mx.array(t + 1, dtype=mx.int32))  # m a device value (cache.py's keep_at)
        assert same(state, s) and same(conv, inputs[t + 1 : t + 1 + span]), f"redo(array({t + 1}))"
    conv, state = redo(mx.array(0, dtype=mx.int32))
    assert same(state, state0) and same(conv, inputs[:span])


def test_a_rollback_reruns_only_the_recurrence_on_the_windows_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping part of a window asks each linear layer for one recurrence call over the window's first
    m rows as its forward computed them (qwen3_5.py's `redo_fn`): no conv, norm or gate is rebuilt, so
    a partly accepted round adds one operation a layer for the host to build (a GPU round is bound by
    that work), and the state is the one of feeding those m rows alone."""
    target, _ = tiny_target("qwen3_5", "smol", layers=4, seed=29)
    layers = linear_layers(target)
    state, alone = target.new_state(), target.new_state()
    for st in (state, alone):
        mx.eval(target.forward([Segment(list(range(3, 11)), 0, st, [7], prefill=True)])[0].logits, st.arrays())
    mx.eval(target.forward([Segment([11, 12, 13, 14, 15, 16], 8, state, list(range(6)))])[0].logits, state.arrays())
    rebuilt, calls = [], []
    for name in ("conv", "heads", "mix"):
        monkeypatch.setattr(GatedDeltaNet, name, lambda *a, name=name, **k: rebuilt.append(name))
    recurrence = layers[0].recurrence
    monkeypatch.setitem(RECURRENCES, recurrence, lambda windows, run=RECURRENCES[recurrence]: (
        calls.append([w[0].shape[0] for w in windows]), run(windows))[1])
    state.keep(10)
    assert rebuilt == [] and calls == [[2]] * len(layers)
    monkeypatch.undo()
    mx.eval(target.forward([Segment([11, 12], 8, alone, [0, 1])])[0].logits, alone.arrays())
    linear = [(kept, fed) for kept, fed in zip(state.layers, alone.layers) if isinstance(kept, LinearCache)]
    assert len(linear) == len(layers) and all(
        mx.array_equal(kept.state, fed.state) and mx.array_equal(kept.conv, fed.conv) for kept, fed in linear)


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    if not ON_CUDA:
        pytest.skip("the kernel runs only where MLX computes on a CUDA GPU")
    root = tmp_path_factory.mktemp("delta-kernel")
    pair = write_big("qwen3_5-9b-4bit", root / "target", "tiny"), write_big("dflash-9b", root / "drafter", "tiny")
    return Engine(*pair, Settings(parallel=2, context=256, chunk=32, backend="gpu"))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, 1000) for _ in range(rng.randrange(20, 50))] for _ in range(n)]


@on_cuda
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_drafted_equals_plain_on_the_qwen3_5_fixture_in_gpu_mode(gpu_engine: Engine, temperature: float) -> None:
    assert {m.recurrence for m in linear_layers(gpu_engine.target)} == {"delta_kernel"}
    assert gpu_engine.selfcheck.passed, gpu_engine.selfcheck.line()
    reqs = [dict(prompt=p, max_tokens=12, temperature=temperature, seed=i, ignore_eos=True)
            for i, p in enumerate(prompts(2, seed=int(temperature * 10)))]
    plain = [gpu_engine.generate(Request(**r, draft=False)).tokens for r in reqs]
    alone = [gpu_engine.generate(Request(**r)) for r in reqs]
    assert [r.tokens for r in alone] == plain and all(r.stats.drafted > 0 for r in alone)
    together = gpu_engine.run([Request(**r) for r in reqs])  # two streams' windows in one launch a layer
    assert [r.tokens for r in together] == plain
