"""The DFlash recipe: random anchors in the target's replies, weighted block loss, AdamW.

Each step draws sequences, and in each sequence random anchor positions inside the reply. Block
row j (1..B-1) of the block at anchor a is trained to predict the target's token at a + j, with
weight exp(-(j - 1) / gamma): an early row matters more, since a draft is only kept when every row
before it was. The embedding and lm_head are the target's and stay frozen. A DFlash2 drafter adds
its selector's loss to each row's (`selector_loss`).

Held-out evaluation replays decoding: for every reply position a of a held-out greedy sequence,
`accepted[a]` is how many of the block's drafts match the reply from a + 1 on; walking rounds
a -> a + accepted[a] + 1 from the first reply token gives the tokens per round the engine would
report on that reply (decode_tokens / rounds).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial

import dflash_bench  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from dflash_bench.engine.topk import top_k_indices
from train_drafter.data import Sequences, TapStore
from train_drafter.model import Drafter
from train_drafter.target import TrainTarget


@dataclass
class Schedule:
    steps: int
    batch: int  # sequences a step
    anchors: int  # blocks a sequence
    lr: float = 6e-4
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    gamma: float = 7.0
    clip: float = 1.0
    seed: int = 0
    time_budget_s: float | None = None  # when set, steps shrink to what fits (measured after 10 steps)
    log_every: int = 25
    compile: bool = True
    logits_dtype: str = "float32"  # the lm_head product's dtype in training steps (see block_loss)


@dataclass
class TrainLog:
    curve: list[dict] = field(default_factory=list)
    steps_done: int = 0
    seconds: float = 0.0
    steps_planned: int = 0


def labels_and_weights(targets: mx.array, anchors: mx.array, length: mx.array, block: int, gamma: float):
    """Labels of rows 1..B-1 of each block (from `targets`, aligned with the tokens) and their loss
    weights (0 past the sequence's end)."""
    j = mx.arange(1, block)
    pos = anchors[:, :, None] + j[None, None, :]
    valid = pos < length[:, None, None]
    labels = mx.take_along_axis(targets[:, None, :], mx.minimum(pos, targets.shape[1] - 1), axis=2)
    decay = mx.exp(-(j.astype(mx.float32) - 1) / gamma)
    return labels, decay[None, None, :] * valid.astype(mx.float32)


def block_loss(model: Drafter, taps, tokens, targets, anchors, length, embed, head, gamma: float) -> mx.array:
    """Weighted cross-entropy of the blocks' rows 1..B-1. The lm_head product runs in `head`'s dtype
    (a bf16 head puts the largest product of a step, B-1 rows a block times the whole vocabulary, at
    bf16 rate); the softmax is always float32."""
    hidden = model(taps, tokens, anchors, embed)
    logits = model.logits(hidden.astype(head.dtype), head).astype(mx.float32)
    labels, weights = labels_and_weights(targets, anchors, length, model.config.block_size, gamma)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    if model.config.is_dflash2:
        previous = mx.concatenate([mx.take_along_axis(tokens, anchors, axis=1)[..., None], labels[..., :-1]], axis=-1)
        ce = ce + selector_loss(model, hidden[:, :, 1:], logits, labels, previous)
    return (ce * weights).sum() / mx.maximum(weights.sum(), 1e-6)


def selector_loss(model: Drafter, hidden: mx.array, logits: mx.array, labels: mx.array, previous: mx.array) -> mx.array:
    """DFlash2's selector loss per block row: cross-entropy over the row's top-k candidates (the gold
    token put in place of the weakest when it is missing), scored as the engine's walk scores them
    (unary logit plus the pairwise term), with the previous row's gold token as the predecessor:
    the walk's state whenever every earlier draft was kept, the only case in which the row counts."""
    k = model.config.selector_top_k
    candidates = mx.stop_gradient(top_k_indices(logits, k))
    found = candidates == labels[..., None]
    weakest = mx.argmin(mx.take_along_axis(logits, candidates, axis=-1), axis=-1, keepdims=True)
    swap = ~found.any(axis=-1, keepdims=True) & (mx.arange(k) == weakest)
    candidates = mx.stop_gradient(mx.where(swap, labels[..., None], candidates))  # indices: no gradient
    previous = mx.stop_gradient(previous)
    scores = mx.take_along_axis(logits, candidates, axis=-1)
    scores = scores + model.candidate_selector.pairwise(hidden, previous, candidates)
    gold = mx.argmax(candidates == labels[..., None], axis=-1)
    return nn.losses.cross_entropy(scores, gold, reduction="none")


def train(model: Drafter, target: TrainTarget, store: TapStore, s: Schedule, log=print, checkpoint=None) -> TrainLog:
    """Train in place; `checkpoint(step)` is called every 200 steps and at the end."""
    rng = np.random.default_rng(s.seed)
    result = TrainLog(steps_planned=s.steps)
    total = s.steps

    def lr_at(step: int) -> float:
        """Linear warmup, then cosine down to min_lr_ratio at the last step."""
        warm = min(1.0, (step + 1) / max(s.warmup, 1))
        progress = min(1.0, max(step - s.warmup, 0) / max(total - s.warmup, 1))
        return s.lr * warm * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    opt = optim.AdamW(learning_rate=s.lr, weight_decay=s.weight_decay)
    head = target.head.astype(getattr(mx, s.logits_dtype))
    loss_and_grad = nn.value_and_grad(model, partial(block_loss, embed=target.embed, head=head, gamma=s.gamma))
    state = [model.state, opt.state]

    def step(taps, tokens, targets, anchors, length):
        loss, grads = loss_and_grad(model, taps, tokens, targets, anchors, length)
        grads, norm = optim.clip_grad_norm(grads, s.clip)
        opt.update(model, grads)
        return loss, norm

    if s.compile:
        step = mx.compile(step, inputs=state, outputs=state)

    start = time.perf_counter()
    window: list[float] = []
    i, t10 = 0, 0.0
    while i < total:
        opt.learning_rate = lr_at(i)  # set from here: the compiled step reads it from the optimizer's state
        loss, norm = step(*store.batch(rng, s.batch, s.anchors))
        mx.eval(state, loss)
        window.append(loss.item())
        i += 1
        if s.time_budget_s and i == 10:
            t10 = time.perf_counter()
        if s.time_budget_s and i == 30:  # steps 10..30 time a compiled step; warmup is still running
            per_step = (time.perf_counter() - t10) / 20
            left = s.time_budget_s - (time.perf_counter() - start)
            total = max(i, min(s.steps, i + int(left / per_step)))
            result.steps_planned = total
            log(f"{per_step * 1000:.0f} ms a step: {total} steps fit {s.time_budget_s:.0f} s")
        if i % s.log_every == 0 or i == total:
            entry = {"step": i, "loss": round(float(np.mean(window)), 4), "lr": lr_at(i - 1),
                     "grad_norm": round(norm.item(), 3), "seconds": round(time.perf_counter() - start, 1)}
            result.curve.append(entry)
            window = []
            log(f"step {i}/{total} loss {entry['loss']:.4f} lr {entry['lr']:.2e} ({entry['seconds']:.0f} s)")
        if checkpoint is not None and (i % 200 == 0 or i == total):
            checkpoint(i)
    result.steps_done = i
    result.seconds = time.perf_counter() - start
    return result


def accepted_lengths(model: Drafter, target: TrainTarget, taps: mx.array, tokens: mx.array, targets: mx.array,
                     length: int, first: int, chunk: int = 64) -> np.ndarray:
    """For one sequence: drafts of the block at every anchor in [first, length - 2] that match
    `targets` from anchor + 1 on (greedy acceptance against them)."""
    block = model.config.block_size
    anchors = np.arange(first, length - 1)
    out = []
    for i in range(0, len(anchors), chunk):
        part = anchors[i : i + chunk]
        a = mx.array(np.pad(part, (0, chunk - len(part)), mode="edge")[None].astype(np.int32))
        hidden = model(taps, tokens, a, target.embed)
        drafts = model.drafts(hidden, model.logits(hidden, target.head), mx.take_along_axis(tokens, a, axis=1))
        labels, weights = labels_and_weights(targets, a, mx.array([length]), block, 1.0)
        match = (drafts == labels) & (weights > 0)
        run = mx.cumprod(match.astype(mx.int32), axis=-1).sum(axis=-1)
        out.append(np.array(run[0, : len(part)]))
    return np.concatenate(out)


def tokens_per_round(accepted: np.ndarray, first: int, length: int, budget: int) -> tuple[int, int]:
    """(tokens, rounds) of decoding `budget` tokens from the first reply token, drafts as accepted."""
    pos, emitted, rounds = first, 1, 0  # the first reply token comes from the prompt pass
    while emitted < budget and pos < length - 1:
        k = min(int(accepted[pos - first]), budget - emitted - 1)
        rounds += 1
        emitted += k + 1
        pos += k + 1
    return emitted - 1, rounds


def evaluate(models: dict[str, Drafter], target: TrainTarget, seqs: Sequences, taps: tuple[int, ...], gamma: float,
             labels: str = "target") -> dict[str, dict]:
    """Per drafter (all of one tap set, each row's taps computed once): held-out loss, acceptance by
    block row, and tokens per round by prompt kind, against the float32 target's own choices
    (labels="target") or the reply tokens ("replies")."""
    tallies = {name: _Tally(m.config.block_size) for name, m in models.items()}
    for i in range(len(seqs.length)):
        tokens = mx.array(seqs.tokens[i : i + 1])
        planes, choices = target.taps_and_choices(tokens, taps)
        targets = choices if labels == "target" else tokens
        first, length = int(seqs.prompt_len[i]), int(seqs.length[i])
        a = mx.array(np.arange(first, length - 1, 8, dtype=np.int32)[None])
        for name, model in models.items():
            acc = accepted_lengths(model, target, planes, tokens, targets, length, first)
            loss = block_loss(model, planes, tokens, targets, a, mx.array([length]), target.embed, target.head, gamma)
            tallies[name].add(seqs.kind[i], acc, tokens_per_round(acc, first, length, length - first), loss.item())
    return {name: t.summary() for name, t in tallies.items()}


def _rate(pairs: list[tuple[int, int]]) -> float:
    """Tokens per round over (tokens, rounds) pairs."""
    return round(sum(g for g, _ in pairs) / max(sum(r for _, r in pairs), 1), 3)


class _Tally:
    """One drafter's held-out figures, row by row."""

    def __init__(self, block: int):
        self.by_kind: dict[str, list[tuple[int, int]]] = {}
        self.row_hits = np.zeros(block - 1)
        self.row_seen = np.zeros(block - 1)
        self.losses: list[float] = []

    def add(self, kind: str, accepted: np.ndarray, got_rounds: tuple[int, int], loss: float) -> None:
        self.by_kind.setdefault(kind, []).append(got_rounds)
        for k in range(len(self.row_hits)):
            self.row_seen[k] += np.sum(accepted >= k)
            self.row_hits[k] += np.sum(accepted >= k + 1)
        self.losses.append(loss)

    def summary(self) -> dict:
        return {
            "sequences": len(self.losses),
            "loss": round(float(np.mean(self.losses)), 4),
            "tokens_per_round": _rate([x for v in self.by_kind.values() for x in v]),
            "tokens_per_round_by_kind": {k: _rate(v) for k, v in sorted(self.by_kind.items())},
            "acceptance_by_row": [round(h / max(n, 1), 4) for h, n in zip(self.row_hits, self.row_seen)],
        }
