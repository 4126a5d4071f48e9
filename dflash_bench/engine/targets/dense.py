"""llama and qwen3: dense decoder layers (qwen3 adds RMS norms on each head's queries and keys).

`SelfAttention` is also qwen3_5's full attention (gated). A prompt chunk's attention is MLX's SDPA; decode
rows take `tiles.attention` one segment at a time or, on a CUDA GPU, attention_kernel.py's launch for
every decode segment of the forward (docs/gpu-round-profile.md: the per-segment path cost 0.57-0.64 ms a
layer per stream there). Both are row-independent; they differ in the last bits, so a layer runs one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import mlx.core as mx

from dflash_bench.engine.cache import AttentionCache, JointCache
from dflash_bench.engine.fused import sigmoid_gate
from dflash_bench.engine.matmul_kernel import Rope, head_rows, in_order
from dflash_bench.engine.stacked_cache import StackedLayer, StackedState
from dflash_bench.engine.target_config import TargetConfig
from dflash_bench.engine.targets import attention_kernel, norm_rope_kernel
from dflash_bench.engine.targets.base import Segment, Target, as_weight, packed_positions, rope_rows
from dflash_bench.engine.tiles import AttentionPath, Layout, Norm, Stacked, Weight, attention, linear, pad_queries
from dflash_bench.engine.tree_attention import tree_attention, tree_keys

# How a layer runs its decode rows: `tiles.attention` per segment (its two paths), or attention_kernel.py's
# launch for every decode segment of the forward at once.
DecodePath = AttentionPath | Literal["kernel"]


def kernel_runs_here(heads: tuple[int, int, int], device: mx.Device, cuda: bool) -> bool:
    """Whether a layer of `heads` (Hq, Hkv, D) can run decode attention as our CUDA kernel when MLX
    computes on `device`: on a GPU of a CUDA build (`cuda`: `mx.cuda.is_available()`) whose launch covers
    the heads; never on a CPU or a Metal GPU (as qwen3_5.py's `decode_recurrence`)."""
    return device.type == mx.DeviceType.gpu and cuda and attention_kernel.fits(*heads)


def kernel_meta(decoding: list[tuple[Segment, tuple[int, int]]], launch: list[attention_kernel.Rows]) -> mx.array:
    """attention_kernel.py's launch layout for a forward's decode segments, built once for every attention
    layer (the first segment keeps it, as `packed_positions`: a Segment lives for one forward; every
    layer's cache has the same capacity)."""
    first = decoding[0][0]
    key = tuple((id(seg), attention_kernel.cache_shape(rows)[1]) for (seg, _), rows in zip(decoding, launch))
    if first._launch is None or first._launch[0] != key:
        first._launch = (key, attention_kernel.launch_meta(launch, [seg.at for seg, _ in decoding]))
    return first._launch[1]


@dataclass
class Straight:
    """What a forward run straight (DenseTarget.layers) keeps across its layers: each layer's K/V rows, written at
    once at its end, and the attention launch made at its first layer for all of them (its segments, their caches
    and its layout are every layer's: attention_kernel.py's `Call`)."""

    written: list[mx.array] = field(default_factory=list)
    call: attention_kernel.Call | None = None


class SelfAttention:
    """Rotary multi-head attention with grouped K/V heads, one stream's cache per segment.

    `gated` is qwen3_5's variant: q_proj yields queries and a sigmoid gate on the output.
    """

    def __init__(self, config: TargetConfig, weights: dict, prefix: str, gated: bool = False, stack: bool = False):
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        parts = [as_weight(weights[f"{prefix}.{n}_proj.weight"]) for n in "qkv"]
        # a layer without q/k norms or a gate turns its decode rows' queries and keys in the q/k/v launch (`turned`):
        # its q and k rows sit in that launch's order, and every other use of them puts the values back in order
        self.turned = stack and not config.qk_norm and not gated and config.rope_dims % 2 == 0 == self.head_dim % 2
        if self.turned:
            rows = [head_rows(heads, self.head_dim, config.rope_dims) for heads in (self.heads, self.kv_heads)]
            parts[:2] = [part.reordered(r) for part, r in zip(parts, rows)]
            self.back_q, self.back_k = (mx.array(in_order(r), dtype=mx.int32) for r in rows)
        # q, k, v: one stacked weight where `stack` (the gpu mode: tiles.Stacked)
        self.qkv = Stacked(parts, stack)
        self.o = as_weight(weights[f"{prefix}.o_proj.weight"])
        self.q_norm = weights.get(f"{prefix}.q_norm.weight") if config.qk_norm else None
        self.k_norm = weights.get(f"{prefix}.k_norm.weight") if config.qk_norm else None
        self.eps = config.rms_norm_eps
        self.rope_dims = config.rope_dims
        self.rope_theta = config.rope_theta
        self.gated = gated
        self.scale = self.head_dim**-0.5
        heads = (self.heads, self.kv_heads, self.head_dim)
        self.kernel = kernel_runs_here(heads, mx.default_device(), mx.cuda.is_available())
        # what decode rows run: the kernel where it runs, else the tile products (the self-check proves the
        # path on the machine that serves, falling back to the tiled and elementwise ones: selfcheck.py)
        self.path: DecodePath = "kernel" if self.kernel else "tiled"

    @property
    def projections(self) -> tuple[Weight, ...]:
        return (*self.qkv.weights, self.o)

    def __call__(self, x: mx.array, segments: list[Segment], layout: Layout, layer: int, residual: mx.array,
                 norm: Norm) -> mx.array:
        """`residual` plus each segment's rows of x RMS-normed by `norm` over its own stream's cache (the norm
        in the q/k/v launch and the add in o_proj's on the row kernel: tiles.linear). A prompt chunk takes
        MLX's SDPA alone; the decode segments share their norms, RoPE and gate (`decode`), or where the layer is
        `turned` and the forward has decode rows alone, take the q/k/v launch that turns them (`turned_decode`)."""
        decoding = [(seg, span) for seg, span in zip(segments, layout.spans) if not seg.prefill]
        if self.turned and decoding and not layout.blocks and self.path == "kernel" and self.qkv.one_launch:
            return linear(layout.join(self.turned_decode(x, decoding, layer, norm), []), self.o, layout, residual)
        q, k, v = self.qkv(x, layout, norm)
        if self.turned:  # each head's values in order again
            q, k = mx.take(q, self.back_q, axis=1), mx.take(k, self.back_k, axis=1)
        decoded = self.decode(q, k, v, decoding, layer) if decoding else None
        prompts = [self.prompt_chunk(q[lo:hi], k[lo:hi], v[lo:hi], seg, layer)
                   for seg, (lo, hi) in zip(segments, layout.spans) if seg.prefill]
        return linear(layout.join(decoded, prompts), self.o, layout, residual)

    def split(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array | None, mx.array, mx.array]:
        """Rows into heads (n, H, D): queries (normed), the output gate if gated, keys (normed), values."""
        n = q.shape[0]
        if self.gated:
            q, gate = mx.split(q.reshape(n, self.heads, 2 * self.head_dim), 2, axis=-1)
        else:
            q, gate = q.reshape(n, self.heads, self.head_dim), None
        k = k.reshape(n, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = mx.fast.rms_norm(q, self.q_norm, self.eps)
            k = mx.fast.rms_norm(k, self.k_norm, self.eps)
        return q, gate, k, v.reshape(n, self.kv_heads, self.head_dim)

    def gate(self, o: mx.array, gate: mx.array | None) -> mx.array:
        """(n, Hq * D) attention rows, times the sigmoid output gate (n, Hq, D) where the layer has one: the gate
        as the view of q's rows it is (flattening it would copy it first, a launch a layer), the same products."""
        if gate is None:
            return o
        n = o.shape[0]
        return sigmoid_gate(o.reshape(n, self.heads, self.head_dim), gate).reshape(n, -1)

    def prompt_chunk(self, q: mx.array, k: mx.array, v: mx.array, seg: Segment, layer: int) -> mx.array:
        n = len(seg.tokens)
        q, gate, k, v = self.split(q, k, v)
        q, k = self.rope(q.transpose(1, 0, 2), seg.start), self.rope(k.transpose(1, 0, 2), seg.start)
        cache = seg.state.layers[layer]
        assert isinstance(cache, AttentionCache)
        cache.write(seg.start, k, v.transpose(1, 0, 2))
        o = self.prefill_attention(q, cache, seg.start + n)
        return self.gate(o.transpose(1, 0, 2).reshape(n, self.heads * self.head_dim), gate)

    def decode(self, q: mx.array, k: mx.array, v: mx.array, decoding: list[tuple[Segment, tuple[int, int]]],
               layer: int) -> mx.array:
        """Every decode segment's rows (packed first, in order: tiles.Layout): norms, RoPE (each row at
        its own position: `rope_rows`) and the gate over all rows at once, K/V into each stream's cache,
        then attention: the tile products one segment at a time (a tree's over its rows' serial key
        views) or, on the kernel path, one launch for all of them. On the kernel path in bf16 (a CUDA GPU's
        gpu mode) the norms, both RoPEs, the K/V stack and the queries' cast are one launch before it
        (norm_rope_kernel.py: the rotation MLX's bit for bit, a q/k norm the launch's own; each row its own, as
        the attention launch's)."""
        rows = decoding[-1][1][1]
        positions = packed_positions([seg for seg, _ in decoding])
        if self.path == "kernel" and norm_rope_kernel.fits(self.head_dim, q.dtype):
            # norms, RoPE, the K/V stack and the queries' float32 cast in one launch (norm_rope_kernel.py); a gated
            # layer's gates stay in q's rows, read as a view
            queries, kv = norm_rope_kernel.queries_and_keys(
                q[:rows], k[:rows], v[:rows], self.q_norm, self.k_norm, positions, self.rope_theta, self.eps,
                head_dim=self.head_dim, rope_dims=self.rope_dims, gated=self.gated)
            gate = q[:rows].reshape(rows, self.heads, 2 * self.head_dim)[..., self.head_dim :] if self.gated else None
            caches = self.write(decoding, kv, layer)
            o = self.kernel_attention(decoding, caches, queries)
            return self.gate(o, gate)
        q, gate, k, v = self.split(q[:rows], k[:rows], v[:rows])
        q, k, v = self.rope_rows(q, positions), self.rope_rows(k, positions), v.transpose(1, 0, 2)  # (H, rows, D)
        kv = mx.stack([k, v])  # every stream's rows joined once: a write a stream (cache.py's JointCache)
        caches = self.write(decoding, kv, layer)
        if self.path == "kernel":
            # the rows' queries as one array: the launch makes them float32 (one copy), not joined from the segments' first
            o = self.kernel_attention(decoding, caches, q.transpose(1, 0, 2))
        else:
            outs = []
            for (seg, (lo, hi)), c in zip(decoding, caches):
                n, qs = hi - lo, q[:, lo:hi]
                if seg.tree is not None:
                    a = self.tree_attention(qs, c, seg)
                else:
                    keys, values = c.view(seg.start + n)
                    a = attention(pad_queries(qs), keys, values, seg.key_mask(keys.shape[1]), scale=self.scale,
                                  path=self.path)[:, :n]
                outs.append(a.transpose(1, 0, 2).reshape(n, self.heads * self.head_dim))
            o = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        return self.gate(o, gate)

    def turned_decode(self, x: mx.array, decoding: list[tuple[Segment, tuple[int, int]]], layer: int,
                      norm: Norm, straight: Straight | None = None) -> mx.array:
        """Every decode segment's rows (packed first) through the q/k/v launch that norms them, turns their queries
        and keys at their positions and lays them out for attention (matmul_kernel.rows_matmul's `rope`: the bits
        of the parts and norm_rope_kernel.py's launch), their K/V into each stream's cache, then the attention
        launch: (rows, Hq * D). In a `straight` forward the K/V rows are not written but kept in it (the caller
        writes every layer's at once: DenseTarget.layers), and the launch, made once for every layer, reads them
        from the forward's rows (its `block`) and the rest from every stream's array of every layer."""
        rows = decoding[-1][1][1]
        positions = packed_positions([seg for seg, _ in decoding])
        rope = Rope(positions, norm_rope_kernel.device_log2_theta(self.rope_theta),
                    (self.heads, self.kv_heads, self.head_dim, self.rope_dims))
        queries, kv = self.qkv.weights[0].kernel_product(x if rows == x.shape[0] else x[:rows], self.qkv.widths,
                                                         norm=norm, rope=rope)
        if straight is None:
            return self.kernel_attention(decoding, self.write(decoding, kv, layer), queries)
        straight.written.append(kv)
        if straight.call is None:
            launch = [(queries[lo:hi], seg.state.kv, None, seg.start) for seg, (lo, hi) in decoding]
            straight.call = attention_kernel.decode_call(launch, self.scale, kernel_meta(decoding, launch),
                                                         queries=queries, block=kv, layer=layer)
        return straight.call(queries, kv, layer).reshape(rows, -1)

    def write(self, decoding: list[tuple[Segment, tuple[int, int]]], kv: mx.array, layer: int) -> list[JointCache]:
        """Every decode segment's keys and values (kv: 2, Hkv, rows, D, the segments' rows in order) into its
        stream's cache at its start (a device one where it has one): the caches."""
        caches = []
        for seg, (lo, hi) in decoding:
            cache = seg.state.layers[layer]
            assert isinstance(cache, JointCache)
            rows_kv = kv if len(decoding) == 1 else kv[:, :, lo:hi]  # (no view where it is all of them)
            cache.write_joint(seg.start, rows_kv,
                              None if seg.at is None else seg.write_index(cache.index_shape(rows_kv.shape)))
            caches.append(cache)
        return caches

    def kernel_attention(self, decoding: list[tuple[Segment, tuple[int, int]]], caches: list[JointCache],
                         queries: mx.array) -> mx.array:
        """Every decode segment's rows over its cache in attention_kernel.py's launch, from the packed queries
        (rows, Hq, D): (rows, Hq * D). A dense target's layer (stacked_cache.py's StackedLayer) is read in place in
        its state's array of every layer (the launch's `layer`)."""
        assert all(seg.tree is None for seg, _ in decoding), "trees never reach the kernel: DenseTarget.tree_refusal"
        layer = caches[0].index if isinstance(caches[0], StackedLayer) else None
        launch = [(queries[lo:hi], c.kv if layer is None else c.stack.kv, None, seg.start)
                  for (seg, (lo, hi)), c in zip(decoding, caches)]
        o = attention_kernel.decode_attention(launch, self.scale, kernel_meta(decoding, launch), queries=queries,
                                              layer=layer)
        return o.reshape(queries.shape[0], -1)

    def prefill_attention(self, q: mx.array, cache: AttentionCache, length: int) -> mx.array:
        """A prompt chunk's rows over the keys [0, length) in one call: (Hq, n, d) -> (Hq, n, d).

        MLX's "causal" mask aligns the last query with the last key, which is the chunk's last row
        when exactly `length` keys are given. The call's shapes depend on the chunk's start and row
        count alone, so its rows are a deterministic function of the chunk and its stream's keys
        (never of other segments); they are not equal to the same rows computed one at a time, which
        a prompt row never needs (base.py). MLX composes it from two batched matmuls and a softmax,
        holding one float32 score array (measured on CPU, and at 256 x 65,536 on an H200's CUDA
        backend: not fused there either), in far fewer calls than the 8 x 64 tiles; on CPU the
        softmax's exp then dominates (measured on MLX 0.32.4, it is most of the time).
        """
        keys, values = cache.k[:, :length], cache.v[:, :length]
        return mx.fast.scaled_dot_product_attention(q[None], keys[None], values[None], scale=self.scale, mask="causal")[0]

    def tree_attention(self, q: mx.array, cache: AttentionCache, seg: Segment) -> mx.array:
        """A draft tree's rows (its K/V written at start + row), each over the keys of its serial step
        (tree_attention.py): (Hq, n, d) -> (Hq, n, d)."""
        n, view = len(seg.tokens), seg.tree_view()
        a, end = view.prefix, seg.start + n
        tail_k, tail_v = tree_keys(cache.k[:, a:end], view.index), tree_keys(cache.v[:, a:end], view.index)
        return tree_attention(pad_queries(q), cache.k[:, :a], cache.v[:, :a], tail_k, tail_v, view.seen,
                              scale=self.scale, path=self.path)[:, :n]

    def rope_rows(self, x: mx.array, positions: mx.array) -> mx.array:
        """(n, heads, d) rows each rotated at its own position: (heads, n, d) (base.py's `rope_rows`)."""
        return rope_rows(x, positions, self.rope_dims, self.rope_theta)

    def rope(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(
            x[None], self.rope_dims, traditional=False, base=self.rope_theta, scale=1.0, offset=offset
        )[0]


class DenseTarget(Target):
    """Embedding, N x (attention + SwiGLU MLP), final norm, lm_head."""

    @property
    def tree_refusal(self) -> str | None:
        """Every layer's state is attention K/V, which a tree's rows share by position, so a tree
        verifies, in the tile products (tree_attention.py). Where decode attention runs our CUDA kernel
        (the self-check's choice on a CUDA GPU), a plain step's bits are the kernel's, which a tree
        row's tile products would not equal: chains there."""
        if any(a.path == "kernel" for a in self.attn):
            return "decode attention runs the CUDA kernel, which verifies chains only"
        return None

    def __init__(self, config: TargetConfig, weights: dict, dtype: mx.Dtype = mx.float32):
        super().__init__(config, weights, dtype)
        self.attn, self.mlps, self.norms = [], [], []
        for i in range(config.num_layers):
            p = f"layers.{i}"
            self.attn.append(SelfAttention(config, weights, f"{p}.self_attn", stack=self.stacks))
            self.mlps.append(self.mlp_weights(weights, f"{p}.mlp"))
            self.norms.append((weights[f"{p}.input_layernorm.weight"], weights[f"{p}.post_attention_layernorm.weight"]))

    def new_state(self) -> StackedState:
        """Every layer's keys and values in one array (stacked_cache.py): a decode forward writes them once a stream."""
        c = self.config
        return StackedState(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype)

    def mixer_layers(self) -> list[SelfAttention]:
        return self.attn

    def turned(self) -> bool:
        """Whether every layer's decode rows take the turned q/k/v launch, attention's and o's (SelfAttention's
        `turned_decode`) and one gate/up and one down launch: what the self-check sets on a CUDA GPU's gpu mode."""
        return all(a.turned and a.path == "kernel" and a.qkv.one_launch and a.o.kernel for a in self.attn) and all(
            len(gate_up.weights) == 1 and gate_up.weights[0].kernel and down.kernel for gate_up, down in self.mlps)

    def layers(self, x: mx.array, segments: list[Segment], layout: Layout, taps: tuple[int, ...]
               ) -> tuple[mx.array, list[mx.array]]:
        """A forward of unpadded decode rows alone on the turned launches (`turned`) runs them layer by layer
        without the per-layer choices `layer` makes (its Python was most of a default-model step's build on the
        host: docs/gpu-round-profile.md, session 54): the same launches on the same arrays, so the same bits (the
        packed positions, as every layer's, made once a forward: `packed_positions`). Each layer's attention reads
        the rows' own keys and values from the forward's (its launch's `block`: the bits of the cache written
        first), and every layer's are written at the end, once a stream (stacked_cache.py), where a layer wrote
        each stream's as it went."""
        rows = layout.spans[-1][1] if layout.spans else 0
        if layout.blocks or layout.rows != rows or not self.turned():  # (a prompt chunk is a block)
            return super().layers(x, segments, layout, taps)
        decoding = list(zip(segments, layout.spans))
        planes, straight = [], Straight()
        for i, (attn, (pre, post), (gate_up, down)) in enumerate(zip(self.attn, self.norms, self.mlps)):
            x = attn.o.kernel_product(attn.turned_decode(x, decoding, i, (pre, self.eps), straight), residual=x)
            x = down.kernel_product(gate_up.weights[0].kernel_product(x, norm=(post, self.eps), glu=True), residual=x)
            if i in taps:
                planes.append(x)
        kv = mx.concatenate(straight.written)  # (2 * layers, Hkv, rows, D): as a state's array holds every layer's
        for seg, (lo, hi) in decoding:  # one write a stream (stacked_cache.py)
            rows_kv = kv if len(decoding) == 1 else kv[:, :, lo:hi]
            seg.state.write_layers(seg.start, rows_kv, None if seg.at is None else seg.write_index(rows_kv.shape))
        return x, planes

    def layer(self, i: int, x: mx.array, segments: list[Segment], layout: Layout) -> mx.array:
        pre, post = self.norms[i]
        x = self.attn[i](x, segments, layout, i, residual=x, norm=(pre, self.eps))
        return self.mlp(x, layout, *self.mlps[i], residual=x, norm=(post, self.eps))
