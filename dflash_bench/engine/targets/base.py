"""What every target model shares: segments, the packed forward's edges, taps and logits.

One forward serves every stream in a round. Each stream contributes a segment (its prompt chunk,
or its pending token plus its drafts) at its own absolute positions against its own caches; the
projections run over all segments' rows packed together in fixed row tiles, attention and
linear-attention run per segment, so a segment's outputs never depend on the other segments or
on padding. Within a segment the two kinds of rows differ (`engine/tiles.py`):

- a decode segment (a window, or a one-row step) is row-independent: its rows equal the same rows
  fed one at a time, which drafted == plain and rollback need;
- a prefill segment (`prefill=True`: every row is a prompt row of a chunk starting at a chunk
  boundary) is deterministic per chunk: attention and the GatedDeltaNet recurrence take the chunk
  whole, so a row's bits depend on the chunk it sits in, and are not a single step's. That is
  enough because prompt chunks are laid out by position alone (lanes.py) and the prompt cache
  keeps states only at chunk boundaries: fresh, resumed, drafted, plain, alone or packed, a prompt
  row is always computed in the same chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from dflash_bench.engine.cache import TargetState, write_index
from dflash_bench.engine.row_ids import row_ids
from dflash_bench.engine.target_config import TargetConfig
from dflash_bench.engine.tiles import ROW_TILE, Layout, Norm, SwiGLU, Weight, key_mask, linear, pad_rows, query_positions
from dflash_bench.engine.tree import Tree
from dflash_bench.engine.tree_attention import tail_index


@dataclass
class Segment:
    """Rows one stream feeds this forward: `tokens` at positions start, start+1, ..."""

    tokens: list[int]
    start: int
    state: TargetState
    logit_rows: list[int] = field(default_factory=list)  # rows (0-based in the segment) whose logits are wanted
    want_taps: bool = False
    prefill: bool = False  # every row is a prompt row of a chunk that starts at a chunk boundary
    tree: Tree | None = None  # the rows are a draft tree's (tree.py): row r at position start + its depth
    ids: mx.array | None = None  # the tokens as an array not yet read back (a lookahead round, lanes.py)
    at: mx.array | None = None  # the start as a device value, `start` its upper bound (cache.py's keep_at)
    _masks: dict[int, mx.array] = field(default_factory=dict, repr=False)
    _tree_view: TreeView | None = field(default=None, repr=False)
    _positions: mx.array | None = field(default=None, repr=False)
    _packed: tuple[tuple[int, ...], mx.array] | None = field(default=None, repr=False)  # packed_positions'
    _launch: tuple[tuple, mx.array] | None = field(default=None, repr=False)  # dense.py's kernel_meta
    _writes: dict[tuple[int, ...], mx.array] = field(default_factory=dict, repr=False)  # `write_index`'s

    @property
    def origin(self) -> int | mx.array:
        """The first row's position: `at` where the host knows only its bound, else `start`."""
        return self.start if self.at is None else self.at

    def key_mask(self, k_rows: int) -> mx.array:
        """The causal mask of this segment's rows over `k_rows` keys from position 0, built once."""
        if k_rows not in self._masks:
            n = len(self.tokens)
            self._masks[k_rows] = key_mask(query_positions(self.origin, n), 0, k_rows, self.origin + n)
        return self._masks[k_rows]

    def positions(self) -> mx.array:
        """Each row's absolute position: start + row, or start + depth in a tree; built once for every layer."""
        if self._positions is None:
            if self.tree is not None:
                self._positions = mx.array(self.tree.depths, dtype=mx.int32) + self.start
            elif self.at is not None:
                self._positions = row_ids(len(self.tokens)) + self.at
            else:
                self._positions = mx.arange(self.start, self.start + len(self.tokens), dtype=mx.int32)
        return self._positions

    def write_index(self, shape: tuple[int, ...]) -> mx.array:
        """Where an attention layer's cache write puts this segment's rows of `shape` at a device start: its
        positions as cache.py's `write_index` gives them, built once for every layer."""
        if shape not in self._writes:
            self._writes[shape] = write_index(self.positions(), shape)
        return self._writes[shape]

    def tree_view(self) -> TreeView:
        """Where a tree's rows find their keys (tree_attention.py), built once for every layer."""
        if self._tree_view is None:
            assert self.tree is not None
            rows = len(query_positions(self.start, len(self.tokens)))
            prefix, tail, index = tail_index(self.tree, self.start, rows)
            q_pos = mx.concatenate([self.positions(), mx.full((rows - len(self.tokens),), self.start, dtype=mx.int32)])
            seen = key_mask(q_pos, 0, prefix + tail, self.start + self.tree.depth + 1)
            self._tree_view = TreeView(prefix, mx.array(index), seen)
        return self._tree_view


@dataclass(frozen=True)
class TreeView:
    """A tree segment's key layout: shared key rows [0, prefix), each row's tail gathered by `index`
    (tree_attention.tail_index), and the mask over prefix + tail keys at the rows' positions."""

    prefix: int
    index: mx.array
    seen: mx.array


@dataclass
class SegmentOut:
    logits: mx.array | None  # (len(logit_rows), vocab) float32
    taps: mx.array | None  # (rows, taps * hidden): the tap layers' outputs side by side
    joint: mx.array | None = None  # the forward's logits, every segment's rows: `logits` is its rows from `first` on
    first: int = 0


def packed_positions(segments: list[Segment]) -> mx.array:
    """The segments' row positions one after another, built once a forward for every layer (the
    first segment keeps it: a Segment lives for one forward)."""
    first = segments[0]
    if len(segments) == 1:
        return first.positions()
    key = tuple(id(seg) for seg in segments)
    if first._packed is None or first._packed[0] != key:
        first._packed = (key, mx.concatenate([seg.positions() for seg in segments]))
    return first._packed[1]


def rope_rows(x: mx.array, positions: mx.array, dims: int, theta: float) -> mx.array:
    """(n, heads, d) rows each rotated at its own position: (heads, n, d). A row's rotation is its own
    (each row is its own batch entry), so rows rotated together equal rows rotated alone."""
    n, heads, d = x.shape
    out = mx.fast.rope(x.reshape(n, heads, 1, d), dims, traditional=False, base=theta, scale=1.0, offset=positions)
    return out.reshape(n, heads, d).transpose(1, 0, 2)


def as_weight(w: Weight | mx.array) -> Weight:
    """A checkpoint tensor as a projection weight: kept-packed ones arrive as Weights already."""
    return w if isinstance(w, Weight) else Weight(w)


class Target:
    """Shared parts of the target families; subclasses implement `layer`.

    `dtype` is the activation and attention-cache dtype (backend.py): float32 in the cpu mode, bf16
    in the gpu mode, where the weights arrive packed (`Weight.packed`) or in bf16.
    """

    config: TargetConfig
    mlps: list[tuple[SwiGLU, Weight]]  # each layer's gate and up projections, and its down projection

    def __init__(self, config: TargetConfig, weights: dict[str, mx.array | Weight], dtype: mx.Dtype = mx.float32):
        self.config = config
        self.dtype = dtype
        self.embed = as_weight(weights["embed_tokens.weight"])
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = self.embed if tied else as_weight(weights["lm_head.weight"])
        self.norm = weights["norm.weight"]
        self.eps = config.rms_norm_eps
        # the gpu mode (bf16) stacks the projections that share their input (tiles.Stacked)
        self.stacks = dtype == mx.bfloat16
        self._projections: list[Weight] | None = None  # `projections()`, read once by `row_tile`

    def mlp_weights(self, weights: dict, prefix: str) -> tuple[SwiGLU, Weight]:
        """An MLP's gate and up projections (one interleaved weight where `stacks`: tiles.SwiGLU) and its down
        projection."""
        gate_up = SwiGLU(*(as_weight(weights[f"{prefix}.{n}_proj.weight"]) for n in ("gate", "up")), self.stacks)
        return gate_up, as_weight(weights[f"{prefix}.down_proj.weight"])

    def new_state(self) -> TargetState:
        raise NotImplementedError

    @property
    def tree_refusal(self) -> str | None:
        """Why this target verifies chains only, or None where a draft tree's rows (Segment.tree) are
        each their path's serial step. The hybrid's GatedDeltaNet state is one per path."""
        return "this target's linear-attention state is one per path"

    @property
    def supports_trees(self) -> bool:
        return self.tree_refusal is None

    def layer(self, i: int, x: mx.array, segments: list[Segment], layout: Layout) -> mx.array:
        raise NotImplementedError

    def layers(self, x: mx.array, segments: list[Segment], layout: Layout, taps: tuple[int, ...]
               ) -> tuple[mx.array, list[mx.array]]:
        """Every layer over the forward's rows: the last one's rows, and the tap layers' rows in
        layer order."""
        planes: list[mx.array] = []
        for i in range(self.config.num_layers):
            x = self.layer(i, x, segments, layout)
            if i in taps:
                planes.append(x)
        return x, planes

    def mixer_layers(self) -> list:
        """Each layer's token mixer (attention, or qwen3_5's GatedDeltaNet), in layer order."""
        raise NotImplementedError

    def projections(self) -> list[Weight]:
        """Every weight a decode row is multiplied by, each once: what the self-check proves."""
        found: dict[int, Weight] = {}
        mlps = [w for gate_up, down in self.mlps for w in (*gate_up.weights, down)]
        for w in [p for m in self.mixer_layers() for p in m.projections] + mlps:
            found.setdefault(id(w), w)
        found.setdefault(id(self.lm_head), self.lm_head)
        return list(found.values())

    def weight_bytes(self) -> int:
        """Bytes of the weights a decode forward multiplies its rows by (`projections`), each once: the least a forward
        reads from memory where one launch takes every row (the gpu mode's row kernel), so what bounds a round's cost
        from below at 1 to 16 rows (docs/gpu-round-profile.md, session 46). The embedding is looked up by row, not
        read whole, unless it is the lm_head too."""
        return sum(a.nbytes for w in self.projections() for a in w.arrays())

    def embed_rows(self, tokens: list[int] | mx.array) -> mx.array:
        """The embedding rows of `tokens` (a list, or int32 ids still being computed), in the activation dtype."""
        ids = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.int32)
        return self.embed.rows(ids).astype(self.dtype)

    def embed_segments(self, segments: list[Segment], layout: Layout, ids: mx.array | None = None) -> mx.array:
        """The forward's first rows laid out as `layout`. Where the segments' rows lie one after another from
        row 0 (decode rows, or one prompt chunk), their ids are joined and looked up once: a lookup and its
        dequantization a forward, not a stream (a gather is row by row, so the rows are the same bits);
        host tokens of neighbouring segments become one array, and `ids`, every segment's ids already
        joined by the caller, is looked up as it is. Otherwise each segment's rows are looked up and placed
        apart."""
        ends = [0] + [b for _, b in layout.spans[:-1]]
        if [a for a, _ in layout.spans] != ends:
            return layout.pack([self.embed_rows(seg.tokens if seg.ids is None else seg.ids) for seg in segments])
        if ids is not None:
            return layout.place([(0, self.embed_rows(ids))])
        parts: list[list[int] | mx.array] = []
        for seg in segments:
            if seg.ids is not None:
                parts.append(seg.ids)
            elif parts and isinstance(parts[-1], list):
                parts[-1] = parts[-1] + list(seg.tokens)
            else:
                parts.append(list(seg.tokens))
        ids = [mx.array(p, dtype=mx.int32) if isinstance(p, list) else p for p in parts]
        return layout.place([(0, self.embed_rows(ids[0] if len(ids) == 1 else mx.concatenate(ids)))])

    def forward(self, segments: list[Segment], taps: tuple[int, ...] = (), ids: mx.array | None = None
                ) -> list[SegmentOut]:
        """Run every segment through the model; caches grow by each segment's rows. `ids`, where the caller
        holds every segment's ids as one array in order (lanes.py's look_ahead_windows, whose segments' ids
        are views of it), spares the embedding joining them again."""
        for seg in segments:
            if seg.start != seg.state.length:
                raise ValueError(f"segment starts at {seg.start} but its state holds {seg.state.length} positions")
        rows = sum(len(seg.tokens) for seg in segments)
        if ids is not None and ids.shape != (rows,):
            raise ValueError(f"the joined ids have shape {tuple(ids.shape)}, expected ({rows},): one a segment row")
        layout = Layout.of([len(seg.tokens) for seg in segments], [seg.prefill for seg in segments], self.row_tile)
        spans = layout.spans
        x, planes = self.layers(self.embed_segments(segments, layout, ids), segments, layout, taps)
        tap_rows = mx.concatenate([planes[taps.index(i)] for i in taps], axis=-1) if taps else None
        wanted = [a + r for seg, (a, _) in zip(segments, spans) for r in seg.logit_rows]
        logits = self.logits(x, wanted) if wanted else None
        outs, cursor = [], 0
        for seg, (a, b) in zip(segments, spans):
            n = len(seg.logit_rows)
            outs.append(
                SegmentOut(
                    logits=logits[cursor : cursor + n] if n else None,
                    taps=tap_rows[a:b] if (seg.want_taps and tap_rows is not None) else None,
                    joint=logits,
                    first=cursor,
                )
            )
            cursor += n
        return outs

    @property
    def row_tile(self) -> int:
        """What a forward pads its decode rows to: ROW_TILE, or 1 where every projection runs the row
        kernel, which takes any row count (tiles.Layout). The self-check sets the kernels (selfcheck.apply)."""
        if self._projections is None:
            self._projections = self.projections()
        return 1 if all(w.kernel for w in self._projections) else ROW_TILE

    def logits(self, x: mx.array, rows: list[int]) -> mx.array:
        """Float32 logits of the packed rows `rows` after the final norm (their lm_head products run in row
        tiles; on the row kernel, one call with the norm in it: tiles.linear)."""
        first = rows[0]
        if rows == list(range(first, first + len(rows))):  # a slice (a view), where a gather is an operation
            picked = x[first : first + len(rows)]
        else:
            picked = x[mx.array(rows, dtype=mx.int32)]
        h = pad_rows(picked, self.row_tile)
        return linear(h, self.lm_head, norm=(self.norm, self.eps))[: len(rows)].astype(mx.float32)

    def mlp(self, x: mx.array, layout: Layout, gate_up: SwiGLU, down: Weight, residual: mx.array, norm: Norm) -> mx.array:
        """`residual` plus the SwiGLU MLP of x RMS-normed by `norm`: the norm and the SwiGLU in the gate/up launch
        and the add in the down projection's where they run the row kernel (tiles.SwiGLU, tiles.linear)."""
        return linear(gate_up(x, layout, norm), down, layout, residual)


def repack(parts: list[mx.array], rows: int) -> mx.array:
    """Blocks' rows back into one packed array padded to `rows` (the drafter's, which has no Layout)."""
    x = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    return pad_rows(x, ROW_TILE) if x.shape[0] != rows else x
