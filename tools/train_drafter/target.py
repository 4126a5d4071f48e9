"""The target as training sees it: mlx-lm's llama over the engine's canonical weights, batched.

The engine's own target runs one stream's rows in fixed tiles for bit-exact serving; training needs
the opposite, wide batches: hundreds of replies generated at once, and the tap planes of whole
batches of finished sequences. mlx-lm's llama computes the same function (tests/test_target_forward.py checks its logits against
the engine, tests/test_train_smoke.py these taps), so the taps are the engine's up to rounding.
"""

from __future__ import annotations

import dflash_bench  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from dflash_bench.engine.checkpoint import LoadedTarget


class TrainTarget:
    """A llama target that generates replies in batches and returns tap planes of sequences.

    Taps (and the drafter's frozen embedding and head) come from the float32 model, as the engine
    serves it on a CPU. Replies may come from a second copy in bf16 (`gen_dtype`): 1.5x faster on
    the H200, but its greedy replies are not the float32 ones: on a CPU 10 of 12 left them within
    128 tokens (first at tokens 2-100), after which they are another plausible continuation.
    """

    def __init__(self, loaded: LoadedTarget, dtype: mx.Dtype = mx.float32, gen_dtype: mx.Dtype | None = None):
        c = loaded.config
        if c.family != "llama":
            raise ValueError(f"the training tool builds drafters for llama targets; this target is {c.family!r}")
        self.config = c
        self.model = _llama(loaded, dtype)
        self.gen_model = self.model if gen_dtype is None or gen_dtype == dtype else _llama(loaded, gen_dtype)
        self.embed = self.model.model.embed_tokens.weight  # the drafter's frozen embedding and (tied) head
        self.head = _head(self.model)

    def hidden(self, ids: mx.array, mask, caches=None, taps: tuple[int, ...] = (),
               model: llama.Model | None = None) -> tuple[mx.array, list[mx.array]]:
        """Run the layers (of `model`, the float32 one by default); the final hidden state and the
        outputs of the tap layers."""
        model = model or self.model
        h = model.model.embed_tokens(ids)
        planes = []
        for i, layer in enumerate(model.model.layers):
            h = layer(h, mask, caches[i] if caches else None)
            if i in taps:
                planes.append(h)
        return h, [planes[sorted(taps).index(t)] for t in taps]

    def logits(self, h: mx.array, model: llama.Model | None = None) -> mx.array:
        model = model or self.model
        return model.model.norm(h) @ _head(model).T

    def taps(self, tokens: mx.array, taps: tuple[int, ...]) -> mx.array:
        """(S, T) token ids (right-padded) -> (S, T, taps * hidden): each row's tap planes side by side."""
        _, planes = self.hidden(tokens, "causal", taps=taps)
        return mx.concatenate(planes, axis=-1)

    def taps_and_choices(self, tokens: mx.array, taps: tuple[int, ...]) -> tuple[mx.array, mx.array]:
        """The tap planes and, from the same pass, the float32 target's greedy choice for every
        position: choices[:, t] is its argmax given tokens[:, :t] (choices[:, 0] = tokens[:, 0]).

        These are what greedy verification compares a draft with, whatever produced the tokens (a
        bf16 copy, or sampling), so they are the labels a drafter should learn.
        """
        h, planes = self.hidden(tokens, "causal", taps=taps)
        picks = mx.argmax(self.logits(h[:, :-1]), axis=-1).astype(tokens.dtype)
        return mx.concatenate(planes, axis=-1), mx.concatenate([tokens[:, :1], picks], axis=1)

    def generate(self, prompts: list[list[int]], new_tokens: int, temperatures: list[float], seed: int) -> np.ndarray:
        """`new_tokens` tokens after each prompt (eos ignored, as the decode probes ask), one batch.

        Prompts are left-padded; a padded row sees only itself, so no row is empty and nothing
        undefined reaches the real rows. Temperature 0 is greedy; above 0 a Gumbel-max sample.
        """
        s, width = len(prompts), max(len(p) for p in prompts)
        pad = mx.array([width - len(p) for p in prompts], dtype=mx.int32)
        ids = mx.array([[0] * (width - len(p)) + list(p) for p in prompts], dtype=mx.int32)
        temp = mx.array(temperatures, dtype=mx.float32)[:, None]
        gen = self.gen_model
        caches = [KVCache() for _ in gen.model.layers]
        q = mx.arange(width)[:, None]
        k = mx.arange(width)[None]
        mask = ((k <= q) & (k >= pad[:, None, None, None])) | (k == q)
        h, _ = self.hidden(ids, mask, caches, model=gen)
        key = mx.random.key(seed)
        out = []
        for step in range(new_tokens):
            logits = self.logits(h[:, -1, :], gen).astype(mx.float32)
            key, sub = mx.random.split(key)
            gumbel = -mx.log(-mx.log(mx.random.uniform(low=1e-20, high=1.0, shape=logits.shape, key=sub)))
            sampled = mx.argmax(logits / mx.maximum(temp, 1e-6) + gumbel, axis=-1)
            token = mx.where(temp[:, 0] > 0, sampled, mx.argmax(logits, axis=-1))
            out.append(token)
            if step + 1 == new_tokens:
                break
            keys = width + step + 1
            mask = mx.arange(keys)[None, None, None, :] >= pad[:, None, None, None]
            h, _ = self.hidden(token[:, None], mask, caches, model=gen)
            mx.eval(h, token)
        return np.array(mx.stack(out, axis=1))


def _llama(loaded: LoadedTarget, dtype: mx.Dtype) -> llama.Model:
    """mlx-lm's llama holding the target's canonical weights in `dtype`, frozen and evaluated."""
    c = loaded.config
    args = llama.ModelArgs(
        model_type="llama", hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        intermediate_size=c.intermediate_size, num_attention_heads=c.num_heads, rms_norm_eps=c.rms_norm_eps,
        vocab_size=c.vocab_size, head_dim=c.head_dim, num_key_value_heads=c.num_kv_heads,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings,
    )
    model = llama.Model(args)
    model.load_weights([(f"model.{k}" if k != "lm_head.weight" else k, v.astype(dtype)) for k, v in loaded.weights.items()])
    model.freeze()
    mx.eval(model.parameters())
    return model


def _head(model: llama.Model) -> mx.array:
    """The output projection: the embedding when tied."""
    return model.model.embed_tokens.weight if model.args.tie_word_embeddings else model.lm_head.weight
