"""How fast NVRTC compiles the row kernel's variants one after another, on threads, and in processes.

usage: python3 tools/nvrtc_probe.py [--variants 8] [--workers 2] [--library PATH] [--include DIR ...] [--arch 90]

A first start compiles every kernel variant the warm-up builds (engine/kernel_cache.py); this times the same
work three ways on any machine with an NVRTC library (no GPU needed: the code is compiled for `--arch`, never
loaded): the variants one after another in this process, on `--workers` threads of it, and each in a process
of its own on as many threads (engine/nvrtc.py's `Apart`, what the cache runs). The sources are MLX's for the
row kernel at the 9B's and the default model's projection shapes at 1 and 16 rows (`kernel_cache.mlx_source`),
compiled as the cache compiles them. Defaults: the NVRTC library and headers MLX uses (on a CUDA machine);
elsewhere name them, e.g. the `nvidia-cuda-nvrtc` wheel's library and MLX's and CUDA's include folders.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine import kernel_cache, matmul_kernel
from dflash_bench.engine.nvrtc import Apart, Nvrtc

# (rows, K, N, bits, group size): the 9B's projections (fixture qwen3_5-9b-4bit), then the default model's
SHAPES = [(1, 4096, 24576, 4, 64), (16, 4096, 24576, 4, 64), (1, 12288, 4096, 4, 64), (16, 12288, 4096, 4, 64),
          (1, 4096, 4096, 4, 64), (16, 4096, 12352, 4, 64), (1, 576, 3072, 4, 32), (16, 1536, 576, 4, 32),
          (1, 4096, 10240, 4, 64), (16, 4096, 4096, 4, 64), (1, 576, 576, 4, 32), (16, 576, 3072, 4, 32),
          (16, 4096, 10240, 4, 64), (1, 1536, 576, 4, 32), (16, 576, 576, 4, 32), (1, 4096, 12352, 4, 64),
          (64, 4096, 24576, 4, 64), (64, 12288, 4096, 4, 64), (64, 4096, 4096, 4, 64), (64, 4096, 12352, 4, 64)]
DTYPES = [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16, mx.int32, mx.bfloat16, mx.bfloat16]


def variants(count: int) -> list[tuple[str, str]]:
    """(kernel name, MLX's source) of the row kernel's first `count` distinct variants over SHAPES."""
    kernel = matmul_kernel._kernel(0)
    found: dict[str, str] = {}
    for shape in SHAPES:
        template = tuple(matmul_kernel.launch(*shape, ()).options["template"])
        variant = kernel.variant(template, DTYPES, [mx.bfloat16])
        found[variant[0]] = kernel_cache.mlx_source(*variant)
    if count > len(found):
        raise SystemExit(f"--variants: at most {len(found)} distinct variants in SHAPES, not {count}")
    return list(found.items())[:count]


def timed(compiler, jobs: list[tuple[str, str]], opts: list[str], workers: int) -> tuple[float, list[float]]:
    """Seconds for all `jobs` on `workers` threads (1: in turn), and each compile's own seconds."""
    def one(job: tuple[str, str]) -> float:
        name, source = job
        t0 = time.perf_counter()
        compiler.compile(source.replace(kernel_cache.MLX_HEADER, kernel_cache.COMPILED_HEADER, 1), f"{name}.cu",
                         f"mlx::core::cu::custom_kernel_{name}", opts)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    if workers == 1:
        each = [one(j) for j in jobs]
    else:
        with ThreadPoolExecutor(workers) as pool:
            each = list(pool.map(one, jobs))
    return time.perf_counter() - t0, each


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--library", help="the NVRTC library (default: the one MLX loaded, else the loader's)")
    parser.add_argument("--include", action="append", type=Path, help="NVRTC include folders (default: MLX's)")
    parser.add_argument("--arch", type=int, help="compute capability as 90 (default: this device's)")
    args = parser.parse_args()
    arch = divmod(args.arch, 10) if args.arch else kernel_cache.architecture()  # (MLX's CUDA set up first)
    nvrtc = Nvrtc(args.library or kernel_cache.loaded("libnvrtc.so"))
    opts = kernel_cache.options(*arch, args.include or kernel_cache.include_paths())
    jobs = variants(args.variants)
    print(f"NVRTC {nvrtc.version()} at {nvrtc.path}; {len(jobs)} row-kernel variants for sm_{arch[0]}{arch[1]}")
    timed(nvrtc, jobs[:1], opts, 1)  # the library's first compile (its builtins' loading) untimed
    ways = [("one after another", nvrtc, 1), (f"{args.workers} threads", nvrtc, args.workers),
            (f"{args.workers} processes", Apart(nvrtc.path), args.workers)]
    for label, compiler, workers in ways:
        total, each = timed(compiler, jobs, opts, workers)
        print(f"  {label:>18}: {total:6.1f} s, each compile {min(each):.2f}-{max(each):.2f} s")


if __name__ == "__main__":
    main()
