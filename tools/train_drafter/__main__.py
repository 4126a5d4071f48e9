"""python -m train_drafter {data,train,all,probe,average}: see README.md beside this file for the exact runs."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

import dflash_bench  # noqa: F401  (loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from dflash_bench.engine.checkpoint import load_target
from dflash_bench.engine.draft_config import parse_draft_config, read_draft_config
from train_drafter import corpus
from train_drafter.data import Sequences, TapStore, generate_all
from train_drafter.model import GROUP_SIZE, Drafter, average, drafter_config, export, load, start_from, stored_body
from train_drafter.recipe import RECIPES, Recipe, parse_mix, with_overrides
from train_drafter.target import TrainTarget
from train_drafter.train import Schedule, evaluate, train


STARTED = time.perf_counter()
EVAL_RESERVE_S = 40.0  # export and held-out evaluation: about 10 s on the H200


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def mix_arg(text: str) -> dict[str, float]:
    """argparse's reading of `--mix` (recipe.parse_mix): a malformed one is a one-line usage error."""
    try:
        return parse_mix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def recipe_from(args: argparse.Namespace) -> Recipe:
    return with_overrides(RECIPES[args.recipe], prompts=args.prompts, steps=args.steps, batch=args.batch,
                          gen_batch=args.gen_batch, seed=args.seed, held_out=args.held_out,
                          new_tokens=args.new_tokens, lr=args.lr, gen_dtype=args.gen_dtype,
                          labels=args.labels, logits_dtype=args.logits_dtype, layers=args.layers, bits=args.bits,
                          selector_rank=args.selector_rank, trains=args.trains, mix=args.mix)


def cmd_data(args: argparse.Namespace, recipe: Recipe, target: TrainTarget, loaded) -> tuple[Sequences, dict]:
    stdlib = Path(args.stdlib or sysconfig.get_paths()["stdlib"])
    prompts = corpus.build_prompts(stdlib, recipe.prompts, recipe.seed, recipe.mix, recipe.held_out_words)
    start = time.perf_counter()
    seqs = generate_all(target, loaded.tokenizer, prompts, new_tokens=recipe.new_tokens,
                        max_prompt_tokens=recipe.max_prompt_tokens, batch=recipe.gen_batch,
                        sampled_fraction=recipe.sampled_fraction, temperatures=recipe.temperatures,
                        seed=recipe.seed, log=log,
                        deadline=STARTED + args.deadline - 30 if args.deadline else None)
    kept = Counter(seqs.kind)
    summary = {
        "prompts": len(seqs.kind),
        "prompts_built": len(prompts),
        "prompts_sha256": corpus.prompts_sha256(prompts),
        "prompts_by_kind": dict(sorted(kept.items())),
        "examples": {k: [p.text[:160] for p in prompts if p.kind == k][:2] for k in sorted(kept)},
        "held_out_words": list(recipe.held_out_words),
        "stdlib": f"{stdlib} (Python {platform.python_version()})",
        "prompt_tokens": int(seqs.prompt_len.sum()),
        "reply_tokens": int((seqs.length - seqs.prompt_len).sum()),
        "greedy_replies": int((seqs.temperature == 0).sum()),
        "sampled_replies": int((seqs.temperature > 0).sum()),
        "sample_temperatures": list(recipe.temperatures),
        "generation_seconds": round(time.perf_counter() - start, 1),
        "tokens_sha256": hashlib.sha256(seqs.tokens.tobytes()).hexdigest(),
    }
    if args.data:
        path = Path(args.data[0])
        path.parent.mkdir(parents=True, exist_ok=True)
        seqs.save(path)
        path.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"data: {summary['prompts']} prompts, {summary['prompt_tokens']} prompt + {summary['reply_tokens']} reply tokens")
    return seqs, summary


def load_data(paths: list[str]) -> tuple[Sequences, dict]:
    """One or more data files (each with its summary beside it) as one training set."""
    parts = [Sequences.load(p) for p in paths]
    summaries = [json.loads(Path(p).with_suffix(".json").read_text()) for p in paths]
    if len(parts) == 1:
        return parts[0], summaries[0]
    seqs = Sequences.concat(parts)
    totals = {k: sum(s[k] for s in summaries) for k in ("prompts", "prompt_tokens", "reply_tokens",
                                                         "greedy_replies", "sampled_replies")}
    return seqs, {**totals, "tokens_sha256": hashlib.sha256(seqs.tokens.tobytes()).hexdigest(),
                  "files": [{"file": Path(p).name, **s} for p, s in zip(paths, summaries)]}


def split(seqs: Sequences, held_out: int) -> tuple[Sequences, Sequences]:
    """Held-out rows: greedy replies (the probes are greedy), drawn at random; the rest train.

    The draw is seeded by the data itself (its tokens), not by the run's seed: two runs on one
    data set (a drafter continued from another) hold out the same rows, so neither trains on the
    other's held-out replies.
    """
    rng = np.random.default_rng(int(hashlib.sha256(seqs.tokens.tobytes()).hexdigest()[:16], 16))
    greedy = np.flatnonzero(seqs.temperature == 0)
    held = np.sort(rng.choice(greedy, size=min(held_out, len(greedy)), replace=False))
    rest = np.setdiff1d(np.arange(len(seqs.length)), held)
    return seqs.take(rest), seqs.take(held)


def cmd_train(args, recipe: Recipe, target: TrainTarget, loaded, seqs: Sequences, data_summary: dict) -> dict:
    out = Path(args.out)
    config = drafter_config(recipe.shape, loaded.config)
    draft_cfg = parse_draft_config(config)
    if recipe.shape.block > recipe.shape.window:
        raise ValueError("the block must fit inside the sliding window")
    train_set, held = split(seqs, recipe.held_out)
    store = TapStore(target, train_set, draft_cfg.taps, recipe.tap_chunk, recipe.tap_batch, recipe.labels, log=log)
    mx.random.seed(recipe.seed)
    model = Drafter(draft_cfg)
    model.init(recipe.seed)
    init = None
    if args.init:  # continue from an exported drafter: this recipe's, or a smaller one grown
        init = {"from": args.init, "how": start_from(model, config, Path(args.init))}
        log(f"init: {init['how']}")
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    body = None
    if recipe.trains == "selector":  # main() checked that this is a DFlash2 recipe with --init
        model.freeze()
        model.candidate_selector.unfreeze()
        body = stored_body(Path(args.init))  # read once: every checkpoint ships it
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    log(f"drafter: {params} params ({trainable} trained), {draft_cfg.num_layers} layers, taps {list(draft_cfg.taps)}")
    budget = args.time_budget
    if args.deadline:  # the whole command ends by then: training gets what is left after evaluation's share
        budget = max(30.0, args.deadline - (time.perf_counter() - STARTED) - EVAL_RESERVE_S)
    sched = Schedule(steps=recipe.steps, batch=recipe.batch, anchors=recipe.anchors, lr=recipe.lr,
                     warmup=recipe.warmup, gamma=recipe.gamma, seed=recipe.seed, time_budget_s=budget,
                     compile=not args.no_compile, logits_dtype=recipe.logits_dtype)
    trained = train(model, target, store, sched, log=log, checkpoint=lambda step: export(model, config, out / "drafter", body))
    del store
    drafter_dir = export(model, config, out / "drafter", body)
    log("evaluating the export (as stored: quantized when the recipe says so) on held-out replies")
    held_eval = evaluate({"export": load(drafter_dir)}, target, held, draft_cfg.taps, recipe.gamma, recipe.labels)["export"]
    log(f"held-out: {json.dumps(held_eval)}")
    return {
        "schema": 1,
        "what": f"training receipt of a {draft_cfg.kind} drafter (tools/train_drafter)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m train_drafter", *sys.argv[1:]]),
        **_source(),
        "environment": {"python": platform.python_version(), "mlx": mx.__version__,
                        "device": str(mx.default_device()), "machine": platform.machine()},
        "target": {"path": loaded.path.name, "weights_sha256": loaded.weights_sha256, "taps_dtype": "float32",
                   "stored_taps": "bfloat16"},
        "recipe": recipe.as_dict(),
        "init": init,
        "data": data_summary | {"train_sequences": len(train_set.length), "held_out_sequences": len(held.length)},
        "architecture": {"layers": draft_cfg.num_layers, "layer_types": list(draft_cfg.layer_types),
                         "taps": list(draft_cfg.taps), "block": draft_cfg.block_size, "window": draft_cfg.sliding_window,
                         "hidden": draft_cfg.hidden_size, "intermediate": draft_cfg.intermediate_size,
                         "heads": draft_cfg.num_heads, "kv_heads": draft_cfg.num_kv_heads,
                         "mask_token_id": draft_cfg.mask_token_id, "params": int(params),
                         "stored": f"{recipe.shape.bits}-bit matrices (groups of {GROUP_SIZE}), bf16 norms"
                         if recipe.shape.bits else "bf16",
                         "frozen": "the target's embedding and (tied) lm_head"
                         + (f", and every drafter tensor but the selector's (as {args.init} stores them)"
                            if body is not None else "")}
                        | ({"variant": "DFlash2", "conv_kernel": draft_cfg.conv_kernel_size,
                            "conv_group": draft_cfg.conv_group_size, "selector_rank": draft_cfg.selector_rank,
                            "selector_top_k": draft_cfg.selector_top_k,
                            "loss": "block cross-entropy plus the selector's over each row's top-k (gold injected)"}
                           if draft_cfg.is_dflash2 else {}),
        "training": {"steps": trained.steps_done, "steps_planned": trained.steps_planned,
                     "seconds": round(trained.seconds, 1), "time_budget_s": budget,
                     "blocks_per_step": recipe.batch * recipe.anchors, "loss_curve": trained.curve},
        "held_out": held_eval,
        "files": _files(drafter_dir),
        "trained_params": int(trainable),
    }


def _files(folder: Path) -> dict:
    return {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
            for f in sorted(folder.iterdir())}


def _source() -> dict:
    """What code ran: the tool's own sources by hash (right wherever the tree was copied), and git's
    view, which a copied tree can get wrong (a stale .git): `git_dirty` then says it differs."""
    tool = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        tool.update(f.name.encode() + b"\0" + f.read_bytes())
    out = {"tool_sha256": tool.hexdigest(), "git_revision": None, "git_dirty": None}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()

    try:
        out["git_revision"] = git("rev-parse", "HEAD")
        out["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def cmd_probe(args) -> None:
    """Tokens per round (and CPU speed) of the decode probes with the engine, drafted and plain."""
    from dflash_bench.engine.engine import Engine

    probes = json.loads(Path(args.probes).read_text())["probes"]
    for drafter in args.drafter:
        engine = Engine(args.target, drafter)
        for row in _probe_rows(engine, probes, args.tokens):
            print(json.dumps({"drafter": drafter, **row}), flush=True)


def _probe_rows(engine, probes: list[dict], tokens: int):
    """One row a probe: tokens a round, speed and token hash, drafted and plain (which must be equal)."""
    from dflash_bench.engine.request import Request

    tok = engine.tokenizer
    for p in probes:
        text = p["text"]
        if p["endpoint"] == "chat":
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        ids = tok.encode(text)
        row = {"probe": p["id"]}
        for mode, draft in (("drafted", True), ("plain", False)):
            t0 = time.perf_counter()
            res = engine.generate(Request(ids, max_tokens=tokens, draft=draft, ignore_eos=True))
            row[mode] = {"tokens_per_round": round(res.stats.tokens_per_round, 3),
                         "decode_tok_s": round(res.stats.decode_tokens / max(res.stats.decode_seconds, 1e-9), 1),
                         "seconds": round(time.perf_counter() - t0, 1), "token_sha": res.token_sha}
        row["speedup"] = round(row["drafted"]["decode_tok_s"] / row["plain"]["decode_tok_s"], 2)
        row["equal"] = row["drafted"]["token_sha"] == row["plain"]["token_sha"]
        yield row


def cmd_average(args, recipe: Recipe) -> None:
    """The mean of several exported drafters (`average`), with a receipt naming its sources (and
    embedding their training receipts, `--receipts`); with `--data`, the mean and each source are
    scored on that data's held-out rows (the first `--eval-rows` of them: a CPU takes seconds a row)."""
    out = Path(args.out)
    drafter_dir = average([Path(d) for d in args.drafter], out / "drafter")
    kind = read_draft_config(drafter_dir).kind
    held_out = None
    if args.data:
        loaded = load_target(args.target)
        _, held = split(load_data(args.data)[0], recipe.held_out)
        held = held.take(np.arange(min(args.eval_rows or len(held.length), len(held.length))))
        models = {"mean": load(drafter_dir)} | {d: load(Path(d)) for d in args.drafter}
        taps = models["mean"].config.taps
        log(f"held-out: {len(held.length)} rows, {len(models)} drafters")
        held_out = {"data": args.data, "rows": f"the first {len(held.length)} of {recipe.held_out} held-out rows",
                    "labels": recipe.labels,
                    "drafters": evaluate(models, TrainTarget(loaded), held, taps, recipe.gamma, recipe.labels)}
    receipt = {
        "schema": 1,
        "what": f"mean of exported {kind} drafters' float32 weights (tools/train_drafter average)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m train_drafter", *sys.argv[1:]]),
        **_source(),
        "sources": [{"path": d, "files": _files(Path(d))} for d in args.drafter],
        "source_receipts": {r: json.loads(Path(r).read_text()) for r in args.receipts or []},
        "held_out": held_out,
        "files": _files(drafter_dir),
    }
    (out / "receipt.json").write_text(json.dumps(receipt, indent=2, sort_keys=True) + "\n")
    log(f"wrote {out / 'receipt.json'} and {drafter_dir}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train_drafter", description=__doc__)
    ap.add_argument("command", choices=("data", "train", "all", "probe", "average"))
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="smollm2")
    ap.add_argument("--target", default="default", help="'default' or a checkpoint path (llama)")
    ap.add_argument("--out", default="out/train-drafter", help="folder for drafter/ and receipt.json")
    ap.add_argument("--data", nargs="+", help="sequences .npz: written by data/all (one), read by train (one or more)")
    ap.add_argument("--stdlib", help="Python standard library folder for prompts (default: this Python's)")
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--mix", type=mix_arg, help="data: prompt kinds and shares, KIND=SHARE,... (default: the recipe's)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--gen-batch", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--held-out", type=int, help="greedy sequences kept out of training")
    ap.add_argument("--new-tokens", type=int, help="reply tokens a prompt")
    ap.add_argument("--layers", type=int, help="drafter layers (more than --init's: grown from it)")
    ap.add_argument("--bits", type=int, choices=(0, 4, 5, 6, 8), help="stored bits of the matrices (0: bf16)")
    ap.add_argument("--lr", type=float, help="peak learning rate (lower when continuing a trained drafter)")
    ap.add_argument("--gen-dtype", choices=("float32", "bfloat16"), help="dtype the replies are generated in")
    ap.add_argument("--labels", choices=("target", "replies"),
                    help="train on the float32 target's own choices (default) or on the reply tokens")
    ap.add_argument("--logits-dtype", choices=("float32", "bfloat16"),
                    help="dtype of training's lm_head product (the softmax stays float32); evaluation is float32")
    ap.add_argument("--time-budget", type=float, help="seconds of training; steps shrink to fit")
    ap.add_argument("--deadline", type=float, help="seconds the whole command may take (sets the training budget)")
    ap.add_argument("--no-compile", action="store_true", help="train without mx.compile")
    ap.add_argument("--selector-rank", type=int, help="DFlash2: the selector's rank (another than --init's starts a fresh selector)")
    ap.add_argument("--trains", choices=("all", "selector"),
                    help="selector: train only a DFlash2 drafter's selector, its body as --init stores it")
    ap.add_argument("--init", help="train: start from this exported drafter (this recipe's, or one with fewer layers, grown) instead of random weights")
    ap.add_argument("--drafter", nargs="+", help="probe: drafter folders, each probed in turn; average: those to average")
    ap.add_argument("--probes", default="dflash_bench/prompts/probes.json", help="probe: prompt set")
    ap.add_argument("--eval-rows", type=int, help="average: score on only the first N held-out rows of --data")
    ap.add_argument("--receipts", nargs="+", help="average: the sources' training receipts, embedded in its receipt")
    ap.add_argument("--tokens", type=int, default=256, help="probe: tokens a reply")
    args = ap.parse_args(argv)
    if args.command in ("probe", "average"):
        if not args.drafter:
            ap.error(f"{args.command} needs --drafter")
        if args.command == "probe":
            cmd_probe(args)
        else:
            cmd_average(args, recipe_from(args))
        return
    if args.command in ("data", "all") and args.data and len(args.data) > 1:
        ap.error(f"{args.command} writes one --data file, not {len(args.data)}")
    recipe = recipe_from(args)
    if recipe.trains == "selector" and not (recipe.shape.variant == "dflash2" and args.init):
        ap.error("--trains selector needs a DFlash2 recipe and --init naming the drafter whose body it keeps")
    loaded = load_target(args.target)
    generates = args.command in ("data", "all")  # `train` reads replies: no generation copy to build
    target = TrainTarget(loaded, gen_dtype=getattr(mx, recipe.gen_dtype) if generates else None)
    log(f"target {loaded.path.name} on {mx.default_device()}")
    if args.command in ("data", "all"):
        seqs, summary = cmd_data(args, recipe, target, loaded)
        if args.command == "data":
            return
    else:
        if not args.data:
            ap.error("train needs --data")
        seqs, summary = load_data(args.data)
    receipt = cmd_train(args, recipe, target, loaded, seqs, summary)
    path = Path(args.out) / "receipt.json"
    path.write_text(json.dumps(receipt, indent=2, sort_keys=True) + "\n")
    log(f"wrote {path} and {Path(args.out) / 'drafter'}")


if __name__ == "__main__":
    main()
