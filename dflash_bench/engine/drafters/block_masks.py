"""A drafter block pass's row positions and key masks, built once a pass and shared by its layers.

Every layer of a stream holds the same positions (drafters/dflash.py's `absorb` writes each layer alike), so a
pass's layers share its rows' positions, and the layers with the same window, causality and key span share one
mask. On a GPU a decode round is bound by the operations the host encodes (docs/gpu-round-profile.md); a mask is
about ten of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx

from dflash_bench.engine.row_ids import row_ids
from dflash_bench.engine.targets import attention_kernel

if TYPE_CHECKING:
    from dflash_bench.engine.drafters.dflash import Proposal


class BlockMasks:
    """A block pass's row positions per stream, and which keys its rows see per stream and layer kind,
    each built by the first layer that needs it (the module docstring says why)."""

    def __init__(self) -> None:
        self.streams: dict[int, StreamBlock] = {}
        self.positions: mx.array | None = None  # every stream's rows' positions, one after another
        self.metas: dict[tuple, mx.array] = {}  # attention_kernel.py's launch layouts, by causality and capacities
        # attention_kernel.py's calls, by (causal, window): the layers of a kind launch the same segments over the same
        # arrays (each stream's state of every layer), each with its queries, block and layer, so the call (its
        # launch found, its inputs checked) is made once a pass, as a dense target's forward makes its one (dense.py)
        self.calls: dict[tuple, attention_kernel.Call] = {}

    def of(self, stream: int) -> StreamBlock:
        """The pass's `stream`-th stream's positions and masks."""
        return self.streams.setdefault(stream, StreamBlock())

    def packed(self, items: list[Proposal], spans: list[tuple[int, int]]) -> mx.array:
        """The kernel path's row positions (int32), every stream's block from its first position (a device
        value while the host has not read it), built by the pass's first layer."""
        if self.positions is None:
            parts = [row_ids(b - a) + p.state.start for p, (a, b) in zip(items, spans)]
            self.positions = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        return self.positions

    def launch_meta(self, launch: list[attention_kernel.Rows], ats: list[mx.array | None], causal: bool) -> mx.array:
        """attention_kernel.py's layout for the pass's launches of one causality (every layer's caches have
        the same capacity, as `absorb` writes each layer alike), built by the first layer that needs it."""
        key = (causal, *(attention_kernel.cache_shape(segment)[1] for segment in launch))
        if key not in self.metas:
            self.metas[key] = attention_kernel.launch_meta(launch, ats, causal)
        return self.metas[key]


@dataclass
class StreamBlock:
    """One stream's block in a pass: its rows' positions (`query_positions`, padded to whole query
    tiles) and its key masks by (first key, key rows, causal, window), each built by the first layer
    that needs it."""

    positions: mx.array | None = None
    masks: dict[tuple, mx.array] = field(default_factory=dict)
