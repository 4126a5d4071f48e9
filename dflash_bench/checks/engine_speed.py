"""Engine speed in one process: plain and drafted rounds at 1..N streams, beside mlx-lm.

No HTTP in the way: the bundled engine serves the decode probes from `dflash_bench/prompts/` at each level,
drafted (per drafter precision) and plain (`draft: false`) on the same loaded target, and mlx-lm's
`generate_step` decodes the same prompt on the same float32 weights with the same BLAS, so every
figure in the receipt is a ratio taken in one run on one machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx

from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.receipt import Receipt, summary
from dflash_bench.engine.checkpoint import LoadedTarget, load_target
from dflash_bench.engine.drafters.dflash import load_drafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request
from dflash_bench.engine.targets import build_target


@dataclass(frozen=True)
class SpeedSettings:
    target: str = "default"
    drafter: str | None = None
    levels: tuple[int, ...] = (1, 4)
    tokens: int = 64
    reps: int = 2
    drafter_bits: tuple[int, ...] = (0,)
    mlx_lm: bool = True


def chat_ids(loaded: LoadedTarget, prompt: prompt_sets.Prompt) -> list[int]:
    tok = loaded.tokenizer
    if prompt.endpoint == "chat":
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt.text}]))
    return tok.encode(prompt.text)


def run_level(engine: Engine, prompt: list[int], streams: int, tokens: int, draft: bool) -> dict:
    """`streams` copies of one request (distinct seeds keep them separate streams), timed together."""
    reqs = [Request(prompt, max_tokens=tokens, draft=draft, ignore_eos=True, seed=i) for i in range(streams)]
    start = time.perf_counter()
    results = engine.run(reqs)
    wall = time.perf_counter() - start
    decode = [r.stats.decode_seconds for r in results]
    return {
        "streams": streams,
        "wall_seconds": wall,
        "completion_tokens": sum(len(r.tokens) for r in results),
        "aggregate_tok_s": sum(r.stats.decode_tokens for r in results) / max(decode),
        "stream_tok_s": [r.stats.decode_tokens / r.stats.decode_seconds for r in results],
        "tokens_per_round": [r.stats.tokens_per_round for r in results],
        "token_sha": [r.token_sha for r in results],
        "peak_bytes": mx.get_peak_memory(),
    }


def mlx_lm_decode(loaded: LoadedTarget, prompt: list[int], tokens: int) -> dict:
    """mlx-lm's own llama on our float32 weights: decode tok/s after its prompt pass."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama

    c = loaded.config
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama", hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
            intermediate_size=c.intermediate_size, num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads, rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
            rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, head_dim=c.head_dim,
        )
    )
    model.load_weights([("model." + k if k != "lm_head.weight" else k, v) for k, v in loaded.weights.items()])
    out, start, first = [], 0.0, 0.0
    for i, (token, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=tokens)):
        out.append(int(token))
        if i == 0:
            first = start = time.perf_counter()
    end = time.perf_counter()
    return {"tok_s": (len(out) - 1) / (end - start), "tokens": out, "first_token_at": first}


def run(s: SpeedSettings, receipt: Receipt, progress=lambda msg: None) -> None:
    if s.target != "default" and s.mlx_lm:
        receipt.skip("mlx-lm", "the mlx-lm comparison builds mlx-lm's llama and runs for llama targets only")
    loaded = load_target(s.target)
    target = build_target(loaded.config, loaded.weights)
    eos = loaded.config.eos_token_ids or loaded.tokenizer.eos_ids
    receipt.server = {"engine": "dflash-bench (in process)", "target": str(loaded.path),
                      "target_sha256": loaded.weights_sha256, "drafter": s.drafter}
    modes: list[tuple[str, Engine, bool]] = []
    top = max(s.levels)
    plain = Engine(model=target, settings=Settings(parallel=top, context=4096), eos_ids=eos)
    modes.append(("plain", plain, False))
    receipt.environment["selfcheck"] = plain.selfcheck.as_dict()
    if s.drafter and not plain.selfcheck.passed:  # drafted figures on a path that failed would not be exact
        receipt.skip("drafted", f"drafting is off: {plain.selfcheck.line()}")
    elif s.drafter:
        for bits in s.drafter_bits:
            drafter = load_drafter(s.drafter, target, bits=bits)
            engine = Engine(model=target, draft_model=drafter, settings=Settings(parallel=top, context=4096), eos_ids=eos)
            modes.append((f"drafted-{bits}bit" if bits else "drafted", engine, True))
    else:
        receipt.skip("drafted", "no --drafter given: only plain decode was measured")
    probes = prompt_sets.probes()
    for name, probe in probes.items():
        ids = chat_ids(loaded, probe)
        for mode, engine, draft in modes:
            for streams in s.levels:
                reps = []
                for rep in range(s.reps):
                    progress(f"{name} {mode} x{streams} rep {rep + 1}/{s.reps}")
                    reps.append(run_level(engine, ids, streams, s.tokens, draft))
                    receipt.records.append({"probe": name, "mode": mode, "rep": rep, **reps[-1]})
                receipt.aggregates.setdefault(name, {}).setdefault(mode, {})[str(streams)] = {
                    "aggregate_tok_s": summary([r["aggregate_tok_s"] for r in reps]),
                    "stream_tok_s": summary([r["stream_tok_s"][0] for r in reps]),
                    "tokens_per_round": summary([r["tokens_per_round"][0] for r in reps]),
                }
        shas = {r["token_sha"][0] for r in receipt.records if r["probe"] == name}
        if len(shas) != 1:
            receipt.fail("drafted equals plain", name, f"token hashes differ across modes and levels: {sorted(shas)}")
        if s.mlx_lm and s.target == "default":
            progress(f"{name} mlx-lm")
            ref = [mlx_lm_decode(loaded, ids, s.tokens) for _ in range(s.reps)]
            ours = receipt.aggregates[name]["plain"][str(min(s.levels))]["stream_tok_s"]["median"]
            theirs = summary([r["tok_s"] for r in ref])
            receipt.aggregates[name]["mlx-lm"] = {"stream_tok_s": theirs, "ours_over_mlx_lm": ours / theirs["median"]}
    receipt.aggregates["peak_bytes"] = mx.get_peak_memory()
