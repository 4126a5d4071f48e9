"""What a decode step asks of the device: fewer operations, the same bits.

A GPU decode round pays per operation (docs/gpu-round-profile.md), so the forward avoids those that
compute nothing new: zero rows, copies, a second norm launch.

Where every projection runs the row kernel, a forward leaves its decode rows unpadded (tiles.Layout).
On a CUDA GPU the row kernel (engine/matmul_kernel.py) takes any row count, so the gpu mode packs a
decode forward's rows without the zero rows of a ROW_TILE: a 1-row step then has no zero block and no
concatenation a layer (docs/gpu-round-profile.md: a GPU round pays per operation). On any machine
here, the kernel is stood in for by a product that is row-independent by construction (each row
multiplied alone, one fixed shape), so what is tested is the layout around it: the rows unpadded,
the operations gone, and the model check (window == steps, packed == alone) still passing for each
family. The negative control gives the stand-in a dependence on the call's row count and sees the
model check fail; the real kernel's rows are tested on a GPU (tests/test_matmul_kernel.py).

A GatedDeltaNet layer normalizes q and k in one norm and one product, bit-equal to mlx-lm's
`normalize_qk`; it keeps its conv tail and the recurrence kernel's states as views, not copies, and
casts its decode rows to the conv's float32 once, not once a stream. Row positions are built once a
forward, not once a layer.
"""

from __future__ import annotations

from itertools import accumulate

import collections
import sys
from pathlib import Path

import cuda_emulator
import pytest
from mlx_lm.models.gated_delta import normalize_qk
from test_delta_kernel import window
from tiny_targets import canonical_weights, config_dict, reference_model, tiny_target

import mlx.core as mx

from dflash_bench.engine import selfcheck
from dflash_bench.engine.backend import FLOAT32_TENSORS
from dflash_bench.engine.cache import AttentionCache, JointCache, keep_windows
from dflash_bench.engine.stacked_cache import StackedLayer
from dflash_bench.engine.target_config import parse_target_config
from dflash_bench.engine.targets import build_target
from dflash_bench.engine.targets import delta_kernel
from dflash_bench.engine.targets.base import Segment, Target, packed_positions
from dflash_bench.engine.targets.qwen3_5 import GatedDeltaNet
from dflash_bench.engine.tiles import ROW_TILE, Layout, Weight, pairs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from forward_ops import census  # noqa: E402  (tools/: the operation census the GPU figures were counted with)


def apart(y: mx.array, parts: tuple[int, ...]) -> mx.array | list[mx.array]:
    """`y`, or with `parts` (a stacked weight's column widths) each part as its own array, as the kernel
    returns them (matmul_kernel.rows_matmul)."""
    if not parts:
        return y
    return [mx.contiguous(c) for c in mx.split(y, list(accumulate(parts[:-1])), axis=-1)]


def each_row_alone(self: Weight, x: mx.array, parts: tuple[int, ...] = (), residual: mx.array | None = None,
                   norm: tuple[mx.array, float] | None = None, glu: bool = False) -> mx.array | list[mx.array]:
    """The kernel's contract without the kernel: every row (RMS-normed first with `norm`, as the kernel's
    prologue does) through the weight's own product, alone (then the residual added, or the SwiGLU of its column
    pairs taken, as its epilogue does)."""
    if norm is not None:
        x = mx.fast.rms_norm(x, *norm)
    y = mx.concatenate([self.tile(x[i : i + 1]) for i in range(x.shape[0])])
    if glu:
        return pairs(y)
    return apart(y if residual is None else residual + y, parts)


def count_dependent(self: Weight, x: mx.array, parts: tuple[int, ...] = (), residual: mx.array | None = None,
                    norm: tuple[mx.array, float] | None = None, glu: bool = False) -> mx.array | list[mx.array]:
    """A product whose rows depend on the call's row count: what the model check must catch."""
    y = each_row_alone(self, x, norm=norm, glu=glu) + (x.shape[0] - 1) * 1e-2
    if glu:
        return y
    return apart(y if residual is None else residual + y, parts)


def kernel_target(family: str, monkeypatch, product) -> Target:
    """A bf16 target of `family` whose every projection takes `product` as its row kernel."""
    monkeypatch.setattr(Weight, "kernel_product", product)
    cfg = config_dict(family, "small", 4, False)
    weights = {name: w if name.endswith(FLOAT32_TENSORS) else w.astype(mx.bfloat16)
               for name, w in canonical_weights(reference_model(cfg, 8)).items()}
    target = build_target(parse_target_config(cfg), weights, mx.bfloat16)
    for w in target.projections():
        w.kernel = True
    return target


def decode_census(target: Target, streams: int = 1, rows: int = 1) -> collections.Counter:
    """The operations of one decode forward of `streams` streams of `rows` rows each after 5-token
    prompts: their logits and states."""
    states = []
    for _ in range(streams):
        state = target.new_state()
        mx.eval(target.forward([Segment([3, 1, 4, 1, 5], 0, state, [4], prefill=True)])[0].logits, state.arrays())
        state.keep(5)
        states.append(state)
    window = [9, 2, 6][:rows]
    outs = target.forward([Segment(window, 5, state, list(range(rows))) for state in states])
    return census([o.logits for o in outs] + [a for state in states for a in state.arrays()])


def test_the_layout_pads_decode_rows_only_to_its_tile() -> None:
    padded = Layout.of([1, 3, 5], [False, False, True])
    assert (padded.spans, padded.decode_rows, padded.rows) == (((0, 1), (1, 4), (16, 21)), 16, 32)
    unpadded = Layout.of([1, 3, 5], [False, False, True], tile=1)
    assert (unpadded.spans, unpadded.decode_rows, unpadded.rows) == (((0, 1), (1, 4), (4, 9)), 4, 20)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_kernel_rows_go_unpadded_and_windows_still_equal_steps(family: str, monkeypatch) -> None:
    target = kernel_target(family, monkeypatch, each_row_alone)
    assert target.row_tile == 1
    unpadded = decode_census(target)
    assert not selfcheck.model_faults(target)
    target.lm_head.kernel = False  # one projection without the kernel: ROW_TILEs again
    assert target.row_tile == ROW_TILE
    padded = decode_census(target)
    # each layer's join of its mixer's rows, and the packed embedding, lose their zero block and concatenation
    layers = target.config.num_layers
    assert padded["Full"] - unpadded["Full"] >= layers + 1, (padded, unpadded)
    assert padded["Concatenate"] - unpadded["Concatenate"] >= layers + 1, (padded, unpadded)


def one_launch(self: Weight, x: mx.array, parts: tuple[int, ...] = (), residual: mx.array | None = None,
               norm: tuple[mx.array, float] | None = None, glu: bool = False) -> mx.array | list[mx.array]:
    """The kernel as one node a call, as it is one launch on a GPU, with its residual added, its rows normed
    and its SwiGLU taken inside (for censuses only: its values are zeros)."""
    zeros = mx.zeros((x.shape[1], self.out_features // 2 if glu else self.out_features), dtype=x.dtype)
    return apart(x @ zeros if residual is None else mx.addmm(residual, x, zeros), parts)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_residual_adds_ride_in_the_projections_launches(family: str, monkeypatch) -> None:
    """A decoder layer's two residual adds happen in its output and down projections' kernel launches
    (tiles.linear's `residual`): a decode step on the kernel has no separate Add for them, one launch a
    layer each fewer (on a CPU, without the kernel, the adds stay: the same bits either way, as
    tests/test_matmul_kernel.py checks the kernel's source)."""
    target = kernel_target(family, monkeypatch, one_launch)
    fused = decode_census(target)
    layers = target.config.num_layers
    assert fused["AddMM"] == 2 * layers, fused
    for w in target.projections():
        w.kernel = False
    assert decode_census(target)["Add"] - fused["Add"] >= 2 * layers


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5"])
def test_the_layer_norms_ride_in_the_projections_launches(family: str, monkeypatch) -> None:
    """A decoder layer's input and post-attention RMS norms, and the final norm, happen in the launches of the
    products they feed (tiles.linear's `norm`): a decode step hands each launch its layer's own weights in the
    layer's order and asks MLX for none of those norms, one launch each fewer; without the kernel MLX norms the
    rows first, as before. A prompt chunk's block is normed by MLX (its lm_head row on the kernel is not)."""
    target = kernel_target(family, monkeypatch, one_launch)
    handed: list[int] = []

    def launch(self, x, parts=(), residual=None, norm=None, glu=False):
        if norm is not None:
            handed.append(id(norm[0]))
        return one_launch(self, x, parts, residual, glu=glu)

    monkeypatch.setattr(Weight, "kernel_product", launch)
    norms: list[int] = []
    rms_norm = mx.fast.rms_norm
    monkeypatch.setattr(mx.fast, "rms_norm", lambda x, *a: norms.append(1) or rms_norm(x, *a))
    decode_census(target)
    on_kernel = len(norms)
    layers = target.config.num_layers
    final = [id(target.norm)]
    assert handed == final + [id(w) for pre_post in target.norms for w in pre_post] + final  # the prompt's row, then the step
    for w in target.projections():
        w.kernel = False
    norms.clear()
    decode_census(target)
    assert len(norms) - on_kernel == 2 * layers + 2, (len(norms), on_kernel)


def test_the_recurrence_kernel_takes_unscaled_q_and_k_and_hands_the_gated_norm_bf16_rows(monkeypatch) -> None:
    """On the recurrence kernel a GatedDeltaNet decode step launches neither a cast of its y (the kernel
    writes y in the activation dtype: `in_place`'s `y_dtype`) nor the product that scales q and k (the
    kernel scales them as it loads them: `in_place`'s `scale`, the layer's own); tests/test_delta_kernel.py
    checks the bits of both. The kernel is stood in for by one node writing y in the dtype asked for."""
    target = kernel_target("qwen3_5", monkeypatch, one_launch)
    linear_layers = [m for m in target.mixer_layers() if isinstance(m, GatedDeltaNet)]
    before = decode_census(target)
    scales: list[mx.array] = []

    def launch(qkv, g, beta, states, starts):
        scales.append(qkv.scale)
        return (mx.depends([mx.zeros(qkv.views()[2].shape, dtype=qkv.y_dtype or mx.float32)], [*qkv.arrays, g, beta])[0],
                [mx.abs(s) for s in states])

    monkeypatch.setattr(delta_kernel, "delta_packed", launch)
    for m in linear_layers:
        m.recurrence = "delta_kernel"
    on_kernel = decode_census(target)
    assert linear_layers and on_kernel["AsType"] == before["AsType"] - len(linear_layers), (before, on_kernel)
    assert [id(s) for s in scales] == [id(m.qk_scales) for m in linear_layers]


def test_a_row_count_dependent_product_fails_the_model_check(monkeypatch) -> None:
    """The negative control: the stand-in made to depend on its call's row count breaks window == steps."""
    target = kernel_target("qwen3_5", monkeypatch, count_dependent)
    assert selfcheck.model_faults(target)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_q_and_k_normed_together_equal_mlx_lms_normalize_qk(rows: int) -> None:
    target, _ = tiny_target("qwen3_5", "smol", layers=2, seed=3)
    m = next(m for m in target.mixer_layers() if isinstance(m, GatedDeltaNet))
    mixed = mx.random.normal((rows, m.conv_dim), key=mx.random.key(rows)) * 3
    q, k, v = m.heads(mixed)
    shape = (rows, m.hk, m.dk)
    q_ref, k_ref = normalize_qk(mixed[:, : m.key_dim].reshape(shape), mixed[:, m.key_dim : 2 * m.key_dim].reshape(shape),
                                inv_scale=m.dk**-0.5, eps=1e-6)
    assert q.shape == k.shape == shape and mx.array_equal(q, q_ref).item() and mx.array_equal(k, k_ref).item()
    assert mx.array_equal(v, mixed[:, 2 * m.key_dim :].reshape(rows, m.hv, m.dv)).item()


def test_a_decode_step_copies_no_conv_tail() -> None:
    """The conv tail a GatedDeltaNet step keeps is a view of the step's few input rows (a prompt chunk's
    is a copy, so it does not pin the chunk)."""
    target, _ = tiny_target("qwen3_5", "smol", layers=4, seed=3)
    assert decode_census(target)["Contiguous"] == 0


@cuda_emulator.needs_gxx
def test_the_recurrence_kernels_states_are_views(monkeypatch) -> None:
    """Each stream's state out of one launch is a view of the launch's output, every stream's from one split
    (delta_kernel.py's `_unstacked`): not a gather (a copy), nor a slice and a squeeze a stream."""
    cuda_emulator.install_delta(monkeypatch)
    windows = [window((1, 2, 32, 16), n, seed=70 + i) for i, n in enumerate((1, 2))]
    q, k, v, g, beta = (mx.concatenate([w[i] for w in windows]) for i in range(5))
    y, states = delta_kernel.delta_packed(delta_kernel.separate(q, k, v), g, beta, [w[5] for w in windows], (0, 1, 3))
    ops = census([y, *states])
    assert ops["Split"] == 1 and ops["Gather"] == ops["Slice"] == ops["Squeeze"] == 0, ops
    assert [st.shape for st in states] == [w[5].shape for w in windows]


def test_a_launch_takes_each_streams_state_as_it_lies(monkeypatch) -> None:
    """The recurrence kernel's launch over three streams' windows takes each stream's state as an input of its
    own (delta_kernel.py's `source` picks a window's), not the states stacked into one array: a copy of every
    stream's state a layer (2 MB a stream at Qwen3.5-9B's heads) and one operation a layer more."""
    given = []

    def launch(inputs, output_shapes, output_dtypes, **_):
        given.append(inputs)
        return [mx.depends([mx.zeros(shape, dtype=dtype)], inputs)[0] for shape, dtype in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(delta_kernel, "_kernel", lambda *key: launch)
    windows = [window((1, 2, 32, 16), n, seed=80 + i) for i, n in enumerate((1, 2, 3))]
    q, k, v, g, beta = (mx.concatenate([w[i] for w in windows]) for i in range(5))
    mx.eval(q, k, v, g, beta, [w[5] for w in windows])
    delta_kernel.delta_packed(delta_kernel.separate(q, k, v), g, beta, [w[5] for w in windows], (0, 1, 3, 6))
    [inputs] = given
    assert all(any(a is w[5] for a in inputs) for w in windows)
    assert census(inputs)["Concatenate"] == 0


def test_more_streams_add_no_casts(monkeypatch) -> None:
    """In the gpu mode (bf16 rows, a float32 conv) more streams add no cast to a GatedDeltaNet layer's step."""
    target = kernel_target("qwen3_5", monkeypatch, each_row_alone)
    assert decode_census(target, 1, rows=2)["AsType"] == decode_census(target, 3, rows=2)["AsType"]


def test_the_conv_keeps_its_inputs_as_the_projection_wrote_them(monkeypatch) -> None:
    """In the gpu mode a GatedDeltaNet layer's conv tail stays bf16, as the projection wrote its rows, through
    a prompt chunk, a decode step and a rollback: the conv's float32 taps promote them (exactly) inside its own
    launch (fused.py compiles it on a GPU), so no cast of the rows is launched before it."""
    target = kernel_target("qwen3_5", monkeypatch, each_row_alone)
    state = target.new_state()
    mx.eval(target.forward([Segment([3, 1, 4, 1, 5], 0, state, [4], prefill=True)])[0].logits, state.arrays())
    state.keep(5)
    tails = lambda: {c.conv.dtype for c in state.layers if not hasattr(c, "k")}  # noqa: E731
    assert tails() == {mx.bfloat16}
    target.forward([Segment([9, 2, 6], 5, state, [0, 1, 2])])
    state.keep(6)
    assert tails() == {mx.bfloat16}


def test_positions_are_built_once_a_forward() -> None:
    state = tiny_target("llama", "smol", layers=1, seed=3)[0].new_state()
    a, b = Segment([1, 2], 0, state), Segment([3], 0, state)
    assert a.positions() is a.positions() and a.positions().tolist() == [0, 1]
    assert packed_positions([a, b]) is packed_positions([a, b]) and packed_positions([a, b]).tolist() == [0, 1, 0]
    assert packed_positions([b, a]).tolist() == [0, 0, 1]


def test_a_rollback_to_a_device_length_launches_the_kernel_to_it_with_no_mask(monkeypatch) -> None:
    """`keep_at` with the kernel (qwen3_5.py's `redo_fn`) launches it to walk the kept count of the
    window's rows (delta_kernel.py's `delta_prefix`): no positions, comparisons or selects a layer, and
    the count is one subtraction for the stream, taken by each launch as it is (cache.py's
    `TargetState.keep_at`): a layer adds its launch, nothing else: the launch copies the conv tail too
    (delta_kernel.py's `rollback`), where a slice at the device offset was one more operation a layer. The
    kernel is stood in for by a node on all of its inputs for each output (its rows and tails are tested
    through its source in tests/test_delta_kernel.py). A drafted round keeps its windows through
    cache.py's `keep_windows`, one launch for every layer."""

    def launch(inputs, output_shapes, output_dtypes, **_):
        return [mx.depends([mx.zeros(shape, dtype=dtype)], inputs)[0] for shape, dtype in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(delta_kernel, "_kernel", lambda *key: launch)
    target = kernel_target("qwen3_5", monkeypatch, each_row_alone)
    linear = [m for m in target.mixer_layers() if isinstance(m, GatedDeltaNet)]
    for m in linear:
        monkeypatch.setattr(m, "recurrence", "delta_kernel")
    for keep in ("keep_at", "keep_windows"):
        state = target.new_state()
        mx.eval(target.forward([Segment([3, 1, 4, 1, 5], 0, state, [4], prefill=True)])[0].logits, state.arrays())
        state.keep(5)
        mx.eval(target.forward([Segment([9, 2, 6], 5, state, [0, 1, 2])])[0].logits, state.arrays())
        if keep == "keep_at":  # one launch a layer
            state.keep_at(mx.array(6, dtype=mx.int32), 8, 6)
        else:  # a drafted round's keep (lanes.py): one launch for every layer
            keep_windows([(state, (mx.array(6, dtype=mx.int32), 8, 6))])
        ops = census([a for layer in state.layers if not hasattr(layer, "k") for a in (layer.conv, layer.state)])
        launched = len(linear) if keep == "keep_at" else 1
        assert len(linear) > 1 and ops["Depends"] == 2 * launched and ops["DynamicSlice"] == 0, (keep, ops)  # state, tail
        assert ops["Select"] == ops["Arange"] == ops["Less"] == 0, (keep, ops)
        assert ops["Subtract"] == 1 and ops["Multiply"] == 0, (keep, ops)


def test_a_windows_forward_slices_its_rows_for_a_rollback_only_when_one_runs(monkeypatch) -> None:
    """A GatedDeltaNet layer's windows leave each stream's redo (qwen3_5.py's `redo_fn`) and, on the kernel, every
    window's rollback in one launch (`PackedRedo`), which a drafted round takes (cache.py's `keep_windows`). The
    redo's slices of the window's rows are made when it runs, not by the forward: a slice of each of its rows'
    arrays a layer and stream was about 30 us of a drafted round's host a layer and stream on this project's CPU,
    for a redo that a drafted round never runs. A stream rolled back alone (`keep_at`) still slices its rows."""

    def launch(inputs, output_shapes, output_dtypes, **_):
        return [mx.depends([mx.zeros(shape, dtype=dtype)], inputs)[0] for shape, dtype in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(delta_kernel, "_kernel", lambda *key: launch)
    sliced = []
    real = delta_kernel.QKV.__getitem__
    monkeypatch.setattr(delta_kernel.QKV, "__getitem__", lambda self, rows: (sliced.append(rows), real(self, rows))[1])
    target = kernel_target("qwen3_5", monkeypatch, each_row_alone)
    linear = [m for m in target.mixer_layers() if isinstance(m, GatedDeltaNet)]
    for m in linear:
        monkeypatch.setattr(m, "recurrence", "delta_kernel")
    states = []
    for _ in range(2):
        state = target.new_state()
        mx.eval(target.forward([Segment([3, 1, 4, 1, 5], 0, state, [4], prefill=True)])[0].logits, state.arrays())
        state.keep(5)
        states.append(state)
    sliced.clear()
    mx.eval([o.logits for o in target.forward([Segment([9, 2, 6], 5, state, [0, 1, 2]) for state in states])],
            [state.arrays() for state in states])
    assert sliced == []  # the forward: none
    keep_windows([(states[0], (mx.array(6, dtype=mx.int32), 8, 6))])
    assert sliced == []  # a drafted round's keep: the launch over every layer's windows
    states[1].keep_at(mx.array(7, dtype=mx.int32), 8, 6)
    assert len(sliced) == len(linear) > 1  # a stream rolled back alone: its window's rows, a layer


def test_a_window_on_the_kernel_hands_it_q_k_and_v_where_they_lie(monkeypatch) -> None:
    """Over a window's rows q, k and v are strided views of the normed qk and the conv's rows; the
    kernel reads them in place (delta_kernel.py's `in_place`), so a window's forward makes no more
    copies than a one-row step's (those of the stand-in product's parts), three a linear layer before."""

    def launch(inputs, output_shapes, output_dtypes, **_):
        return [mx.depends([mx.zeros(shape, dtype=dtype)], inputs)[0] for shape, dtype in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(delta_kernel, "_kernel", lambda *key: launch)
    target = kernel_target("qwen3_5", monkeypatch, each_row_alone)
    for m in target.mixer_layers():
        if isinstance(m, GatedDeltaNet):
            monkeypatch.setattr(m, "recurrence", "delta_kernel")
    assert decode_census(target, rows=3)["Contiguous"] == decode_census(target, rows=1)["Contiguous"]


def test_a_window_at_a_device_length_scatters_its_keys_along_positions_built_once(monkeypatch) -> None:
    """A window placed at a length the host has not read (cache.py's `keep_at`) scatters its K/V along
    the forward's row positions, built once for every layer: no copy at a dynamic offset (on CUDA it
    launches over the whole cache: docs/profiles/round-kernels-h200.txt) and no positions a layer; keys and
    values lie in one array (a dense target's layers all in one: stacked_cache.py), so one scatter a layer where
    its layers write as they go (this CPU's tile products)."""
    write, given = StackedLayer.write_joint, []
    monkeypatch.setattr(StackedLayer, "write_joint", lambda self, start, kv, rows=None: (
        given.append(rows) if self.at is not None else None, write(self, start, kv, rows))[1])

    def window_census(layers: int) -> collections.Counter:
        target, _ = tiny_target("llama", "smol", layers=layers, seed=3)
        state = target.new_state()
        mx.eval(target.forward([Segment([3, 1, 4, 1, 5, 9], 0, state, [5], prefill=True)])[0].logits, state.arrays())
        state.keep(6)
        mx.eval(target.forward([Segment([2, 6, 5], 6, state, [0, 1, 2])])[0].logits, state.arrays())
        state.keep_at(mx.array(7, dtype=mx.int32), 9, 7)
        mx.eval(state.at)
        outs = target.forward([Segment([3, 5], 9, state, [0, 1], at=state.at)])
        return census([o.logits for o in outs] + state.arrays())

    ops = window_census(3)
    assert ops["Scatter"] == 3 and ops["ScatterAxis"] == 0 and ops["DynamicSliceUpdate"] == 0, ops
    assert len(given) == 3 and all(rows is given[0] for rows in given)  # the forward's positions, made once


def test_a_joint_cache_holds_what_a_separate_one_does_and_writes_at_a_device_length_in_one_scatter() -> None:
    """cache.py's JointCache (a drafter's: keys and values in one array) against an AttentionCache fed the
    same rows: at host offsets, then at a device length (a drafted round's: cache.py's keep_at), past its first
    capacity, the kept rows, the keys and values it hands a reader (`view`) and a snapshot are the same bits;
    a write at a device length is one scatter where the separate cache makes two, and a tree's kept path moves
    keys and values alike."""

    heads, d = 2, 8
    joint, separate = JointCache(heads, d, mx.bfloat16), AttentionCache(heads, d, mx.bfloat16)
    key = iter(mx.random.split(mx.random.key(4), 8))

    def rows(n: int) -> tuple[mx.array, mx.array]:
        return tuple(mx.random.normal((heads, n, d), key=next(key)).astype(mx.bfloat16) for _ in range(2))

    k, v = rows(5)
    joint.write_joint(0, mx.stack([k, v]))
    separate.write(0, k, v)
    for cache in (joint, separate):
        cache.keep_at(mx.array(3, dtype=mx.int32), 5, 3)
    k, v = rows(70)  # past the first capacity: both grow
    joint.write_joint(5, mx.stack([k, v]))
    separate.write(5, k, v)
    assert census([joint.kv])["ScatterAxis"] == 1 and census([separate.k, separate.v])["ScatterAxis"] == 2
    for cache in (joint, separate):
        cache.settle(73)
    mx.eval(joint.kv, separate.k, separate.v)
    assert joint.length == separate.length == 73
    for a, b in zip((*joint.view(73), *joint.snapshot(73).view(73)), (*separate.view(73), *separate.snapshot(73).view(73))):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    other = joint.snapshot(73)
    joint.keep_path(60, [0, 2, 5])
    separate.keep_path(60, [0, 2, 5])
    assert mx.array_equal(joint.k[:, :63], separate.k[:, :63]).item() and mx.array_equal(joint.v[:, :63], separate.v[:, :63]).item()
    other.keep_path(60, [0, 3, 5])  # a control: another path keeps other rows
    assert not mx.array_equal(other.v[:, :63], separate.v[:, :63]).item()


@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("tile", [1, ROW_TILE])
def test_a_forwards_rows_are_looked_up_once_and_each_row_is_its_own(bits: int, tile: int, monkeypatch) -> None:
    """Decode segments (host tokens and device ids mixed) join their ids and look them up in one lookup, whose
    rows equal each segment's looked up alone, padded as before. A prompt chunk joins unpadded decode rows (it
    starts where they end); after a tile's padding each segment keeps its own lookup. A packed table dequantizes
    its rows in the same one lookup."""
    target = tiny_target("llama", "smol", layers=1, seed=3)[0]
    if bits:
        target.embed = Weight.packed(*mx.quantize(target.embed.w, group_size=32, bits=bits), 32, bits)
    state = target.new_state()
    lookups: list[int] = []
    rows = Weight.rows
    monkeypatch.setattr(Weight, "rows", lambda self, ids: (lookups.append(ids.shape[0]), rows(self, ids))[1])

    def alone(segments: list[Segment], layout: Layout) -> mx.array:
        return layout.pack([target.embed_rows(s.tokens if s.ids is None else s.ids) for s in segments])

    decode = [Segment([5], 0, state), Segment([-1, -1], 0, state, ids=mx.array([7, 8], dtype=mx.int32)),
              Segment([9, 3], 0, state), Segment([4], 0, state)]
    layout = Layout.of([len(s.tokens) for s in decode], [False] * len(decode), tile)
    expected = alone(decode, layout)
    lookups.clear()
    joined = target.embed_segments(decode, layout)
    assert lookups == [6] and joined.shape == expected.shape and mx.array_equal(joined, expected).item()
    mixed = decode[:2] + [Segment([2, 6, 1], 0, state, prefill=True)]
    layout = Layout.of([1, 2, 3], [False, False, True], tile)
    expected = alone(mixed, layout)
    lookups.clear()
    placed = target.embed_segments(mixed, layout)
    assert lookups == ([6] if tile == 1 else [1, 2, 3]) and mx.array_equal(placed, expected).item()


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [5], [2, 3, 4], [0, 2, 3]])
def test_the_logits_of_consecutive_rows_take_a_slice_not_a_gather(rows: list[int]) -> None:
    """Every decode forward wants its rows' logits one after another (and a prompt chunk its last row): those
    are a slice of the rows (a view), where picking them by index is a gather, an operation a forward. The same
    logits either way."""
    target = tiny_target("llama", "smol", layers=1, seed=4)[0]
    x = mx.random.normal((8, target.config.hidden_size), key=mx.random.key(2)).astype(target.dtype)
    got = target.logits(x, rows)
    gathers = census([got])["Gather"]
    assert gathers == (0 if rows != [0, 2, 3] else 1)
    want = target.logits(mx.stack([x[r] for r in rows]), list(range(len(rows))))
    assert mx.array_equal(got, want).item()
