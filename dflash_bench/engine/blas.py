"""Which BLAS MLX's CPU backend multiplies with, chosen before `mlx.core` is imported.

The mlx-cpu wheel on Linux carries a reference BLAS (a few GFLOP/s). Loading OpenBLAS into the
global symbol namespace first makes MLX's `cblas_sgemm` calls resolve to it (30x faster). OpenBLAS
picks kernels by shape, so a row's bits can depend on how many rows share its matmul; the engine
keeps every call site at a fixed row count (see `engine/tiles.py`) so that this does not matter.

`DFLASH_BENCH_BLAS=reference` keeps the wheel's own BLAS (used by the tests that prove exactness
under both); `DFLASH_BENCH_BLAS=/path/libopenblas.so.0` names a library explicitly.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasChoice:
    """What was loaded, for receipts: `kind` is openblas, reference or platform (macOS Accelerate).

    `core` and `config` are OpenBLAS's own words for the kernels it picked on this processor
    (`openblas_get_corename`, `openblas_get_config`): two machines that both call themselves
    "AMD EPYC" can run different kernels, and a row's bits follow the kernel.
    """

    kind: str
    path: str | None
    reason: str
    core: str | None = None
    config: str | None = None


_choice: BlasChoice | None = None


def load() -> BlasChoice:
    """Load OpenBLAS (once) unless told not to; must run before the first `import mlx.core`."""
    global _choice
    if _choice is not None:
        return _choice
    if sys.platform != "linux":
        _choice = BlasChoice("platform", None, "MLX uses the platform's own BLAS here")
        return _choice
    wanted = os.environ.get("DFLASH_BENCH_BLAS", "")
    if wanted == "reference":
        _choice = BlasChoice("reference", None, "DFLASH_BENCH_BLAS=reference")
        return _choice
    if "mlx.core" in sys.modules:
        _choice = BlasChoice("reference", None, "mlx.core was imported before dflash_bench")
        return _choice
    paths = (wanted,) if wanted else CANDIDATES
    for path in paths:
        if os.path.exists(path):
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            _choice = BlasChoice("openblas", path, "loaded before mlx.core", *_openblas_words(lib))
            return _choice
    _choice = BlasChoice("reference", None, "no libopenblas.so.0 found")
    print(
        "dflash-bench: warning: MLX's CPU backend runs on its reference BLAS (about 30x slower); "
        "install OpenBLAS (apt-get install libopenblas0-pthread) or set DFLASH_BENCH_BLAS=/path/libopenblas.so.0",
        file=sys.stderr,
    )
    return _choice


def _openblas_words(lib: ctypes.CDLL) -> tuple[str | None, str | None]:
    """OpenBLAS's core name and build configuration, where the library exports them."""
    words = []
    for name in ("openblas_get_corename", "openblas_get_config"):
        fn = getattr(lib, name, None)
        if fn is None:
            words.append(None)
            continue
        fn.restype = ctypes.c_char_p
        words.append(fn().decode(errors="replace").strip())
    return words[0], words[1]


def choice() -> BlasChoice:
    """The BLAS in use (loads if nothing was decided yet)."""
    return load()
