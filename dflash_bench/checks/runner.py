"""Runs one check: opens the server, hands the check a `Context`, and always writes the receipt.

Whatever stops a run (Ctrl-C, SIGTERM, the server dying, a timeout, a bug) the receipt is written,
marked incomplete with the reason (checks/lifecycle.py); the exit code says which (receipt.exit_code).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflash_bench.checks import pair
from dflash_bench.checks.adapters import EngineClient
from dflash_bench.checks.client import PEAK_MEMORY_METRIC, Client, Record, Request
from dflash_bench.checks.lifecycle import receipt_run
from dflash_bench.checks.receipt import Receipt
from dflash_bench.checks.server import ServeSettings, open_server
from dflash_bench.engine.errors import DFlashBenchError
from dflash_bench.engine.http_guard import API_KEY_ENV

NO_DFLASH = ("the server's replies carry no `dflash` block, so whether it honours `draft` is unknown "
             "(e.g. mlx_lm.server; --plain-url URL compares it with a server of the same model that does not draft)")
NO_HASH = "the server returns neither `dflash.token_sha` nor token ids, so replies cannot be compared"
NO_CACHED = "the server does not report usage.prompt_tokens_details.cached_tokens"


@dataclass
class Capabilities:
    """What the server's replies carry, seen on one small request."""

    dflash: bool
    token_ids: bool
    cached_tokens: bool
    drafter: str | None
    probe_error: str | None = None
    refused: str | None = None  # why the server will not draft (its self-check failed), from /health
    two_server: bool = False  # plain replies come from --plain-url (checks/pair.py), not from `draft: false`

    @property
    def hashes(self) -> bool:
        return self.dflash or self.token_ids

    @property
    def drafts(self) -> bool:
        """Whether `draft: true` can make the server draft, so drafted-vs-plain means something."""
        return (self.dflash or self.two_server) and self.refused is None


@dataclass
class Comparison:
    """Two replies compared: equal is None when they cannot be (a hash is missing)."""

    equal: bool | None
    index: int | None = None
    detail: str = ""


def compare_records(a: Record, b: Record) -> Comparison:
    """Token ids when both have them (names the first differing index), else the two token hashes."""
    for rec in (a, b):
        if rec.status != "ok":
            return Comparison(False, None, f"request {rec.status}: {rec.error}")
    if a.token_ids is not None and b.token_ids is not None:
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                return Comparison(False, i, f"first differing token at index {i} ({x} vs {y})")
        if len(a.token_ids) != len(b.token_ids):
            n = min(len(a.token_ids), len(b.token_ids))
            return Comparison(False, n, f"lengths differ ({len(a.token_ids)} vs {len(b.token_ids)} tokens)")
        return Comparison(True)
    if a.token_sha and b.token_sha:
        if a.token_sha == b.token_sha:
            return Comparison(True)
        return Comparison(False, None, f"token_sha {a.token_sha} vs {b.token_sha}")
    return Comparison(None, None, "no token hash or ids to compare")


@dataclass
class Context:
    """What a check works with: the client, the receipt being filled, the server, progress bars."""

    client: Client
    receipt: Receipt
    server: object
    progress: Progress
    out_path: Path
    caps: Capabilities | None = None
    extras: dict = field(default_factory=dict)
    pending: dict[str, str] = field(default_factory=dict)  # subject -> check, in the order planned
    plain: Client | None = None  # --plain-url's client in two-server mode (checks/pair.py)

    def capabilities(self) -> Capabilities:
        """Probes once with a tiny drafted request asking for token ids, and records what came back."""
        if self.caps is None:
            rec = self.send(Request("capability-probe", prompt="Hello", max_tokens=4, draft=True), step="probe")
            refused = (getattr(self.server, "health", None) or {}).get("drafting_refused")
            token_ids = rec.token_ids is not None
            if self.plain is not None:  # both servers must give tokens for a comparison to mean anything
                other = self.send_plain(Request("capability-probe", prompt="Hello", max_tokens=4, draft=False),
                                        step="probe")
                token_ids = token_ids and other.token_ids is not None
            self.caps = Capabilities(dflash=rec.has_dflash, token_ids=token_ids,
                                     cached_tokens=rec.cached_tokens is not None, drafter=rec.drafter,
                                     probe_error=None if rec.ok else rec.error, refused=refused,
                                     two_server=self.plain is not None)
            self.receipt.server["capabilities"] = vars(self.caps)
            if refused:  # drafted requests decode plainly: no drafted-vs-plain comparison may pass
                self.receipt.skip("drafting", f"the server refused to draft: {refused}")
            elif self.caps.dflash and self.caps.drafter is None and rec.ok and self.plain is None:
                self.receipt.warn("drafter", "server", "the server reports no drafter (dflash.drafter is null): "
                                  "drafted requests decode plainly, so drafted-vs-plain comparisons are trivial")
        return self.caps

    def keep(self, rec: Record, **labels) -> Record:
        rec.labels.update(labels)
        self.receipt.records.append(rec.to_dict())
        return rec

    def send(self, req: Request, **labels) -> Record:
        return self.keep(self.client.send(req), **labels)

    def send_plain(self, req: Request, **labels) -> Record:
        """The plain reply: from --plain-url in two-server mode, else `"draft": false` on the one server."""
        if self.plain is None:
            return self.send(req, **labels)
        return self.keep(self.plain.send(req), server="plain", **labels)

    def send_many(self, requests: list[Request], **labels) -> tuple[list[Record], float]:
        records, wall = self.client.send_many(requests)
        for i, rec in enumerate(records):
            self.keep(rec, stream_index=i, **labels)
        return records, wall

    def expect_equal(self, check: str, subject: str, a: Record, b: Record, what: str) -> Comparison:
        """Files a failure or an unverified entry unless a and b are the same tokens."""
        cmp = compare_records(a, b)
        if cmp.equal is False:
            self.receipt.fail(check, subject, f"{subject}: {what} differ: {cmp.detail}")
        elif cmp.equal is None:
            self.receipt.unverify(check, subject, f"{subject}: {what}: {cmp.detail}")
        return cmp

    def plan(self, check: str, subjects: list[str]) -> None:
        """Names the prompts or cells the check is about to run, so that a run cut short (the server
        dying, Ctrl-C) lists each one it never finished in not_run instead of naming nothing."""
        self.pending.update(dict.fromkeys(subjects, check))

    def reached(self, subject: str) -> None:
        """The subject's result is in the receipt (its row landed): it no longer counts as not run."""
        self.pending.pop(subject, None)

    def unreached(self, reason: str) -> None:
        """Files every planned subject not yet reached as not run, with why the run stopped."""
        for subject, check in self.pending.items():
            self.receipt.skip(check, f"{subject}: not reached ({reason})", subject)
        self.pending.clear()

    def task(self, description: str, total: int):
        """A progress bar; returns the function that advances it."""
        task_id = self.progress.add_task(description, total=total)
        return lambda n=1: self.progress.advance(task_id, n)


@dataclass
class RunSpec:
    """How to reach the server and where the receipt goes."""

    kind: str
    out: Path
    url: str | None = None
    plain_url: str | None = None  # two-server mode (checks/pair.py)
    tokenizer: Callable[[str], list[int]] | None = None  # re-tokenizes text-only replies (checks/adapters.py)
    serve: ServeSettings = field(default_factory=ServeSettings)
    startup_timeout: float = 600.0
    request_timeout: float = 600.0
    command: list[str] = field(default_factory=lambda: list(sys.argv))
    # The key requests carry: a server at --url may need one, and a managed server inherits the same
    # environment variable, so it requires exactly the key the client sends.
    api_key: str | None = field(default_factory=lambda: os.environ.get(API_KEY_ENV) or None)


def make_progress(console: Console | None = None) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console or Console(stderr=True), transient=True)


def run_check(spec: RunSpec, settings: dict, body: Callable[[Context], None],
              progress: Progress | None = None) -> tuple[Receipt, int]:
    """Runs `body` against the server and writes the receipt, complete or not (lifecycle.receipt_run);
    returns it and the exit code."""
    receipt = Receipt.new(spec.kind, spec.command, settings)
    progress = progress or make_progress()
    server = open_server(spec.url, spec.serve, spec.out.with_suffix(".server.log"), spec.startup_timeout)
    contexts: list[Context] = []

    def reason(err: BaseException) -> str:
        death = server.death() if isinstance(err, (httpx.HTTPError, DFlashBenchError)) else None
        return f"{type(err).__name__}: {err}" + (f"; {death}" if death else "")

    def before_write() -> None:
        if not receipt.server:
            receipt.server.update(server.describe())
        if server.managed and server.startup_line():
            receipt.server["startup_line"] = server.startup_line()
        if contexts and not receipt.complete:
            contexts[0].unreached(receipt.incomplete_reason or "the run stopped")

    with receipt_run(receipt, spec.out, (httpx.HTTPError, DFlashBenchError), reason) as run:
        run.before_write.append(before_write)
        with progress, server, contextlib.ExitStack() as stack:
            receipt.server.update(server.describe())
            health = server.health or {}
            receipt.server.update(target=health.get("model"), drafter=health.get("drafter"), dtype=health.get("dtype"),
                                  **{k: v for k, v in health.items() if k.endswith("sha256")})  # weight hashes
            if health.get("startup_line"):
                receipt.server["startup_line"] = health["startup_line"]
            if "selfcheck" in health:  # the serving machine's proof of the row rule (engine/selfcheck.py)
                receipt.environment["selfcheck"] = health["selfcheck"]
            client = EngineClient(server.url, spec.request_timeout, spec.api_key, spec.tokenizer)
            try:
                receipt.server["adapter"] = client.describe()
                client.pick_model(health)
                receipt.server["model"] = client.model
                plain = stack.enter_context(pair.plain_side(spec.plain_url, spec.request_timeout, spec.api_key,
                                                            receipt, spec.tokenizer))
                contexts.append(Context(client, receipt, server, progress, spec.out, plain=plain))
                body(contexts[0])
                _read_peak(client, receipt)
            finally:
                client.close()
    return receipt, run.code


def _read_peak(client: Client, receipt: Receipt) -> None:
    try:
        receipt.server["peak_memory_bytes"] = client.metric(PEAK_MEMORY_METRIC)
    except httpx.HTTPError:
        receipt.server["peak_memory_bytes"] = None
