"""qwen3_5: hybrid layers, GatedDeltaNet linear attention and gated full attention.

Three of every four layers are GatedDeltaNet (a depthwise causal conv, then a gated delta-rule
recurrence over a (Hv, Dv, Dk) state); the rest are full attention with a sigmoid output gate
(`SelfAttention(gated=True)`). Projections run over the packed rows in fixed tiles; the conv runs per
segment and the recurrence per segment or, on a CUDA GPU, every decode segment in one launch, so a
row's result depends only on its own stream's rows:

- the conv is written with elementwise products and sums in a fixed order (`mx.conv1d` may choose
  its algorithm by length, so a window's rows could differ from the same rows fed one at a time);
- a decode window's recurrence (`RECURRENCES`) is, on a CUDA GPU, our kernel (delta_kernel.py): it
  walks each segment's rows in order doing one step's arithmetic per row, every segment of the
  forward in one launch; elsewhere it is mlx-lm's `gated_delta_ops`, a loop of the same compiled
  one-row step, a call per segment. Either way n rows at once are bit-equal to n single rows by
  construction. The two differ in the last bits, so a layer picks one when it is built
  (`decode_recurrence`) and its rollback (`redo_fn`) runs the same one;
- a prompt chunk's (a prefill segment, base.py) is the chunkwise-parallel form (chunked_delta.py):
  sub-chunks at fixed offsets from the chunk's start, a few dozen batched ops per chunk, so its rows
  are a deterministic function of the chunk, which is all a prompt row needs. It replaced
  `mx.fast.gated_delta_update`, a per-row loop on both backends: at Qwen3.5-9B's heads (32 value
  heads of 128) a 256-row chunk took 534 ms on this CPU against 76 ms chunked (and 41 ms a call on
  an H200, where the chunked form is a few dozen kernels instead of 256 dependent steps).

Rolling back part of a window re-runs the recurrence over the kept rows from the state the window
started from (`LinearCache.redo`): the state after each row is never stored, since one is Hv x Dv x
Dk floats per layer. The redo takes the window's own q, k, v, g and beta rows, so it is one recurrence
call a layer: recomputing them (the conv, the q/k norm and scale, the gates) cost ~5 more operations a layer for
the host to build and encode in every partly accepted round, and a GPU round is bound by that host work
(docs/gpu-round-profile.md). Until `keep` a window's conv inputs and those rows stay referenced (about
rows x (conv_dim + 2 x key_dim + value_dim) floats per linear layer); a prompt chunk is always kept
whole, so it leaves no record.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops

from dflash_bench.engine.cache import JointCache, LinearCache, TargetState
from dflash_bench.engine.device_values import constant
from dflash_bench.engine.fused import conv_silu, gated
from dflash_bench.engine.row_ids import row_ids
from dflash_bench.engine.target_config import TargetConfig
from dflash_bench.engine.targets import delta_kernel
from dflash_bench.engine.targets.base import Segment, Target, as_weight
from dflash_bench.engine.targets.chunked_delta import chunked_gated_delta, log_gate
from dflash_bench.engine.targets.dense import SelfAttention
from dflash_bench.engine.tiles import Layout, Norm, Stacked, Weight, linear


# a decode recurrence: a forward's decode windows to each one's (y, new state)
Recurrence = Callable[[list[delta_kernel.Window]], list[tuple[mx.array, mx.array]]]


def per_window_ops(windows: list[delta_kernel.Window]) -> list[tuple[mx.array, mx.array]]:
    """mlx-lm's `gated_delta_ops`, one call per window: each window's (y, state after its last row)."""
    outs = []
    for q, k, v, g, beta, state in windows:
        y, state = gated_delta_ops(q[None], k[None], v[None], g[None], beta[None], state[None])
        outs.append((y[0], state[0]))
    return outs


def prefix_by_rerun(recurrence: Recurrence, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                    state: mx.array, m: mx.array) -> mx.array:
    """The state after a window's first m rows (m a device value) by `recurrence` over every row, rows m
    and after with g = 1 and beta = 0, which leave a state as it is (s * 1 is s, the delta (v - kv) * 0
    adds zeros): mlx-lm's ops have no window end to stop at, as the kernel does (delta_kernel.py's `rollback`)."""
    live = (row_ids(q.shape[0]) < m)[:, None]
    g, beta = mx.where(live, g, mx.array(1, dtype=g.dtype)), mx.where(live, beta, mx.array(0, dtype=beta.dtype))
    [(_, state)] = recurrence([(q, k, v, g, beta, state)])
    return state


# The decode recurrences by name (a layer's `recurrence`, and the self-check's key): each takes the
# windows of a forward's decode segments and returns each one's (y, new state).
RECURRENCES: dict[str, Recurrence] = {
    "gated_delta_ops": per_window_ops,
    "delta_kernel": delta_kernel.delta_windows,
}


def decode_recurrence(heads: tuple[int, int, int, int], device: mx.Device, cuda: bool) -> str:
    """The decode recurrence a layer of `heads` (Hk, Hv, Dk, Dv) runs when MLX computes on `device`:
    the CUDA kernel on a GPU of a CUDA build (`cuda`: `mx.cuda.is_available()`) when its launch covers
    the heads, mlx-lm's `gated_delta_ops` everywhere else (a CPU, a Metal GPU)."""
    if device.type == mx.DeviceType.gpu and cuda and delta_kernel.fits(*heads):
        return "delta_kernel"
    return "gated_delta_ops"


class GatedDeltaNet:
    """One linear-attention layer: packed projections, the conv per segment, then the recurrence (a
    prompt chunk's alone, the decode segments' together: `recurrence`)."""

    def __init__(self, config: TargetConfig, weights: dict, prefix: str, dtype: mx.Dtype = mx.float32,
                 stack: bool = False):
        lin = config.linear
        assert lin is not None
        self.hk, self.hv, self.dk, self.dv = lin.num_key_heads, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim
        self.kernel = lin.conv_kernel
        self.key_dim = self.hk * self.dk
        self.conv_dim = lin.conv_dim
        self.dtype = dtype
        # qkv, z, b, a: one stacked weight where `stack` (the gpu mode: tiles.Stacked)
        self.in_proj = Stacked([as_weight(weights[f"{prefix}.in_proj_{n}.weight"]) for n in ("qkv", "z", "b", "a")], stack)
        self.out = as_weight(weights[f"{prefix}.out_proj.weight"])
        # tap j of every channel, each its own float32 row (the conv sums in float32), so a forward
        # neither gathers a row of the transposed weight nor casts it, once a tap a layer
        conv_w = weights[f"{prefix}.conv1d.weight"][:, :, 0].T.astype(mx.float32)
        self.taps = [mx.contiguous(conv_w[j]) for j in range(self.kernel)]
        mx.eval(self.taps)
        self.dt_bias = weights[f"{prefix}.dt_bias"]
        self.A_log = weights[f"{prefix}.A_log"]
        self.norm = weights[f"{prefix}.norm.weight"]
        self.eps = config.rms_norm_eps
        heads = (self.hk, self.hv, self.dk, self.dv)
        self.recurrence = decode_recurrence(heads, mx.default_device(), mx.cuda.is_available())
        # mlx-lm's normalize_qk as one norm and one product over q's and k's heads together (`heads`):
        # its eps, and its scales per head (q: head_dim**-1, k: head_dim**-0.5), float32 as the conv's rows
        inv_scale = self.dk**-0.5
        self.qk_eps = 1e-6 * inv_scale**2
        # q's and k's as the kernel takes them (in device memory, padded past MLX's small pool: device_values)
        self.qk_scales = constant((inv_scale**2, inv_scale), mx.float32)
        self.qk_scale = mx.repeat(self.qk_scales[:2], self.hk)[:, None]  # one a head, for mlx-lm's ops
        mx.eval(self.qk_scales, self.qk_scale)  # made now: no forward's graph holds them

    @property
    def projections(self) -> tuple[Weight, ...]:
        return (*self.in_proj.weights, self.out)

    def new_cache(self) -> LinearCache:
        return LinearCache(  # the conv's last inputs in the activation dtype, as the projection wrote them
            conv=mx.zeros((self.kernel - 1, self.conv_dim), dtype=self.dtype),
            state=mx.zeros((self.hv, self.dv, self.dk), dtype=mx.float32),
        )

    def __call__(self, x: mx.array, segments: list[Segment], layout: Layout, layer: int, residual: mx.array,
                 norm: Norm) -> mx.array:
        """`residual` plus the layer's output for every segment's rows of x RMS-normed by `norm` (the norm in
        in_proj's launch and the add in out_proj's on the row kernel: tiles.linear)."""
        qkv, z, b, a = self.in_proj(x, layout, norm)
        decoding = [(seg, span) for seg, span in zip(segments, layout.spans) if not seg.prefill]
        decoded = self.decode(qkv, z, b, a, decoding, layer) if decoding else None
        prompts = [self.prompt_chunk(qkv[lo:hi], z[lo:hi], b[lo:hi], a[lo:hi], seg, layer)
                   for seg, (lo, hi) in zip(segments, layout.spans) if seg.prefill]
        return linear(layout.join(decoded, prompts), self.out, layout, residual)

    def prompt_chunk(self, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, seg: Segment, layer: int) -> mx.array:
        """A prompt chunk's rows, kept whole (no rollback record): the chunkwise recurrence."""
        cache = seg.state.layers[layer]
        assert isinstance(cache, LinearCache)
        n = len(seg.tokens)
        inputs = mx.concatenate([cache.conv, qkv])  # (kernel - 1 + n, conv_dim)
        q, k, v = self.mix(inputs, n)
        y, cache.state = chunked_gated_delta(q, k, v, log_gate(self.A_log, a, self.dt_bias), mx.sigmoid(b), cache.state)
        cache.redo = cache.together = None
        cache.conv = mx.contiguous(inputs[n:])  # a copy: a view would pin the chunk
        cache.window_start, cache.length = seg.start, seg.start + n
        return self.gated_norm(y, z.reshape(n, self.hv, self.dv)).reshape(n, -1)

    def decode(self, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array,
               decoding: list[tuple[Segment, tuple[int, int]]], layer: int) -> mx.array:
        """Every decode segment's rows at once (tiles.Layout packs them first, in order): the conv over
        the segments' inputs laid end to end, each its stream's conv tail then its rows (a row reads
        only its own segment's inputs; the rows straddling two segments are dropped), the norms and
        gates over all rows, the recurrence over every window in one call. Each row's arithmetic is
        elementwise or its own row's, as for one segment alone, so its bits are."""
        span = self.kernel - 1
        caches = [seg.state.layers[layer] for seg, _ in decoding]
        assert all(isinstance(c, LinearCache) for c in caches)
        spans = [sp for _, sp in decoding]
        rows = spans[-1][1]
        # the conv's inputs as the projection wrote them: its float32 taps promote them (exactly) in its own launch
        inputs = mx.concatenate([p for c, (lo, hi) in zip(caches, spans) for p in (c.conv, qkv[lo:hi])])
        starts = [lo + i * span for i, (lo, _) in enumerate(spans)]  # each segment's first input row
        mixed = self.conv(inputs, inputs.shape[0] - span)
        if len(decoding) > 1:  # slices, not a row gather (26 us a layer on an H200: docs/profiles/ncu-forward-h200.txt)
            mixed = mx.concatenate([mixed[st : st + hi - lo] for st, (lo, hi) in zip(starts, spans)])
        window = self.window_rows(mixed, compute_g(self.A_log, a[:rows], self.dt_bias), mx.sigmoid(b[:rows]))
        bounds, before = (0, *(hi for _, hi in spans)), [c.state for c in caches]
        if self.recurrence == "delta_kernel":
            y, states = delta_kernel.delta_packed(*window, before, bounds)
        else:
            y, states = self.recur(*window, before, spans)
        # what a round may roll back: with the kernel, every layer's windows in one launch (cache.py's keep_windows)
        together = (PackedRedo(window, before, bounds, inputs, starts, span)
                    if self.recurrence == "delta_kernel" and any(hi - lo > 1 for lo, hi in spans) else None)
        for w, ((seg, (lo, hi)), c, st, state) in enumerate(zip(decoding, caches, starts, states)):
            n = hi - lo
            c.redo = self.redo_fn(c.conv, c.state, window_of(inputs, st, span, window, lo, hi)) if n > 1 else None
            c.together = (together, w) if together is not None and n > 1 else None
            # a view: it pins this round's few decode input rows, where a copy is a launch per stream and layer
            c.conv, c.state = inputs[st + n : st + n + span], state
            c.window_start, c.window_at, c.length = seg.start, seg.at, seg.start + n
        return self.gated_norm(y, z[:rows].reshape(rows, self.hv, self.dv)).reshape(rows, -1)

    def recur(self, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, states: list[mx.array],
              spans: list[tuple[int, int]]) -> tuple[mx.array, list[mx.array]]:
        """The recurrence by mlx-lm's ops over every decode segment's rows (`spans` of the packed q ..
        beta), one window at a time from its stream's state: all rows' y, and each segment's new state
        (the kernel takes the packed rows in one launch: `decode`)."""
        windows = [(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], st) for st, (lo, hi) in zip(states, spans)]
        results = RECURRENCES[self.recurrence](windows)
        y = mx.concatenate([y for y, _ in results]) if len(results) > 1 else results[0][0]
        return y, [st for _, st in results]

    def conv(self, inputs: mx.array, n: int) -> mx.array:
        """The causal conv's rows 0..n-1 (row t sees inputs t .. t + kernel - 1, summed in tap order), then silu."""
        return conv_silu(*self.taps, *(inputs[j : j + n] for j in range(self.kernel)))

    def normed(self, mixed: mx.array) -> mx.array:
        """The conv's rows' q heads then k heads, each row normed on its own and not yet scaled: (rows, 2 * hk, dk)."""
        n = mixed.shape[0]
        return mx.fast.rms_norm(mixed[:, : 2 * self.key_dim].reshape(n, 2 * self.hk, self.dk), None, self.qk_eps)

    def normed_qk(self, mixed: mx.array) -> mx.array:
        """The conv's rows' q heads then k heads, normalized: (rows, 2 * hk, dk)."""
        return self.normed(mixed) * self.qk_scale  # normed, then scaled: normalize_qk's bits, half its launches

    def heads(self, mixed: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The conv's rows split into normalized q and k heads and v heads."""
        qk = self.normed_qk(mixed)
        v = mixed[:, 2 * self.key_dim :].reshape(mixed.shape[0], self.hv, self.dv)
        return qk[:, : self.hk], qk[:, self.hk :], v

    def window_rows(self, mixed: mx.array, g: mx.array, beta: mx.array) -> tuple:
        """What the layer's recurrence reads of decode rows: q, k, v, g and beta for mlx-lm's ops; for the
        kernel q, k and v where they lie (delta_kernel.py's `in_place`: over a verify window's rows they
        are strided views of qk and the conv's rows, which a row-contiguous launch would copy first, three
        copies a layer), g and beta. Either slices by rows as its parts do (a rollback's window)."""
        if self.recurrence == "delta_kernel":  # q and k scaled, y written in bf16, in the launch: two launches fewer
            qkv = delta_kernel.in_place(self.normed(mixed), mixed, 2 * self.key_dim, self.hv, self.dv, self.qk_scales,
                                        self.dtype)
            return qkv, g, beta
        return (*self.heads(mixed), g, beta)

    def mix(self, inputs: mx.array, n: int) -> tuple[mx.array, mx.array, mx.array]:
        """Conv (row t sees inputs t .. t + kernel - 1, summed in tap order), silu, normalized q/k, v."""
        return self.heads(self.conv(inputs, n))

    def redo_fn(self, prev_conv: mx.array, prev_state: mx.array, window: Callable[[], tuple[mx.array, tuple]]):
        """The (conv, state) after the first m rows of this window, from the state before it.

        `window()` gives the window's conv inputs (the conv tail it started from, then its rows) and its
        rows as its forward computed them (`window_rows`), so the recurrence over their first m is the
        layer's own (`recurrence`) on the same inputs: the window's state after m rows; the conv after m
        rows keeps the `kernel - 1` inputs ending at row m, a view of them.
        """
        span = self.kernel - 1

        def redo(m: int | mx.array) -> tuple[mx.array, mx.array]:
            if isinstance(m, mx.array):
                return masked(m)
            if m == 0:
                return prev_conv, prev_state
            inputs, rows = window()
            if self.recurrence == "delta_kernel":
                _, [state] = delta_kernel.delta_packed(*(r[:m] for r in rows), [prev_state], (0, m))
            else:
                [(_, state)] = RECURRENCES[self.recurrence]([(*(r[:m] for r in rows), prev_state)])
            return inputs[m : m + span], state

        def masked(m: mx.array) -> tuple[mx.array, mx.array]:
            """m a device value (cache.py's keep_at): the state after the window's first m rows in one call
            whatever m is. The kernel takes m as the window's end (delta_kernel.py's `rollback`: the
            rows' own steps, one launch and no mask) and copies the conv tail, the `kernel - 1` inputs
            ending at row m, in the same launch; mlx-lm's ops rerun every row (`prefix_by_rerun`)."""
            inputs, rows = window()
            if self.recurrence == "delta_kernel":
                [([state], [tail])] = delta_kernel.rollback([(*rows, [prev_state], inputs)], (0, rows[0].rows),
                                                            mx.reshape(m, (1,)), (0,), span)
                return tail, state
            state = prefix_by_rerun(RECURRENCES[self.recurrence], *rows, prev_state, m)
            return conv_tail(inputs, m, span), state

        return redo

    def gated_norm(self, y: mx.array, z: mx.array) -> mx.array:
        """RMSNorm of each value head, times silu of the z gate (mlx-lm's precise_swiglu order), in
        the activation dtype (the recurrence's float32 output is cast first)."""
        return gated(z, mx.fast.rms_norm(y.astype(self.dtype), self.norm, self.eps))


class HybridTarget(Target):
    """Embedding, N x (GatedDeltaNet or gated attention, then SwiGLU MLP), final norm, lm_head."""

    def __init__(self, config: TargetConfig, weights: dict, dtype: mx.Dtype = mx.float32):
        super().__init__(config, weights, dtype)
        self.mixers: list[GatedDeltaNet | SelfAttention] = []
        self.mlps, self.norms = [], []
        for i, kind in enumerate(config.layer_types):
            p = f"layers.{i}"
            if kind == "linear_attention":
                self.mixers.append(GatedDeltaNet(config, weights, f"{p}.linear_attn", dtype, self.stacks))
            else:
                self.mixers.append(SelfAttention(config, weights, f"{p}.self_attn", gated=True, stack=self.stacks))
            self.mlps.append(self.mlp_weights(weights, f"{p}.mlp"))
            self.norms.append((weights[f"{p}.input_layernorm.weight"], weights[f"{p}.post_attention_layernorm.weight"]))

    def new_state(self) -> TargetState:
        c = self.config
        return TargetState(
            [
                m.new_cache() if isinstance(m, GatedDeltaNet) else JointCache(c.num_kv_heads, c.head_dim, self.dtype)
                for m in self.mixers
            ]
        )

    def mixer_layers(self) -> list[GatedDeltaNet | SelfAttention]:
        return self.mixers

    def layer(self, i: int, x: mx.array, segments: list[Segment], layout: Layout) -> mx.array:
        pre, post = self.norms[i]
        x = self.mixers[i](x, segments, layout, i, residual=x, norm=(pre, self.eps))
        return self.mlp(x, layout, *self.mlps[i], residual=x, norm=(post, self.eps))


def window_of(inputs: mx.array, first: int, span: int, rows: tuple, lo: int, hi: int) -> Callable[[], tuple[mx.array, tuple]]:
    """One decode window's conv inputs (`span` tail rows from `first`, then its rows) and its rows lo..hi of
    every segment's `rows`, sliced when called: where a layer's windows roll back in one launch
    (`PackedRedo`) a window's own redo never runs, and its slices cost a drafted round's host about 30 us
    a layer and stream on this project's CPU (docs/gpu-round-profile.md)."""
    return lambda: (inputs[first : first + span + hi - lo], tuple(r[lo:hi] for r in rows))


class PackedRedo:
    """The rollback record of one GatedDeltaNet layer's decode windows, which one kernel launch ran
    (`GatedDeltaNet.decode`): each window's kept rows are walked again from the state it started from, and its
    conv tail, the `kernel - 1` inputs ending at its row m, copied in the same launch (delta_kernel.py's
    `rollback`), what each window's own `redo_fn` gives at the same count. `many` rolls back the records of
    every layer of a round in one launch (cache.py's `keep_windows`)."""

    def __init__(self, rows: tuple, states: list[mx.array], bounds: tuple[int, ...], inputs: mx.array,
                 starts: list[int], span: int):
        """`inputs`: the layer's conv inputs, every segment's laid end to end; `starts`: where each begins."""
        self.rows, self.states, self.bounds, self.span = rows, states, bounds, span
        self.inputs, self.starts = inputs, tuple(starts)
        self.windows = len(states)

    @staticmethod
    def many(jobs: list[tuple["PackedRedo", mx.array, dict[int, mx.array]]]) -> list[dict[int, tuple[mx.array, mx.array]]]:
        """For each (record, counts, kept) of `jobs` (counts: every window's kept rows, 0 for those not kept;
        `kept`: the windows wanted), each kept window's (conv, state) after its count: the records whose
        windows lie alike and take the same counts (every layer of a round's forward) in one launch."""
        launches: dict[tuple, list[int]] = {}
        for i, (redo, counts, _) in enumerate(jobs):
            q = redo.rows[0]
            launches.setdefault((id(counts), redo.bounds, redo.starts, redo.span, q.heads, q.rows, q.layout,
                                 q.y_dtype, redo.inputs.dtype, redo.inputs.shape[1]), []).append(i)
        out: list[dict[int, tuple[mx.array, mx.array]]] = [{} for _ in jobs]
        for members in launches.values():
            first = jobs[members[0]][0]
            done = delta_kernel.rollback([(*jobs[i][0].rows, jobs[i][0].states, jobs[i][0].inputs) for i in members],
                                         first.bounds, jobs[members[0]][1], first.starts, first.span)
            for i, (states, tails) in zip(members, done):
                out[i] = {w: (tails[w], states[w]) for w in jobs[i][2]}
        return out


def conv_tail(inputs: mx.array, m: mx.array, span: int) -> mx.array:
    """A window's conv inputs (its starting tail, then its rows) after its first m rows, m a device value:
    the `span` inputs ending at row m, one slice at a device offset."""
    return mx.slice(inputs, mx.reshape(m, (1,)).astype(mx.int32), (0,), (span, inputs.shape[1]))
