"""The DFlash (v1) drafter: a qwen3-style body over the target's fused tap planes.

As each token's target forward completes, `absorb` fuses its tap planes into one hidden-size row
(`fc`, then `hidden_norm`) and appends that row's keys and values to every drafter layer's context
cache: the stream's ring holds one fused row's K/V per token, never the raw planes. `propose` runs
one pass over the block `[last token, mask x n]` of every drafting stream: each layer's queries
see the context (a sliding layer its own window, a full layer all of it) plus the block (causal
inside it when the layer is), and rows 1..n become drafts through the target's lm_head: a chain
(each position's pick), or from the same pass a draft tree (`propose_trees`, tree.py) over each
position's top candidates.

A block runs only as far as its stream drafts (`block_rows`: n = the proposal's count, B - 1 for a
full one). Rows past the last draft can reach the drafts only through a layer that is bidirectional
inside the block (the shipped drafter's last one), so a short block drafts nearly what a full
block's first rows do, and costs its rows' share: with the auto verify budget (2-4 drafts a round)
the default model decoded 15-24% faster on this CPU at the same tokens a round (docs/drafter-block.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import mlx.core as mx

from dflash_bench.engine.cache import write_index
from dflash_bench.engine.checkpoint import all_finite, files_sha256, in_device_memory
from dflash_bench.engine.draft_config import DraftConfig, read_draft_config
from dflash_bench.engine.targets import norm_rope_kernel
from dflash_bench.engine.drafters.block_masks import BlockMasks, StreamBlock
from dflash_bench.engine.drafters.position_lattice import PositionLattice
from dflash_bench.engine.errors import CheckpointError
from dflash_bench.engine.quantize import dequantize_packed
from dflash_bench.engine.row_ids import row_ids
from dflash_bench.engine.stacked_cache import StackedState
from dflash_bench.engine.sampling import SamplingParams, choose, filtered, gumbel
from dflash_bench.engine.targets import attention_kernel
from dflash_bench.engine.targets.base import Target, repack, rope_rows
from dflash_bench.engine.targets.dense import kernel_runs_here
from dflash_bench.engine.tiles import KEY_TILE, Stacked, SwiGLU, Weight, attention, key_mask, linear, pad_queries, pad_rows, query_positions
from dflash_bench.engine.tree import Lattice, Tree, build
from dflash_bench.engine.validate import check_drafter

TREE_WIDTH = 4  # candidates a tree considers at each depth (tree.py); best-first picks among them


class DrafterState(StackedState):
    """One stream's drafter context: every layer's keys and values over the fused rows so far in one array
    (stacked_cache.py), so `absorb` writes a stream's rows once, not once a layer (docs/gpu-round-profile.md,
    session 56), and the block pass's launch reads a layer's keys at its offset. Its lengths keep, settle and
    snapshot as a target state's attention layers do (cache.py)."""

    @property
    def start(self) -> int | mx.array:
        """Where the next rows go: the length, or its device value while the host has not read it (cache.py)."""
        return self.length if self.at is None else self.at


@dataclass
class Proposal:
    """What one drafting stream asks for: drafts after `last`, keyed like its target draws: a chain of
    `count`, or (`propose_trees`) a tree of `nodes` nodes at most `count` deep."""

    state: DrafterState
    last: int | mx.array  # an int32 scalar while the host has not read the stream's last token (lanes.py)
    count: int
    params: SamplingParams
    nodes: int = 0


class DFlashDrafter:
    kind = "DFlash"
    weights_sha256: str | None = None  # set by load_drafter: sha256 over the safetensors files read

    def __init__(self, config: DraftConfig, weights: dict[str, mx.array], target: Target, bits: int = 0):
        self.config = config
        self.target = target
        self.bits = bits
        c = config
        self.taps = tuple(c.taps)
        self.block = c.block_size
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.eps = c.rms_norm_eps
        self.dtype = weights["hidden_norm.weight"].dtype  # its activations and context K/V: its weights' dtype
        # every stream's block in one launch of attention_kernel.py a layer where it runs (a CUDA GPU): a
        # decode round there is bound by the operations the host builds and encodes, and the tile products'
        # softmax is about 15 of them a layer and stream (docs/gpu-round-profile.md)
        self.kernel_attention = kernel_runs_here((self.heads, self.kv_heads, self.head_dim), mx.default_device(),
                                                 mx.cuda.is_available())

        def w(name: str) -> Weight:
            """A projection; on a CUDA GPU in bf16 it takes the row kernel (matmul_kernel.py): one launch
            for every stream's block instead of 16-row tiles. Drafts need no row rule (the target's
            choice decides every token), only determinism, which the kernel has."""
            weight = Weight(weights[name], bits=bits)
            weight.kernel = weight.fits_kernel(self.dtype)
            return weight

        def stacked(*names: str | Weight, glu: bool = False) -> Stacked | SwiGLU:
            """Projections of the same rows (by name, or made by `w`): on the row kernel one launch writing each part
            apart (tiles.Stacked), or with `glu` an MLP's gate and up writing their SwiGLU (tiles.SwiGLU), elsewhere
            one product each, as `w` (a stacked weight's bits are its own, which drafts may change: the target's
            choices decide every token)."""
            parts = [name if isinstance(name, Weight) else w(name) for name in names]
            stack = all(part.kernel for part in parts)
            joined = SwiGLU(*parts, stack=stack) if glu else Stacked(parts, stack=stack)
            for weight in joined.weights:
                weight.kernel = weight.fits_kernel(self.dtype)
            return joined

        self.fc = w("fc.weight")
        self.hidden_norm = weights["hidden_norm.weight"]
        self.norm = weights["norm.weight"]
        # on the row kernel, every layer's k, v and q rows in one array, each layer's its rows of it (views): an
        # absorb's products of every layer are one launch over it (`absorb`), where they were one a layer
        parts = [w(f"layers.{i}.self_attn.{n}_proj.weight") for i in range(c.num_layers) for n in "kvq"]
        self.kvq_all: Weight | None = None
        self.k_norms: mx.array | None = None  # every layer's k norm weights (layers, D), where kvq_all is
        if all(part.kernel for part in parts) and all(parts[0].stacks_with(part) for part in parts[1:]):
            self.kvq_all = Weight.stacked(parts)
            self.kvq_all.kernel = self.kvq_all.fits_kernel(self.dtype)
            self.k_norms = mx.stack([weights[f"layers.{i}.self_attn.k_norm.weight"] for i in range(c.num_layers)])
        widths = tuple(part.out_features for part in parts[:3])
        self.layers = []
        for i in range(c.num_layers):
            p = f"layers.{i}"
            # a pass's k, v and q in one product; `absorb` runs k and v alone on the context rows where no launch runs
            # every layer's: on a stacked weight its first rows, views (`parameters` counts them once, as kvq's)
            kvq = (stacked(*parts[3 * i : 3 * i + 3]) if self.kvq_all is None
                   else Stacked.of(self.kvq_all.row_range(i * sum(widths), (i + 1) * sum(widths)), widths))
            self.layers.append(
                dict(
                    kvq=kvq,
                    kv=kvq.leading(2),
                    o=w(f"{p}.self_attn.o_proj.weight"),
                    q_norm=weights[f"{p}.self_attn.q_norm.weight"],
                    k_norm=weights[f"{p}.self_attn.k_norm.weight"] if self.k_norms is None else self.k_norms[i],
                    pre=weights[f"{p}.input_layernorm.weight"],
                    post=weights[f"{p}.post_attention_layernorm.weight"],
                    gate_up=stacked(f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight", glu=True),
                    down=w(f"{p}.mlp.down_proj.weight"),
                    window=c.sliding_window if c.layer_types[i] == "sliding_attention" else None,
                    causal=c.causal[i],
                )
            )
        # whether every product and attention of a pass takes any row count (the row kernel and the attention
        # kernel, on a CUDA GPU): then its rows are not padded to whole ROW_TILEs, a zero block and a
        # concatenation the host would build and encode for each layer's attention and the pass's embedding
        weights = [self.fc] + [w for layer in self.layers for v in layer.values()
                               for w in (v.weights if isinstance(v, (Stacked, SwiGLU)) else (v,) if isinstance(v, Weight) else ())]
        self.any_rows = self.kernel_attention and all(w.kernel for w in weights)
        mx.eval(self.parameters())  # materialize now: later memory readings must not see lazy weights land
        self.nbytes = sum(a.nbytes for a in self.parameters())

    def padded(self, x: mx.array) -> mx.array:
        """Rows padded to whole ROW_TILEs where a product of the pass runs in row tiles (`any_rows`)."""
        return x if self.any_rows else pad_rows(x)

    def parameters(self) -> list[mx.array]:
        """Every array the drafter holds (quantized copies included)."""
        out = [self.hidden_norm, self.norm, *self.fc.arrays()]
        for layer in self.layers:
            for name, value in layer.items():
                if name == "kv":  # views of kvq's arrays
                    continue
                if isinstance(value, Weight):
                    out += value.arrays()
                elif isinstance(value, (Stacked, SwiGLU)):
                    out += [a for w in value.weights for a in w.arrays()]
                elif isinstance(value, mx.array):
                    out.append(value)
        return out

    def weight_bytes(self) -> int:
        """Bytes a drafted round's drafter work reads at least: every array it holds, once (its absorb's k/v products
        read their part of kvq again, or on the row kernel all of every layer's kvq: `kvq_all`), and the target's
        lm_head its drafts go through (`logits`)."""
        return self.nbytes + sum(a.nbytes for a in self.target.lm_head.arrays())

    def new_state(self) -> DrafterState:
        return DrafterState(len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    def rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(x[None], self.head_dim, traditional=False, base=self.config.rope_theta, scale=1.0, offset=offset)[0]

    @property
    def kernel_rope(self) -> bool:
        """Whether q and k rows take norm_rope_kernel.py's one launch for their norm and RoPE: where the
        attention runs its kernel (a CUDA GPU), in bf16."""
        return self.kernel_attention and norm_rope_kernel.fits(self.head_dim, self.dtype)

    def absorb(self, items: list[tuple[DrafterState, mx.array]]) -> None:
        """Fuse each stream's new tap rows and append their K/V at the stream's next positions (a device
        value while the host has not read it: lanes.py then keeps the accepted ones with `keep_at`): where the
        keys' norm and RoPE take their launch, every layer's at once a stream (`StackedState.write_layers`), and on
        the row kernel every layer's products in one launch and their keys in one more (`kvq_all`,
        norm_rope_kernel.layer_keys), where they were two a layer."""
        if not items:
            return
        spans, total = [], 0
        for _, taps in items:
            spans.append((total, total + taps.shape[0]))
            total += taps.shape[0]
        taps = mx.concatenate([t for _, t in items]) if len(items) > 1 else items[0][1]
        fused, norm = linear(self.padded(taps), self.fc), (self.hidden_norm, self.eps)
        if not all(layer["kv"].one_launch for layer in self.layers):
            fused, norm = mx.fast.rms_norm(fused, *norm), None  # one norm for every layer's k/v products
        # else every layer's k/v launch norms the rows itself (tiles.linear): no launch for the norm
        # read once: writing layer 0 advances them; at a device length, the rows' positions for every layer
        starts = [(state.length, state.start, None if isinstance(state.start, int)
                   else row_ids(b - a) + state.start) for (state, _), (a, b) in zip(items, spans)]
        kernel = self.kernel_rope
        if kernel:  # every stream's rows' positions, for one norm-and-RoPE launch a layer
            parts = [mx.arange(at, at + b - a, dtype=mx.int32) if rows is None else rows
                     for (_, at, rows), (a, b) in zip(starts, spans)]
            positions = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        else:  # at a device length, each stream's write index once for every layer's write (cache.py)
            starts = [(start, at, None if rows is None else write_index(rows, state.layers[0].index_shape(
                (2, self.kv_heads, b - a, self.head_dim)))) for (start, at, rows), (a, b), (state, _) in zip(starts, spans, items)]
        theta = self.config.rope_theta
        if kernel and self.kvq_all is not None:
            # every layer's k and v in one launch (and their q, unused: a product over every layer's rows of one
            # array reads the q rows too, bytes the device can spare in a round the host bounds:
            # docs/gpu-round-profile.md, session 57), their keys in one more
            made = linear(fused, self.kvq_all, norm=norm)
            kv = norm_rope_kernel.layer_keys(made if made.shape[0] == total else made[:total], self.k_norms, positions,
                                             theta, self.eps, self.kv_heads)
        elif kernel:  # a layer's k and v in a launch, its keys in another
            written = [norm_rope_kernel.keys(k[:total], v[:total], layer["k_norm"], positions, theta, self.eps)
                       for layer in self.layers for k, v in [layer["kv"](fused, norm=norm)]]
            kv = mx.concatenate(written) if len(written) > 1 else written[0]  # (2 * layers, heads, rows, d)
        else:
            for li, layer in enumerate(self.layers):
                k, v = layer["kv"](fused, norm=norm)
                for (state, _), (a, b), (start, at, rows) in zip(items, spans, starts):
                    n = b - a
                    ks = mx.fast.rms_norm(k[a:b].reshape(n, self.kv_heads, self.head_dim), layer["k_norm"], self.eps)
                    ks = self.rope(ks.transpose(1, 0, 2), at)
                    vs = v[a:b].reshape(n, self.kv_heads, self.head_dim).transpose(1, 0, 2)
                    state.layers[li].write(start, ks, vs, rows)
            return
        for (state, _), (a, b), (start, _, rows) in zip(items, spans, starts):  # as a state's array holds every layer's
            state.write_layers(start, kv if len(items) == 1 else kv[:, :, a:b], rows)

    def propose(self, items: list[Proposal]) -> list[list[int]]:
        """Drafts for every drafting stream from one pass over their blocks, read back as lists."""
        return [d.tolist() for d in self.propose_queued(items)]

    def propose_queued(self, items: list[Proposal]) -> list[mx.array]:
        """The drafts of `propose` as int32 arrays not yet read back: a round queues its verify forward
        on them, so the device runs this pass while the host builds that forward (lanes.py)."""
        if not items:
            return []
        return self.drafts(*self.block_pass(items), items)

    def propose_trees(self, items: list[Proposal]) -> list[Tree]:
        """A draft tree for every drafting stream from one pass over their blocks (tree.py): its first
        path is what `propose` would draft."""
        if not items:
            return []
        lattices = self.lattices(*self.block_pass(items), items)
        return [build(p.last, lattice, p.nodes, p.count) for p, lattice in zip(items, lattices)]

    def lattices(self, h: mx.array, logits: mx.array, items: list[Proposal]) -> list[Lattice]:
        """Each stream's tree candidates from its block rows' logits, scored as `drafts` picks."""
        out = []
        for first, p in zip(firsts(items), items):
            part = logits[first : first + p.count]
            positions = draft_positions(p)
            scores = part
            if not p.params.greedy:
                scores = filtered(part / p.params.temperature, p.params.top_k, p.params.top_p)
                scores = scores + gumbel(p.params.seed, positions, part.shape[-1])
            out.append(PositionLattice(scores, choose(part, positions, p.params), TREE_WIDTH))
        return out

    def block_rows(self, count: int) -> int:
        """The rows of a stream's block a pass runs for `count` drafts: the anchor and one a draft
        (module docstring). The verify budget prices a pass by these rows (budget.py)."""
        return count + 1

    def block_pass(self, items: list[Proposal]) -> tuple[mx.array, mx.array]:
        """One pass over every stream's block `[last, mask x (block_rows - 1)]`: each stream's rows 1..count, not
        yet through the final norm, and their logits (stream i's from row `firsts(items)[i]`: `logits`). Only the
        rows a stream drafts from go through the lm_head, the pass's largest product; its row tiles keep each
        row's bits."""
        mask = self.config.mask_token_id
        blocks = [[p.last] + [mask] * (self.block_rows(p.count) - 1) for p in items]
        ends = list(accumulate(len(b) for b in blocks))
        spans = list(zip([0, *ends[:-1]], ends))
        h = self.padded(self.target.embed_rows(block_ids(blocks)))
        masks = BlockMasks()
        for li, layer in enumerate(self.layers):
            h = self.layer(li, layer, h, items, spans, masks)
        if len(items) == 1:  # one stream's rows 1 .. count: a slice, where a gather is an operation
            drafted = h[1 : 1 + items[0].count]
        else:
            drafted = h[mx.array([a + r for (a, _), p in zip(spans, items) for r in range(1, 1 + p.count)], dtype=mx.int32)]
        return drafted, self.logits(drafted)

    def layer(self, li: int, layer: dict, h: mx.array, items: list[Proposal], spans: list[tuple[int, int]],
              masks: BlockMasks) -> mx.array:
        """One decoder layer over every stream's block: attention, then the SwiGLU MLP, each after its RMS norm and
        with its residual (on the row kernel the norms in the k/v/q and gate/up launches, the adds in the o and
        down projections': tiles.linear)."""
        h = self.attention(li, layer, h, items, spans, masks, residual=h, norm=layer["pre"])
        return self.mlp(layer, h, residual=h, norm=layer["post"])

    def attention(self, li: int, layer: dict, x: mx.array, items: list[Proposal], spans: list[tuple[int, int]],
                  masks: BlockMasks, residual: mx.array | None = None, norm: mx.array | None = None) -> mx.array:
        """The attention sublayer's output, plus `residual` where given; x RMS-normed with `norm`'s weights
        first where given, in the k/v/q product's launch on the row kernel (tiles.linear)."""
        k, v, q = layer["kvq"](x, norm=None if norm is None else (norm, self.eps))
        if self.kernel_attention:
            o = self.attend_launch(li, layer, q, k, v, items, spans, masks)
            return linear(o if o.shape[0] == x.shape[0] else pad_rows(o, x.shape[0]), layer["o"], residual=residual)
        outs = [self.attend(layer, li, p.state, q[a:b], k[a:b], v[a:b], masks.of(i))
                for i, (p, (a, b)) in enumerate(zip(items, spans))]
        return linear(repack(outs, x.shape[0]), layer["o"], residual=residual)

    def mlp(self, layer: dict, x: mx.array, residual: mx.array | None = None, norm: mx.array | None = None) -> mx.array:
        """The SwiGLU MLP of `x` (RMS-normed with `norm`'s weights first where given, as `attention`), plus
        `residual` where given."""
        return linear(layer["gate_up"](x, norm=None if norm is None else (norm, self.eps)), layer["down"],
                      residual=residual)

    def drafts(self, h: mx.array, logits: mx.array, items: list[Proposal]) -> list[mx.array]:
        """Each stream's drafts (int32) from its block rows' logits, keyed like the target's own draws. Where
        every stream is greedy, one argmax over all their rows (a row's pick is its own) split into the streams'
        parts: two operations and a split a pass, not a slice, an argmax and a cast a stream (a GPU round pays per
        operation: docs/gpu-round-profile.md)."""
        starts = firsts(items)
        if len(items) > 1 and all(p.params.greedy for p in items):
            return mx.split(mx.argmax(logits, axis=-1).astype(mx.int32), starts[1:])
        out = []
        for first, p in zip(starts, items):
            part = logits[first : first + p.count]
            out.append(choose(part, draft_positions(p), p.params).astype(mx.int32))
        return out

    def logits(self, h: mx.array) -> mx.array:
        """Float32 logits of block rows through the final norm and the target's lm_head (with the config's
        output multiplier and soft cap, where it sets them). On the row kernel the head takes any row count
        and the norm in its launch (tiles.linear)."""
        head = self.target.lm_head
        out = linear(h if head.kernel else pad_rows(h), head, norm=(self.norm, self.eps))[: h.shape[0]].astype(mx.float32)
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping:
            out = mx.tanh(out / c.final_logit_softcapping) * c.final_logit_softcapping
        return out

    def attend(self, layer: dict, li: int, state: DrafterState, q: mx.array, k: mx.array, v: mx.array,
               block: StreamBlock) -> mx.array:
        """One stream's block queries over its context plus the block, in the layer's window; the rows'
        positions and the keys they see from `block` (the stream's, `BlockMasks`), built by its pass's
        first layer (of a kind)."""
        cache = state.layers[li]
        n, start, at, low = q.shape[0], cache.length, cache.at, cache.low
        here = start if at is None else at  # the block's first position (a device value while unread)
        qs = mx.fast.rms_norm(q.reshape(n, self.heads, self.head_dim), layer["q_norm"], self.eps)
        ks = mx.fast.rms_norm(k.reshape(n, self.kv_heads, self.head_dim), layer["k_norm"], self.eps)
        qs = self.rope(qs.transpose(1, 0, 2), here)
        ks = self.rope(ks.transpose(1, 0, 2), here)
        vs = v.reshape(n, self.kv_heads, self.head_dim).transpose(1, 0, 2)
        if block.positions is None:
            block.positions = query_positions(here, n)
        positions = block.positions
        cache.write(start, ks, vs, None if at is None else positions[:n])  # after the context for this pass only
        keys, values = cache.view(start + n)
        if at is None:
            cache.keep(start)
        else:
            cache.keep_at(at, start, low)
        first = 0
        if layer["window"] is not None:  # from the host's lower bound of the length: the mask drops the rest
            first = max(0, low + n - layer["window"]) // KEY_TILE * KEY_TILE
        kind = (first, keys.shape[1] - first, layer["causal"], layer["window"])
        if kind not in block.masks:
            block.masks[kind] = key_mask(positions, *kind[:2], here + n, *kind[2:])
        seen = block.masks[kind]
        o = attention(pad_queries(qs), keys[:, first:], values[:, first:], seen, scale=self.scale)[:, :n]
        return o.transpose(1, 0, 2).reshape(n, self.heads * self.head_dim)

    def attend_launch(self, li: int, layer: dict, q: mx.array, k: mx.array, v: mx.array, items: list[Proposal],
                      spans: list[tuple[int, int]], masks: BlockMasks) -> mx.array:
        """Every stream's block over its context plus the block, in one launch of attention_kernel.py with
        the layer's causality and window (what `attend` computes per stream with the tile products, in
        another summation order): the rows' norms and RoPE once for all streams, each row at its own
        position (one launch for both where `kernel_rope`). Returns (rows, heads * head_dim) for
        the blocks' rows."""
        rows = spans[-1][1]
        q, k, v = q[:rows], k[:rows], v[:rows]
        positions = masks.packed(items, spans)
        if self.kernel_rope:  # float32 queries (rows, heads, d), as the attention kernel reads them; K/V joined
            queries, kv = norm_rope_kernel.queries_and_keys(q, k, v, layer["q_norm"], layer["k_norm"], positions,
                                                            self.config.rope_theta, self.eps)
        else:
            q, k = q.reshape(rows, self.heads, self.head_dim), k.reshape(rows, self.kv_heads, self.head_dim)
            qs = rope_rows(mx.fast.rms_norm(q, layer["q_norm"], self.eps), positions, self.head_dim, self.config.rope_theta)
            ks = rope_rows(mx.fast.rms_norm(k, layer["k_norm"], self.eps), positions, self.head_dim, self.config.rope_theta)
            vs = v.reshape(rows, self.kv_heads, self.head_dim).transpose(1, 0, 2)
            queries, kv = qs.transpose(1, 0, 2), mx.stack([ks, vs])
        # the block's K/V are this pass's only: the launch reads them from kv itself, where the cache holds the
        # context (no write into the cache, one scatter a layer and stream); it reads the context's keys and
        # values from the stream's array of every layer at this layer's offset itself (its `layer`: no views of it)
        kind = (layer["causal"], layer["window"])
        call = masks.calls.get(kind)
        if call is None:  # the pass's first layer of this kind: its launch, which the kind's other layers call too
            launch = [(queries[a:b], p.state.kv, None, p.state.layers[li].length) for p, (a, b) in zip(items, spans)]
            # every layer of a stream holds the same positions (`absorb` writes each alike), so the state's device
            # length (its first layer's, read once a pass by `start`) stands for this layer's: reading a layer's own
            # adds the rows written since (cache.py's `at`), an addition a layer and stream
            meta = masks.launch_meta(launch, [p.state.at for p in items], layer["causal"])
            call = masks.calls[kind] = attention_kernel.decode_call(launch, self.scale, meta, *kind, block=kv,
                                                                    queries=queries, layer=li)
        return call(queries, kv, li).reshape(rows, self.heads * self.head_dim)


def firsts(items: list[Proposal]) -> list[int]:
    """Where each stream's rows start in a block pass's output rows (`block_pass`): after the rows of
    the streams before it, `count` each."""
    return [sum(p.count for p in items[:i]) for i in range(len(items))]


def draft_positions(p: Proposal) -> mx.array:
    """The absolute positions a stream's drafts would take (its sampling keys)."""
    return row_ids(p.count, 1) + p.state.start


def block_ids(blocks: list[list[int | mx.array]]) -> list[int] | mx.array:
    """The blocks' token ids one after another: a list, or an int32 array where a block's anchor (its
    first id) is a device value the host has not read (lanes.py)."""
    if not any(isinstance(b[0], mx.array) for b in blocks):
        return [t for b in blocks for t in b]
    parts = []
    for anchor, *rest in blocks:
        parts.append(anchor.astype(mx.int32).reshape(1) if isinstance(anchor, mx.array)
                     else mx.array([anchor], dtype=mx.int32))
        if rest:
            parts.append(mx.array(rest, dtype=mx.int32))
    return mx.concatenate(parts)


def load_drafter(path: str | Path, target: Target, bits: int = 0, dtype: mx.Dtype = mx.float32) -> DFlashDrafter:
    """Read a DFlash drafter directory (config.json + model.safetensors) for `target`: float weights,
    or mlx-lm's affine-quantized layout (the shipped drafter is stored in 6 bits), dequantized here; in `dtype`
    (the engine's activation dtype) before any `bits` quantization."""
    path = Path(path)
    config = read_draft_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights beside config.json")
    check_drafter(path, config)  # byte ranges, dtypes, names and shapes: one line before any weight is read
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    if config.quantization is not None:  # stored packed (mlx-lm's layout): the engine computes in float
        weights = dequantize_packed(weights, *config.quantization)
    weights = {k: v.astype(dtype) for k, v in weights.items()}
    for v in weights.values():  # one tensor at a time: at once, every tensor's dequantization temporaries
        mx.eval(v)  # were alive together (the 6-bit drafter's load peaked 212 MB above its float weights)
    bad = [k for k, v in weights.items() if not all_finite([v])]
    if bad:  # checked after the cast: a value finite in float32 can overflow to inf in bf16
        raise CheckpointError(f"{path}: tensor {bad[0]!r} holds NaN or infinite values")
    weights = {k: in_device_memory(v) for k, v in weights.items()}
    if config.is_dflash2:
        from dflash_bench.engine.drafters.dflash2 import DFlash2Drafter  # the subclass imports this module

        drafter: DFlashDrafter = DFlash2Drafter(config, weights, target, bits=bits)
    else:
        drafter = DFlashDrafter(config, weights, target, bits=bits)
    drafter.weights_sha256 = files_sha256(files)
    return drafter
