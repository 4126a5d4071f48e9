"""A drafter pass runs only what each stream drafts (drafters/dflash.py's `block_pass`): its lm_head
takes only the rows drafted from, and a DFlash v1 block only its anchor and draft rows (`block_rows`);
and a stream's drafts keep their bits whatever shares the pass, greedy and sampled. DFlash2 runs whole
blocks, so its short proposals draft a full block's first rows; so does v1 where no layer is
bidirectional inside the block (a short block then loses nothing a draft row could see)."""

from __future__ import annotations

import cuda_emulator
import mlx.core as mx
import pytest
from gpu import on_cuda

from dflash_bench.engine.drafters.dflash import Proposal
from dflash_bench.engine.drafters.dflash2 import DFlash2Drafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.sampling import SamplingParams
from dflash_bench.engine.targets import Segment
from dflash_bench.engine.tiles import key_mask
from dflash_bench.fixtures.small import write_fixture


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def drafter(request, tmp_path_factory):
    """The engine's drafter: the lm_head's row tiles are the ones its self-check proved on this machine."""
    root = tmp_path_factory.mktemp(request.param)
    engine = Engine(write_fixture("llama", root / "target", seed=1),
                    write_fixture(request.param, root / "drafter", seed=2, target="llama"), Settings(parallel=3, context=512))
    assert engine.selfcheck.passed, engine.selfcheck.line()
    target, drafter = engine.target, engine.drafter
    prompt = [(11 * i) % 400 + 8 for i in range(37)]
    taps = target.forward([Segment(prompt, 0, target.new_state(), want_taps=True)], drafter.taps)[0].taps
    states = []
    for n in (37, 30, 21):
        state = drafter.new_state()
        drafter.absorb([(state, taps[:n])])
        states.append(state)
    return drafter, states


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_short_proposals_draft_a_full_blocks_first_rows_and_run_only_their_rows(drafter, temperature, monkeypatch):
    drafter, states = drafter
    full = drafter.block - 1
    params = [SamplingParams(temperature, seed=s) for s in range(3)]
    whole = [drafter.propose([Proposal(st, 9 + i, full, p)])[0] for i, (st, p) in enumerate(zip(states, params))]
    counts = (3, full, 1)
    rows: list[int] = []
    logits = drafter.logits

    def counted(x):
        rows.append(x.shape[0])
        return logits(x)

    monkeypatch.setattr(drafter, "logits", counted)
    embedded: list[int] = []
    embed_rows = drafter.target.embed_rows
    monkeypatch.setattr(drafter.target, "embed_rows", lambda tokens: embedded.append(len(tokens)) or embed_rows(tokens))
    proposals = [Proposal(st, 9 + i, n, p) for i, (st, n, p) in enumerate(zip(states, counts, params))]
    short = drafter.propose(proposals)
    assert rows == [sum(counts)]  # not 3 x full
    assert embedded == [sum(drafter.block_rows(p.count) for p in proposals)]
    assert short == [drafter.propose([p])[0] for p in proposals]  # beside other streams == alone
    assert short[1] == whole[1]  # a full proposal runs the whole block
    if isinstance(drafter, DFlash2Drafter):
        assert embedded[0] == 3 * drafter.block
    else:
        assert embedded[0] == sum(n + 1 for n in counts)
        for layer in drafter.layers:  # causal in every layer: rows past a draft cannot reach it
            monkeypatch.setitem(layer, "causal", True)
        whole = [drafter.propose([Proposal(st, 9 + i, full, p)])[0] for i, (st, p) in enumerate(zip(states, params))]
        short = drafter.propose(proposals)
    assert short == [w[:n] for w, n in zip(whole, counts)]


def test_a_pass_builds_one_key_mask_per_stream_and_layer_kind(drafter, monkeypatch):
    """Every layer of a stream holds the same positions, so a pass builds each stream's mask once per
    kind of layer (window, causality), not once per layer (drafters/block_masks.py's `BlockMasks`: a GPU
    round pays per operation; the DFlash2 fixture's two sliding layers share one), and its drafts are
    the ones each layer's own mask gives."""
    from dflash_bench.engine.drafters import dflash

    class PerLayer:
        def of(self, stream: int) -> dflash.StreamBlock:
            return dflash.StreamBlock()

    drafter, states = drafter
    proposals = [Proposal(st, 9 + i, 5, SamplingParams(0.0)) for i, st in enumerate(states)]
    built = []
    monkeypatch.setattr(dflash, "key_mask", lambda *a: built.append(a) or key_mask(*a))
    shared = drafter.propose(proposals)
    assert len(built) == len(proposals) * len({(layer["window"], layer["causal"]) for layer in drafter.layers})
    monkeypatch.setattr(dflash, "BlockMasks", PerLayer)
    built.clear()
    assert drafter.propose(proposals) == shared and len(built) == len(proposals) * len(drafter.layers)


@cuda_emulator.needs_gxx
def test_on_the_row_kernel_a_drafter_layer_runs_k_v_q_and_gate_up_as_one_launch_each(monkeypatch, tmp_path) -> None:
    """Where the drafter's projections take the row kernel (a CUDA GPU; here its CUDA source run by
    tests/cuda_emulator.py), a layer's k, v and q, and its gate and up, are one stacked weight and one
    launch each, whose parts come back apart (tiles.Stacked): a block pass of the 9B-shaped tiny drafter
    launches 4 products a layer, not 7, and its logits are the separate products' to bf16 accuracy (a
    swapped part would be off by the whole norm). An absorb's k and v are the stacked weight's first rows
    (views of its arrays) in one launch."""
    from dflash_bench.engine import tiles
    from dflash_bench.engine.drafters.dflash import load_drafter
    from dflash_bench.fixtures.big import write_big

    engine = Engine(write_big("qwen3_5-9b-4bit", tmp_path / "t", "tiny"), None,
                    Settings(context=256, chunk=32, backend="gpu"))
    path = write_big("dflash-9b", tmp_path / "d", "tiny")
    separate = load_drafter(path, engine.target, dtype=mx.bfloat16)  # here: no kernel, one product each
    cuda_emulator.install_matmul(monkeypatch)
    monkeypatch.setattr(tiles, "available", lambda dtype: dtype == mx.bfloat16)
    stacked = load_drafter(path, engine.target, dtype=mx.bfloat16)
    for mine, theirs in zip(stacked.layers, separate.layers):
        for name, parts in (("kvq", 3), ("kv", 2), ("gate_up", 2)):
            assert len(mine[name].weights) == 1 and len(theirs[name].weights) == parts
        assert mine["kv"].weights[0].w.shape[0] == sum(mine["kv"].widths) == sum(mine["kvq"].widths[:2])
    taps = engine.target.forward([Segment(list(range(8, 40)), 0, engine.target.new_state(), want_taps=True)],
                                 stacked.taps)[0].taps
    launches: list[tuple[int, ...]] = []
    rows_matmul = tiles.rows_matmul
    monkeypatch.setattr(tiles, "rows_matmul", lambda *a, **kw: launches.append(a[-1]) or rows_matmul(*a, **kw))
    logits, layers = [], len(stacked.layers)
    for drafter in (separate, stacked):
        state = drafter.new_state()
        launches.clear()
        drafter.absorb([(state, taps)])
        assert launches.count(stacked.layers[0]["kv"].widths) == (layers if drafter is stacked else 0)
        launches.clear()
        logits.append(drafter.block_pass([Proposal(state, 9, 5, SamplingParams(0.0))])[1])
    assert len(launches) == 4 * layers and launches.count(stacked.layers[0]["kvq"].widths) == layers
    err = (mx.linalg.norm(logits[1] - logits[0]) / mx.linalg.norm(logits[0])).item()
    assert err < 5e-2, err


@cuda_emulator.needs_gxx
def test_where_every_kernel_takes_any_row_count_a_pass_runs_its_rows_unpadded(monkeypatch, tmp_path) -> None:
    """Where a pass's products and attention all run our kernels (a CUDA GPU; here their CUDA sources run
    by tests/cuda_emulator.py), its rows are not padded to whole ROW_TILEs (`any_rows`): the absorb's
    projection takes the taps' rows and every product of the block pass the block's rows alone, and the
    drafter's logits and K/V equal a padded pass's bit for bit, since each kernel gives a row the same
    arithmetic whatever rows share its launch. The block pass's RMS norms (each layer's two, the final one)
    and the absorb's (its fused rows' norm, in every layer's k/v launch) are in its products' launches: neither
    asks MLX for a norm."""
    from dflash_bench.engine import tiles
    from dflash_bench.engine.drafters import dflash
    from dflash_bench.fixtures.big import write_big

    engine = Engine(write_big("qwen3_5-9b-4bit", tmp_path / "t", "tiny"), None,
                    Settings(context=256, chunk=32, backend="gpu"))
    path = write_big("dflash-9b", tmp_path / "d", "tiny")
    cuda_emulator.install(monkeypatch)
    cuda_emulator.install_norm_rope(monkeypatch)
    cuda_emulator.install_matmul(monkeypatch)
    monkeypatch.setattr(tiles, "available", lambda dtype: dtype == mx.bfloat16)
    monkeypatch.setattr(dflash, "kernel_runs_here", lambda *a: True)
    drafter = dflash.load_drafter(path, engine.target, dtype=mx.bfloat16)
    assert drafter.any_rows
    head = engine.target.lm_head  # the target's head on the kernel too, as in a gpu-mode engine on a GPU
    assert head.fits_kernel(mx.bfloat16)
    monkeypatch.setattr(head, "kernel", True)
    taps = engine.target.forward([Segment(list(range(8, 37)), 0, engine.target.new_state(), want_taps=True)],
                                 drafter.taps)[0].taps
    rows: list[int] = []
    rows_matmul = tiles.rows_matmul
    monkeypatch.setattr(tiles, "rows_matmul", lambda x, *a, **kw: rows.append(x.shape[0]) or rows_matmul(x, *a, **kw))

    norms: list[int] = []
    rms_norm = mx.fast.rms_norm
    monkeypatch.setattr(mx.fast, "rms_norm", lambda x, *a: norms.append(x.shape[0]) or rms_norm(x, *a))

    def run(any_rows: bool) -> tuple[list[int], list[int], list[mx.array]]:
        monkeypatch.setattr(drafter, "any_rows", any_rows)
        state = drafter.new_state()
        rows.clear()
        norms.clear()
        drafter.absorb([(state, taps)])
        absorbed = list(rows)
        assert norms == []
        rows.clear()
        norms.clear()
        logits = drafter.block_pass([Proposal(state, 9, 5, SamplingParams(0.0))])[1]
        assert norms == []
        return absorbed, list(rows), [logits, *state.arrays()]

    absorbed, passed, unpadded = run(True)
    # the taps' 29 rows; the anchor and 5 draft rows, then the head's 5 drafted rows
    assert set(absorbed) == {29} and set(passed) == {6, 5}
    absorbed, passed, padded = run(False)
    assert set(absorbed) == {32} and set(passed) == {16, 5}
    assert len(unpadded) == len(padded)
    for got, want in zip(unpadded, padded):
        assert got.shape == want.shape and mx.array_equal(got, want).item()


@cuda_emulator.needs_gxx
def test_on_a_cuda_gpu_a_block_pass_runs_each_layers_attention_as_one_kernel_launch(monkeypatch, tmp_path) -> None:
    """Where decode attention runs attention_kernel.py (a CUDA GPU; here its CUDA source run by
    tests/cuda_emulator.py), a block pass runs each layer's attention for every stream in one launch with
    the layer's own mask (causal or bidirectional inside the block, a sliding window or none), instead of
    the tile products a stream at a time, from a call made once a pass for each kind of layer: a stream at a host start and one at a device start (cache.py's
    keep_at), the 9B-shaped tiny drafter in bf16, each stream's context read from its joint K/V cache, the
    streams' queries handed packed. The q and k rows' norms and RoPE take one launch a layer
    (targets/norm_rope_kernel.py), and an absorb's keys one a layer. Its logits are the tile
    products' to bf16 accuracy, and a control with the windows left out of the launches is not (the masks
    are what the kernel takes)."""
    from itertools import cycle

    from dflash_bench.engine.targets import norm_rope_kernel
    from dflash_bench.engine.drafters.dflash import load_drafter
    from dflash_bench.engine.targets import attention_kernel
    from dflash_bench.fixtures.big import write_big

    engine = Engine(write_big("qwen3_5-9b-4bit", tmp_path / "t", "tiny"), None,
                    Settings(context=256, chunk=32, backend="gpu"))
    drafter = load_drafter(write_big("dflash-9b", tmp_path / "d", "tiny"), engine.target, dtype=mx.bfloat16)
    assert not drafter.kernel_attention  # no CUDA GPU here
    cuda_emulator.install(monkeypatch)
    cuda_emulator.install_norm_rope(monkeypatch)
    kinds = cycle([(True, 20), (False, 20), (False, None), (True, None)])
    for layer, (causal, window) in zip(drafter.layers, kinds):
        monkeypatch.setitem(layer, "causal", causal)
        monkeypatch.setitem(layer, "window", window)
    taps = engine.target.forward([Segment(list(range(8, 48)), 0, engine.target.new_state(), want_taps=True)],
                                 drafter.taps)[0].taps
    made: list[tuple] = []  # each call made: its segments, whether each reads a joint cache, its queries packed
    launches: list[int] = []  # each layer's launch: the layer
    decode_call = attention_kernel.decode_call

    def counted(segs, *a, **kw):
        made.append((len(segs), all(v is None for _, _, v, _ in segs), kw.get("queries") is not None))
        call = decode_call(segs, *a, **kw)
        return lambda q, block, layer: launches.append(layer) or call(q, block, layer)

    monkeypatch.setattr(attention_kernel, "decode_call", counted)
    turned: list[tuple[str, int]] = []  # (launch, rows) of each norm-and-RoPE launch
    for name in ("keys", "queries_and_keys"):
        launch = getattr(norm_rope_kernel, name)
        monkeypatch.setattr(norm_rope_kernel, name,
                            lambda x, *a, launch=launch, name=name: turned.append((name, x.shape[0])) or launch(x, *a))

    def logits(kernel: bool) -> mx.array:
        monkeypatch.setattr(drafter, "kernel_attention", kernel)
        states = []
        for n in (40, 29):
            state = drafter.new_state()
            drafter.absorb([(state, taps[:n])])
            states.append(state)
        states[1].keep_at(mx.array(27, dtype=mx.int32), 29, 25)  # two stale rows past the device length
        out = drafter.block_pass([Proposal(st, 9 + i, 7, SamplingParams(0.0)) for i, st in enumerate(states)])[1]
        assert [st.length for st in states] == [40, 29]  # the block's K/V were the pass's only
        return out

    def error(got: mx.array, want: mx.array) -> float:
        return (mx.linalg.norm(got - want) / mx.linalg.norm(want)).item()

    tiled = logits(False)
    assert launches == [] and turned == []
    kernel = logits(True)
    # a launch a layer; each stream's context read from its joint cache, every stream's queries handed packed, in a
    # call made once for each kind of layer (causality, window)
    assert launches == list(range(len(drafter.layers)))
    assert made == [(2, True, True)] * len({(layer["causal"], layer["window"]) for layer in drafter.layers}) != []
    layers = len(drafter.layers)
    # an absorb of each stream (40 and 29 rows: keys), then the pass over both blocks of 8 rows (q and k)
    assert turned == [("keys", 40)] * layers + [("keys", 29)] * layers + [("queries_and_keys", 16)] * layers
    assert error(kernel, tiled) < 5e-2, error(kernel, tiled)  # 1.7e-2 here: the tile products' bf16 scores
    for layer in drafter.layers:
        monkeypatch.setitem(layer, "window", None)
    assert error(logits(True), tiled) > 0.3  # 0.95 here


def test_greedy_streams_draft_from_one_argmax_over_their_rows_as_each_alone(drafter):
    """Where every stream of a v1 pass is greedy, its drafts come from one argmax over all the streams' rows (a
    GPU round pays per operation: a slice, an argmax and a cast a stream before), each stream's the picks it
    drafts alone; a pass with a sampled stream among greedy ones picks a stream at a time, as alone."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from forward_ops import census

    drafter, states = drafter
    greedy = [Proposal(st, 9 + i, n, SamplingParams(0.0)) for i, (st, n) in enumerate(zip(states, (4, 2, 6)))]
    alone = [drafter.propose([p])[0] for p in greedy]
    queued = drafter.propose_queued(greedy)
    if not isinstance(drafter, DFlash2Drafter):  # DFlash2 walks its selector a stream at a time
        assert census(queued)["ArgReduce"] == 1
    assert [d.tolist() for d in queued] == alone
    mixed = [greedy[0], Proposal(states[1], 10, 2, SamplingParams(0.7, seed=3)), greedy[2]]
    assert drafter.propose(mixed) == [drafter.propose([p])[0] for p in mixed]


def nine_b_shaped(tmp_path):
    """The 9B-shaped tiny target in gpu mode, its drafter's folder, and the taps of a 40-token prompt."""
    from dflash_bench.fixtures.big import PRESETS, write_big

    engine = Engine(write_big("qwen3_5-9b-4bit", tmp_path / "t", "tiny"), None,
                    Settings(context=256, chunk=32, backend="gpu"))
    taps = engine.target.forward([Segment(list(range(8, 48)), 0, engine.target.new_state(), want_taps=True)],
                                 PRESETS["tiny"].taps)[0].taps
    return engine, write_big("dflash-9b", tmp_path / "d", "tiny"), taps


def emulated_kernel_drafter(monkeypatch, tmp_path):
    """The 9B-shaped tiny drafter in bf16 on the kernel path (attention and norm-and-RoPE launches run by
    tests/cuda_emulator.py), and its taps of a 40-token prompt."""
    from dflash_bench.engine.drafters.dflash import load_drafter

    engine, path, taps = nine_b_shaped(tmp_path)
    drafter = load_drafter(path, engine.target, dtype=mx.bfloat16)
    cuda_emulator.install(monkeypatch)
    cuda_emulator.install_norm_rope(monkeypatch)
    monkeypatch.setattr(drafter, "kernel_attention", True)
    return drafter, taps


def check_absorb_of_every_layer(drafter, taps: mx.array, monkeypatch) -> None:
    """A drafter whose products take the row kernel and whose keys take their launch: every layer's k, v and q rows
    are one array (`kvq_all`, each layer's kvq a view of its rows), and an absorb of two streams runs two launches
    for every layer's keys and values where it ran two a layer: one product over that array and one `layer_keys`
    launch. Each layer's rows in a stream's array are that layer's columns of the product, normed by its own k norm
    and turned at the rows' positions, as that layer's own `keys` launch turns them, bit for bit."""
    from dflash_bench.engine import tiles
    from dflash_bench.engine.targets import norm_rope_kernel

    layers, width = len(drafter.layers), sum(drafter.layers[0]["kvq"].widths)
    assert drafter.kvq_all.out_features == layers * width
    # each layer's own k norm weights (the fixture's are alike), still rows of one array as loading makes them
    mx.random.seed(5)
    drafter.k_norms = (1 + 0.5 * mx.random.normal((layers, drafter.head_dim))).astype(mx.bfloat16)
    for i, layer in enumerate(drafter.layers):
        layer["k_norm"] = drafter.k_norms[i]
    for i, layer in enumerate(drafter.layers):
        assert mx.array_equal(layer["kvq"].weights[0].w, drafter.kvq_all.w[i * width : (i + 1) * width]).item()
    launches, keyed = [], []
    rows_matmul, keys, layer_keys = tiles.rows_matmul, norm_rope_kernel.keys, norm_rope_kernel.layer_keys
    monkeypatch.setattr(tiles, "rows_matmul", lambda *a, **kw: launches.append(a[1].shape[0]) or rows_matmul(*a, **kw))
    monkeypatch.setattr(norm_rope_kernel, "keys", lambda *a: keyed.append("keys") or keys(*a))
    monkeypatch.setattr(norm_rope_kernel, "layer_keys", lambda *a: keyed.append("layer_keys") or layer_keys(*a))
    states = [drafter.new_state() for _ in range(2)]
    drafter.absorb([(states[0], taps[:20]), (states[1], taps[:12])])
    assert launches == [drafter.fc.out_features, layers * width] and keyed == ["layer_keys"]
    monkeypatch.setattr(tiles, "rows_matmul", rows_matmul)
    both = mx.concatenate([taps[:20], taps[:12]])
    made = tiles.linear(tiles.linear(both, drafter.fc), drafter.kvq_all, norm=(drafter.hidden_norm, drafter.eps))
    positions = mx.concatenate([mx.arange(20, dtype=mx.int32), mx.arange(12, dtype=mx.int32)])
    kv_width = drafter.kv_heads * drafter.head_dim
    for li, layer in enumerate(drafter.layers):
        k = mx.contiguous(made[:, li * width : li * width + kv_width])
        v = mx.contiguous(made[:, li * width + kv_width : li * width + 2 * kv_width])
        want = keys(k, v, layer["k_norm"], positions, drafter.config.rope_theta, drafter.eps)
        for st, lo, n in zip(states, (0, 20), (20, 12)):
            assert mx.array_equal(st.kv[2 * li : 2 * li + 2, :, :n], want[:, :, lo : lo + n]).item(), li
    # and the pass drafts from what it absorbed
    drafts = drafter.propose_queued([Proposal(st, 9, 5, SamplingParams(0.0)) for st in states])
    assert [d.shape for d in drafts] == [(5,), (5,)]


@cuda_emulator.needs_gxx
def test_on_the_row_kernel_an_absorb_makes_every_layers_keys_in_two_launches(monkeypatch, tmp_path) -> None:
    """`check_absorb_of_every_layer` with the drafter's CUDA sources run by tests/cuda_emulator.py; and off the row
    kernel (this CPU as it is) no such array is made, and the drafter holds the same bytes either way."""
    from dflash_bench.engine import tiles
    from dflash_bench.engine.drafters.dflash import load_drafter

    engine, path, taps = nine_b_shaped(tmp_path)
    separate = load_drafter(path, engine.target, dtype=mx.bfloat16)  # here: no kernel, one product each
    cuda_emulator.install_matmul(monkeypatch)
    cuda_emulator.install(monkeypatch)
    cuda_emulator.install_norm_rope(monkeypatch)
    monkeypatch.setattr(tiles, "available", lambda dtype: dtype == mx.bfloat16)
    drafter = load_drafter(path, engine.target, dtype=mx.bfloat16)
    monkeypatch.setattr(drafter, "kernel_attention", True)
    assert separate.kvq_all is None and drafter.nbytes == separate.nbytes  # (views: counted once)
    check_absorb_of_every_layer(drafter, taps, monkeypatch)


@on_cuda
def test_on_the_device_an_absorb_makes_every_layers_keys_in_two_launches(monkeypatch, tmp_path) -> None:
    from dflash_bench.engine.drafters.dflash import load_drafter

    engine, path, taps = nine_b_shaped(tmp_path)
    check_absorb_of_every_layer(load_drafter(path, engine.target, dtype=mx.bfloat16), taps, monkeypatch)


def test_a_kernel_pass_at_device_lengths_reads_each_streams_length_from_its_first_layer_only(monkeypatch, tmp_path) -> None:
    """Every layer of a stream's drafter state holds the same positions (`absorb` writes each alike), so the block
    pass's launch layouts take the state's device length, read from its first layer, for every layer: reading
    another layer's adds the rows written since (cache.py's `at`), an addition a layer and stream built for
    nothing. Streams kept at device lengths with rows absorbed since; the drafts equal those of states settled at
    the same lengths."""
    from dflash_bench.engine.cache import AttentionCache

    drafter, taps = emulated_kernel_drafter(monkeypatch, tmp_path)

    def states(placed: bool) -> list:
        out = []
        for n, kept in ((30, 26), (24, 21)):
            state = drafter.new_state()
            drafter.absorb([(state, taps[:n])])
            if placed:  # kept at a device length, then 6 more rows written at it
                state.keep_at(mx.array(kept, dtype=mx.int32), n, kept - 2)
            else:
                state.keep(kept)
            drafter.absorb([(state, taps[n : n + 6])])
            out.append(state)
        return out

    settled, placed = states(False), states(True)
    read = AttentionCache.at.fget
    reads: list[int] = []
    layers = {id(layer): i for st in placed for i, layer in enumerate(st.layers)}
    monkeypatch.setattr(AttentionCache, "at", property(
        lambda self: reads.append(layers.get(id(self), -1)) or read(self), AttentionCache.at.fset))
    want = drafter.propose_queued([Proposal(st, 9 + i, 7, SamplingParams(0.0)) for i, st in enumerate(settled)])
    reads.clear()
    got = drafter.propose_queued([Proposal(st, 9 + i, 7, SamplingParams(0.0)) for i, st in enumerate(placed)])
    assert reads and set(reads) == {0}, reads
    assert [d.tolist() for d in got] == [d.tolist() for d in want]


def test_a_kernel_absorb_writes_every_layers_rows_with_one_write_a_stream(monkeypatch, tmp_path) -> None:
    """Where the keys' norm and RoPE take their launch (a CUDA GPU; here its CUDA source run by
    tests/cuda_emulator.py), `absorb` writes every drafter layer's keys and values into a stream's one array at
    once (stacked_cache.py): one copy or scatter a stream, not one a layer and stream, at a host start and at a device
    start with stale rows past it; each layer's rows land at its offset with the bits its launch made, and the rows
    before them stay."""
    import sys
    from pathlib import Path

    from dflash_bench.engine.targets import norm_rope_kernel

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from forward_ops import census

    drafter, taps = emulated_kernel_drafter(monkeypatch, tmp_path)
    layers = len(drafter.layers)
    assert layers > 1
    made: list[mx.array] = []  # each layer's keys and values (2, heads, rows, d) as its launch made them
    keys = norm_rope_kernel.keys
    monkeypatch.setattr(norm_rope_kernel, "keys", lambda *a: made.append(keys(*a)) or made[-1])
    states = [drafter.new_state() for _ in range(2)]
    drafter.absorb([(states[0], taps[:20]), (states[1], taps[:12])])
    mx.eval([st.kv for st in states])
    before = [mx.array(st.kv) for st in states]
    states[1].keep_at(mx.array(10, dtype=mx.int32), 12, 8)  # two stale rows past the device length
    made.clear()
    drafter.absorb([(states[0], taps[20:26]), (states[1], taps[12:18])])
    arrays = [st.kv for st in states]  # (the writes are made where the arrays are next read)
    counts = census(arrays)
    assert counts["SliceUpdate"] + counts["Scatter"] + counts["ScatterAxis"] == 2, counts
    assert len(made) == layers
    for st, start, lo, old in zip(states, (20, 10), (0, 6), before):
        for li in range(layers):
            rows = st.kv[2 * li : 2 * li + 2, :, start : start + 6]
            assert mx.array_equal(rows, made[li][:, :, lo : lo + 6]).item(), (start, li)
        assert mx.array_equal(st.kv[:, :, :start], old[:, :, :start]).item()
        assert [layer.length if layer.at is None else layer.at.item() for layer in st.layers] == [start + 6] * layers
