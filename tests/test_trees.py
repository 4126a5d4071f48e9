"""Draft trees (engine/tree.py, engine/tree_attention.py) keep the exactness contract, bit for bit.

- every node of a random tree, verified in one target forward, has the logits of its path fed as
  serial one-row steps, for llama and qwen3, with trees inside a key tile, across a key-tile
  boundary and before the first shared tile (float32 CPU, equality, never a tolerance);
- keeping any accepted path leaves the state of those serial steps, and the next step agrees;
- a deliberately misplaced ancestor key (two ancestors' slots swapped: the same keys, mask and
  sums, in another order) changes bits, so the node check can fail;
- the tree's first path is the chain `propose` drafts (v1 and DFlash2, greedy and T=0.7); the
  build picks the best nodes by cumulative log-probability;
- through the engine: drafted with trees == plain, greedy and T=0.7, with the fixtures' v1 and
  DFlash2 drafters and with an oracle tree drafter under which every accepted depth occurs;
  qwen3_5 falls back to chains.
"""

from __future__ import annotations

import heapq
import itertools
import random

import mlx.core as mx
import numpy as np
import pytest
from test_rows import assert_same_state, prefilled, random_tokens, run, target_for
from tiny_targets import VOCAB, tiny_target

from dflash_bench.engine.cache import TargetState
from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.drafters import dflash as dflash_module
from dflash_bench.engine.drafters.position_lattice import PositionLattice
from dflash_bench.engine.drafters.dflash import Proposal, load_drafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.engine.sampling import SamplingParams
from dflash_bench.engine.targets import Segment, Target, base, build_target
from dflash_bench.engine.tree import Tree, build
from dflash_bench.fixtures.small import write_fixture

DENSE = ("llama", "qwen3")
# (start, nodes, spine): a tree inside one key tile (70..), one whose spine crosses the key-tile
# boundary at 128 (120..130), one with no whole key tile before it (10..), one wider than a row tile
CASES = ((70, 15, 3), (120, 15, 10), (10, 12, 2), (100, 23, 6))


def random_tree(nodes: int, seed: int, spine: int) -> Tree:
    """A random tree of `nodes` nodes under root token 7: the first `spine` nodes a chain, each later
    one under any earlier row, its siblings' tokens distinct."""
    rng = random.Random(seed)
    tokens, parents = [7], [-1]
    for row in range(1, nodes + 1):
        parent = row - 1 if row <= spine else rng.randrange(row)
        taken = {tokens[r] for r in range(1, row) if parents[r] == parent}
        tokens.append(rng.choice([t for t in range(VOCAB) if t not in taken]))
        parents.append(parent)
    return Tree.of(tokens, parents)


def serial_states(target: Target, base_state: TargetState, tree: Tree) -> tuple[list[mx.array], list[TargetState]]:
    """Each node's logits and state when its path is fed one row at a time (a parent's state, one step)."""
    start = base_state.length
    logits, states = [], []
    for row, token in enumerate(tree.tokens):
        before = base_state if row == 0 else states[tree.parents[row]]
        state = before.snapshot(start + tree.depths[row])
        logits.append(run(target, state, [token])[0])
        states.append(state)
    return logits, states


def tree_forward(target: Target, state: TargetState, tree: Tree) -> mx.array:
    rows = list(range(len(tree.tokens)))
    out = target.forward([Segment(list(tree.tokens), state.length, state, rows, tree=tree)])[0].logits
    mx.eval(out)
    return out


def differing_nodes(target: Target, start: int, tree: Tree) -> list[int]:
    base_state = prefilled(target, random_tokens(start, start))
    want, _ = serial_states(target, base_state, tree)
    got = tree_forward(target, base_state.snapshot(start), tree)
    return [r for r in range(len(want)) if not mx.array_equal(got[r], want[r]).item()]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", DENSE)
def test_every_tree_node_equals_the_serial_steps_of_its_path(family: str, case: tuple[int, int, bool]) -> None:
    start, nodes, spine = case
    target = target_for(family, "small")
    for seed in range(3):
        tree = random_tree(nodes, seed, spine)
        assert differing_nodes(target, start, tree) == [], f"{family} start {start} tree {seed}: {tree.parents}"


@pytest.mark.parametrize("family", DENSE)
def test_tree_nodes_equal_serial_steps_at_smollm2_size(family: str) -> None:
    """At hidden 576 (16-row projection tiles, 64-dim heads), across the tile boundary at 128."""
    assert differing_nodes(target_for(family, "smol"), 120, random_tree(15, 4, 10)) == []


@pytest.mark.parametrize("family", DENSE)
def test_keep_after_accepting_any_path_equals_serial_steps(family: str) -> None:
    """keep_path(start, path) after a tree's forward leaves the state of feeding the path one row at a
    time, for the path to every node; the next step from it agrees too."""
    target, start = target_for(family, "small"), 120
    tree = random_tree(15, 7, 10)
    base_state = prefilled(target, random_tokens(start, 11))
    _, want = serial_states(target, base_state, tree)
    bonus = random_tokens(len(tree.tokens), 12)
    for row in range(len(tree.tokens)):
        state = base_state.snapshot(start)
        tree_forward(target, state, tree)
        state.keep_path(start, tree.path(row))
        assert_same_state(state, want[row], f"{family} kept the path to node {row}")
        expected = run(target, want[row].snapshot(want[row].length), [bonus[row]])
        assert mx.array_equal(run(target, state, [bonus[row]]), expected).item(), f"{family} next step after node {row}"


def test_the_node_check_can_fail_with_a_misplaced_ancestor_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swap the slots of a deep node's first two ancestors (the root and its child): the same keys,
    mask and values in another order. The node check then finds rows that differ."""
    tail_index = base.tail_index

    def misplaced(tree: Tree, start: int, rows: int):
        prefix, tail, index = tail_index(tree, start, rows)
        slot = start - prefix
        for row in range(min(rows, len(tree.tokens))):
            if tree.depths[row] >= 2:
                index[row, [slot, slot + 1]] = index[row, [slot + 1, slot]]
        return prefix, tail, index

    monkeypatch.setattr(base, "tail_index", misplaced)
    assert differing_nodes(target_for("llama", "small"), 70, random_tree(15, 0, 6)), "no node changed"


def test_accept_walks_the_targets_choices_from_the_root() -> None:
    tree = Tree.of([5, 1, 2, 3, 4, 6], [-1, 0, 0, 2, 3, 1])  # root 5: children 1 (-> 6) and 2 (-> 3 -> 4)
    assert tree.depths == (0, 1, 1, 2, 3, 2)
    assert tree.accept([2, 0, 3, 4, 9, 0]) == [0, 2, 3, 4]
    assert tree.accept([1, 6, 0, 0, 0, 9]) == [0, 1, 5]
    assert tree.accept([8, 0, 0, 0, 0, 0]) == [0]
    with pytest.raises(ValueError, match="does not precede"):
        Tree.of([5, 1, 2], [-1, 2, 0])


class TableLattice:
    """Children ranked by a fixed pseudo-random log-probability table of (depth, parent, token)."""

    def __init__(self, width: int, seed: int):
        self.width, self.seed = width, seed

    def children(self, depth: int, parent_token: int) -> tuple[list[int], list[float]]:
        rng = np.random.default_rng([self.seed, depth, parent_token])
        logp = np.log(rng.dirichlet(np.ones(self.width)))
        order = np.argsort(-logp, kind="stable")
        return [int(100 * depth + i) for i in order], [float(logp[i]) for i in order]


def test_build_keeps_the_best_nodes_by_cumulative_log_probability() -> None:
    """Against brute force over every path: the built tree's nodes have the top scores, their parents
    precede them, and its first path takes rank 0 at every depth."""
    for seed, (width, nodes, depth) in enumerate([(3, 10, 4), (4, 15, 6), (2, 7, 3)]):
        lattice = TableLattice(width, seed)
        tree = build(7, lattice, nodes, depth)
        scores = {0: 0.0}
        for row in range(1, len(tree.tokens)):
            parent = tree.parents[row]
            assert parent < row
            cands, logps = lattice.children(tree.depths[row], tree.tokens[parent])
            scores[row] = scores[parent] + logps[cands.index(tree.tokens[row])]
        every = []
        for d in range(1, depth + 1):
            for ranks in itertools.product(range(width), repeat=d):
                token, total = 7, 0.0
                for j, rank in enumerate(ranks, start=1):
                    cands, logps = lattice.children(j, token)
                    token, total = cands[rank], total + logps[rank]
                every.append(total)
        best = heapq.nlargest(nodes, every)
        assert tree.nodes == nodes and np.allclose(sorted(scores[r] for r in range(1, nodes + 1)), sorted(best))
        row, token = 0, 7
        for d in range(1, tree.depth + 1):  # the first path: rank 0 at every depth, first child added
            kids = [r for r in range(len(tree.tokens)) if tree.parents[r] == row]
            if not kids:
                break
            row = min(kids)
            assert tree.tokens[row] == lattice.children(d, token)[0][0]
            token = tree.tokens[row]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("trees")
    out: dict[str, object] = {}
    for family in ("llama", "qwen3", "qwen3_5"):
        out[family] = write_fixture(family, root / family, seed=1)
        for kind in ("dflash", "dflash2"):
            out[family, kind] = write_fixture(kind, root / f"{family}-{kind}", seed=2, target=family)
    return out


def first_path(tree: Tree) -> list[int]:
    row, out = 0, []
    while kids := [r for r in range(1, len(tree.tokens)) if tree.parents[r] == row]:
        row = min(kids)
        out.append(tree.tokens[row])
    return out


@pytest.mark.parametrize("kind", ("dflash", "dflash2"))
@pytest.mark.parametrize("temperature", (0.0, 0.7))
def test_a_trees_first_path_is_the_chain(fixtures, kind: str, temperature: float, monkeypatch) -> None:
    """From the same drafter pass, the tree's first path is `propose`'s chain (a prefix of it when the
    node budget runs out first); with one candidate a depth the tree is the whole chain."""
    loaded = load_target(fixtures["llama"])
    target = build_target(loaded.config, loaded.weights)
    drafter = load_drafter(fixtures["llama", kind], target)
    tokens = random_tokens(40, 3)
    taps = target.forward([Segment(tokens[:39], 0, target.new_state(), want_taps=True)], drafter.taps)[0].taps
    for seed in range(4):
        state = drafter.new_state()
        drafter.absorb([(state, taps)])
        p = Proposal(state, tokens[39], drafter.block - 1, SamplingParams(temperature, seed=seed), nodes=15)
        chain = drafter.propose([p])[0]
        spine = first_path(drafter.propose_trees([p])[0])
        assert spine and chain[: len(spine)] == spine, (chain, spine)
    if kind == "dflash":
        monkeypatch.setattr(dflash_module, "TREE_WIDTH", 1)
        assert first_path(drafter.propose_trees([p])[0]) == drafter.propose([p])[0]


def requests(n: int, temperature: float, max_tokens: int = 40) -> list[Request]:
    rng = random.Random(5)
    return [Request([rng.randrange(8, 500) for _ in range(rng.randrange(3, 70))], max_tokens=max_tokens,
                    ignore_eos=True, temperature=temperature, seed=i) for i in range(n)]


def plain(engine: Engine, req: Request) -> list[int]:
    return engine.generate(Request(req.prompt, max_tokens=req.max_tokens, ignore_eos=True,
                                   temperature=req.temperature, seed=req.seed, draft=False)).tokens


@pytest.mark.parametrize("kind", ("dflash", "dflash2"))
@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("temperature", (0.0, 0.7))
def test_drafted_with_trees_equals_plain(fixtures, family: str, kind: str, temperature: float) -> None:
    """Four streams at once, each verifying a 20-node tree a round (wider than a row tile)."""
    engine = Engine(fixtures[family], fixtures[family, kind], Settings(parallel=4, context=512, tree_nodes=20))
    reqs = requests(6, temperature)
    for req, got in zip(reqs, engine.run(reqs, arrivals=[0, 0, 1, 2, 5, 9])):
        assert got.tokens == plain(engine, req)
        assert got.stats.drafted > got.stats.rounds  # trees, not single drafts, were verified


class OracleState:
    """A drafter state that only counts the positions absorbed."""

    def __init__(self, length: int = 0):
        self.length = length

    def snapshot(self, length: int) -> OracleState:
        return OracleState(length)

    def keep_at(self, kept: mx.array, bound: int, low: int) -> None:  # a chain-shaped tree's window (lanes.py)
        self.length = int(kept.item())

    def settle(self, length: int) -> None:
        assert length == self.length

    def arrays(self) -> list[mx.array]:
        return []

    nbytes = 0


class OracleTreeDrafter:
    """Knows the plain reply: builds trees whose true path, k nodes deep, hangs on a non-first branch
    among decoys, then a wrong child; k cycles through every depth the stream allows."""

    kind = "DFlash"
    taps = (0,)
    block = 8

    def __init__(self):
        self.truth: list[int] = []  # the stream's prompt + plain reply (one stream at a time)
        self.turn = 0
        self.depths: list[int] = []  # the depth k each tree's true path reaches, in order

    def block_rows(self, count: int) -> int:
        return count + 1

    def new_state(self) -> OracleState:
        return OracleState()

    def absorb(self, items) -> None:
        for state, taps in items:
            state.length += taps.shape[0]

    def propose_trees(self, items: list[Proposal]) -> list[Tree]:
        out = []
        for p in items:
            start, full = p.state.length, self.truth
            assert full[start] == p.last
            k = self.turn % (p.count + 1)
            self.turn += 1
            tokens, parents = [p.last], [-1]
            rng = random.Random(self.turn)
            true_row = 0
            for depth in range(1, k + 2):
                if depth > p.count:
                    break
                want = full[start + depth]
                decoy = (want + 1 + rng.randrange(VOCAB - 1)) % VOCAB
                tokens.append(decoy)
                parents.append(true_row)  # a wrong sibling first
                if depth <= k:
                    tokens.append(want)
                    parents.append(true_row)
                    true_row = len(tokens) - 1
            self.depths.append(k)
            out.append(Tree.of(tokens, parents))
        return out


@pytest.mark.parametrize("family", DENSE)
@pytest.mark.parametrize("temperature", (0.0, 0.7))
def test_every_accepted_depth_keeps_drafted_equal_to_plain(fixtures, family: str, temperature: float) -> None:
    loaded = load_target(fixtures[family])
    target = build_target(loaded.config, loaded.weights)
    reference = Engine(model=target, settings=Settings(parallel=1, context=512), eos_ids=())
    oracle = OracleTreeDrafter()
    engine = Engine(model=target, draft_model=oracle, eos_ids=(),  # a double: no drafter pass to warm
                    settings=Settings(parallel=1, context=512, tree_nodes=OracleTreeDrafter.block - 1, warm=False))
    kept = np.zeros(OracleTreeDrafter.block, dtype=int)
    for req in requests(3, temperature, max_tokens=48):
        want = plain(reference, req)
        oracle.truth = req.prompt + want
        got = engine.generate(req)
        assert got.tokens == want
        kept[: len(got.stats.accepted_counts)] += got.stats.accepted_counts
    # every round kept exactly the true path the oracle hid, and every depth 0..block-1 occurred
    assert kept.tolist() == np.bincount(oracle.depths, minlength=OracleTreeDrafter.block).tolist()
    assert kept.min() > 0, kept


@pytest.mark.parametrize("temperature", (0.0, 0.7))
def test_a_tree_on_one_path_is_verified_as_a_chain_window(fixtures, temperature: float, monkeypatch) -> None:
    """One-node trees (the auto budget's count of 1) lie on one path: the target verifies them as
    chain windows, whose attention needs no per-row key view, with the same replies as plain."""
    engine = Engine(fixtures["llama"], fixtures["llama", "dflash"], Settings(parallel=2, context=512, tree_nodes=1))
    forward, shapes = engine.target.forward, []

    def recorded(segments, *args, **kwargs):
        shapes.extend((seg.tree is not None, len(seg.tokens)) for seg in segments if not seg.prefill)
        return forward(segments, *args, **kwargs)

    monkeypatch.setattr(engine.target, "forward", recorded)
    reqs = requests(3, temperature)
    for req, got in zip(reqs, engine.run(reqs, arrivals=[0, 0, 3])):
        assert got.tokens == plain(engine, req)
    assert (False, 2) in shapes and not any(tree for tree, _ in shapes)


def test_hybrid_targets_fall_back_to_chains(fixtures) -> None:
    engine = Engine(fixtures["qwen3_5"], fixtures["qwen3_5", "dflash"], Settings(parallel=1, context=512, tree_nodes=8))
    assert engine.tree_nodes == 0 and engine.lanes.tree_nodes == 0
    assert "draft trees off (chains)" in engine.startup_line()
    req = requests(1, 0.0)[0]
    assert engine.generate(req).tokens == plain(engine, req)


def test_the_self_check_proves_trees_and_catches_a_misplaced_ancestor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time self-check's model test includes a draft tree on dense targets (selfcheck.py)."""
    from dflash_bench.engine import selfcheck

    target = target_for("qwen3", "small")
    assert selfcheck.model_faults(target) == []
    tail_index = base.tail_index

    def misplaced(tree: Tree, start: int, rows: int):
        prefix, tail, index = tail_index(tree, start, rows)
        index[:, [start - prefix, start - prefix + 1]] = index[:, [start - prefix + 1, start - prefix]]
        return prefix, tail, index

    monkeypatch.setattr(base, "tail_index", misplaced)
    assert any("draft tree" in f for f in selfcheck.model_faults(target))


def test_auto_budget_with_trees_keeps_drafted_equal_to_plain(fixtures) -> None:
    """--verify-budget auto chooses each stream's rows and the tree takes that many nodes: staggered
    streams at T=0.7 still decode plain decoding's tokens."""
    engine = Engine(fixtures["llama"], fixtures["llama", "dflash"],
                    Settings(parallel=4, context=512, verify_budget="auto", tree_nodes=15))
    assert "draft trees of the budget's rows" in engine.startup_line()
    reqs = requests(4, 0.7)
    for req, got in zip(reqs, engine.run(reqs, arrivals=[0, 1, 2, 5])):
        assert got.tokens == plain(engine, req)


def test_a_trees_round_is_counted_by_its_nodes_and_depths() -> None:
    """15 nodes reaching depth 6, a path of 3 kept: drafted 15, accepted 3, depths 1..6 reached."""
    from dflash_bench.engine.request import Stats

    stats = Stats()
    stats.count_round(15, 3, depth=6)
    assert (stats.drafted, stats.accepted, stats.rounds) == (15, 3, 1)
    assert stats.accepted_counts == [0, 0, 0, 1] and stats.drafted_counts == [1] * 6
    assert stats.acceptance_by_depth() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_trees_fall_back_to_chains_where_decode_attention_runs_the_cuda_kernel() -> None:
    """On a CUDA GPU the self-check may put decode attention on our kernel (targets/attention_kernel.py),
    whose bits a tree row's tile products would not equal: such a target verifies chains and says why."""
    target, _ = tiny_target("llama", "small", layers=2, seed=9)
    assert target.supports_trees and target.tree_refusal is None
    target.attn[0].path = "kernel"
    assert not target.supports_trees and "CUDA kernel" in target.tree_refusal


def test_the_lattice_ranks_each_depth_by_its_scores_with_the_chains_draft_first() -> None:
    """PositionLattice's candidates equal a full sort of each row: the pick first, then the best others by
    log-probability; ties go to the lower id, filtered (-inf) tokens never appear, no token twice."""
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((6, 500)).astype(np.float32) * 3
    scores[1, :] = -np.inf
    scores[1, [7, 40]] = [1.0, 2.0]  # a row with two tokens left after filtering
    scores[2, [10, 20, 30]] = 50.0  # a three-way tie at the top
    picks = [int(np.argmax(scores[0])), 7, 30, 11, 0, 499]
    lattice = PositionLattice(mx.array(scores), mx.array(picks), 4)
    for row, (tokens, logps) in enumerate(lattice.depths):
        s = scores[row].astype(np.float64)
        lse = s.max() + np.log(np.exp(s - s.max()).sum())
        order = sorted((i for i in range(s.size) if np.isfinite(s[i]) and i != picks[row]), key=lambda i: (-s[i], i))
        assert tokens == [picks[row], *order[:3]]
        assert len(set(tokens)) == len(tokens)
        assert np.allclose(logps, [s[t] - lse for t in tokens], atol=1e-4)
    assert lattice.depths[1][0] == [7, 40] and lattice.depths[2][0][:3] == [30, 10, 20]
