"""The DFlash2 drafter: DFlash's body with a grouped dynamic causal conv around each sublayer, and a
candidate selector that walks each position's top-k from the anchor.

Each sublayer (attention, MLP) runs between two convs over its stream's block: before it, the
normed input is convolved with the first base kernel plus a per-row dynamic kernel projected from
that input; after it, its output is convolved with the second base kernel plus the second half of
the same projection. A conv is causal and block-local: row t mixes rows t, t-1, .. t-K+1 of its own
block, with zeros before the block's first row, and one kernel value per channel group.

The selector replaces the per-position argmax: each draft position keeps its logits' top-k
candidates; walking from the block's anchor (the stream's last token), a candidate's score is its
logit plus a low-rank pairwise term, predecessor codebook row of the previous pick, times the
position's projected hidden row, times the candidate's successor codebook row. At T > 0 the pick is
the keyed Gumbel draw over the candidates (sampling.py's noise at the draft's absolute position and
the candidate's token id), so drafts are a function of (seed, position) as the target's draws are.
Drafts are only proposals: the target's keyed choice decides every kept token (lanes.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from dflash_bench.engine.draft_config import DraftConfig
from dflash_bench.engine.drafters.block_masks import BlockMasks
from dflash_bench.engine.drafters.dflash import DFlashDrafter, Proposal, draft_positions, firsts
from dflash_bench.engine.sampling import filtered, gumbel
from dflash_bench.engine.targets.base import Target
from dflash_bench.engine.tiles import Weight, linear, pad_rows
from dflash_bench.engine.topk import top_k_indices


class DFlash2Drafter(DFlashDrafter):
    kind = "DFlash2"

    def __init__(self, config: DraftConfig, weights: dict[str, mx.array], target: Target, bits: int = 0):
        super().__init__(config, weights, target, bits=bits)
        self.kernel, self.group = config.conv_kernel_size, config.conv_group_size
        # each layer's two convs: (base kernel (2, kernel, hidden), the dynamic kernel's projection)
        self.convs: list[dict[str, tuple[mx.array, Weight]]] = [
            {conv: (weights[f"layers.{i}.{conv}.base_kernel"], Weight(weights[f"layers.{i}.{conv}.kernel_projection.weight"], bits=bits))
             for conv in ("attention_conv", "mlp_conv")}
            for i in range(config.num_layers)
        ]
        s = "candidate_selector"
        self.top_k = config.selector_top_k
        self.hidden_projection = Weight(weights[f"{s}.hidden_projection.weight"], bits=bits)
        self.predecessor = weights[f"{s}.predecessor_codebook"]
        self.successor = weights[f"{s}.successor_codebook"]
        self.any_rows = False  # the convs' projections and the selector's run in row tiles (tiles.linear)
        mx.eval(self.parameters())
        self.nbytes = sum(a.nbytes for a in self.parameters())

    def parameters(self) -> list[mx.array]:
        out = super().parameters()
        if not hasattr(self, "predecessor"):  # the base class's __init__ asks before the convs exist
            return out
        for convs in self.convs:
            for base, projection in convs.values():
                out += [base, *projection.arrays()]
        return out + [*self.hidden_projection.arrays(), self.predecessor, self.successor]

    def block_rows(self, count: int) -> int:
        """Every block whole: each layer is bidirectional in the block and its convs run per block."""
        return self.block

    # -- the body: each sublayer between its two convs ------------------------------------------
    def layer(self, li: int, layer: dict, h: mx.array, items: list[Proposal], spans: list[tuple[int, int]],
              masks: BlockMasks) -> mx.array:
        base, projection = self.convs[li]["attention_conv"]
        x, kernel = self.prepare(mx.fast.rms_norm(h, layer["pre"], self.eps), base, projection, len(items))
        h = h + self.convolve(self.attention(li, layer, x, items, spans, masks), kernel, base[1], len(items))
        base, projection = self.convs[li]["mlp_conv"]
        x, kernel = self.prepare(mx.fast.rms_norm(h, layer["post"], self.eps), base, projection, len(items))
        return h + self.convolve(self.mlp(layer, x), kernel, base[1], len(items))

    def prepare(self, x: mx.array, base: mx.array, projection: Weight, blocks: int) -> tuple[mx.array, mx.array]:
        """The input conv (base kernel 0 plus the dynamic kernel), and the dynamic kernel kept for the
        output conv: (blocks, block, kernel, groups) each."""
        groups = x.shape[-1] // self.group
        rows = blocks * self.block
        dynamic = linear(x, projection)[:rows].reshape(blocks, self.block, 2, self.kernel, groups)
        return self.convolve(x, dynamic[:, :, 0], base[0], blocks), dynamic[:, :, 1]

    def convolve(self, x: mx.array, dynamic: mx.array, base: mx.array, blocks: int) -> mx.array:
        """Each block's rows convolved causally within the block (zeros before its first row); rows
        past the blocks (padding) stay zero."""
        hidden = x.shape[-1]
        groups, rows = hidden // self.group, blocks * self.block
        values = x[:rows].reshape(blocks, self.block, groups, self.group)
        out = mx.zeros_like(values)
        for offset in range(self.kernel):
            shifted = values if offset == 0 else mx.concatenate(
                [mx.zeros_like(values[:, :offset]), values[:, :-offset]], axis=1)
            out = out + base[offset].reshape(1, 1, groups, self.group).astype(x.dtype) * shifted
            out = out + dynamic[:, :, offset, :, None] * shifted
        return pad_rows(out.reshape(rows, hidden))

    # -- the selector ---------------------------------------------------------------------------------
    def drafts(self, h: mx.array, logits: mx.array, items: list[Proposal]) -> list[mx.array]:
        """Each stream's walk (int32) over its positions' top-k candidates, from its anchor."""
        out = []
        for selector in self.lattices(h, logits, items):
            previous, picks = mx.array(selector.proposal.last), []
            for depth in range(1, selector.proposal.count + 1):
                scores = selector.scores(depth, previous)
                previous = selector.candidates[selector.first + depth - 1][mx.argmax(scores)]
                picks.append(previous)
            out.append(mx.stack(picks).astype(mx.int32) if picks else mx.zeros((0,), dtype=mx.int32))
        return out

    def lattices(self, h: mx.array, logits: mx.array, items: list[Proposal]) -> list[SelectorLattice]:
        """Each stream's selector over its positions' top-k candidates: the walk of `drafts`, and the
        tree candidates (tree.py) of any parent. Its pairwise term projects the rows after the final norm."""
        x = mx.fast.rms_norm(h, self.norm, self.eps)
        candidates = top_k_indices(logits, self.top_k)
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        projected = linear(pad_rows(x), self.hidden_projection)[: x.shape[0]].astype(mx.float32)
        successors = self.successor[candidates].astype(mx.float32)  # (rows, k, rank)
        predecessor = self.predecessor.astype(mx.float32)
        out = []
        for first, p in zip(firsts(items), items):
            noise = None
            if not p.params.greedy:
                full = gumbel(p.params.seed, draft_positions(p), logits.shape[-1])
                noise = mx.take_along_axis(full, candidates[first : first + p.count], axis=-1)
            out.append(SelectorLattice(p, first, candidates, unary, projected, successors, predecessor, noise))
        return out


class SelectorLattice:
    """One stream's selector: a candidate's score at a depth is its logit plus the pairwise term with
    its parent's token (at T > 0 filtered and keyed-noised as the target's draw); the walk picks the
    best, a tree (tree.py) ranks them all, the walk's pick first."""

    def __init__(self, proposal: Proposal, first: int, candidates: mx.array, unary: mx.array, projected: mx.array,
                 successors: mx.array, predecessor: mx.array, noise: mx.array | None):
        self.proposal, self.first, self.candidates, self.unary = proposal, first, candidates, unary
        self.projected, self.successors, self.predecessor, self.noise = projected, successors, predecessor, noise
        self.levels = proposal.count
        self._ranked: dict[tuple[int, int], tuple[list[int], list[float]]] = {}  # the build's, reused by the budget's ranks

    def scores(self, depth: int, parent: mx.array) -> mx.array:
        """The candidates' scores at `depth` (1-based) after the token `parent`."""
        row, params = self.first + depth - 1, self.proposal.params
        scores = self.unary[row] + mx.sum(self.predecessor[parent] * self.projected[row] * self.successors[row], axis=-1)
        if self.noise is not None:
            scores = filtered(scores[None] / params.temperature, params.top_k, params.top_p)[0] + self.noise[depth - 1]
        return scores

    def children(self, depth: int, parent_token: int) -> tuple[list[int], list[float]]:
        if (depth, parent_token) not in self._ranked:
            self._ranked[depth, parent_token] = self._children(depth, parent_token)
        return self._ranked[depth, parent_token]

    def _children(self, depth: int, parent_token: int) -> tuple[list[int], list[float]]:
        scores = self.scores(depth, mx.array(parent_token))
        pick = int(mx.argmax(scores).item())
        logp = np.array(scores - mx.logsumexp(scores))
        tokens = np.array(self.candidates[self.first + depth - 1])
        order = [pick] + [i for i in np.argsort(-logp, kind="stable") if i != pick and np.isfinite(logp[i])]
        return [int(tokens[i]) for i in order], [float(logp[i]) for i in order]
