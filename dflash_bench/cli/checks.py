"""The check commands: exactness, concurrent, resume, cancel, stress, decode, prefill, suite.

Each check runs against --url, or starts the bundled server (`dflash-bench serve`) on a free
loopback port and stops it after; writes a receipt (receipts/<command>-<UTC stamp>.json unless
--out), prints its table (or the receipt with --json). Exit codes: 0 passed, 1 a check failed,
2 incomplete (cut short, or something not run or unverified), 130 interrupted.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from dflash_bench.checks import cancel as cancel_check
from dflash_bench.checks import concurrent as concurrent_check
from dflash_bench.checks import decode as decode_check
from dflash_bench.checks import exactness as exactness_check
from dflash_bench.checks import prefill as prefill_check
from dflash_bench.checks import resume as resume_check
from dflash_bench.checks import stress as stress_check
from dflash_bench.checks import tables
from dflash_bench.checks.lifecycle import receipt_run
from dflash_bench.checks.receipt import Receipt, canonical_json, exit_code, utc_stamp
from dflash_bench.checks.runner import RunSpec, run_check
from dflash_bench.checks.server import ServeSettings
from dflash_bench.cli import app
from dflash_bench.engine.constants import MIB

SERVER = "Bundled server (ignored with --url)"
OUTPUT = "Output"

Url = Annotated[Optional[str], typer.Option(help="Check a running OpenAI-compatible server instead of starting "
                                                 "the bundled one.", rich_help_panel=SERVER)]
PlainUrl = Annotated[Optional[str], typer.Option(
    help="Two-server mode: a server of the same model and settings without speculative decoding; every "
         "request also goes there and the replies are compared token for token with --url's (any engine).")]
TokenizerPath = Annotated[Optional[str], typer.Option(
    "--tokenizer", help="The model's folder or GGUF, to re-tokenize replies of a server that returns only "
                        "text and has no tokenize endpoint (the receipt then marks its evidence as text-level).")]
Target = Annotated[str, typer.Option(help="Target for the bundled server.", rich_help_panel=SERVER)]
Drafter = Annotated[Optional[str], typer.Option(help="Drafter folder, or a shipped drafter's name ('dflash', 'dflash2'), "
                                                     "for the bundled server (default: the target's shipped v1 "
                                                     "drafter; 'none': serve without one).",
                                                rich_help_panel=SERVER)]
Parallel = Annotated[Optional[int], typer.Option(help="Streams (--parallel) for the bundled server.",
                                                 rich_help_panel=SERVER)]
ContextSize = Annotated[Optional[int], typer.Option(help="Context (--context) for the bundled server.",
                                                rich_help_panel=SERVER)]
Cache = Annotated[Optional[float], typer.Option("--prompt-cache-gib", help="Prompt cache for the bundled server.",
                                                rich_help_panel=SERVER)]
Bits = Annotated[Optional[int], typer.Option(help="--drafter-bits for the bundled server.", rich_help_panel=SERVER)]
Backend = Annotated[Optional[str], typer.Option(help="--backend for the bundled server: auto (the default device's), "
                                                     "cpu (float32) or gpu (packed weights, bf16).",
                                                rich_help_panel=SERVER)]
VerifyBudgetOpt = Annotated[Optional[str], typer.Option(
    "--verify-budget", help="--verify-budget for the bundled server: fixed (a full block a round) or auto.",
    rich_help_panel=SERVER)]
TreeNodes = Annotated[Optional[int], typer.Option(
    "--tree-nodes", min=0, help="--tree-nodes for the bundled server: draft trees of N nodes a round (0: chains).",
    rich_help_panel=SERVER)]
Startup = Annotated[float, typer.Option(help="Seconds to wait for the bundled server's /health to say ready.",
                                        rich_help_panel=SERVER)]
Timeout = Annotated[float, typer.Option(help="Seconds one request may take.", rich_help_panel=SERVER)]
Out = Annotated[Optional[Path], typer.Option(help="Receipt path (default receipts/<command>-<UTC stamp>.json).",
                                             rich_help_panel=OUTPUT)]
Json = Annotated[bool, typer.Option("--json", help="Print the receipt as JSON instead of a table.",
                                    rich_help_panel=OUTPUT)]
Levels = Annotated[str, typer.Option(help="Stream counts, comma-separated.")]
Tokens = Annotated[int, typer.Option(help="Tokens each reply decodes (max_tokens, ignore_eos).")]
Reps = Annotated[int, typer.Option(help="Repetitions of each cell.")]


def numbers(value: str, option: str, kind: type = int, low: float = 1) -> tuple:
    """A comma-separated option (`--levels 1,4`, `--temperatures 0,0.7`) as a tuple, each at least `low`."""
    name = "integers" if kind is int else "numbers"
    try:
        out = tuple(kind(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise typer.BadParameter(f"{option} {value!r}: expected comma-separated {name} such as "
                                 f"{'1,4' if kind is int else '0,0.7'}") from None
    if not out or min(out) < low:
        raise typer.BadParameter(f"{option} {value!r}: expected {name} >= {low:g}")
    return out


def ints(value: str, option: str) -> tuple[int, ...]:
    return numbers(value, option, int, 1)


def floats(value: str, option: str) -> tuple[float, ...]:
    return numbers(value, option, float, 0)


def default_out(kind: str) -> Path:
    return Path("receipts") / f"{kind}-{utc_stamp()}.json"


def serve_settings(given: tuple, **defaults) -> ServeSettings:
    """The bundled server's settings from (target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend,
    verify_budget, tree_nodes): what was given, else the check's own defaults, else the server's."""
    names = ("target", "drafter", "parallel", "context", "prompt_cache_gib", "drafter_bits", "backend", "verify_budget",
             "tree_nodes")
    return ServeSettings(**{k: v if v is not None else defaults.get(k) for k, v in zip(names, given)})


def local_tokenizer(path: str | None) -> Callable[[str], list[int]] | None:
    """--tokenizer read here, or a one-line error naming it."""
    if path is None:
        return None
    try:
        return prefill_check.LocalTokenizer(path).tokenize
    except (DFlashBenchError, OSError, ValueError, KeyError) as err:
        raise typer.BadParameter(f"--tokenizer {path}: cannot read a tokenizer there ({err})") from None


def two_servers(url: str | None, plain_url: str | None) -> None:
    if plain_url and not url:
        raise typer.BadParameter("--plain-url needs --url (the server that drafts)")
    if plain_url and url and plain_url.rstrip("/") == url.rstrip("/"):
        raise typer.BadParameter(f"--plain-url {plain_url} is --url itself: two-server mode needs two servers")


def execute(kind: str, out: Path | None, url: str | None, serve: ServeSettings, startup: float, timeout: float,
            settings, body: Callable, json_out: bool, plain_url: str | None = None,
            tokenizer: str | None = None) -> None:
    """Runs one check, prints its table (or JSON) and exits with its code."""
    two_servers(url, plain_url)
    spec = RunSpec(kind=kind, out=out or default_out(kind), url=url, serve=serve, startup_timeout=startup,
                   request_timeout=timeout, plain_url=plain_url, tokenizer=local_tokenizer(tokenizer))
    receipt, code = run_check(spec, asdict(settings), lambda ctx: body(ctx, settings))
    report(receipt, spec.out, json_out)
    raise typer.Exit(code)


def report(receipt: Receipt, path: Path, json_out: bool) -> None:
    if json_out:
        typer.echo(canonical_json(receipt.to_dict()), nl=False)
        return
    console = tables.console()
    console.print(tables.render(receipt))
    console.print(f"receipt: {path}", style="dim")


@app.command(rich_help_panel="Checks")
def exactness(url: Url = None, plain_url: PlainUrl = None, tokenizer: TokenizerPath = None, target: Target = "default", drafter: Drafter = None, parallel: Parallel = None,
              context: ContextSize = None, prompt_cache_gib: Cache = None, drafter_bits: Bits = None, backend: Backend = None, verify_budget: VerifyBudgetOpt = None, tree_nodes: TreeNodes = None,
              startup_timeout: Startup = 600.0, timeout: Timeout = 600.0, out: Out = None, json_out: Json = False,
              known_tokens: int = 64, probe_tokens: int = 256, long_tokens: int = 256,
              window: Annotated[int, typer.Option(help="The drafter's sliding window: long prompts must pass it.")] = 512):
    """Drafted equals `"draft": false`, token for token: known-answer prompts, code and chat probes, long prompts."""
    s = exactness_check.ExactnessSettings(known_tokens, probe_tokens, long_tokens, window)
    execute("exactness", out, url, serve_settings((target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend, verify_budget, tree_nodes)),
            startup_timeout, timeout, s, exactness_check.run, json_out, plain_url, tokenizer)


@app.command(rich_help_panel="Checks")
def concurrent(url: Url = None, plain_url: PlainUrl = None, tokenizer: TokenizerPath = None, target: Target = "default", drafter: Drafter = None, parallel: Parallel = None,
               context: ContextSize = None, prompt_cache_gib: Cache = None, drafter_bits: Bits = None, backend: Backend = None, verify_budget: VerifyBudgetOpt = None, tree_nodes: TreeNodes = None,
               startup_timeout: Startup = 600.0, timeout: Timeout = 600.0, out: Out = None, json_out: Json = False,
               levels: Levels = "1,4", tokens: Tokens = 256, reps: Reps = 3,
               temperatures: Annotated[str, typer.Option(help="Temperatures, comma-separated (seeded).")] = "0,0.7",
               alone: Annotated[bool, typer.Option(help="Each concurrent reply must equal its solo reply.")] = True,
               serial: Annotated[bool, typer.Option(help="Each solo drafted reply must equal draft:false.")] = True,
               seed: int = 1234):
    """Concurrent equals solo: every stream's reply is what it is alone (and, --serial, what draft:false gives)."""
    lv = ints(levels, "--levels")
    s = concurrent_check.ConcurrentSettings(lv, tokens, reps, floats(temperatures, "--temperatures"), alone, serial,
                                            seed)
    execute("concurrent", out, url,
            serve_settings((target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend, verify_budget, tree_nodes), parallel=max(lv)),
            startup_timeout, timeout, s, concurrent_check.run, json_out, plain_url, tokenizer)


@app.command(rich_help_panel="Checks")
def resume(url: Url = None, plain_url: PlainUrl = None, tokenizer: TokenizerPath = None, target: Target = "default", drafter: Drafter = None, parallel: Parallel = None,
           context: ContextSize = None, prompt_cache_gib: Cache = None, drafter_bits: Bits = None, backend: Backend = None, verify_budget: VerifyBudgetOpt = None, tree_nodes: TreeNodes = None,
           startup_timeout: Startup = 600.0, timeout: Timeout = 600.0, out: Out = None, json_out: Json = False,
           tokens: Tokens = 256,
           prompt: Annotated[Optional[str], typer.Option(help="Long prompt id (default: the longest).")] = None):
    """Resumed equals fresh: a long prompt twice with the prompt cache on (bundled server: 1 GiB)."""
    s = resume_check.ResumeSettings(tokens, prompt)
    execute("resume", out, url,
            serve_settings((target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend, verify_budget, tree_nodes), prompt_cache_gib=1.0),
            startup_timeout, timeout, s, resume_check.run, json_out, plain_url, tokenizer)


@app.command(rich_help_panel="Checks")
def cancel(url: Url = None, target: Target = "default", drafter: Drafter = None, parallel: Parallel = None,
           context: ContextSize = None, prompt_cache_gib: Cache = None, drafter_bits: Bits = None, backend: Backend = None, verify_budget: VerifyBudgetOpt = None, tree_nodes: TreeNodes = None,
           startup_timeout: Startup = 600.0, timeout: Timeout = 600.0, out: Out = None, json_out: Json = False,
           probe_tokens: int = 128, drop_after_tokens: int = 16,
           prefill_tokens: Annotated[int, typer.Option(help="Size of the prompt dropped mid-prefill.")] = 6000,
           drop_after_seconds: Annotated[float, typer.Option(help="When the mid-prefill drop happens.")] = 0.5,
           memory_tolerance_mib: Annotated[float, typer.Option(help="Active memory allowed above baseline.")] = 1.0):
    """Cancellation changes nothing: drops mid-reply, mid-prefill, beside a probe, and a refusal past the window."""
    s = cancel_check.CancelSettings(probe_tokens, drop_after_tokens, 512, prefill_tokens, drop_after_seconds,
                                    int(memory_tolerance_mib * MIB))
    execute("cancel", out, url,
            serve_settings((target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend, verify_budget, tree_nodes), parallel=2,
                           prompt_cache_gib=0, context=8192),
            startup_timeout, timeout, s, cancel_check.run, json_out)


@app.command(rich_help_panel="Checks")
def stress(url: Url = None, target: Target = "default", drafter: Drafter = None, parallel: Parallel = None,
           context: ContextSize = None, prompt_cache_gib: Cache = None, drafter_bits: Bits = None, backend: Backend = None, verify_budget: VerifyBudgetOpt = None, tree_nodes: TreeNodes = None,
           startup_timeout: Startup = 600.0,
           timeout: Annotated[float, typer.Option(help="Seconds one request may take: longer is a hang, which fails.",
                                                  rich_help_panel=SERVER)] = 120.0,
           out: Out = None, json_out: Json = False,
           requests: Annotated[int, typer.Option(min=1, help="Requests in the load.")] = 500,
           concurrency: Annotated[int, typer.Option(min=1, help="Requests in flight at once.")] = 8,
           drop_fraction: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of requests the client hangs "
                                                        "up on, at a random time, streamed or not.")] = 0.5,
           seed: Annotated[int, typer.Option(help="Seeds the draw of every request (lengths, modes, hang-ups).")] = 1234,
           min_tokens: Annotated[int, typer.Option(min=1, help="Smallest max_tokens drawn.")] = 1,
           max_tokens: Annotated[int, typer.Option(min=1, help="Largest max_tokens drawn (64 keeps the default "
                                                   "model's 500 requests to about 16 minutes on 2 CPU cores).")] = 64,
           max_prompt_words: Annotated[int, typer.Option(min=1, help="Longest prompt drawn, in words.")] = 300,
           drop_within: Annotated[float, typer.Option(help="Hang-ups come at a time drawn from 0.05 s to this.")] = 4.0,
           probe_tokens: Annotated[int, typer.Option(help="max_tokens of the reference probes.")] = 32,
           time_limit: Annotated[float, typer.Option(help="No request is sent after this many seconds of load.")]
           = 1800.0,
           memory_tolerance_mib: Annotated[float, typer.Option(help="Active memory allowed above baseline.")] = 1.0):
    """Load with random hang-ups changes nothing: N requests at a concurrency, random lengths, draft on/off, a share dropped by the client; probes unchanged, memory back at baseline, no 5xx, no hang.

    Each request draws from --seed: chat or raw completion, a prompt of 1..--max-prompt-words words, max_tokens in --min-tokens..--max-tokens (ignore_eos), streamed or not, drafted or not, greedy or sampled, and (a --drop-fraction of them) a hang-up time. The bundled server runs with --parallel 4, --context 2048 and no prompt cache unless given.

    Hang-ups come 0.05 s to --drop-within after sending: with 8 in flight on 4 streams most land while a request waits for a stream or is in prefill (receipts/stress-default.json: all 246 before the first token); a larger --drop-within reaches decode too.
    """
    s = stress_check.StressSettings(requests, concurrency, drop_fraction, seed, min_tokens, max_tokens,
                                    max_prompt_words, drop_within, probe_tokens, time_limit,
                                    memory_tolerance_bytes=int(memory_tolerance_mib * MIB))
    if s.min_tokens > s.max_tokens:
        raise typer.BadParameter(f"--min-tokens {min_tokens} is above --max-tokens {max_tokens}")
    execute("stress", out, url,
            serve_settings((target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend, verify_budget, tree_nodes), parallel=4,
                           prompt_cache_gib=0, context=2048),
            startup_timeout, timeout, s, stress_check.run, json_out)


@app.command(rich_help_panel="Benchmarks")
def decode(url: Url = None, target: Target = "default", drafter: Drafter = None, parallel: Parallel = None,
           context: ContextSize = None, prompt_cache_gib: Cache = None, drafter_bits: Bits = None, backend: Backend = None, verify_budget: VerifyBudgetOpt = None, tree_nodes: TreeNodes = None,
           startup_timeout: Startup = 600.0, timeout: Timeout = 600.0, out: Out = None, json_out: Json = False,
           levels: Levels = "1,4", tokens: Tokens = 256, reps: Reps = 3):
    """Decode speed, drafted and plain side by side: single-stream and aggregate tok/s, tokens a round, footprint."""
    lv = ints(levels, "--levels")
    s = decode_check.DecodeSettings(lv, tokens, reps)
    execute("decode", out, url,
            serve_settings((target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend, verify_budget, tree_nodes), parallel=max(lv),
                           prompt_cache_gib=0),
            startup_timeout, timeout, s, decode_check.run, json_out)


@app.command(rich_help_panel="Benchmarks")
def prefill(url: Url = None, target: Target = "default", drafter: Drafter = None, parallel: Parallel = None,
            context: ContextSize = None, prompt_cache_gib: Cache = None, drafter_bits: Bits = None, backend: Backend = None, verify_budget: VerifyBudgetOpt = None, tree_nodes: TreeNodes = None,
            startup_timeout: Startup = 600.0, timeout: Timeout = 600.0, out: Out = None, json_out: Json = False,
            sizes: Annotated[str, typer.Option(help="Exact prompt sizes in tokens, comma-separated.")] = "512,2048,8192",
            rounds: Annotated[int, typer.Option(help="Rounds over the sizes (after one warm-up).")] = 3,
            tokenizer: Annotated[Optional[str], typer.Option(
                help="The model's folder or GGUF, to make the arrays here when the server has no /tokenize "
                     "(e.g. mlx_lm.server); they are sent as text.")] = None):
    """Cold prefill speed at exact token counts (cached_tokens must be 0), drafted and plain serve."""
    sz = ints(sizes, "--sizes")
    s = prefill_check.PrefillSettings(sz, rounds, tokenizer=tokenizer)
    execute("prefill", out, url,
            serve_settings((target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend, verify_budget, tree_nodes), parallel=1,
                           prompt_cache_gib=0, context=max(sz) + 64),
            startup_timeout, timeout, s, prefill_check.run, json_out)


@app.command(rich_help_panel="Benchmarks")
def suite(url: Url = None, target: Target = "default", drafter: Drafter = None, parallel: Parallel = None,
          context: ContextSize = None, prompt_cache_gib: Cache = None, drafter_bits: Bits = None, backend: Backend = None, verify_budget: VerifyBudgetOpt = None, tree_nodes: TreeNodes = None,
          startup_timeout: Startup = 600.0, timeout: Timeout = 600.0,
          out: Annotated[Optional[Path], typer.Option(help="Folder (default receipts/suite-<UTC stamp>/).")] = None,
          json_out: Json = False, levels: Levels = "1,4", tokens: Tokens = 256, reps: Reps = 3,
          sizes: str = "512,2048,8192", rounds: int = 3, temperatures: str = "0,0.7"):
    """Every check and benchmark in one run, a folder of receipts plus suite.json (stops at a Ctrl-C)."""
    folder = out or Path("receipts") / f"suite-{utc_stamp()}"
    lv, sz = ints(levels, "--levels"), ints(sizes, "--sizes")
    base = (target, drafter, parallel, context, prompt_cache_gib, drafter_bits, backend, verify_budget, tree_nodes)
    plan = [
        ("exactness", exactness_check.ExactnessSettings(), exactness_check.run, serve_settings(base)),
        ("concurrent", concurrent_check.ConcurrentSettings(lv, tokens, reps, floats(temperatures, "--temperatures")),
         concurrent_check.run, serve_settings(base, parallel=max(lv))),
        ("resume", resume_check.ResumeSettings(tokens), resume_check.run, serve_settings(base, prompt_cache_gib=1.0)),
        ("cancel", cancel_check.CancelSettings(), cancel_check.run,
         serve_settings(base, parallel=2, prompt_cache_gib=0, context=8192)),
        ("decode", decode_check.DecodeSettings(lv, tokens, reps), decode_check.run,
         serve_settings(base, parallel=max(lv), prompt_cache_gib=0)),
        ("prefill", prefill_check.PrefillSettings(sz, rounds), prefill_check.run,
         serve_settings(base, parallel=1, prompt_cache_gib=0, context=max(sz) + 64)),
    ]
    index = Receipt.new("suite", list(sys.argv), {"folder": str(folder), "checks": [p[0] for p in plan]})
    rows, codes = [], []
    index.aggregates["checks"] = rows

    def verdicts() -> None:
        for row in rows:
            if row["exit_code"] == 1:
                index.fail("suite", row["kind"], f"{row['kind']} failed ({row['receipt']})")
            elif row["exit_code"] != 0:
                index.unverify("suite", row["kind"], f"{row['kind']} did not pass ({row['receipt']})")

    with receipt_run(index, folder / "suite.json") as run:  # a SIGTERM between checks still writes suite.json
        run.before_write.append(verdicts)
        for kind, s, body, serve in plan:
            spec = RunSpec(kind=kind, out=folder / f"{kind}.json", url=url, serve=serve,
                           startup_timeout=startup_timeout, request_timeout=timeout)
            receipt, code = run_check(spec, asdict(s), lambda ctx, s=s, body=body: body(ctx, s))
            codes.append(code)
            rows.append({"kind": kind, "receipt": spec.out.name, "exit_code": code,
                         "result": "passed" if receipt.passed else "failed" if receipt.failures else "not passed"})
            if not json_out:
                report(receipt, spec.out, False)
            if code == 130:
                break
        index.finish(len(rows) == len(plan) and 130 not in codes,
                     None if len(rows) == len(plan) else "stopped early")
    report(index, folder / "suite.json", json_out)
    raise typer.Exit(exit_code(index, run.interrupted or 130 in codes))
