"""cancel: a cancelled request changes nothing for any other request, then or later.

Two reference probes first; then each step (a drafting stream dropped mid-reply, a long prompt
dropped mid-prefill, a drafting stream dropped beside a running probe, a request past the window)
is followed by both probes again, which must equal their references, and a memory reading that
must be back at its baseline.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.client import ACTIVE_MEMORY_METRIC, Record, Request
from dflash_bench.checks.prefill import NoTokenizer, lighthouse_ids
from dflash_bench.checks.runner import NO_HASH, Context
from dflash_bench.engine.constants import MIB

CHECK = "cancel_changes_nothing"


@dataclass
class CancelSettings:
    probe_tokens: int = 128
    drop_after_tokens: int = 16
    drop_max_tokens: int = 512
    prefill_tokens: int = 6000
    drop_after_seconds: float = 0.5
    memory_tolerance_bytes: int = MIB


class _Steps:
    def __init__(self, ctx: Context, s: CancelSettings, draft: bool | None) -> None:
        self.ctx, self.s, self.draft = ctx, s, draft
        probes = prompt_sets.probes()
        self.probes = [probes["code"], probes["chat"]]
        self.refs: list[Record] = []
        self.baseline: float | None = None
        self.rows: list[dict] = []

    def probe(self, i: int, step: str) -> Record:
        req = self.probes[i].request(draft=self.draft, max_tokens=self.s.probe_tokens)
        return self.ctx.send(req, step=step, probe=i)

    def memory(self) -> float | None:
        return self.ctx.client.metric(ACTIVE_MEMORY_METRIC)

    def references(self) -> None:
        self.refs = [self.probe(0, "reference"), self.probe(1, "reference")]
        for ref in self.refs:
            if ref.status != "ok":
                self.ctx.receipt.fail(CHECK, "reference", f"reference probe {ref.prompt_id}: {ref.status}: {ref.error}")
        self.baseline = self.memory()
        self.rows.append({"step": "reference", "memory_bytes": self.baseline,
                          "probes": [r.token_sha for r in self.refs]})
        self.ctx.reached("reference")

    def after(self, step: str, note: str = "") -> None:
        """Both probes again, each equal to its reference; then memory back at baseline."""
        row = {"step": step, "note": note, "probes": []}
        for i in range(2):
            rec = self.probe(i, f"after {step}")
            cmp = self.ctx.expect_equal(CHECK, f"after {step}", rec, self.refs[i],
                                        f"probe {rec.prompt_id} and its reference")
            row["probes"].append({"token_sha": rec.token_sha, "equal": cmp.equal})
        row["memory_bytes"] = mem = self.memory()
        if self.baseline is not None and mem is not None and mem > self.baseline + self.s.memory_tolerance_bytes:
            self.ctx.receipt.fail("memory_returns_to_baseline", step,
                                  f"after {step}: active memory {mem:.0f} bytes, baseline {self.baseline:.0f} "
                                  f"(+{mem - self.baseline:.0f} > tolerance {self.s.memory_tolerance_bytes})")
        self.rows.append(row)
        self.ctx.reached(step)

    def dropping_stream(self) -> Request:
        return self.probes[1].request(draft=self.draft, max_tokens=self.s.drop_max_tokens, stream=True)

    def drop_mid_reply(self) -> None:
        rec = self.ctx.keep(self.ctx.client.send(self.dropping_stream(), drop_after_tokens=self.s.drop_after_tokens),
                            step="drop mid-reply")
        note = "" if rec.status == "dropped" else f"stream ended before the drop ({rec.status})"
        self.after("drop mid-reply", note)

    def drop_mid_prefill(self, context: int | None) -> None:
        size = self.s.prefill_tokens if context is None else min(self.s.prefill_tokens, context - 16)
        ids = lighthouse_ids(self.ctx.client, size)[:size]
        req = Request(prompt_id=f"lighthouse-{size}", prompt=ids, max_tokens=16, draft=self.draft, stream=True)
        rec = self.ctx.keep(self.ctx.client.send(req, drop_after_seconds=self.s.drop_after_seconds),
                            step="drop mid-prefill")
        note = ""
        if rec.ttft is not None:
            note = f"the first token came after {rec.ttft:.2f} s, before the drop: dropped after prefill"
            self.ctx.receipt.warn(CHECK, "drop mid-prefill", note + " (raise --prefill-tokens)")
        self.after("drop mid-prefill", note)

    def drop_beside_probe(self) -> None:
        holder: dict = {}

        def run_probe() -> None:
            try:
                holder["rec"] = self.ctx.client.send(
                    self.probes[0].request(draft=self.draft, max_tokens=self.s.probe_tokens, stream=True))
            except Exception as err:  # re-raised in the main thread below
                holder["err"] = err

        thread = threading.Thread(target=run_probe, daemon=True)
        thread.start()
        dropped = self.ctx.client.send(self.dropping_stream(), drop_after_tokens=self.s.drop_after_tokens)
        thread.join()
        self.ctx.keep(dropped, step="drop beside a probe")
        if "err" in holder:
            raise holder["err"]
        rec = self.ctx.keep(holder["rec"], step="drop beside a probe", probe=0)
        self.ctx.expect_equal(CHECK, "drop beside a probe", rec, self.refs[0],
                              f"probe {rec.prompt_id} running beside the drop and its reference")
        self.after("drop beside a probe")

    def past_window(self, context: int) -> None:
        ids = lighthouse_ids(self.ctx.client, context + 1)[: context + 1]
        req = Request(prompt_id=f"past-window-{context + 1}", prompt=ids, max_tokens=16, draft=self.draft)
        rec = self.ctx.send(req, step="past the window")
        if rec.http_status != 400 or "context_length_exceeded" not in (rec.error or ""):
            self.ctx.receipt.fail("past_window_refused", "past the window",
                                  f"a {context + 1}-token prompt with context {context}: expected HTTP 400 "
                                  f"context_length_exceeded, got {rec.http_status or 200} {rec.error or rec.status}")
        self.after("past the window")


def run(ctx: Context, s: CancelSettings) -> None:
    caps = ctx.capabilities()
    if not caps.hashes:
        ctx.receipt.skip(CHECK, NO_HASH)
        return
    steps = _Steps(ctx, s, True if caps.dflash else None)
    ctx.receipt.aggregates["steps"] = steps.rows  # filled as it goes, so a cut-short run keeps its steps
    advance = ctx.task("cancel", 5)
    ctx.plan(CHECK, ["reference", "drop mid-reply", "drop mid-prefill", "drop beside a probe", "past the window"])
    steps.references()
    if steps.baseline is None:
        ctx.receipt.skip("memory_returns_to_baseline", f"the server's /metrics has no {ACTIVE_MEMORY_METRIC}")
    advance()
    steps.drop_mid_reply()
    advance()
    context = (ctx.receipt.server.get("health") or {}).get("context")
    try:
        steps.drop_mid_prefill(context)
    except NoTokenizer as err:
        ctx.receipt.skip("drop_mid_prefill", str(err))
        ctx.reached("drop mid-prefill")
    advance()
    steps.drop_beside_probe()
    advance()
    if context is None:
        ctx.receipt.skip("past_window_refused", "GET /health does not report the server's context")
        ctx.reached("past the window")
    else:
        try:
            steps.past_window(int(context))
        except NoTokenizer as err:
            ctx.receipt.skip("past_window_refused", str(err))
            ctx.reached("past the window")
    advance()
