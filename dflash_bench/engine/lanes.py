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

A drafted round of chains is queued ahead too (`look_ahead_windows`). Its verify's outcome stays on the
device (verify.py): the choices, the accepted count k (the leading run of drafts equal to the choices
before them), the next anchor (the choice after them), and each state's kept length (cache.py's
`keep_at`: attention caches place the next rows at it, a GatedDeltaNet layer reruns its window's
recurrence with the rows past it made inert). The drafter absorbs every row of the window and keeps as
many, and proposes from the anchor; the next round's verify forward is built on those drafts and that
anchor and queued, and only then are this round's choices read (`read`), while the device runs it. So
the host builds round r + 1 while the device runs round r, as for plain rounds: docs/gpu-round-profile.md
measured a drafted round at 2.21x a plain one on an H200 when they ran in series. Every row sits at the
positions and sees the keys it would with host values, so no bit changes (tests/test_lookahead.py).
The drafts a pass may propose are counted before the round's tokens are read, as if it kept one
(`limit`). A round with a prompt row, or while a request waits for a free lane, is not queued ahead;
trees and the auto verify budget (which counts drafts by what was accepted, and times each pass) read
the choices before the drafter's pass.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx

from dflash_bench.engine.budget import Acceptance, Budget
from dflash_bench.engine.cache import keep_windows
from dflash_bench.engine.constants import CHUNK
from dflash_bench.engine.drafters.dflash import DFlashDrafter, Proposal
from dflash_bench.engine.prompt_cache import Entry, PromptCache, last_boundary
from dflash_bench.engine.request import Event, Handle, Stats
from dflash_bench.engine.errors import ContextExceeded
from dflash_bench.engine.sampling import SamplingParams, choose, seed_from_prompt
from dflash_bench.engine.targets.base import Segment, SegmentOut, Target
from dflash_bench.engine.tree import Lattice, Tree, choice_ranks
from dflash_bench.engine.verify import Verdict, Verified, Window, verify


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
    known: int = 0  # positions its state holds as the host knows them: the start of the window it verifies
    anchor: mx.array | None = None  # its last verify's choice after the kept drafts, until `read` reads it
    verdict: Verdict | None = None  # its last verify, on the device until `read`

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
        """Admit, run one target forward over every stream, keep, then one drafter pass; read the
        chain windows' choices last, after queuing the next round where it can (the module's docstring)."""
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
        if all(s.pending is not None and not s.drafting and seg.at is None for s, seg in zip(self.streams, segments)):
            self.plain_round(segments, outs)
            return
        absorb, proposals, draft_seconds, windows = [], [], 0.0, []
        chains = [(s, seg, out) for s, seg, out in zip(self.streams, segments, outs)
                  if s.pending is not None and s.tree is None]
        verified = dict(zip([id(s) for s, _, _ in chains], verify([
            Window(s.params, seg, out, s.drafts if s.draft_ids is None else s.draft_ids) for s, seg, out in chains])))
        for s, seg, out in zip(list(self.streams), segments, outs):
            if s.pending is None:
                kept_taps = self.after_chunk(s, seg, out)
            elif s.tree is not None:
                kept_taps = self.after_tree(s, seg, out)
            else:
                kept_taps = self.keep_verdict(s, seg, out, verified[id(s)])
                windows.append(s)
            if s.drafting and kept_taps is not None:
                absorb.append((s.drafter_state, kept_taps))
        # a GatedDeltaNet layer rolls back the windows its forward launched together in one launch too
        keep_windows([(s.segment_state, s.verdict.keep) for s in windows])
        if windows:  # queued on their own: reading them then waits for nothing queued after them
            mx.async_eval([s.verdict.values for s in windows])
        if self.drafter is not None:
            self.drafter.absorb(absorb)
            for s in windows:
                if s.drafting:
                    s.drafter_state.keep_at(*s.verdict.keep)
            if windows and (self.tree_nodes or self.budget.fit is not None):
                # a tree grows from the stream's last token, and the auto budget counts drafts by what
                # was accepted: both read the choices before the pass
                self.read(windows)
                windows = []
            ready, others = [], []  # the drafting streams that decode; the next round's other rows
            for s in self.streams:
                if s.drafting and s.pending is not None:
                    ready.append(s)
                else:
                    others.append(1 if s.pending is not None else min(self.chunk, len(s.prompt) - s.pos))
            limits = [self.limit(s) for s in ready]
            counts = self.budget.counts(limits, [s.acceptance for s in ready], [s.idle for s in ready], others)
            for s, count, limit in zip(ready, counts, limits):
                s.idle = s.idle + 1 if count == 0 and limit > 0 else 0
                last = s.pending if s.anchor is None else s.anchor
                if count > 0 and self.tree_nodes:  # a tree of the budget's rows, as deep as the stream allows
                    nodes = self.tree_nodes if self.budget.kind == "fixed" else count
                    # n nodes reach at most n deep: the drafter's lm_head then runs no row the tree cannot use
                    proposals.append((s, Proposal(s.drafter_state, last, min(limit, nodes), s.params, nodes)))
                elif count > 0:
                    proposals.append((s, Proposal(s.drafter_state, last, count, s.params)))
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
        if windows and self.lookahead and self.queue_drafts and not self.tree_nodes:
            self.ahead = self.look_ahead_windows()
        if self.ahead is None:
            evaluate = mx.async_eval if self.queue_drafts else mx.eval
            evaluate([a for s in self.streams for a in self.arrays(s)], [s.draft_ids for s in self.streams
                                                                          if s.draft_ids is not None])
        if windows:
            self.read(windows)
            if not self.streams:  # the last ones ended: let the work queued for them finish, so an idle
                mx.synchronize()  # engine holds no temporaries (memory is back at its baseline)
        if self.budget is not None and not any(seg.prefill for seg in segments):
            # what a decode round cost, for the auto budget's fit (budget.py); prompt chunks take another
            # path whose rows cost less, so their rounds would skew the price of a decode row
            self.budget.observe([len(seg.tokens) for seg in segments],
                                time.perf_counter() - started - draft_seconds, [p.count for _, p in proposals],
                                draft_seconds, sum(len(seg.tokens) for seg in segments if seg.tree is not None))

    def limit(self, s: Stream) -> int:
        """The most drafts `s`'s next window can use: up to its max_tokens, and while its verify is unread
        (at least one more token, the window starting at most at the verify's end) inside the context."""
        left = s.request.max_tokens - s.emitted - 1
        if s.verdict is not None:
            left = min(left - 1, self.context - s.verdict.keep[1] - 1)
        return max(0, min(self.drafter.block - 1, left))

    def keep_verdict(self, s: Stream, seg: Segment, out: SegmentOut, v: Verified) -> mx.array | None:
        """A chain window's verify (verify.py's device values): the state keeps the pending token and the k
        drafts equal to the choices before them (cache.py's `keep_at`, which `round` runs for all of its
        windows at once: `keep_windows`), the drafter absorbs every row and keeps as many, the next pass
        starts from the choice after them (`anchor`), and `read` reads them later. Returns the window's taps,
        every row."""
        n = len(seg.tokens)
        s.anchor = v.anchor
        keep = (v.kept + seg.origin, s.known + n, s.known + 1)  # one add, the origin the host's or the device's
        s.verdict = Verdict(v.values, keep, list(seg.tokens) if seg.ids is None else [], s.lattice)
        s.drafts, s.draft_ids, s.lattice = (), None, None
        return out.taps

    def read(self, windows: list[Stream]) -> None:
        """Read the chain windows' verifies (`keep_verdict`): stats, the budget's record, the kept tokens out. A
        state that no queued round has written past is settled at its length."""
        values = [s.verdict.values.tolist() for s in windows]
        for s, (kept, *chosen) in zip(windows, values):
            k = kept - 1  # the drafts accepted (verify.py counts the pending token too)
            verdict, s.verdict, s.anchor = s.verdict, None, None
            s.known += k + 1
            if self.ahead is None or id(s) not in self.ahead:
                s.segment_state.settle(s.known)
                if s.drafting:
                    s.drafter_state.settle(s.known)
            s.stats.count_round(len(chosen) - 1, k)
            if s.acceptance is not None:
                ranks = self.ranks(verdict.lattice, verdict.window[: k + 1], chosen[: k + 1])
                self.budget.record(s.acceptance, len(chosen) - 1, k, ranks)
            s.pending = chosen[k]
            self.emit(s, chosen[: k + 1], from_round=True)

    def look_ahead_windows(self) -> dict[int, tuple[Segment, SegmentOut]] | None:
        """The next round's forward over every stream's next window (its anchor, then its drafts: device
        values), queued before this round's choices are read, as `look_ahead` queues a plain round: each
        state places the window at its kept length, a device value (cache.py). None where a stream is in
        its prompt, no stream drafts or a request could take a lane; a stream this round surely ends is left out."""
        if (any(s.pending is None for s in self.streams) or not any(s.drafting for s in self.streams)
                or (self.waiting and len(self.streams) < self.parallel)):
            return None  # (plain streams alone take `look_ahead`'s cheaper rounds)
        going = [s for s in self.streams if s.emitted + (s.anchor is not None) < s.request.max_tokens]
        if not going:
            return None
        parts = []  # every stream's anchor then its drafts, joined once (a join a stream was an operation each)
        for s in going:
            parts.append((mx.array(s.pending, dtype=mx.int32) if s.anchor is None else s.anchor).reshape(1))
            if s.draft_ids is not None:
                parts.append(s.draft_ids)
        joined, segments, cursor = mx.concatenate(parts) if len(parts) > 1 else parts[0], [], 0
        for s in going:
            n, state = 1 + (0 if s.draft_ids is None else s.draft_ids.shape[0]), s.segment_state
            ids = joined[cursor : cursor + n]  # a view
            cursor += n
            segments.append(Segment([-1] * n, state.length, state, list(range(n)), s.drafting, ids=ids, at=state.at))
        outs = self.target.forward(segments, self.drafter.taps if self.drafter else (), ids=joined)
        mx.async_eval([o.logits for o in outs], [o.taps for o in outs if o.taps is not None],
                      [a for s in self.streams for a in self.arrays(s)])
        return {id(s): (seg, out) for s, seg, out in zip(going, segments, outs)}

    def plain_round(self, segments: list[Segment], outs: list[SegmentOut]) -> None:
        """Every stream takes its keyed choice of its one row, with the next round queued before the
        choices are read (`look_ahead`) unless a waiting request could take a lane."""
        picks = [choose(out.logits, mx.array([seg.start + 1], dtype=mx.int32), s.params)
                 for s, seg, out in zip(self.streams, segments, outs)]
        for s, seg in zip(self.streams, segments):
            s.segment_state.keep(seg.start + 1)
            s.known = seg.start + 1
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
            s.known = s.pos
            first = choose(out.logits, mx.array([s.pos], dtype=mx.int32), s.params).item()
            now = time.perf_counter()
            s.stats.prefill_seconds = s.stats.ttft_seconds = now - s.started
            s.decode_started = now
            s.pending = first
            self.emit(s, [first], from_round=False)
        return out.taps

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
            ranks = self.ranks(s.lattice, [tree.tokens[r] for r in path], [chosen[r] for r in path])
            self.budget.record(s.acceptance, tree.depth, len(path) - 1, ranks)
        s.known = seg.start + len(path)
        s.tree, s.lattice = None, None
        s.pending = chosen[path[-1]]
        self.emit(s, [chosen[r] for r in path], from_round=True)
        return out.taps[mx.array(path, dtype=mx.int32)] if out.taps is not None else None

    def ranks(self, lattice: Lattice | None, path_tokens: list[int], choices: list[int]) -> list[int]:
        """The ranks of the target's choices along the kept path among the candidates a stream's drafts
        came from (`lattice`, `tree.choice_ranks`), where the budget counts them; else none."""
        if lattice is None or not self.budget.counts_ranks:
            return []
        return choice_ranks(lattice, path_tokens, choices)

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
        if self.ahead is not None:  # its queued round goes with it (and the round if it was the last)
            self.ahead.pop(id(s), None)
            self.ahead = self.ahead or None
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
