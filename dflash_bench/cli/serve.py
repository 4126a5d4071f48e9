"""`dflash-bench serve TARGET`: the bundled engine behind an OpenAI-compatible server (loopback by default).

Startup order matters: the pre-load refusals run first, from the config files and the tensor headers
alone (engine/validate.py), so a drafter for another target or a broken checkpoint costs a one-line
error and no weight is read. Then the server listens (GET /health answers 503 "warming") while the
weights load in a thread; a weight found NaN or infinite there ends the server with its one line
before any request is served. Once they are in, /health answers "ready" and one startup line names
the target, the drafter kind, the streams and context, and the URL. Each reply then logs one line:
id, prompt, cached, tokens, token_sha, finish, rounds, accepted/drafted.

Who may use it (engine/http_guard.py): the Host header must name the bound address (loopback names
on loopback), with --api-key every path but /health needs `Authorization: Bearer KEY`, and binding
beyond loopback prints a warning line, louder without a key.
"""

from __future__ import annotations

from enum import Enum

import logging
import sys
import threading
import time
from typing import Annotated, Optional

import typer
import uvicorn

from dflash_bench.cli import app
from dflash_bench.engine import backend as backends
from dflash_bench.engine.constants import MIB
from dflash_bench.engine.defaults import chosen_drafter
from dflash_bench.engine.engine import Engine, Settings
from dflash_bench.engine.errors import DFlashBenchError
from dflash_bench.engine.http_guard import (
    API_KEY_ENV,
    BODY_BYTES_PER_TOKEN,
    Access,
    Hosts,
    default_body_limit,
    is_loopback,
)
from dflash_bench.engine.planner import PlanInputs, admit
from dflash_bench.engine.server import create_app, warm_up
from dflash_bench.engine.validate import check_checkpoints

SHUTDOWN_GRACE_SECONDS = 5


class VerifyBudget(str, Enum):
    fixed = "fixed"
    auto = "auto"


@app.command(rich_help_panel="Server")
def serve(
    target: Annotated[str, typer.Argument(help="'default' (SmolLM2-135M-Instruct), a .gguf file, or a checkpoint folder.")] = "default",
    drafter: Annotated[Optional[str], typer.Option(help="DFlash drafter folder, or a shipped drafter's name ('dflash', 'dflash2' for 'default'; default: "
                                                                "the target's shipped v1 drafter, if any; 'none': no drafter).")] = None,
    no_drafter: Annotated[bool, typer.Option("--no-drafter", help="Serve without a drafter (plain decode only).")] = False,
    parallel: Annotated[int, typer.Option(min=1, help="Streams that share rounds.")] = 4,
    context: Annotated[int, typer.Option(min=2, help="Tokens a stream holds: prompt plus max_tokens.")] = 4096,
    prompt_cache_gib: Annotated[float, typer.Option("--prompt-cache-gib", min=0.0, help="Prompt cache budget (0: off).")] = 0.0,
    drafter_bits: Annotated[int, typer.Option(help="Quantize the drafter's matrices to this many bits (0: keep them).")] = Settings.drafter_bits,
    backend: Annotated[str, typer.Option(help="Engine mode: auto (the default device's), cpu (float32) or gpu "
                                              "(packed quantized weights, bf16).")] = "auto",
    verify_budget: Annotated[VerifyBudget, typer.Option(
        help="Drafts a stream verifies a round: fixed (a full block) or auto (chosen each round from its recent "
             "acceptance and a cost model timed at load; never changes the output).")] = VerifyBudget.fixed,
    tree_nodes: Annotated[int, typer.Option(
        "--tree-nodes", min=0, help="Draft trees: each drafting stream verifies a tree of N draft nodes a round "
                                    "(with --verify-budget auto, of the budget's count); 0: chains. Dense targets "
                                    "(llama, qwen3); a qwen3_5 target drafts chains.")] = 0,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback unless you mean otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar=API_KEY_ENV, show_envvar=True,
                                                   help="Require 'Authorization: Bearer KEY' on every path but "
                                                        "/health (401 otherwise).")] = None,
    allowed_host: Annotated[Optional[list[str]], typer.Option(
        help="Another name clients reach the server by (a DNS name, a proxy's); repeatable. Other Host headers "
             "get 421 (the bound address and the loopback names are always allowed).")] = None,
    max_body_mib: Annotated[Optional[float], typer.Option(
        "--max-body-mib", min=0.001, help=f"Largest request body (413 beyond it). Default: sized from --context, "
                                          f"1 MiB + {BODY_BYTES_PER_TOKEN} bytes a context token.")] = None,
) -> None:
    """Serve TARGET (and its drafter) with an OpenAI-compatible API: /v1/completions, /v1/chat/completions,
    /health, /metrics, /tokenize, /detokenize."""
    try:  # the pre-load refusals and the memory plan, from the configs and tensor headers alone
        drafter = chosen_drafter(target, drafter, no_drafter)
        mode = backends.resolve(backend)
        tcfg, dcfg = check_checkpoints(target, drafter)
        decision = admit(PlanInputs(tcfg, dcfg, parallel, context, prompt_cache_gib, drafter_bits if dcfg else 0,
                                    backend=mode))
    except (DFlashBenchError, ValueError) as err:
        typer.echo(err.line() if isinstance(err, DFlashBenchError) else f"serve: {err}", err=True)
        raise typer.Exit(1) from None
    if decision.refused_reason:
        typer.echo(decision.line(), err=True)
        raise typer.Exit(1)
    _request_log()
    settings = Settings(parallel=decision.streams, context=context, prompt_cache_gib=prompt_cache_gib,
                        drafter_bits=drafter_bits, backend=mode.name, verify_budget=verify_budget.value,
                        tree_nodes=tree_nodes)
    if not is_loopback(host):
        guard = "clients need --api-key" if api_key else "no --api-key: anyone who reaches it can use the engine"
        typer.echo(f"warning: serving on {host}, beyond loopback; {guard}", err=True)
    body_bytes = round(max_body_mib * MIB) if max_body_mib is not None else default_body_limit(context)
    web = create_app(access=Access(Hosts.bound_to(host, tuple(allowed_host or ())), api_key or None, body_bytes))
    server = uvicorn.Server(uvicorn.Config(web, host=host, port=port, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS))
    url = f"http://{host}:{port}"
    loaded: list[Engine] = []
    failed: list[str] = []

    def load() -> None:
        try:
            engine = Engine(target, drafter, settings)
            warm_up(engine)
        except Exception as err:  # a load error ends the server with its one line
            failed.append(err.line() if isinstance(err, DFlashBenchError) else f"{type(err).__name__}: {err}")
            server.should_exit = True
            return
        engine.start()
        loaded.append(engine)
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        web.state.served.attach(engine)
        typer.echo(engine.startup_line(f", at {url}; {decision.line()}"))

    threading.Thread(target=load, name="dflash-load", daemon=True).start()
    server.run()
    for engine in loaded:
        engine.stop()
    if failed:
        typer.echo(failed[0], err=True)
        raise typer.Exit(1)
    if not server.started:
        raise typer.Exit(1)


def _request_log() -> None:
    """The per-reply lines go to stdout as plain text."""
    logger = logging.getLogger("dflash_bench.server")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
