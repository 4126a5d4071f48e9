"""mlx-lm's own decode on the target's files, the reference `engine-speed` sets our engine beside.

One stream runs mlx-lm's `generate_step`; B streams run a batched greedy loop over mlx-lm's model with
`make_prompt_cache` (the same prompt B times, one forward of B rows a token), pipelined the way
`generate_step` is (the next token's forward is queued with `mx.async_eval` before the current one is
read), so both sides are timed at their steady state. Both pass the prompt as `generate_step` does
(all but the last token, then the last as the first step), which is why the batched loop's rows give
`generate_step`'s greedy tokens (tests/test_engine_speed.py holds it to that).

mlx-lm reads a folder of config.json and model*.safetensors (MLX-quantized or float), which it loads itself.
It cannot read a GGUF file (the default model), so for one its model is built here on the weights our engine
loaded from the file (`from_loaded`): llama.cpp's Q/K rows put back in order and every quantized block already
an MLX affine triple (engine/checkpoint.py), each projection quantized as its triple is (Q4_1 as 4 bits in groups
of 32, Q8_0 as 8). The same bits for both sides, and the same arrays, so nothing is copied.
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from dflash_bench.engine.checkpoint import LoadedTarget
from dflash_bench.engine.tiles import Weight


def unavailable() -> str | None:
    """Why mlx-lm cannot decode here, or None when it can (any target: `load`)."""
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        return "mlx-lm not measured: mlx-lm is not installed"
    return None


def load(loaded: LoadedTarget) -> nn.Module:
    """mlx-lm's model for the target, its weights evaluated (as mlx-lm's `load` leaves them): from its own files
    for a safetensors folder, else on the weights our engine loaded (`from_loaded`)."""
    if loaded.path.is_dir():
        from mlx_lm.utils import load_model

        model, _ = load_model(loaded.path)
    else:
        model = from_loaded(loaded)
    mx.eval(model.parameters())
    return model


def mlx_lm_name(canonical: str) -> str:
    """mlx-lm's parameter name for one of our canonical ones (checkpoint.py strips mlx-lm's `model.`)."""
    return canonical if canonical.startswith("lm_head.") else f"model.{canonical}"


def from_loaded(loaded: LoadedTarget) -> nn.Module:
    """mlx-lm's model of the target's family on our loaded weights: its config from the one our loader read (for a
    GGUF, built from the file's metadata), each packed projection quantized as its own triple (its group size and
    bits), every other tensor as loaded."""
    import importlib

    family = importlib.import_module(f"mlx_lm.models.{loaded.config.family}")
    model = family.Model(family.ModelArgs.from_dict(dict(loaded.config.raw)))
    weights: dict[str, mx.array] = {}
    quantized: dict[str, dict[str, int]] = {}
    for name, w in loaded.weights.items():
        if isinstance(w, Weight) and w.bits:
            module = mlx_lm_name(name).removesuffix(".weight")
            weights.update({f"{module}.weight": w.w, f"{module}.scales": w.scales, f"{module}.biases": w.biases})
            quantized[module] = {"group_size": w.group_size, "bits": w.bits}
        else:
            weights[mlx_lm_name(name)] = w.w if isinstance(w, Weight) else w
    nn.quantize(model, class_predicate=lambda path, _: quantized.get(path, False))
    model.load_weights(list(weights.items()), strict=True)
    return model


def generate_one(model: nn.Module, prompt: list[int], tokens: int) -> dict:
    """`tokens` greedy tokens from `generate_step`; tok/s counts those after the first (its prompt pass)."""
    from mlx_lm.generate import generate_step

    out: list[int] = []
    start = time.perf_counter()
    for i, (token, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=tokens)):
        out.append(int(token))
        if i == 0:
            start = time.perf_counter()
    seconds = time.perf_counter() - start
    return {"streams": 1, "tokens": [out], "seconds": seconds, **rates(1, len(out), seconds)}


def generate_batched(model: nn.Module, prompt: list[int], streams: int, tokens: int) -> dict:
    """`tokens` greedy tokens for each of `streams` copies of `prompt`, one batched forward a token."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    rows = mx.array([prompt] * streams)
    if len(prompt) > 1:
        model(rows[:, :-1], cache=cache)
        mx.eval([c.state for c in cache])

    def step(last: mx.array) -> mx.array:
        return mx.argmax(model(last, cache=cache)[:, -1, :], axis=-1)

    y = step(rows[:, -1:])
    mx.async_eval(y)
    out: list[list[int]] = []
    start = time.perf_counter()
    for i in range(tokens):
        nxt = step(y[:, None]) if i + 1 < tokens else None
        if nxt is not None:
            mx.async_eval(nxt)
        out.append(y.tolist())
        if i == 0:
            start = time.perf_counter()
        y = nxt
    seconds = time.perf_counter() - start
    per_stream = [list(col) for col in zip(*out)]
    return {"streams": streams, "tokens": per_stream, "seconds": seconds, **rates(streams, len(out), seconds)}


def rates(streams: int, tokens: int, seconds: float) -> dict:
    """Aggregate and per-stream tok/s over the tokens after each stream's first."""
    each = (tokens - 1) / seconds if seconds > 0 and tokens > 1 else 0.0
    return {"stream_tok_s": each, "aggregate_tok_s": streams * each}


def decode(model: nn.Module, prompt: list[int], streams: int, tokens: int) -> dict:
    """One level: `generate_step` for one stream, the batched loop for more."""
    return generate_one(model, prompt, tokens) if streams == 1 else generate_batched(model, prompt, streams, tokens)
