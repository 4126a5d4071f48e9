"""Receipts: one canonical JSON file per run (README.md, "Receipts").

Canonical means sorted keys, two-space indent, UTF-8, no NaN: the same run data always gives the
same bytes, so receipts diff cleanly. Written atomically (a temporary file in the same folder, then
os.replace), so a reader never sees half a receipt and an interrupted write leaves the old one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import dflash_bench
from dflash_bench.checks.schema import SCHEMA, SCHEMA_VERSION, BadReceipt, ReceiptBase, read_json, validate_receipt
from dflash_bench.engine import blas

__all__ = ["SCHEMA", "SCHEMA_VERSION", "BadReceipt", "Receipt", "exit_code", "percentiles", "summary"]


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def utc_stamp() -> str:
    """For file names: receipts/<command>-<stamp>.json."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _plain(value):
    """JSON-ready copy: dataclasses and tuples become dicts and lists, NaN and infinities become None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def canonical_json(data) -> str:
    return json.dumps(_plain(data), sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Writes `text` to `path` through a temporary file in the same folder and os.replace.

    mkstemp makes the file owner-only (0600); the receipt gets the mode any new file would (0666
    less the umask), since receipts are meant to be shared and committed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def summary(values) -> dict:
    """Median, extremes, spread ((max - min) / median) and the per-rep values of a list of numbers."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "spread": None, "values": []}
    med = statistics.median(vals)
    return {"n": len(vals), "median": med, "min": min(vals), "max": max(vals),
            "spread": (max(vals) - min(vals)) / med if med else None, "values": vals}


def percentiles(values) -> dict:
    """n and p50/p90/p99 (linear between the nearest ranks), None when there are no values."""
    vals = sorted(float(v) for v in values if v is not None)
    if not vals:
        return {"n": 0, "p50": None, "p90": None, "p99": None}

    def at(q: float) -> float:
        pos = q * (len(vals) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(vals) - 1)
        return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)

    return {"n": len(vals), "p50": at(0.50), "p90": at(0.90), "p99": at(0.99)}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def named_revision() -> dict | None:
    """The revision DFLASH_BENCH_COMMIT names ("SHA" or "SHA+dirty"), or None where it is unset: a copy of
    the tree whose `.git` is not its own (the GPU machine's, tools/gpu_receipts.sh) names its revision so
    that a stale `.git` does not speak for it. The CLI reads it before a command runs, so a malformed
    value stops the command in one line before anything is lost."""
    named = os.environ.get("DFLASH_BENCH_COMMIT")
    if not named:
        return None
    sha, _, mark = named.partition("+")
    if not re.fullmatch(r"[0-9a-f]{7,40}", sha) or mark not in ("", "dirty"):
        raise ValueError(f"DFLASH_BENCH_COMMIT={named!r} is not a commit SHA with an optional '+dirty'")
    return {"commit": sha, "dirty": mark == "dirty"}


def git_revision() -> dict:
    """The checkout's commit and whether tracked files differ from it (`named_revision` first)."""
    if named := named_revision():
        return named
    head = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head, "dirty": bool(dirty) if dirty is not None else None}


def _cpu() -> str:
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def environment() -> dict:
    """Where the harness ran: OS, CPU, memory, Python, MLX and its default device, the BLAS. MLX's own settings
    from the environment (`MLX_*`: how large a graph its CUDA backend hands the device, whether it uses CUDA graphs)
    change a timing without changing a bit, so a receipt names the ones that were set."""
    env = {"os": platform.platform(), "machine": platform.machine(), "cpu": _cpu(), "cpu_count": os.cpu_count(),
           "memory_bytes": _memory_bytes(), "python": platform.python_version(),
           "blas": dataclasses.asdict(blas.choice())}
    try:
        import mlx.core as mx

        env["mlx"] = {"version": mx.__version__, "default_device": str(mx.default_device()),
                      "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}}
    except ImportError as err:
        env["mlx"] = {"version": None, "default_device": None, "error": str(err)}
    return env


@dataclass
class Receipt:
    """One run. Checks append records and verdict entries as they go, so an interrupted run keeps them."""

    kind: str
    command: list[str]
    settings: dict
    started_at: str = field(default_factory=utc_now)
    finished_at: str | None = None
    complete: bool = False
    incomplete_reason: str | None = None
    tool: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    server: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    aggregates: dict = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    unverified: list[dict] = field(default_factory=list)
    warnings: list[dict] = field(default_factory=list)
    not_run: list[dict] = field(default_factory=list)
    side_files: dict = field(default_factory=dict)

    @classmethod
    def new(cls, kind: str, command: list[str], settings: dict) -> Receipt:
        return cls(kind=kind, command=list(command), settings=_plain(settings),
                   tool={"name": "dflash-bench", "version": dflash_bench.__version__, "git": git_revision()},
                   environment=environment())

    def fail(self, check: str, subject: str, message: str) -> None:
        self.failures.append({"check": check, "subject": subject, "message": message})

    def unverify(self, check: str, subject: str, message: str) -> None:
        self.unverified.append({"check": check, "subject": subject, "message": message})

    def warn(self, check: str, subject: str, message: str) -> None:
        self.warnings.append({"check": check, "subject": subject, "message": message})

    def skip(self, check: str, reason: str, subject: str | None = None) -> None:
        """Reports a check (or, with `subject`, one prompt or cell of it) as not run, never as passed."""
        entry = {"check": check, "reason": reason}
        if subject is not None:
            entry["subject"] = subject
        self.not_run.append(entry)

    def finish(self, complete: bool, reason: str | None = None) -> None:
        self.complete, self.incomplete_reason, self.finished_at = complete, reason, utc_now()

    @property
    def passed(self) -> bool:
        """Passed only if complete, nothing failed, nothing left unverified and nothing skipped."""
        return self.complete and not (self.failures or self.unverified or self.not_run)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "kind": self.kind, "command": self.command,
            "started_at": self.started_at, "finished_at": self.finished_at, "complete": self.complete,
            "incomplete_reason": self.incomplete_reason, "tool": self.tool, "environment": self.environment,
            "server": self.server, "settings": self.settings, "records": self.records,
            "aggregates": self.aggregates, "not_run": self.not_run, "side_files": self.side_files,
            "verdict": {"passed": self.passed, "failures": self.failures, "unverified": self.unverified,
                        "warnings": self.warnings},
        }

    def write(self, path: Path) -> None:
        write_atomic(Path(path), canonical_json(self.to_dict()))

    def typed(self) -> ReceiptBase:
        """The receipt as its kind's pydantic model (checks/schema.py): typed aggregates and records."""
        return validate_receipt(self.to_dict(), self.kind)

    @classmethod
    def from_dict(cls, data: dict, where: str = "receipt") -> Receipt:
        """Reads a receipt of any version this tool reads (schema.READS); BadReceipt if it breaks the contract."""
        validate_receipt(data, where)
        verdict = data["verdict"]
        return cls(kind=data["kind"], command=data["command"], settings=data["settings"],
                   started_at=data.get("started_at"), finished_at=data.get("finished_at"),
                   complete=data["complete"], incomplete_reason=data.get("incomplete_reason"),
                   tool=data["tool"], environment=data.get("environment", {}),
                   server=data.get("server", {}), records=data.get("records", []),
                   aggregates=data.get("aggregates") or {}, failures=verdict.get("failures", []),
                   unverified=verdict.get("unverified", []), warnings=verdict.get("warnings", []),
                   not_run=data.get("not_run", []), side_files=data.get("side_files", {}))

    @classmethod
    def load(cls, path: Path) -> Receipt:
        return cls.from_dict(read_json(path), str(path))


def exit_code(receipt: Receipt, interrupted: bool = False) -> int:
    """0 passed, 1 a check failed, 2 incomplete (cut short, or something not run or unverified), 130 interrupted."""
    if interrupted:
        return 130
    if receipt.failures:
        return 1
    return 0 if receipt.passed else 2
