"""Engine speed in one process: plain and drafted rounds at 1..N streams, beside mlx-lm.

No HTTP in the way: the bundled engine, loaded in the mode `serve` would use on this machine (or the
one named: engine/backend.py), serves the decode probes from `dflash_bench/prompts/` at each level,
plain (a drafter-less engine) and drafted (per drafter precision) on the same loaded target. mlx-lm
decodes the same prompt from the same files (mlx_lm_speed.py): `generate_step` for one stream, its
batched loop for more. Every figure in the receipt is a ratio taken in one run on one machine:
ours over mlx-lm, a drafted round's seconds over a plain round's (what verifying a window costs),
and a level's aggregate over one stream's (how streams scale). Beside them, the weights each mode's round
reads at least (Engine.weight_bytes): a drafted round that reads 1.71x a plain one's bytes cannot cost less than
1.71x at one speed a byte (docs/gpu-round-profile.md, session 46).
The timed reps are greedy. At each sampled temperature (`sampled`, 0.7 by default) every one of our modes decodes
once more at every level, untimed, each stream with its own seed: each drafted stream must equal plain's stream of
the same seed, and plain's stream of a seed has one hash at every level (check_sampled).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from dflash_bench.checks import mlx_lm_speed
from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.receipt import Receipt, summary
from dflash_bench.engine import backend as backends
from dflash_bench.engine.checkpoint import LoadedTarget
from dflash_bench.engine.drafters.dflash import load_drafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.request import Request, token_sha

MLX_LM = "mlx-lm"  # the reference's mode key beside ours
FIRST_TOKENS = 4  # the first request after ready: how long a user waits for a short reply


@dataclass(frozen=True)
class SpeedSettings:
    target: str = "default"
    drafter: str | None = None
    levels: tuple[int, ...] = (1, 4)
    tokens: int = 64
    reps: int = 2
    drafter_bits: tuple[int, ...] = (0,)
    mlx_lm: bool = True
    backend: str = "auto"  # 'auto' (the mode serve would use here), 'cpu' or 'gpu'
    sampled: tuple[float, ...] = (0.7,)  # temperatures of one untimed pass a mode and level (module docstring)


def chat_ids(loaded: LoadedTarget, prompt: prompt_sets.Prompt) -> list[int]:
    tok = loaded.tokenizer
    if prompt.endpoint == "chat":
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt.text}]))
    return tok.encode(prompt.text)


def run_level(engine: Engine, prompt: list[int], streams: int, tokens: int, draft: bool,
              temperature: float = 0.0) -> dict:
    """`streams` copies of one request (distinct seeds keep them separate streams), timed together; stream i
    has seed i, which picks its tokens where they are sampled (`temperature` above 0)."""
    reqs = [Request(prompt, max_tokens=tokens, draft=draft, ignore_eos=True, seed=i, temperature=temperature)
            for i in range(streams)]
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
        "rounds": [r.stats.rounds for r in results],
        "seconds_per_round": [r.stats.decode_seconds / r.stats.rounds if r.stats.rounds else 0.0 for r in results],
        "token_sha": [r.token_sha for r in results],
        "peak_bytes": mx.get_peak_memory(),
    }


def cell(reps: list[dict]) -> dict:
    """One (mode, level) cell from its reps: medians of the aggregate, the first stream, and a round's
    seconds averaged over the level's streams."""
    return {
        "aggregate_tok_s": summary([r["aggregate_tok_s"] for r in reps]),
        "stream_tok_s": summary([r["stream_tok_s"][0] for r in reps]),
        "tokens_per_round": summary([r["tokens_per_round"][0] for r in reps]),
        "seconds_per_round": summary([sum(r["seconds_per_round"]) / len(r["seconds_per_round"]) for r in reps]),
    }


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def derive(modes: dict[str, dict[str, dict]]) -> None:
    """Each of our cells' ratios, from the medians: `over_mlx_lm` (aggregate tok/s over mlx-lm's at the
    level), `round_over_plain` (seconds a round over a plain round's at the level: the verify round's
    cost) and `scaling` (aggregate at the level over the mode's aggregate at 1 stream)."""
    plain, ref = modes.get("plain", {}), modes.get(MLX_LM, {})
    for mode, cells in modes.items():
        if mode == MLX_LM:
            continue
        one = cells.get("1")
        measured = mode != "plain"  # a plain round over itself says nothing
        for streams, c in cells.items():
            agg = c["aggregate_tok_s"]["median"]
            c["over_mlx_lm"] = ratio(agg, ref[streams]["aggregate_tok_s"]["median"]) if streams in ref else None
            base = plain.get(streams)
            c["round_over_plain"] = (ratio(c["seconds_per_round"]["median"], base["seconds_per_round"]["median"])
                                     if base and measured else None)
            c["scaling"] = ratio(agg, one["aggregate_tok_s"]["median"]) if one else None


def engines(s: SpeedSettings, receipt: Receipt) -> tuple[LoadedTarget, list[tuple[str, Engine, bool]]]:
    """The plain engine (loads the target in the chosen mode) and one drafting engine per drafter
    precision on the same loaded target. Each mode's time to ready is what serving it alone waits for: the
    plain engine's construction; a drafting one's is the target's load and self-check (the plain engine's
    construction without its warm-up) plus the drafter's load and the drafting engine's construction (its
    warm-up, with the drafter's passes; the self-check's verdict is cached by then, as on a server's restart)."""
    mode = backends.resolve(s.backend)
    settings = Settings(parallel=max(s.levels), context=4096, backend=mode.name)
    started = time.perf_counter()
    plain = Engine(s.target, settings=settings)
    loading = receipt.aggregates["load_seconds"] = time.perf_counter() - started
    ready = receipt.aggregates["ready_seconds"] = {"plain": loading}
    checked = loading - (plain.warmup.seconds if plain.warmup else 0.0)  # the target loaded and self-checked
    loaded = plain.loaded
    receipt.server = {"engine": "dflash-bench (in process)", "target": str(loaded.path), "backend": mode.name,
                      "target_sha256": loaded.weights_sha256, "drafter": s.drafter}
    receipt.environment["backend"] = mode.name
    receipt.environment["selfcheck"] = plain.selfcheck.as_dict()
    modes = [("plain", plain, False)]
    if s.drafter and not plain.selfcheck.passed:  # drafted figures on a path that failed would not be exact
        receipt.skip("drafted", f"drafting is off: {plain.selfcheck.line()}")
    elif s.drafter:
        for bits in s.drafter_bits:
            started = time.perf_counter()
            drafter = load_drafter(s.drafter, plain.target, bits=bits, dtype=mode.dtype)
            engine = Engine(model=plain.target, draft_model=drafter, settings=settings, loaded=loaded)
            name = f"drafted-{bits}bit" if bits else "drafted"
            # what `serve --drafter` waits for: the target loaded and checked, then the drafter and its warm-up
            ready[name] = checked + time.perf_counter() - started
            modes.append((name, engine, True))
    else:
        receipt.skip("drafted", "no --drafter given: only plain decode was measured")
    receipt.server["startup_line"] = modes[-1][1].startup_line()
    # the least each mode's round reads: at one speed a byte a drafted round's cost over a plain one's is their ratio
    receipt.aggregates["weight_bytes"] = {name: engine.weight_bytes() for name, engine, _ in modes}
    return loaded, modes


def mlx_lm_record(reference, ids: list[int], streams: int, tokens: int) -> dict:
    """One mlx-lm decode as a record beside ours (its tokens as hashes)."""
    got = mlx_lm_speed.decode(reference, ids, streams, tokens)
    return {"streams": streams, "seconds": got["seconds"], "aggregate_tok_s": got["aggregate_tok_s"],
            "stream_tok_s": got["stream_tok_s"], "token_sha": [token_sha(t) for t in got["tokens"]]}


def run(s: SpeedSettings, receipt: Receipt, progress: Callable[[str], None] = lambda msg: None) -> None:
    """Each probe and level: every side (our modes, then mlx-lm) once untimed at the timed length, then the
    reps taken in turns (ours, mlx-lm, ours, ...). A shorter untimed pass left each side's first timed rep
    to grow its caches: in job I on the H200 (receipts/engine-speed-qwen3.5-9b-4bit-gpu-h200.json at 2fe7321)
    rep 0 of our plain rows took 13.4 ms a round against rep 1's 10.4, at 4 streams 24.1 against 15.7. A plain
    GPU round is bound by the host CPU's speed, which drifts on a shared machine
    (docs/profiles/round-split-h200.txt); in turns, a drift reaches both sides of a ratio. A run cut short
    (a job's time limit) keeps the equality checks and ratios of every level it finished."""
    loaded, modes = engines(s, receipt)
    reference = None
    if s.mlx_lm:
        why = mlx_lm_speed.unavailable()
        if why:
            receipt.aggregates["mlx_lm_note"] = why
            receipt.warn("mlx-lm", str(loaded.path), why)
        else:
            progress("loading mlx-lm")
            reference = mlx_lm_speed.load(loaded)
    for name, probe in prompt_sets.probes().items():
        ids = chat_ids(loaded, probe)
        cells: dict[str, dict[str, dict]] = receipt.aggregates.setdefault(name, {})
        done: list[int] = []
        try:
            for streams in s.levels:
                measure_level(s, receipt, name, ids, streams, modes, reference, cells, progress)
                done.append(streams)
        finally:  # an interrupted run keeps the checks and ratios of the levels it finished
            if done:
                check_equal(receipt, name, cells, tuple(done))
                check_sampled(receipt, name, cells, tuple(done), s.sampled)
                derive(cells)
    receipt.aggregates["peak_bytes"] = mx.get_peak_memory()


def measure_level(s: SpeedSettings, receipt: Receipt, name: str, ids: list[int], streams: int,
                  modes: list[tuple[str, Engine, bool]], reference: object | None,
                  cells: dict[str, dict[str, dict]], progress: Callable[[str], None]) -> None:
    """One probe at one level: every side untimed once, then the reps in turns, then the level's cells."""
    sides: list[tuple[str, Callable[[int], dict]]] = [
        (mode, lambda n, e=engine, d=draft: run_level(e, ids, streams, n, d)) for mode, engine, draft in modes]
    if reference is not None:
        sides.append((MLX_LM, lambda n: mlx_lm_record(reference, ids, streams, n)))
    if "first_request_seconds" not in receipt.aggregates:
        receipt.aggregates["first_request_seconds"] = sides[0][1](FIRST_TOKENS)["wall_seconds"]
    for _, side in sides:  # untimed, at the timed length: every cache size and buffer a rep will use
        side(s.tokens)
    reps: dict[str, list[dict]] = {mode: [] for mode, _ in sides}
    for rep in range(s.reps):
        for mode, side in sides:
            progress(f"{name} {mode} x{streams} rep {rep + 1}/{s.reps}")
            reps[mode].append(side(s.tokens))
            receipt.records.append({"probe": name, "mode": mode, "rep": rep, **reps[mode][-1]})
    for temperature in s.sampled:  # drafted == plain where tokens are sampled: once each, untimed, our modes only
        for mode, engine, draft in modes:
            progress(f"{name} {mode} x{streams} T={temperature:g}")
            got = run_level(engine, ids, streams, s.tokens, draft, temperature)
            receipt.records.append({"probe": name, "mode": mode, "rep": 0, "temperature": temperature, **got})
    for mode, got in reps.items():
        cells.setdefault(mode, {})[str(streams)] = cell(got) if mode != MLX_LM else {
            "aggregate_tok_s": summary([r["aggregate_tok_s"] for r in got]),
            "stream_tok_s": summary([r["stream_tok_s"] for r in got]),
        }


def records_of(receipt: Receipt, probe: str, mode: str, streams: int, temperature: float = 0.0) -> list[dict]:
    """A cell's records at one temperature: the timed greedy reps (0, the records that name none), or a sampled
    pass's."""
    return [r for r in receipt.records if r["probe"] == probe and r["mode"] == mode and r["streams"] == streams
            and r.get("temperature", 0.0) == temperature]


def check_equal(receipt: Receipt, probe: str, cells: dict[str, dict[str, dict]], levels: tuple[int, ...]) -> None:
    """Drafted == plain per cell: every stream of every rep of a drafted cell (not mlx-lm's, whose
    kernels differ from ours) has plain's token hash at that level (greedy, so one hash), and plain
    has one hash over all levels (streams never change a stream's tokens); a cell or level that
    differs fails the receipt."""
    def shas(mode: str, streams: int) -> set[str]:
        return {h for r in records_of(receipt, probe, mode, streams) for h in r["token_sha"]}

    plain_all = set().union(*(shas("plain", n) for n in levels))
    if len(plain_all) != 1:
        receipt.fail("drafted equals plain", f"{probe} plain", f"{probe} plain: token hashes differ across levels: "
                                                              f"{sorted(plain_all)}")
    for mode, by_level in cells.items():
        if mode in ("plain", MLX_LM):  # mlx-lm's own arithmetic: its tokens may differ and are not checked
            continue
        for streams in levels:
            plain, ours = shas("plain", streams), shas(mode, streams)
            equal = len(plain) == 1 and ours == plain
            by_level[str(streams)]["equals_plain"] = equal
            if not equal:
                receipt.fail("drafted equals plain", f"{probe} {mode} x{streams}",
                             f"{probe} {mode} x{streams}: token hashes {sorted(ours)}, plain {sorted(plain)}")


def check_sampled(receipt: Receipt, probe: str, cells: dict[str, dict[str, dict]], levels: tuple[int, ...],
                  temperatures: tuple[float, ...]) -> None:
    """Drafted == plain where tokens are sampled: at each temperature and level, each drafted stream's tokens are
    plain's stream of the same seed (stream i has seed i: run_level), recorded per temperature in the drafted
    cell's `equals_plain_sampled`; and plain's stream of a seed has one hash at every level (a stream's tokens do
    not depend on the streams beside it). A difference fails the receipt."""
    def streams_of(mode: str, streams: int, temperature: float) -> list[str] | None:
        found = records_of(receipt, probe, mode, streams, temperature)
        return found[0]["token_sha"] if found else None

    for temperature in temperatures:
        by_seed: dict[int, set[str]] = {}
        for streams in levels:
            for seed, sha in enumerate(streams_of("plain", streams, temperature) or []):
                by_seed.setdefault(seed, set()).add(sha)
        for seed, found in by_seed.items():
            if len(found) != 1:
                receipt.fail("sampled plain equals itself", f"{probe} plain T={temperature:g} seed {seed}",
                             f"{probe} plain T={temperature:g} seed {seed}: token hashes differ across levels: "
                             f"{sorted(found)}")
        for mode, by_level in cells.items():
            if mode in ("plain", MLX_LM):
                continue
            for streams in levels:
                plain, ours = streams_of("plain", streams, temperature), streams_of(mode, streams, temperature)
                if plain is None or ours is None:
                    continue
                equal = ours == plain
                by_level[str(streams)].setdefault("equals_plain_sampled", {})[f"{temperature:g}"] = equal
                if not equal:
                    receipt.fail("drafted equals plain", f"{probe} {mode} x{streams} T={temperature:g}",
                                 f"{probe} {mode} x{streams} T={temperature:g}: token hashes {ours}, plain {plain}")
