"""Draft trees: many candidate continuations from one drafter pass, verified in one target forward.

A chain verifies one guess per position; a tree verifies several where the drafter is unsure. From
one drafter pass, `build` grows a tree best-first under a node budget: a node's score is the sum of
its path's log-probabilities, each depth's from the drafter's `Lattice` (v1: block position j's
distribution, the same for every parent; DFlash2: its selector's scores given the parent token). At
T > 0 the lattice ranks the keyed Gumbel-perturbed scores the drafter uses to predict the target's
keyed draw (sampling.py), so a child of rank 0 is always the chain's draft: the tree's first path
(rank 0 at every depth) is exactly today's chain, and a tree never keeps less than a chain of its
depth.

Rows: the root (the stream's pending token) is row 0, then the nodes in the order they were added,
so a parent always precedes its children. A node at depth d sits at position start + d: the target
computes it as the serial step of its path (tree_attention.py), and the accept walk (`Tree.accept`)
follows, from the root, the child carrying the target's keyed choice at each node.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Protocol


class Lattice(Protocol):
    """A stream's drafter output: ranked candidates for each depth given the parent's token."""

    levels: int  # the depths it ranks candidates for: 1 .. levels

    def children(self, depth: int, parent_token: int) -> tuple[list[int], list[float]]:
        """Candidate tokens at `depth` (1-based) after `parent_token`, best first (rank 0 is the chain's
        draft), with their log-probabilities."""
        ...


@dataclass(frozen=True)
class Tree:
    """Row 0 is the root (the pending token); parents[r] < r for every other row."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    _children: dict[tuple[int, int], int] = field(default_factory=dict, repr=False, compare=False)
    lattice: Lattice | None = field(default=None, repr=False, compare=False)  # what `build` grew it from

    def __post_init__(self) -> None:
        for row in range(1, len(self.tokens)):
            self._children[self.parents[row], self.tokens[row]] = row

    @classmethod
    def of(cls, tokens: list[int], parents: list[int], lattice: Lattice | None = None) -> Tree:
        """A tree from its rows' tokens and parents (parents[0] = -1, a parent before its children)."""
        depths = [0]
        for row in range(1, len(tokens)):
            if not 0 <= parents[row] < row:
                raise ValueError(f"row {row}'s parent {parents[row]} does not precede it")
            depths.append(depths[parents[row]] + 1)
        return cls(tuple(tokens), tuple(parents), tuple(depths), lattice=lattice)

    @property
    def nodes(self) -> int:
        """Draft nodes (the root is the pending token, not a draft)."""
        return len(self.tokens) - 1

    @property
    def depth(self) -> int:
        return max(self.depths)

    def path(self, row: int) -> list[int]:
        """The rows from the root to `row`, root first."""
        rows = [row]
        while rows[-1] > 0:
            rows.append(self.parents[rows[-1]])
        return rows[::-1]

    def accept(self, chosen: list[int]) -> list[int]:
        """The accepted rows, root first: from the root, the child carrying the target's choice at
        the current node (`chosen[row]`, keyed at start + depth + 1), while there is one."""
        rows = [0]
        while (child := self._children.get((rows[-1], chosen[rows[-1]]))) is not None:
            rows.append(child)
        return rows


def build(root: int, lattice: Lattice, nodes: int, max_depth: int) -> Tree:
    """The `nodes` best nodes by cumulative log-probability, at most `max_depth` deep.

    Best-first over a lazy frontier: popping a node adds its next sibling and its first child, the
    two best nodes it hides. Scores only fall along a path and across a parent's ranked children, so
    the popped nodes are the top `nodes` paths and every ancestor is popped before its descendants;
    ties go to the node pushed first (a rank-0 child before its siblings).
    """
    tokens, parents = [root], [-1]
    if nodes <= 0 or max_depth <= 0:
        return Tree.of(tokens, parents, lattice)
    ranked: dict[int, tuple[list[int], list[float]]] = {0: lattice.children(1, root)}
    frontier: list[tuple[float, int, int, int, float]] = []  # (-score, order, parent row, rank, parent score)
    order = 0

    def push(parent: int, rank: int, parent_score: float) -> None:
        nonlocal order
        cands, logps = ranked[parent]
        if rank < len(cands):
            heapq.heappush(frontier, (-(parent_score + logps[rank]), order, parent, rank, parent_score))
            order += 1

    push(0, 0, 0.0)
    depths = [0]
    while frontier and len(tokens) <= nodes:
        neg, _, parent, rank, parent_score = heapq.heappop(frontier)
        row, score = len(tokens), -neg
        tokens.append(ranked[parent][0][rank])
        parents.append(parent)
        depths.append(depths[parent] + 1)
        push(parent, rank + 1, parent_score)
        if depths[row] < max_depth:
            ranked[row] = lattice.children(depths[row] + 1, tokens[row])
            push(row, 0, score)
    return Tree.of(tokens, parents, lattice)


def choice_ranks(lattice: Lattice, path_tokens: list[int], choices: list[int]) -> list[int]:
    """Where the target's choices fell among the lattice's candidates along a kept path: for each depth d
    the walk reached (1 .. len(choices), the last one the choice after the kept path), the rank of
    `choices[d - 1]` among the candidates after `path_tokens[d - 1]` (the path's token at depth d - 1,
    the root first), -1 where it is not one. Depths past the lattice's levels are left out. The verify
    budget learns from these what a tree of n nodes keeps (budget.py); a chain's rounds give them too."""
    ranks = []
    for depth, (parent, choice) in enumerate(zip(path_tokens, choices), start=1):
        if depth > lattice.levels:
            break
        candidates = lattice.children(depth, parent)[0]
        ranks.append(candidates.index(choice) if choice in candidates else -1)
    return ranks
