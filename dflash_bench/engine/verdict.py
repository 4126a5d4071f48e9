"""What a self-check's verdict holds and what it depends on (selfcheck.py runs the checks).

A verdict names every path proven (`PathResult`), the tile or kernel chosen for each weight and the path for
each attention layer, and the machine it was proven on. It is cached on disk under a key of everything a
row's bits can depend on: `machine` (device, BLAS and its core, threads, MLX, dtype, and a hash of the code
whose arithmetic is proven) and the target's `shapes`; a restart on the same machine and model reads it back.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from dflash_bench.engine import blas, matmul_kernel
from dflash_bench.engine.targets import attention_kernel
from dflash_bench.engine.targets.base import Target
from dflash_bench.engine.targets.dense import SelfAttention
from dflash_bench.engine.targets.qwen3_5 import GatedDeltaNet
from dflash_bench.engine.tiles import Weight

VERSION = 1
KERNEL = 0  # a weight's "tile" when the row kernel takes all its decode rows in one call


@dataclass(frozen=True)
class PathResult:
    """One path's verdict: what was proven, the configuration chosen, and what differed if none passed."""

    path: str
    passed: bool
    choice: str
    detail: str = ""


@dataclass
class Verdict:
    passed: bool
    paths: list[PathResult]
    tiles: dict[str, int]  # weight key -> rows a decode matmul call
    attention: dict[str, str]  # attention key -> path
    seconds: float
    machine: dict
    key: str
    cached: bool = False
    notes: list[str] = field(default_factory=list)
    ahead: float | None = None  # seconds of `seconds` building the check's launches first to compile them (`check`)

    @property
    def failures(self) -> list[PathResult]:
        return [p for p in self.paths if not p.passed]

    def line(self) -> str:
        """The startup line's clause: what passed with which tiles, or what failed."""
        when = "cached" if self.cached else f"{self.seconds:.1f} s"
        if self.ahead is not None and not self.cached:
            when += f", {self.ahead:.1f} s of it compiling its kernels ahead"
        if not self.passed:
            first = self.failures[0]
            more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
            why = first.detail.rsplit("; ", 1)[-1]  # the last configuration tried, the most conservative
            return f"self-check FAILED on {self.machine['device']} {self.machine['dtype']}: {first.path}: {why}{more} ({when})"
        sizes = sorted(set(self.tiles.values()), reverse=True)
        ways = ([f"{'/'.join(str(t) for t in sizes if t != KERNEL)}-row tiles"] if set(sizes) - {KERNEL} else [])
        ways += ["the row kernel"] if KERNEL in sizes else []
        paths = ", ".join(sorted(set(self.attention.values())))
        return (f"self-check passed on {self.machine['device']} {self.machine['dtype']}: {len(self.tiles)} projection "
                f"shapes in {' and '.join(ways)}, {paths or 'no'} attention, window == steps ({when})")

    def as_dict(self) -> dict:
        return {"version": VERSION, "passed": self.passed, "line": self.line(), "seconds": self.seconds,
                "cached": self.cached, "key": self.key, "machine": self.machine, "tiles": self.tiles,
                "attention": self.attention, "paths": [asdict(p) for p in self.paths], "notes": self.notes,
                "ahead": self.ahead}

    @classmethod
    def from_dict(cls, data: dict) -> "Verdict":
        return cls(passed=data["passed"], paths=[PathResult(**p) for p in data["paths"]], tiles=data["tiles"],
                   attention=data["attention"], seconds=data["seconds"], machine=data["machine"], key=data["key"],
                   notes=data.get("notes", []), ahead=data.get("ahead"))


# -- what the verdict depends on ---------------------------------------------------------------------
def _cpu_signature() -> str:
    """The processor as the kernels see it: family, model, stepping and feature flags (the model name
    alone is often a bare "AMD EPYC" in a VM)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor is enough
            name, _, value = line.partition(":")
            if name.strip() in ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features", "CPU part"):
                fields[name.strip()] = value.strip()
    except OSError:
        return platform.processor() or platform.machine()
    flags = fields.pop("flags", fields.pop("Features", ""))
    return " ".join(fields.values()) + f" flags:{hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def _code_hash() -> str:
    """The sources whose arithmetic the verdict is about: a change to any of them re-runs the check."""
    from dflash_bench.engine import cache, fused, selfcheck, tiles, tree_attention
    from dflash_bench.engine.targets import base, delta_kernel, dense, qwen3_5

    h = hashlib.sha256()
    for module in (tiles, matmul_kernel, tree_attention, cache, base, dense, qwen3_5, delta_kernel, attention_kernel,
                   fused):
        h.update(Path(module.__file__).read_bytes())
    h.update(Path(selfcheck.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def machine(dtype: mx.Dtype) -> dict:
    """Everything a row's bits can depend on besides the shapes: device, BLAS and its core, threads, MLX."""
    choice = blas.choice()
    info = mx.device_info()
    device = mx.default_device()
    return {"device": f"{device.type.name} ({info.get('device_name') or 'unnamed'})",
            "architecture": info.get("architecture"), "cpu": _cpu_signature(), "threads": os.cpu_count(),
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "blas": choice.kind, "blas_path": choice.path,
            "blas_core": choice.core, "blas_config": choice.config, "mlx": mx.__version__,
            "dtype": str(dtype).removeprefix("mlx.core."), "code": _code_hash()}


def weight_key(w: Weight) -> str:
    return f"{w.kind} {w.in_features}x{w.out_features}"


def attention_key(a: SelfAttention) -> str:
    """The shapes, and whether the layer can run our kernel here: a layer that gains or loses it is proven again."""
    return f"{a.heads}/{a.kv_heads} heads of {a.head_dim}{', kernel' if a.kernel else ''}"


def recurrence_key(m: GatedDeltaNet) -> str:
    """The shapes and the decode recurrence the layer runs: a layer that changes path is proven again."""
    return f"{m.hk}/{m.hv} heads of {m.dk}/{m.dv}, conv {m.kernel}x{m.conv_dim}, {m.recurrence}"


def shapes(target: Target) -> dict:
    c = target.config
    mixers = target.mixer_layers()
    return {"family": c.family, "layers": c.num_layers, "vocab": c.vocab_size,
            "weights": sorted({weight_key(w) for w in target.projections()}),
            "attention": sorted({attention_key(m) for m in mixers if isinstance(m, SelfAttention)}),
            "recurrence": sorted({recurrence_key(m) for m in mixers if isinstance(m, GatedDeltaNet)})}


def cache_dir() -> Path:
    if env := os.environ.get("DFLASH_BENCH_CACHE"):
        return Path(env) / "selfcheck"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-bench" / "selfcheck"
