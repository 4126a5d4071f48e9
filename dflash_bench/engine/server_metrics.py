"""The server's /metrics: reply counters by outcome and token totals, beside the engine's gauges.

Counted from the event loop and from the threads that forward engine events (engine/server.py), so
every update takes the lock.
"""

from __future__ import annotations

import threading

from dflash_bench.engine.engine import Engine
from dflash_bench.engine.request import Stats

OUTCOMES = ("stop", "length", "cancelled", "error", "context_length_exceeded", "invalid_request")
TOTALS = ("stream_rounds", "drafted_tokens", "accepted_tokens", "prompt_tokens", "cached_tokens", "completion_tokens")


class Metrics:
    """Counters over replies, updated from the loop and from forwarding threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.totals = dict.fromkeys(TOTALS, 0)
        self.rounds_base = 0  # the engine's rounds before serving (the warm-up's)

    def refused(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def finished(self, outcome: str, stats: Stats, completion_tokens: int) -> None:
        with self.lock:
            self.requests[outcome] += 1
            for name, value in (("stream_rounds", stats.rounds), ("drafted_tokens", stats.drafted),
                                ("accepted_tokens", stats.accepted), ("prompt_tokens", stats.prompt_tokens),
                                ("cached_tokens", stats.cached_tokens), ("completion_tokens", completion_tokens)):
                self.totals[name] += value

    def render(self, engine: Engine | None) -> str:
        """Prometheus text format: counters, then the engine's gauges."""
        now = engine.status() if engine else None
        lines = ["# HELP dflash_requests_total Replies by outcome (finish reason, or why refused).",
                 "# TYPE dflash_requests_total counter"]
        with self.lock:
            lines += [f'dflash_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
            counters = {
                "rounds": (now.rounds - self.rounds_base if now else 0, "Engine rounds (one target forward each)."),
                **{k: (v, f"Sum over finished requests of {k.replace('_', ' ')}.") for k, v in self.totals.items()},
            }
        for name, (value, text) in counters.items():
            lines += [f"# HELP dflash_{name}_total {text}", f"# TYPE dflash_{name}_total counter",
                      f"dflash_{name}_total {value}"]
        memory = engine.memory() if engine else {}
        gauges = {
            "active_streams": (now.active_streams if now else 0, "Streams holding a lane."),
            "waiting_requests": (now.waiting_requests if now else 0, "Requests waiting for a lane."),
            "peak_memory_bytes": (memory.get("peak_bytes", 0), "Peak MLX memory since start."),
            "active_memory_bytes": (memory.get("active_bytes", 0), "MLX memory in use now."),
            "baseline_memory_bytes": (memory.get("baseline_bytes", 0), "MLX memory in use once loaded, idle."),
            "prompt_cache_bytes": (memory.get("prompt_cache_bytes", 0), "Bytes held by the prompt cache."),
        }
        for name, (value, text) in gauges.items():
            lines += [f"# HELP dflash_{name} {text}", f"# TYPE dflash_{name} gauge", f"dflash_{name} {value}"]
        return "\n".join(lines) + "\n"
