"""A layer's q/k/v product with its queries and keys turned in the same row-kernel launch (engine/matmul_kernel.py's
`rope`, targets/dense.py's `turned` layers: no q/k norms, no gate).

Where g++ is (any machine): the kernel's CUDA source, run on the CPU by tests/cuda_emulator.py, gives from the
reordered weight (q and k rows in `rope_order`) what the q/k/v parts launch of the weight in its own order and then
targets/norm_rope_kernel.py's launch give: queries (rows, HQ, D) float32 and keys with values (2, HKV, rows, D),
bit for bit, at 1, 5 and 17 rows, normed or not, full and partial rotary. Anywhere: the order pairs each value
with its partner and puts the rest in place. On a CUDA GPU only: the same comparison, on the device.
"""

from __future__ import annotations

import cuda_emulator
import pytest
from gpu import on_cuda
from test_matmul_kernel import weight
from test_matmul_norm import norm_case

import mlx.core as mx

from dflash_bench.engine import matmul_kernel
from dflash_bench.engine.matmul_kernel import Rope
from dflash_bench.engine.targets import norm_rope_kernel
from dflash_bench.engine.tiles import Stacked, Weight

THETA = 10_000.0
CASES = {"q4": (128, 4, 2, 16, 16, 4, 64), "q4-partial": (128, 2, 1, 32, 16, 4, 32), "bf16": (64, 2, 2, 16, 16, 16, 0)}


def test_the_order_pairs_each_value_with_its_partner() -> None:
    assert matmul_kernel.rope_order(8, 8) == [0, 4, 1, 5, 2, 6, 3, 7]
    assert matmul_kernel.rope_order(8, 4) == [0, 2, 1, 3, 4, 5, 6, 7]
    rows = matmul_kernel.head_rows(2, 4, 4)
    assert rows == [0, 2, 1, 3, 4, 6, 5, 7] and [rows[i] for i in matmul_kernel.in_order(rows)] == list(range(8))


def turned_and_reference(k: int, hq: int, hkv: int, d: int, r: int, bits: int, group: int, m: int,
                         norm: tuple[mx.array, float] | None, positions: mx.array, x: mx.array
                         ) -> tuple[list[mx.array], tuple[mx.array, mx.array]]:
    """The `rope` launch of the reordered q/k/v weight, and the parts launch of the weight in order followed by
    norm_rope_kernel.py's launch (a layer's decode rows before the fused launch)."""
    q, kk, v = (weight(k, heads * d, bits, group, seed=50 + i) for i, heads in enumerate((hq, hkv, hkv)))
    widths = (hq * d, hkv * d, hkv * d)
    plain = Stacked([q, kk, v], stack=True).weights[0]
    turned = Stacked([q.reordered(matmul_kernel.head_rows(hq, d, r)), kk.reordered(matmul_kernel.head_rows(hkv, d, r)), v],
                     stack=True).weights[0]
    rope = Rope(positions[:m], norm_rope_kernel.device_log2_theta(THETA), (hq, hkv, d, r))
    got = turned.kernel_product(x[:m], widths, norm=norm, rope=rope)
    pq, pk, pv = plain.kernel_product(x[:m], widths, norm=norm)
    want = norm_rope_kernel.queries_and_keys(pq, pk, pv, None, None, positions[:m], THETA, 1e-6, head_dim=d,
                                             rope_dims=r)
    return got, want


def check(case: tuple[int, ...]) -> None:
    k, hq, hkv, d, r, bits, group = case
    x, norm = norm_case(k, 17)
    positions = mx.array([3, 0, 4095, 17, 130_000, 5, 64, 65, 1000, 2, 9, 11, 300, 301, 302, 7, 8], dtype=mx.int32)
    for how in (None, norm):
        for m in (1, 5, 17):
            (queries, kv), (want_q, want_kv) = turned_and_reference(k, hq, hkv, d, r, bits, group, m, how, positions, x)
            assert queries.shape == (m, hq, d) and queries.dtype == mx.float32 and kv.shape == (2, hkv, m, d)
            assert mx.array_equal(queries, want_q).item() and mx.array_equal(kv, want_kv).item(), (how is not None, m)
    # the control: the rows turned one position on are other bits
    (queries, kv), _ = turned_and_reference(k, hq, hkv, d, r, bits, group, 17, norm, positions + 1, x)
    assert not mx.array_equal(queries, want_q).item() and not mx.array_equal(kv[0], want_kv[0]).item()
    assert mx.array_equal(kv[1], want_kv[1]).item()  # values are not turned


@cuda_emulator.needs_gxx
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_kernel_source_turns_queries_and_keys_as_the_parts_then_the_norm_rope_launch(monkeypatch, case) -> None:
    cuda_emulator.install_matmul(monkeypatch)
    cuda_emulator.install_norm_rope(monkeypatch)
    check(case)


def test_rope_takes_a_layers_three_parts_and_nothing_else() -> None:
    w = weight(64, 48, 16, 0, seed=60)
    x = mx.zeros((1, 64), dtype=mx.bfloat16)
    rope = Rope(mx.zeros((1,), dtype=mx.int32), mx.zeros((1,)), (1, 1, 16, 16))
    with pytest.raises(ValueError, match="rope takes a layer's three parts"):
        matmul_kernel.rows_matmul(x, w.w, w.w, w.w, 16, 0, parts=(32, 16), rope=rope)
    for kwargs in (dict(glu=True), dict(residual=mx.zeros((1, 48), dtype=mx.bfloat16))):
        with pytest.raises(ValueError):
            matmul_kernel.rows_matmul(x, w.w, w.w, w.w, 16, 0, parts=(16, 16, 16), rope=rope, **kwargs)


def test_a_reordered_weight_takes_its_rows_in_order() -> None:
    w = weight(128, 16, 4, 64, seed=61)
    order = list(reversed(range(16)))
    got = w.reordered(order)
    assert isinstance(got, Weight) and all(mx.array_equal(getattr(got, n), getattr(w, n)[::-1]).item()
                                           for n in ("w", "scales", "biases"))


@on_cuda
@pytest.mark.parametrize("case", [(1024, 8, 2, 64, 64, 4, 64), (1024, 4, 2, 64, 16, 8, 64), (576, 9, 3, 64, 64, 16, 0)],
                         ids=["q4", "q8-partial", "bf16-default-model-heads"])
def test_on_the_device_turned_queries_and_keys_equal_the_parts_then_the_norm_rope_launch(case) -> None:
    check(case)


@cuda_emulator.needs_gxx
def test_a_turned_layers_decode_rows_take_one_launch_before_attention_and_keep_their_bits(monkeypatch) -> None:
    """A bf16 llama layer on the kernels (gpu mode; every launch's CUDA source under the emulator) is `turned`: a
    forward of decode rows alone (two streams, a step and a 5-row window after 40 cached positions) takes the
    q/k/v launch that turns them and no norm-and-RoPE launch, and gives the bits of the path it replaced (the
    parts launch, each head's values back in order, norm_rope_kernel.py's launch), its caches' rows too."""
    from test_attention_kernel import bf16_layer

    from dflash_bench.engine.targets import Segment
    from dflash_bench.engine.tiles import Layout

    cuda_emulator.install(monkeypatch)
    cuda_emulator.install_norm_rope(monkeypatch)
    cuda_emulator.install_matmul(monkeypatch)
    (i, attn), target = bf16_layer("llama", seed=43)
    assert attn.turned and len(attn.qkv.weights) == 1
    attn.path = "kernel"
    for w in (*attn.qkv.weights, attn.o):
        w.kernel = True
    launches: list[str] = []
    rope_launch, matmul = norm_rope_kernel.queries_and_keys, matmul_kernel.rows_matmul
    monkeypatch.setattr(norm_rope_kernel, "queries_and_keys", lambda *a, **kw: launches.append("norm_rope") or rope_launch(*a, **kw))
    monkeypatch.setattr("dflash_bench.engine.tiles.rows_matmul",
                        lambda *a, **kw: launches.append("rope" if kw.get("rope") else "matmul") or matmul(*a, **kw))
    d, hidden = attn.head_dim, target.config.hidden_size
    mx.random.seed(9)
    x = mx.random.normal((6, hidden)).astype(mx.bfloat16)
    prefix = mx.random.normal((2, attn.kv_heads, 40, d)).astype(mx.bfloat16)
    norm = (mx.ones((hidden,), dtype=mx.bfloat16), 1e-5)

    def forward() -> tuple[mx.array, list[mx.array]]:
        states = [target.new_state() for _ in range(2)]
        for state in states:
            state.layers[i].write_joint(0, prefix)
        segments = [Segment([0], 40, states[0]), Segment([0] * 5, 40, states[1])]
        out = attn(x, segments, Layout.of([1, 5], [False, False], tile=1), i, residual=x, norm=norm)
        return out, [s.layers[i].kv[:, :, :46] for s in states]

    fused, fused_caches = forward()
    assert launches == ["rope", "matmul"]  # q/k/v turned, then o
    launches.clear()
    monkeypatch.setattr(Stacked, "one_launch", property(lambda self: False))
    chain, chain_caches = forward()
    assert launches == ["matmul", "norm_rope", "matmul"]
    assert mx.array_equal(fused, chain).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(fused_caches, chain_caches))


@cuda_emulator.needs_gxx
def test_a_forward_of_decode_rows_alone_runs_the_turned_layers_straight_with_the_same_bits(monkeypatch) -> None:
    """A bf16 llama target whose every layer is turned and every projection on the row kernel (a CUDA GPU's gpu
    mode; every launch's CUDA source under the emulator): a forward of decode rows alone (a step and a 3-row window,
    two streams, then a step and a 2-row window after the window kept part of itself at a device length) runs its
    layers without `layer` (DenseTarget.layers), writes every layer's K/V once a stream at its end (stacked_cache.py)
    and gives the logits and caches `layer` gives (a write a layer and stream), bit for bit. A forward with a prompt
    chunk in it takes `layer`."""
    from tiny_targets import canonical_weights, config_dict, reference_model

    from dflash_bench.engine.stacked_cache import StackedLayer, StackedState
    from dflash_bench.engine.target_config import parse_target_config
    from dflash_bench.engine.targets import Segment, build_target
    from dflash_bench.engine.targets.dense import DenseTarget

    cuda_emulator.install(monkeypatch)
    cuda_emulator.install_matmul(monkeypatch)
    cfg = config_dict("llama", "smol", layers=2)
    weights = {name: w.astype(mx.bfloat16) for name, w in canonical_weights(reference_model(cfg, 5)).items()}
    target = build_target(parse_target_config(cfg), weights, dtype=mx.bfloat16)
    for w in target.projections():
        w.kernel = True
    for attn in target.attn:
        attn.path = "kernel"
    assert target.turned() and target.row_tile == 1
    calls: list[str] = []
    layer, write_layers, write_joint = DenseTarget.layer, StackedState.write_layers, StackedLayer.write_joint
    monkeypatch.setattr(DenseTarget, "layer", lambda self, i, *a: calls.append(f"layer {i}") or layer(self, i, *a))
    monkeypatch.setattr(StackedState, "write_layers", lambda self, *a: calls.append("all") or write_layers(self, *a))
    monkeypatch.setattr(StackedLayer, "write_joint", lambda self, *a: calls.append("one") or write_joint(self, *a))

    def forward() -> tuple[list[mx.array], list[mx.array]]:
        states = [target.new_state() for _ in range(2)]
        for state, prompt in zip(states, ([3, 1, 4, 1, 5], [2, 7, 1, 8, 2])):
            mx.eval(target.forward([Segment(prompt, 0, state, [4], prefill=True)])[0].logits, state.arrays())
            state.keep(5)
        calls.clear()
        outs = target.forward([Segment([9], 5, states[0], [0]), Segment([2, 6, 5], 5, states[1], [0, 1, 2])])
        mx.eval([o.logits for o in outs], [s.arrays() for s in states])
        states[0].keep(6)
        states[1].keep_at(mx.array(6, dtype=mx.int32), 8, 6)  # the window kept one of its drafts, a device value
        outs += target.forward([Segment([4], 6, states[0], [0]),
                                Segment([7, 3], 8, states[1], [0, 1], at=states[1].at)])
        return [o.logits for o in outs], [s.layers[i].kv[:, :, :16] for s in states for i in range(2)]

    straight, straight_caches = forward()
    assert calls == ["all", "all"] * 2  # no layer, no write a layer: every layer's rows once a stream
    monkeypatch.setattr(DenseTarget, "turned", lambda self: False)
    chain, chain_caches = forward()
    assert calls == ["layer 0", "one", "one", "layer 1", "one", "one"] * 2
    assert all(mx.array_equal(a, b).item() for a, b in zip(straight + straight_caches, chain + chain_caches))
