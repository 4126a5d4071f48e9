"""The Engine: a target, an optional drafter and N lanes behind a thread-safe submit().

The server and the tests use this API. `submit` returns a Handle whose events carry each round's
new tokens and, last, the finish reason and the per-request stats. With `start()` a background
thread runs rounds while there is work; without it, `step()` / `run()` drive rounds in the caller's
thread (deterministic, for tests and benchmarks).

Before it serves, a loaded target passes the self-check of the row rule on this machine
(selfcheck.py), which also sets the tiles and attention path each weight and layer then runs. A
target that fails it is served without drafting: `drafting_refused` says why, and the drafter
(when one was asked for) is not loaded. Then the warm-up (warmup.py) runs every forward shape
serving will use once on scratch states, so kernels compile before the server says ready.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from dflash_bench.engine import backend as backends
from dflash_bench.engine import kernel_cache, selfcheck, warmup
from dflash_bench.engine.budget import Budget, measure_cost
from dflash_bench.engine.checkpoint import LoadedTarget, load_target
from dflash_bench.engine.constants import CHUNK, GIB
from dflash_bench.engine.drafters.dflash import DFlashDrafter, load_drafter
from dflash_bench.engine.lanes import Lanes
from dflash_bench.engine.prompt_cache import PromptCache
from dflash_bench.engine.request import Handle, Request, Result
from dflash_bench.engine.targets import Target, build_target
from dflash_bench.engine.tiles import Weight
from dflash_bench.engine.validate import check_checkpoints


@dataclass(frozen=True)
class Settings:
    parallel: int = 1
    context: int = 4096
    prompt_cache_gib: float = 0.0
    drafter_bits: int = 0  # 0 keeps the drafter float (on CPU measured faster than 4-bit)
    chunk: int = CHUNK
    backend: str | None = None  # the numeric mode (backend.py): 'cpu', 'gpu', or None for the device's
    fresh_selfcheck: bool = False  # run the self-check even where a cached verdict exists
    verify_budget: str = "fixed"  # drafts a stream verifies a round: a full block, or "auto" (budget.py)
    warm: bool = True  # run every serving shape once on scratch states before serving (warmup.py)
    tree_nodes: int = 0  # 0: chains; N: a draft tree of N nodes (fixed) or of the budget's count (auto), tree.py


@dataclass(frozen=True)
class StreamStatus:
    """One stream holding a lane, as the engine sees it between rounds."""

    pos: int  # prompt positions done (the prompt's length once decoding)
    prefill_done: bool  # the prompt pass is over: the stream decodes
    target_state_bytes: int  # its target state (attention K/V, GatedDeltaNet state)
    drafter_state_bytes: int  # its drafter context (0 when it does not draft)


@dataclass(frozen=True)
class Status:
    """What the server, its metrics and the memory check read of the lanes: a snapshot, not a handle."""

    rounds: int  # target forwards since load
    waiting_requests: int
    streams: tuple[StreamStatus, ...]

    @property
    def active_streams(self) -> int:
        return len(self.streams)

    @property
    def busy(self) -> bool:
        return bool(self.waiting_requests or self.streams)


def preload(target: str, drafter: str | None) -> None:
    """The pre-load checks from the configs and tensor headers (validate.py); raises the one-line refusal."""
    check_checkpoints(target, drafter)


class Engine:
    def __init__(
        self,
        target: str | Path = "default",
        drafter: str | Path | None = None,
        settings: Settings = Settings(),
        *,
        model: Target | None = None,
        draft_model: DFlashDrafter | None = None,
        eos_ids: tuple[int, ...] | None = None,
        loaded: LoadedTarget | None = None,
    ):
        """Load `target` (and `drafter`) from disk in the settings' mode, or take ready-made models
        (tests' doubles, built in whatever mode they were built in; or another engine's target with the
        `loaded` checkpoint it came from, which names it and gives its tokenizer and eos ids). A real
        target (a `Target`) is self-checked either way; a double that is not one has no rows to check."""
        self.graph_limits = backends.size_cuda_graphs()  # before any GPU work: MLX reads them once (backend.py)
        self.settings = settings
        self.backend = backends.resolve(settings.backend)
        self.loaded = loaded
        if model is None:
            preload(str(target), None if drafter is None else str(drafter))
            dtype = self.backend.dtype
            self.loaded = load_target(target, dtype, packed=not self.backend.dequantizes)
            model = build_target(self.loaded.config, self.loaded.weights, dtype)
        if self.loaded is not None and eos_ids is None:
            eos_ids = self.loaded.config.eos_token_ids or self.loaded.tokenizer.eos_ids
        self.selfcheck = None
        if isinstance(model, Target):  # its kernels compiled side by side first where they compile at first use
            ahead = warmup.ahead_of_check(model, settings.parallel, settings.chunk) if settings.warm else None
            self.selfcheck = selfcheck.check(model, fresh=settings.fresh_selfcheck, ahead=ahead)
        self.drafting_refused: str | None = None
        if self.selfcheck is not None and not self.selfcheck.passed and (drafter is not None or draft_model is not None):
            self.drafting_refused = f"drafting is off: {self.selfcheck.line()}"
            drafter = draft_model = None
        if drafter is not None:
            draft_model = load_drafter(drafter, model, bits=settings.drafter_bits, dtype=self.backend.dtype)
        self.target = model
        self.drafter = draft_model
        self.tokenizer = self.loaded.tokenizer if self.loaded else None
        if settings.tree_nodes < 0:
            raise ValueError(f"tree nodes {settings.tree_nodes}: expected 0 (chains) or more")
        # trees where the target can verify them (Target.tree_refusal says why not): chains elsewhere
        self.tree_nodes = settings.tree_nodes if getattr(model, "supports_trees", False) else 0
        if self.loaded is not None:
            mx.eval([a for w in self.loaded.weights.values() for a in (w.arrays() if isinstance(w, Weight) else [w])])
        self.warmup: warmup.Warmup | None = None
        if settings.warm and isinstance(model, Target):  # kernels compile here, not at a client's first request
            on_gpu = mx.default_device().type == mx.DeviceType.gpu
            self.warmup = warmup.warm(model, draft_model, settings.parallel, settings.chunk, every=on_gpu)
        self.budget: Budget | None = None
        if draft_model is not None:  # the auto budget's cost model is timed here (warm), on the machine that serves
            fit = (measure_cost(model, draft_model, settings.parallel, trees=self.tree_nodes > 0)
                   if settings.verify_budget == "auto" else None)
            self.budget = Budget(settings.verify_budget, draft_model.block, fit, draft_model.block_rows,
                                 trees=self.tree_nodes > 0)
        self.lanes = Lanes(
            model,
            draft_model,
            settings.parallel,
            settings.context,
            PromptCache(int(settings.prompt_cache_gib * GIB)),
            tuple(eos_ids or ()),
            settings.chunk,
            self.budget,
            self.tree_nodes if draft_model is not None else 0,
        )
        self._lock = threading.Lock()  # one round at a time
        self._wake = threading.Condition()  # submit() wakes the background loop
        self._thread: threading.Thread | None = None
        self._stop = False
        self.baseline_bytes = mx.get_active_memory()

    # -- identity ------------------------------------------------------------------------------
    @property
    def drafter_kind(self) -> str | None:
        return self.drafter.kind if self.drafter else None

    @property
    def model_name(self) -> str:
        if self.loaded is None:
            return "test-double"
        return self.loaded.config.name or self.loaded.path.name

    def weight_bytes(self) -> int | None:
        """Bytes of weights one round reads at least: the target's (Target.weight_bytes), and the drafter's where it
        drafts (DFlashDrafter.weight_bytes); what engine-speed sets a round's cost against. None for a test double."""
        if not isinstance(self.target, Target):
            return None
        return self.target.weight_bytes() + (self.drafter.weight_bytes() if self.drafter else 0)

    def startup_line(self, where: str = "") -> str:
        """Target, drafter kind, streams and context, mode, MLX's CUDA graph limits (on CUDA; receipts keep this
        line, and a graph's size moves timings), the warm-up's shapes and seconds, then `where`
        (the server's URL and plan), then the self-check's verdict (or why drafting is off)."""
        drafts = f"{self.drafter_kind} drafts" if self.drafter else "no drafter"
        s = self.settings
        cache = f", prompt cache {s.prompt_cache_gib:g} GiB" if s.prompt_cache_gib else ""
        mode = ", gpu mode (packed weights, bf16)" if self.backend.name == "gpu" else ""
        proof = f"; {self.drafting_refused or self.selfcheck.line()}" if self.selfcheck else ""
        budget = ""
        if self.budget is not None and self.budget.measured is not None:
            budget = f", verify budget auto ({self.budget.measured.describe(self.budget.trees)}, refitted to the rounds)"
        if self.drafter and s.tree_nodes:
            size = f"{s.tree_nodes} nodes" if s.verify_budget == "fixed" else "the budget's rows"
            budget += (f", draft trees of {size}" if self.tree_nodes else
                       f", draft trees off (chains): {self.target.tree_refusal}")
        warmed = f", {self.warmup.line()}" if self.warmup else ""
        graphs = ""
        kernels = kernel_cache.status() if self.graph_limits else ""  # on CUDA: our kernels compiled, kept or found
        warmed += f" ({kernels})" if kernels else ""
        if self.graph_limits:
            limits = [self.graph_limits[name] for name in backends.CUDA_GRAPH_LIMITS]
            graphs = f", MLX CUDA graphs of up to {limits[0]} operations and {limits[1]} MB"
        return (f"serving {self.model_name}: {drafts}{budget}, {s.parallel} streams of {s.context} tokens{cache}{mode}"
                f"{graphs}{warmed}{where}{proof}")

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: Request) -> Handle:
        """Queue a request (raises ContextExceeded or ValueError before it takes a lane)."""
        handle = Handle(request)
        self.lanes.submit(handle)  # a deque append: safe beside a running round, which admits at its start
        with self._wake:
            self._wake.notify()
        return handle

    def generate(self, request: Request) -> Result:
        """Submit and wait (runs rounds in this thread when no background loop is started)."""
        handle = self.submit(request)
        while self._thread is None and self.lanes.busy:
            self.step()
        return handle.result()

    def run(self, requests: list[Request], arrivals: list[int] | None = None) -> list[Result]:
        """Run requests to the end in this thread; request i is submitted before round arrivals[i]."""
        arrivals = arrivals or [0] * len(requests)
        handles: list[Handle | None] = [None] * len(requests)
        round_no = 0
        while round_no <= max(arrivals) or self.lanes.busy:
            for i, req in enumerate(requests):
                if arrivals[i] == round_no:
                    handles[i] = self.submit(req)
            self.step()
            round_no += 1
        return [h.result() for h in handles if h is not None]

    def step(self) -> None:
        """One round (admit, target forward, keep, drafter pass)."""
        with self._lock:
            try:
                self.lanes.round()
            except Exception as exc:  # an engine failure ends every request with the error, not the process
                self.lanes.fail_all(f"{type(exc).__name__}: {exc}")
                traceback.print_exc()

    # -- background loop -----------------------------------------------------------------------
    def start(self) -> None:
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="dflash-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stop and not self.lanes.busy:
                    self._wake.wait(timeout=0.5)
            if self._stop:
                with self._lock:
                    self.lanes.fail_all("server shutting down")
                return
            self.step()
            if not self.lanes.streams:
                mx.clear_cache()

    # -- reading -------------------------------------------------------------------------------
    def status(self) -> Status:
        """The lanes now: safe to call beside a running round (a copy of the stream list, then reads)."""
        streams = list(self.lanes.streams)
        return Status(
            rounds=self.lanes.rounds,
            waiting_requests=len(self.lanes.waiting),
            streams=tuple(
                StreamStatus(s.pos, s.pending is not None, s.segment_state.nbytes,
                             s.drafter_state.nbytes if s.drafter_state else 0)
                for s in streams
            ),
        )

    def memory(self) -> dict[str, int]:
        return {
            "active_bytes": mx.get_active_memory(),
            "peak_bytes": mx.get_peak_memory(),
            "baseline_bytes": self.baseline_bytes,
            "prompt_cache_bytes": self.lanes.prompt_cache.nbytes,
        }


def wait_idle(engine: Engine, timeout: float = 60.0) -> None:
    """Block until the background loop has no stream or waiting request."""
    end = time.monotonic() + timeout
    while engine.lanes.busy and time.monotonic() < end:
        time.sleep(0.01)
