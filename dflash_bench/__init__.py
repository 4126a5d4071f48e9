"""dflash-bench: exactness and benchmarks for DFlash speculative decoding, with a bundled MLX engine.

OpenBLAS must be loaded before anything imports `mlx.core`, so the package does it first.
"""

from dflash_bench.engine import blas as _blas

_blas.load()

__version__ = "0.1.0"
