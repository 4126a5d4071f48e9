"""What one call of our row kernel costs the host, and which part of the call it is.

usage (on the GPU machine, from the repo root): PYTHONPATH=/tmp/site:$PWD python3 tools/kernel_call_probe.py

docs/profiles/qmv-probe-h200.txt: building one call of our kernel costs 9-12 us of Python against 2-3 us
for MLX's own `quantized_matmul`, and a 9B forward makes 129 of them, so about 1 ms of a plain step that
mlx-lm does not pay. `mx.fast.cuda_kernel` does two things on every call that MLX's kernels do not: it
turns the template arguments into C++ (nanobind, then `fmt` for the kernel's name and its constants),
and it writes the kernel's whole source (~10 KB: engine/matmul_source.py's header and body) into a new
string, which the evaluation then hashes to find the compiled module. This times, per call in 200
independent calls, the build and the evaluation of launches of the same compiled code:
- `templated`: one kernel object for every shape, the constants passed as template arguments (the
  engine's launch before engine/baked_kernel.py);
- `baked`: one kernel object per shape with the constants written into its source, no template arguments;
- `engine`: `matmul_kernel.rows_matmul` as the engine runs it now (baked, through `BakedKernel`);
- `included`: the body as a `__device__` function in a header file that the source `#include`s by its
  absolute path (NVRTC reads it from disk), so the source is a few hundred bytes; template arguments;
- `included+baked`: both.
Each must give the engine's bits (they run the same code); a failing NVRTC include is printed, not raised.
(docs/profiles/kernel-call-probe-h200.txt's run predates `BakedKernel`: its `engine` is `templated` here.)
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import dflash_bench  # noqa: F401  (loads the BLAS before mlx.core)
import mlx.core as mx

from dflash_bench.engine import baked_kernel, matmul_kernel, matmul_source
from dflash_bench.engine.matmul_kernel import launch, rows_matmul

# the row kernel's constants, in the order `launch` writes them (GLU since the SwiGLU launch)
NAMES = tuple(name for name, _ in launch(1, 512, 256, 4, 64, ()).options["template"])


def header_file(folder: Path) -> Path:
    """The kernel's header and body as one templated device function, in a file NVRTC can include."""
    path = folder / "dflash_rows_probe.cuh"
    params = ", ".join(f"int {n}" for n in NAMES)
    path.write_text(
        "#pragma once\n" + matmul_source.HEADER
        + f"\ntemplate <{params}, typename WT>\n__device__ __forceinline__ void dflash_rows_body("
        "const __nv_bfloat16* x, const WT* w, const __nv_bfloat16* scales, const __nv_bfloat16* biases, "
        "const int32_t* rows, const __nv_bfloat16* residual, const __nv_bfloat16* norm, __nv_bfloat16* y) {\n"
        + matmul_source.source(0) + "\n}\n")
    return path


def variant(name: str, header: str, body: str, baked: bool):
    """A call `f(x, q, s, b, bits, gs)` of one launch variant, and its source's length in bytes. Each call
    shape's kernel object and launch options are made at its first call, so a timed call is MLX's alone."""
    prepared: dict[int, tuple] = {}  # by the id of matmul_kernel's cached KernelCall, which stays alive
    kernels: dict[tuple, object] = {}

    def f(x, q, s, b, bits, gs):
        call = launch(x.shape[0], x.shape[1], q.shape[0], bits, gs, ())
        if id(call) not in prepared:
            template = call.options["template"]
            key = template if baked else ()
            if key not in kernels:
                kernels[key] = mx.fast.cuda_kernel(
                    name=f"dflash_probe_{name.replace('+', '_')}" + baked_kernel.suffix(key),
                    input_names=matmul_source.INPUTS, output_names=["y"],
                    source=baked_kernel.constants(key) + body, header=header, ensure_row_contiguous=True)
            options = {o: v for o, v in call.options.items() if o != "template"}
            if not baked:
                options["template"] = list(template)
            prepared[id(call)] = (kernels[key], options)
        kernel, options = prepared[id(call)]
        return kernel(inputs=[x, q, s, b, call.rows, x, x], **options)[0]  # x: the unread residual and norm

    return f, len(header) + len(body)


def per_op(f, args, n: int = 200) -> tuple[float, float]:
    """Microseconds a call to build, then to evaluate, over n independent calls (the second of two runs)."""
    for _ in range(2):
        mx.synchronize()
        t0 = time.perf_counter()
        ys = [f(*args) for _ in range(n)]
        t1 = time.perf_counter()
        mx.eval(ys)
        mx.synchronize()
        t2 = time.perf_counter()
    return 1e6 * (t1 - t0) / n, 1e6 * (t2 - t1) / n


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    include = f'#include "{header_file(folder)}"\n'
    call = f"  dflash_rows_body<{', '.join(NAMES)}>(x, w, scales, biases, rows, residual, norm, y);\n"
    body = matmul_source.source(0)
    paths = {"templated": variant("templated", matmul_source.HEADER, body, False),
             "baked": variant("baked", matmul_source.HEADER, body, True),
             "engine": (lambda x, q, s, b, bits, gs: rows_matmul(x, q, s, b, bits, gs),
                        len(matmul_kernel._kernel(0).header) + len(matmul_kernel._kernel(0).source)),  # compacted
             "included": variant("included", include, call, False),
             "included+baked": variant("included+baked", include, call, True)}
    for k, n in [(4096, 4096), (4096, 24576)]:
        w = mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02
        q, s, b = mx.quantize(w, group_size=64, bits=4)
        x16 = mx.random.normal((16, k)).astype(mx.bfloat16)
        mx.eval(q, s, b, x16)
        for m in (1, 16):
            args = (x16[:m], q, s, b, 4, 64)
            want = rows_matmul(*args)
            for name, (f, size) in paths.items():
                try:
                    same = bool(mx.array_equal(f(*args), want).item())
                except (RuntimeError, ValueError) as e:  # NVRTC could not compile it: say so, go on
                    print(f"K{k} N{n} M{m} {name:15s} failed: {str(e).splitlines()[0][:300]}", flush=True)
                    continue
                build, evaluate = per_op(f, args)
                print(f"K{k} N{n} M{m} {name:15s} source {size:6d} B  bits {'same' if same else 'DIFFER'}  "
                      f"build {build:5.1f} us  eval {evaluate:6.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
