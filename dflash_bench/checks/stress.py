"""stress: many requests at once with random hang-ups leave the server as they found it.

Reference probes first (the code probe and a known-answer prompt, greedy, ignore_eos, fixed
max_tokens), then the load: `requests` requests drawn up front from a seeded RNG (chat or raw
completion, prompt length, max_tokens, streamed or not, drafted or not, greedy or sampled), sent
`concurrency` at a time; a `drop_fraction` of them are hung up on by the client at a random time,
streamed or not. Then the probes again, which must equal their references, and the server's active
memory (the /metrics gauge cancel reads, checks/cancel.py) back at its baseline within the same
tolerance. Any 5xx, any request that hangs past the timeout, a transport error while the server
lives or a reply whose hash does not match its ids fails; 4xx replies are counted and warned.

The load is bounded: a fixed count, each request bounded by the request timeout, and no request is
sent after `time_limit` seconds (those are reported as not sent, so the run does not pass).
The server's resident memory is sampled through the load: from /proc for the bundled server (its
pid), else from /metrics' `process_resident_memory_bytes` where the server exposes it.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import httpx

from dflash_bench.checks import prompts as prompt_sets
from dflash_bench.checks.client import ACTIVE_MEMORY_METRIC, Record, Request
from dflash_bench.checks.receipt import percentiles
from dflash_bench.checks.runner import NO_HASH, Context
from dflash_bench.engine.constants import MIB

CHECK = "stress_changes_nothing"
RSS_METRIC = "process_resident_memory_bytes"  # the Prometheus client's name for it


@dataclass
class StressSettings:
    requests: int = 500
    concurrency: int = 8
    drop_fraction: float = 0.5
    seed: int = 1234
    min_tokens: int = 1
    max_tokens: int = 64
    max_prompt_words: int = 300
    drop_within: float = 4.0
    probe_tokens: int = 32
    time_limit: float = 1800.0
    settle_seconds: float = 60.0
    memory_tolerance_bytes: int = MIB


@dataclass
class Planned:
    """One load request and, for a dropped one, when the client hangs up."""

    request: Request
    hang_up_after: float | None


def draw(s: StressSettings, draft: bool) -> list[Planned]:
    """The whole load from the seed, before anything is sent, so a run is the same however it is scheduled."""
    rng = random.Random(s.seed)
    paragraph, sep = prompt_sets.prefill_paragraph()
    words = sep.join([paragraph] * (s.max_prompt_words // max(len(paragraph.split()), 1) + 2)).split()
    per = len(paragraph.split())
    out = []
    for i in range(s.requests):
        start, count = rng.randrange(per), rng.randint(1, s.max_prompt_words)
        text = " ".join(words[start:start + count])
        chat = rng.random() < 0.5
        sampled = rng.random() < 0.5
        req = Request(prompt_id=f"stress-{i}", prompt=None if chat else text,
                      messages=[{"role": "user", "content": text}] if chat else None,
                      max_tokens=rng.randint(s.min_tokens, s.max_tokens), temperature=0.7 if sampled else 0.0,
                      seed=rng.randrange(1 << 31) if sampled else None,
                      draft=(rng.random() < 0.5) if draft else None, stream=rng.random() < 0.5)
        hang_up = rng.uniform(0.05, s.drop_within) if rng.random() < s.drop_fraction else None
        out.append(Planned(req, hang_up))
    return out


def error_kind(rec: Record, timeout: float) -> str | None:
    """None for a reply that came whole or was dropped by us; else what went wrong, as a counter key."""
    if rec.status == "dropped":
        return None
    if rec.elapsed is not None and rec.elapsed > timeout:
        return "timeout"
    if rec.status == "ok":
        return None
    if rec.http_status is not None:
        return f"http {rec.http_status}"
    return "error in the stream" if rec.status == "error" else rec.status


def _proc_status(pid: int, field: str) -> float | None:
    """VmRSS / VmHWM of a process in bytes (Linux /proc), None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class RssSampler:
    """The server's resident memory now and its peak while sampling (a thread reads it every 0.2 s)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        proc = getattr(ctx.server, "proc", None)
        self.pid: int | None = proc.pid if proc is not None else None
        self.source = "/proc (the bundled server's pid)" if self.pid else f"/metrics {RSS_METRIC}"
        self.peak: float | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def read(self) -> float | None:
        if self.pid is not None:
            value = _proc_status(self.pid, "VmRSS")
        else:
            try:
                value = self.ctx.client.metric(RSS_METRIC)
            except httpx.HTTPError:
                value = None
        if value is not None:
            self.peak = max(self.peak or 0.0, value)
        return value

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            self.read()

    def high_water(self) -> float | None:
        """The kernel's peak RSS over the process's life (model load included), bundled server only."""
        return _proc_status(self.pid, "VmHWM") if self.pid is not None else None


class _Load:
    """Sends the planned requests `concurrency` at a time and tallies them as they finish."""

    def __init__(self, ctx: Context, s: StressSettings, planned: list[Planned]) -> None:
        self.ctx, self.s, self.planned = ctx, s, planned
        self.timeout = ctx.client.timeout
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.deadline = 0.0  # set when the load starts
        self.records: list[Record] = []
        self.counts: dict = {"planned": len(planned), "drops_planned": sum(p.hang_up_after is not None for p in planned),
                             "sent": 0, "completed": 0, "dropped": 0, "not_sent": 0, "http_5xx": 0, "errors": {}}
        ctx.receipt.aggregates["counts"] = self.counts

    def one(self, i: int, p: Planned, advance) -> Record | None:
        if self.stopping.is_set() or time.monotonic() > self.deadline:
            return None
        with self.lock:
            self.counts["sent"] += 1
        try:
            rec = self.ctx.client.send(p.request, hang_up_after=p.hang_up_after)
        except httpx.TimeoutException as err:
            rec = self._failed(p, "timeout", f"{type(err).__name__}: no reply within {self.timeout:.0f} s")
        except httpx.HTTPError as err:
            if not self.ctx.server.alive():
                self.stopping.set()
                raise
            rec = self._failed(p, "transport", f"{type(err).__name__}: {err}")
        self._tally(i, p, rec)
        advance()
        return rec

    def _failed(self, p: Planned, status: str, error: str) -> Record:
        req = p.request
        return Record(prompt_id=req.prompt_id, endpoint=req.path, draft=req.draft, temperature=req.temperature,
                      seed=req.seed, max_tokens=req.max_tokens, stream=req.stream, status=status, error=error)

    def _tally(self, i: int, p: Planned, rec: Record) -> None:
        """Counts it, files a failure for what must not happen, and keeps its record (ids and text left out:
        the load's replies are not compared, their hashes are enough)."""
        kind = error_kind(rec, self.timeout)
        rec.token_ids, rec.text = None, ""
        with self.lock:
            self.records.append(rec)
            if rec.status == "dropped":
                self.counts["dropped"] += 1
            elif kind is None:
                self.counts["completed"] += 1
            else:
                self.counts["errors"][kind] = self.counts["errors"].get(kind, 0) + 1
            if rec.http_status is not None and rec.http_status >= 500:
                self.counts["http_5xx"] += 1
            self.ctx.keep(rec, phase="load", index=i, hang_up_after=p.hang_up_after)
        if kind is None:
            return
        message = f"{rec.prompt_id}: {kind}: {rec.error}"
        if kind.startswith("http 4"):
            self.ctx.receipt.warn(CHECK, rec.prompt_id, message)
        else:
            self.ctx.receipt.fail("no_5xx_no_hang" if kind == "timeout" or kind.startswith("http 5")
                                  else "no_errors", rec.prompt_id, message)

    def run(self) -> None:
        advance = self.ctx.task("stress", len(self.planned))
        self.deadline = time.monotonic() + self.s.time_limit
        pool = ThreadPoolExecutor(max_workers=self.s.concurrency)
        try:
            futures = [pool.submit(self.one, i, p, advance) for i, p in enumerate(self.planned)]
            for f in as_completed(futures):
                f.result()
        finally:
            self.stopping.set()
            pool.shutdown(wait=False, cancel_futures=True)
            with self.lock:
                self.counts["not_sent"] = len(self.planned) - self.counts["sent"]
            self._latency()
        if self.counts["not_sent"]:
            self.ctx.receipt.skip(CHECK, f"{self.counts['not_sent']} of {len(self.planned)} requests not sent: "
                                  f"the load passed --time-limit {self.s.time_limit:.0f} s", "load")

    def _latency(self) -> None:
        """Percentiles over the requests that came whole: TTFT of the streamed ones, total time of all."""
        with self.lock:
            whole = [r for r in self.records if r.status == "ok"]
            statuses = Counter(r.status for r in self.records)
        self.ctx.receipt.aggregates["latency"] = {
            "ttft_seconds": percentiles([r.ttft for r in whole if r.stream]),
            "total_seconds": percentiles([r.elapsed for r in whole]),
        }
        self.ctx.receipt.aggregates["statuses"] = dict(sorted(statuses.items()))


def _probes() -> list[prompt_sets.Prompt]:
    """The code probe and the first known-answer prompt: a raw completion and a chat, both replies known."""
    return [prompt_sets.probes()["code"], prompt_sets.known_answers()[0]]


def _settle(ctx: Context, s: StressSettings) -> None:
    """Waits (bounded) until the server reports no stream and no waiting request: dropped requests
    leave the engine at its next round, and the probes and the memory reading should not race them."""
    deadline = time.monotonic() + s.settle_seconds
    while time.monotonic() < deadline:
        values = ctx.client.metrics() or {}
        if not values.get("dflash_active_streams") and not values.get("dflash_waiting_requests"):
            return
        time.sleep(0.2)
    ctx.receipt.warn(CHECK, "settle", f"the server still reported running or waiting requests {s.settle_seconds:.0f} "
                     "s after the load")


def run(ctx: Context, s: StressSettings) -> None:
    caps = ctx.capabilities()
    draft = True if caps.dflash else None
    probes = _probes()
    ctx.plan(CHECK, ["reference probes", "load", "probes after", "memory after"])
    rss = RssSampler(ctx)
    rows: list[dict] = []
    memory: dict = {"tolerance_bytes": s.memory_tolerance_bytes}
    rss_row: dict = {"source": rss.source}
    ctx.receipt.aggregates.update(probes=rows, memory=memory, rss=rss_row)
    refs = [ctx.send(p.request(draft=draft, max_tokens=s.probe_tokens), phase="reference") for p in probes]
    for p, ref in zip(probes, refs):
        rows.append({"prompt_id": p.id, "reference": ref.token_sha, "after": None, "equal": None})
        if ref.status != "ok":
            ctx.receipt.fail(CHECK, "reference", f"reference probe {p.id}: {ref.status}: {ref.error}")
    memory["baseline_bytes"] = ctx.client.metric(ACTIVE_MEMORY_METRIC)
    rss_row["before_bytes"] = rss.read()
    ctx.reached("reference probes")
    if memory["baseline_bytes"] is None:
        ctx.receipt.skip("memory_returns_to_baseline", f"the server's /metrics has no {ACTIVE_MEMORY_METRIC}")
    if rss_row["before_bytes"] is None:
        ctx.receipt.skip("peak_rss", f"/proc/{rss.pid}/status cannot be read (not Linux)" if rss.pid else
                         f"the server's resident memory cannot be read: not the bundled server (no pid) and its "
                         f"/metrics has no {RSS_METRIC}")
    rss.thread.start()
    try:
        _Load(ctx, s, draw(s, draft is not None)).run()
        ctx.reached("load")
        _settle(ctx, s)
        for row, p, ref in zip(rows, probes, refs):
            rec = ctx.send(p.request(draft=draft, max_tokens=s.probe_tokens), phase="after")
            if not caps.hashes:
                continue
            cmp = ctx.expect_equal(CHECK, "probes after", rec, ref, f"probe {p.id} after the load and its reference")
            row.update(after=rec.token_sha, equal=cmp.equal)
        if not caps.hashes:
            ctx.receipt.skip("probes_unchanged", NO_HASH)
        ctx.reached("probes after")
        memory["after_bytes"] = after = ctx.client.metric(ACTIVE_MEMORY_METRIC)
        base = memory["baseline_bytes"]
        if base is not None and after is not None and after > base + s.memory_tolerance_bytes:
            ctx.receipt.fail("memory_returns_to_baseline", "after the load",
                             f"active memory {after:.0f} bytes after the load, baseline {base:.0f} "
                             f"(+{after - base:.0f} > tolerance {s.memory_tolerance_bytes})")
        ctx.reached("memory after")
    finally:
        rss.stop.set()
        rss.thread.join(timeout=5)
        rss_row.update(after_bytes=rss.read(), peak_bytes=rss.peak, high_water_bytes=rss.high_water())
