"""Lanes: up to N streams share rounds.

A round is one target forward over every active stream's segment (a prompt chunk, or its pending
token plus its drafts: a chain, or with `tree_nodes` a draft tree, tree.py), then keep (each stream
commits the rows the target agreed with: trim the attention K/V, or move a tree's accepted path to
its serial positions, roll the linear-attention state back, absorb the kept rows' taps into the
drafter's context), then one drafter pass over every drafting stream. Plain streams (`draft: false`) ride in
the same rounds with a window of one row. Prompt chunks and decode windows mix freely in a round:
each segment's rows are computed independently of the other segments (targets/base.py), so a long
prompt does not stall running streams and nothing a stream sees depends on its neighbours.

A prompt chunk runs from a multiple of `chunk` to the next one (or the prompt's end), whether the
stream starts fresh or from a prompt-cache boundary, so a prompt row is always computed in the same
chunk; its segment is marked `prefill` and takes the faster per-chunk attention and recurrence.
Decode windows must equal single steps, and keep the row-independent path.

A round whose streams all decode plainly (no drafts, no prompt rows) is read back only after the next
round's forward is queued on its still-unread tokens (`lookahead`), as mlx-lm's `generate_step` queues
its next step: the host builds round r + 1 while the device runs round r, which is most of a plain
step's cost on a GPU, where a forward is thousands of small launches. The queued forward is the one
the next round would build (the same segments, its tokens as an array instead of a list), so it
changes no bits. A stream that ends on eos or is cancelled meanwhile leaves its queued row unused
(its state goes with it); one that reaches max_tokens is left out of it; a request that arrives
meanwhile is admitted one round later.

A drafted round cannot be queued ahead (the next verify depends on what this one accepts), but its
drafter pass is not read back either: the drafts stay on the device as int32 ids, the next round's
verify forward is built on them while the device runs the pass, and they are read with that verify's
choices (the auto verify budget, which times each pass, reads them at once instead). The verify sees
the same tokens either way, so no bit changes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from dflash_bench.engine.budget import Acceptance, Budget
from dflash_bench.engine.constants import CHUNK
from dflash_bench.engine.drafters.dflash import DFlashDrafter, Proposal
from dflash_bench.engine.prompt_cache import Entry, PromptCache, last_boundary
from dflash_bench.engine.request import Event, Handle, Stats
from dflash_bench.engine.sampling import SamplingParams, choose, seed_from_prompt
from dflash_bench.engine.targets.base import Segment, SegmentOut, Target
from dflash_bench.engine.tree import Lattice, Tree, choice_ranks


class ContextExceeded(ValueError):
    """A prompt plus max_tokens past the window: refused before it takes a lane."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context: int):
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context
        super().__init__(
            f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {prompt_tokens + max_tokens}, "
            f"past the context window of {context}"
        )


@dataclass
class Stream:
    handle: Handle
    segment_state: object
    drafter_state: object
    params: SamplingParams
    drafting: bool
    pos: int  # next prompt position to prefill; == len(prompt) once decoding
    stats: Stats
    started: float
    pending: int | None = None
    drafts: tuple[int, ...] = ()
    draft_ids: mx.array | None = None  # this round's drafts still on the device, in place of `drafts`
    tree: Tree | None = None  # this round's draft tree, in place of `drafts` (tree.py)
    lattice: Lattice | None = None  # with trees on: the candidates this round's drafts came from, for the auto budget's ranks
    boundary: Entry | None = None
    decode_started: float = 0.0
    emitted: int = 0
    finished: bool = False
    acceptance: Acceptance | None = None  # its kept drafts by depth, for the verify budget
    idle: int = 0  # rounds in a row the budget gave it no drafts

    @property
    def request(self):
        return self.handle.request

    @property
    def prompt(self) -> list[int]:
        return self.handle.request.prompt


class Lanes:
    def __init__(
        self,
        target: Target,
        drafter: DFlashDrafter | None,
        parallel: int,
        context: int,
        prompt_cache: PromptCache,
        eos_ids: tuple[int, ...],
        chunk: int = CHUNK,
        budget: Budget | None = None,
        tree_nodes: int = 0,
        lookahead: bool = True,
    ):
        self.target, self.drafter = target, drafter
        self.budget = budget  # the engine's, whenever there is a drafter
        self.tree_nodes = tree_nodes  # 0: chains; else each drafting stream verifies a draft tree (tree.py)
        self.parallel, self.context, self.chunk = parallel, context, chunk
        self.prompt_cache = prompt_cache
        self.eos = frozenset(eos_ids)
        self.waiting: deque[Handle] = deque()
        self.streams: list[Stream] = []
        self.rounds = 0
        self.lookahead = lookahead  # queue plain rounds ahead (the module's docstring); tests turn it off
        self.ahead: dict[int, tuple[Segment, SegmentOut]] | None = None  # the queued round, by id(stream)

    @property
    def queue_drafts(self) -> bool:
        """Whether a drafter pass's drafts stay on the device until the verify that checks them is read
        (the module's docstring): with the lookahead on, unless the auto budget times the pass."""
        return self.lookahead and (self.budget is None or self.budget.fit is None)

    # -- admission ---------------------------------------------------------------------------
    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens < 1:
            raise ValueError("prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens is {max_tokens}, expected at least 1")
        if prompt_tokens + max_tokens > self.context:
            raise ContextExceeded(prompt_tokens, max_tokens, self.context)

    def submit(self, handle: Handle) -> None:
        self.check(len(handle.request.prompt), handle.request.max_tokens)
        self.waiting.append(handle)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.streams)

    def admit(self) -> None:
        while self.waiting and len(self.streams) < self.parallel:
            handle = self.waiting.popleft()
            if handle.cancelled.is_set():
                handle.events.put(Event([], finish="cancelled", stats=Stats(prompt_tokens=len(handle.request.prompt))))
                continue
            self.streams.append(self.open(handle))

    def open(self, handle: Handle) -> Stream:
        req = handle.request
        drafting = bool(req.draft and self.drafter is not None)
        seed = req.seed if req.seed is not None else seed_from_prompt(req.prompt)
        params = SamplingParams(req.temperature, req.top_k, req.top_p, seed)
        entry = self.prompt_cache.lookup(req.prompt, self.chunk, drafting) if self.prompt_cache.enabled else None
        if entry is not None:
            n = len(entry.tokens)
            state = entry.state.snapshot(n)
            dstate = entry.drafter.snapshot(n) if drafting else None
        else:
            n, state = 0, self.target.new_state()
            dstate = self.drafter.new_state() if drafting else None
        stats = Stats(
            prompt_tokens=len(req.prompt),
            cached_tokens=n,
            drafter=self.drafter.kind if drafting else None,
            seed=seed,
        )
        acceptance = self.budget.new_stream() if drafting else None
        return Stream(handle, state, dstate, params, drafting, n, stats, time.perf_counter(), acceptance=acceptance)

    # -- one round ---------------------------------------------------------------------------
    def round(self) -> None:
        """Admit, run one target forward over every stream, keep, then one drafter pass."""
        for s in [s for s in self.streams if s.handle.cancelled.is_set()]:
            self.finish(s, "cancelled")
        ahead, self.ahead = self.ahead, None
        if not self.streams:  # every stream the queued round covered has ended
            ahead = None
        if ahead is None:
            self.admit()
        if not self.streams:
            return
        self.rounds += 1
        started = time.perf_counter()
        if ahead is not None:  # queued by the last round for every stream still running
            segments, outs = map(list, zip(*(ahead[id(s)] for s in self.streams)))
        else:
            segments = [self.segment(s) for s in self.streams]
            outs = self.target.forward(segments, self.drafter.taps if self.drafter else ())
        if all(s.pending is not None and not s.drafting for s in self.streams):
            self.plain_round(segments, outs)
            return
        absorb, proposals, draft_seconds = [], [], 0.0
        for s, seg, out in zip(list(self.streams), segments, outs):
            if s.pending is None:
                kept_taps = self.after_chunk(s, seg, out)
            else:
                kept_taps = self.after_window(s, seg, out)
            if s.drafting and kept_taps is not None:
                absorb.append((s.drafter_state, kept_taps))
        if self.drafter is not None:
            self.drafter.absorb(absorb)
            ready, others = [], []  # the drafting streams that decode; the next round's other rows
            for s in self.streams:
                if s.drafting and s.pending is not None:
                    ready.append(s)
                else:
                    others.append(1 if s.pending is not None else min(self.chunk, len(s.prompt) - s.pos))
            limits = [max(0, min(self.drafter.block - 1, s.request.max_tokens - s.emitted - 1)) for s in ready]
            counts = self.budget.counts(limits, [s.acceptance for s in ready], [s.idle for s in ready], others)
            for s, count, limit in zip(ready, counts, limits):
                s.idle = s.idle + 1 if count == 0 and limit > 0 else 0
                if count > 0 and self.tree_nodes:  # a tree of the budget's rows, as deep as the stream allows
                    nodes = self.tree_nodes if self.budget.kind == "fixed" else count
                    # n nodes reach at most n deep: the drafter's lm_head then runs no row the tree cannot use
                    proposals.append((s, Proposal(s.drafter_state, s.pending, min(limit, nodes), s.params, nodes)))
                elif count > 0:
                    proposals.append((s, Proposal(s.drafter_state, s.pending, count, s.params)))
            drafting_at = time.perf_counter()  # a pass's tokens come back as lists: it is evaluated when it returns
            if self.tree_nodes:
                for (s, _), tree in zip(proposals, self.drafter.propose_trees([p for _, p in proposals])):
                    # a tree whose nodes lie on one path is a chain: verified as a window, the same
                    # rows and bits (window == steps) without each row's own key view (tree_attention.py)
                    if tree.depth == tree.nodes:
                        s.drafts = tree.tokens[1:]
                    else:
                        s.tree = tree
                    s.lattice = tree.lattice
            else:
                for (s, _), d in zip(proposals, self.drafter.propose_queued([p for _, p in proposals])):
                    if self.queue_drafts:
                        s.draft_ids = d
                    else:
                        s.drafts = tuple(d.tolist())
            draft_seconds = time.perf_counter() - drafting_at
        evaluate = mx.async_eval if self.queue_drafts else mx.eval
        queued = [s.draft_ids for s in self.streams if s.draft_ids is not None]
        evaluate([a for s in self.streams for a in self.arrays(s)], queued)
        if self.budget is not None and not any(seg.prefill for seg in segments):
            # what a decode round cost, for the auto budget's fit (budget.py); prompt chunks take another
            # path whose rows cost less, so their rounds would skew the price of a decode row
            self.budget.observe([len(seg.tokens) for seg in segments],
                                time.perf_counter() - started - draft_seconds, [p.count for _, p in proposals],
                                draft_seconds, sum(len(seg.tokens) for seg in segments if seg.tree is not None))

    def plain_round(self, segments: list[Segment], outs: list[SegmentOut]) -> None:
        """Every stream takes its keyed choice of its one row, with the next round queued before the
        choices are read (`look_ahead`) unless a waiting request could take a lane."""
        picks = [choose(out.logits, mx.array([seg.start + 1], dtype=mx.int32), s.params)
                 for s, seg, out in zip(self.streams, segments, outs)]
        for s, seg in zip(self.streams, segments):
            s.segment_state.keep(seg.start + 1)
        admitting = self.waiting and len(self.streams) < self.parallel
        self.ahead = self.look_ahead(picks) if self.lookahead and not admitting else None
        for s, pick in zip(list(self.streams), picks):
            token = pick.item()
            if self.ahead is not None and id(s) in self.ahead:
                self.ahead[id(s)][0].tokens[0] = token
            s.stats.count_round(0, 0)
            s.pending = token
            self.emit(s, [token], from_round=True)
        if self.ahead is None:
            mx.eval([a for s in self.streams for a in self.arrays(s)])

    def look_ahead(self, picks: list[mx.array]) -> dict[int, tuple[Segment, SegmentOut]] | None:
        """The next plain round's forward over the streams that will still run after this one's tokens
        (`picks`, unread), queued on the device with them. Its segments' tokens are filled in as read."""
        going = [(s, p) for s, p in zip(self.streams, picks) if s.emitted + 1 < s.request.max_tokens]
        if not going:
            return None
        # The choices go to the device on their own: reading an array waits for the whole evaluation
        # it was queued in, so queued with the next forward they would be read only after it, and the
        # host's building of each round would not overlap the device's work (mlx-lm's generate_step
        # queues each token before the next step's forward the same way).
        mx.async_eval(picks)
        segments = [Segment([-1], s.segment_state.length, s.segment_state, [0], ids=p.astype(mx.int32))
                    for s, p in going]
        outs = self.target.forward(segments)
        mx.async_eval([o.logits for o in outs], [a for s, _ in going for a in s.segment_state.arrays()])
        return {id(s): (seg, out) for (s, _), seg, out in zip(going, segments, outs)}

    def segment(self, s: Stream) -> Segment:
        if s.pending is None:
            end = min(len(s.prompt), (s.pos // self.chunk + 1) * self.chunk)
            rows = list(s.prompt[s.pos : end])
            logit_rows = [len(rows) - 1] if end == len(s.prompt) else []
            return Segment(rows, s.pos, s.segment_state, logit_rows, s.drafting, prefill=True)
        if s.tree is not None:
            rows = list(range(len(s.tree.tokens)))
            return Segment(list(s.tree.tokens), s.segment_state.length, s.segment_state, rows, s.drafting, tree=s.tree)
        if s.draft_ids is not None:  # the drafts are read with the verify's choices (after_window)
            n = 1 + s.draft_ids.shape[0]
            ids = mx.concatenate([mx.array([s.pending], dtype=mx.int32), s.draft_ids])
            return Segment([s.pending] + [-1] * (n - 1), s.segment_state.length, s.segment_state, list(range(n)),
                           s.drafting, ids=ids)
        window = [s.pending, *s.drafts]
        return Segment(window, s.segment_state.length, s.segment_state, list(range(len(window))), s.drafting)

    def after_chunk(self, s: Stream, seg: Segment, out) -> mx.array | None:
        s.pos = seg.start + len(seg.tokens)
        s.segment_state.keep(s.pos)  # a prompt chunk is kept whole (and drops its rollback record)
        if self.prompt_cache.enabled and s.pos == last_boundary(len(s.prompt), self.chunk) and s.pos > 0:
            s.boundary = Entry(
                tuple(s.prompt[: s.pos]),
                s.segment_state.snapshot(s.pos),
                s.drafter_state.snapshot(s.pos) if s.drafting else None,
            )
        if s.pos == len(s.prompt):
            first = choose(out.logits, mx.array([s.pos], dtype=mx.int32), s.params).item()
            now = time.perf_counter()
            s.stats.prefill_seconds = s.stats.ttft_seconds = now - s.started
            s.decode_started = now
            s.pending = first
            self.emit(s, [first], from_round=False)
        return out.taps

    def after_window(self, s: Stream, seg: Segment, out) -> mx.array | None:
        if s.tree is not None:
            return self.after_tree(s, seg, out)
        n = len(seg.tokens)
        positions = mx.arange(seg.start + 1, seg.start + n + 1, dtype=mx.int32)
        chosen = choose(out.logits, positions, s.params).tolist()
        drafts = s.drafts if s.draft_ids is None else tuple(s.draft_ids.tolist())  # evaluated with the verify
        k = 0
        while k < len(drafts) and drafts[k] == chosen[k]:
            k += 1
        s.segment_state.keep(seg.start + k + 1)
        s.stats.count_round(len(drafts), k)
        if s.acceptance is not None:
            self.budget.record(s.acceptance, len(drafts), k, self.ranks(s, [seg.tokens[0], *drafts[:k]], chosen[: k + 1]))
        s.drafts, s.draft_ids, s.lattice = (), None, None
        s.pending = chosen[k]
        self.emit(s, chosen[: k + 1], from_round=True)
        return out.taps[: k + 1] if out.taps is not None else None

    def after_tree(self, s: Stream, seg: Segment, out) -> mx.array | None:
        """The accept walk (tree.py): commit the path of nodes carrying the target's keyed choices (each
        node's choice keyed at start + depth + 1) and the choice after it; keep moves the path's K/V to
        its serial positions, and the drafter absorbs the path's taps."""
        tree = s.tree
        chosen = choose(out.logits, seg.positions() + 1, s.params).tolist()
        path = tree.accept(chosen)
        s.segment_state.keep_path(seg.start, path)
        s.stats.count_round(tree.nodes, len(path) - 1, tree.depth)
        if s.acceptance is not None:
            ranks = self.ranks(s, [tree.tokens[r] for r in path], [chosen[r] for r in path])
            self.budget.record(s.acceptance, tree.depth, len(path) - 1, ranks)
        s.tree, s.lattice = None, None
        s.pending = chosen[path[-1]]
        self.emit(s, [chosen[r] for r in path], from_round=True)
        return out.taps[mx.array(path, dtype=mx.int32)] if out.taps is not None else None

    def ranks(self, s: Stream, path_tokens: list[int], choices: list[int]) -> list[int]:
        """The ranks of the target's choices along the kept path among the candidates `s`'s drafts came
        from (`tree.choice_ranks`), where the budget counts them; else none."""
        if s.lattice is None or not self.budget.counts_ranks:
            return []
        return choice_ranks(s.lattice, path_tokens, choices)

    # -- output ------------------------------------------------------------------------------
    def emit(self, s: Stream, tokens: list[int], from_round: bool) -> None:
        out, finish = [], None
        for t in tokens:
            if t in self.eos and not s.request.ignore_eos:
                finish = "stop"
                break
            out.append(t)
            s.emitted += 1
            if s.emitted >= s.request.max_tokens:
                finish = "length"
                break
        if from_round:  # a round's tokens include the eos that ends it
            s.stats.decode_tokens += len(out) + (finish == "stop")
        if out:
            s.handle.events.put(Event(out))
        if finish is not None:
            self.finish(s, finish)

    def finish(self, s: Stream, reason: str, error: str | None = None) -> None:
        if s.finished:
            return
        s.finished = True
        if s.decode_started:
            s.stats.decode_seconds = time.perf_counter() - s.decode_started
        if reason in ("stop", "length") and s.boundary is not None:
            self.prompt_cache.insert(s.boundary)
        s.boundary = None
        self.streams.remove(s)
        s.handle.events.put(Event([], finish=reason, stats=s.stats, error=error))

    def fail_all(self, error: str) -> None:
        """An engine failure: every stream and waiting request ends with the error."""
        self.ahead = None
        for s in list(self.streams):
            self.finish(s, "error", error)
        while self.waiting:
            h = self.waiting.popleft()
            h.events.put(Event([], finish="error", stats=Stats(prompt_tokens=len(h.request.prompt)), error=error))

    @staticmethod
    def arrays(s: Stream) -> list[mx.array]:
        out = s.segment_state.arrays()
        if s.drafter_state is not None:
            out += s.drafter_state.arrays()
        return out
