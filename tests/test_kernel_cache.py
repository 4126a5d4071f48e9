"""engine/kernel_cache.py: our kernels' compiled code kept where MLX looks for it, under MLX's module name.

On any machine: the module name's hash is libstdc++'s `std::hash`, the source is laid out as MLX lays it, the
cache folder and file names are MLX's, a variant is compiled and written once and then found, a failure
leaves the variant to MLX, the cache is on only where a canary kernel shows MLX launching what is kept, and
`BakedKernel` keeps each variant at its first launch. On a CUDA GPU: the
source equals what MLX prints for the same launch, launches from kept code equal MLX's own compile bit for
bit (in fresh processes), and MLX launches what is kept (a kept module swapped for another kernel of the
same name changes the output)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gpu import on_cuda

import mlx.core as mx

from dflash_bench.engine import baked_kernel, kernel_cache, matmul_kernel
from dflash_bench.engine.kernel_cache import KernelCache, mlx_source, module_name, module_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="compares with a C++ program's std::hash")
def test_the_module_hash_is_libstdcxx_std_hash(tmp_path: Path) -> None:
    texts = ["", "hello world", mlx_source("k", "// h\n", "  y[0] = x[0];", [("x", mx.float32)], [("y", mx.float32)])]
    (tmp_path / "in.txt").write_bytes(b"\0".join(t.encode() for t in texts))
    (tmp_path / "h.cpp").write_text(
        "#include <fstream>\n#include <sstream>\n#include <string>\n#include <cstdio>\n#include <functional>\n"
        "int main(int, char** argv) { std::ifstream f(argv[1], std::ios::binary); std::stringstream s; s << f.rdbuf();\n"
        "  std::string all = s.str(), part; std::stringstream in(all);\n"
        "  while (std::getline(in, part, '\\0')) printf(\"%zx\\n\", std::hash<std::string>{}(part));\n"
        "  if (!all.empty() && all.back() == '\\0') printf(\"%zx\\n\", std::hash<std::string>{}(std::string()));\n}\n")
    subprocess.run(["g++", "-O1", "-o", str(tmp_path / "h"), str(tmp_path / "h.cpp")], check=True)
    got = subprocess.run([str(tmp_path / "h"), str(tmp_path / "in.txt")], capture_output=True, text=True, check=True)
    assert got.stdout.split() == [f"{kernel_cache.std_hash(t):x}" for t in texts]


def test_the_source_is_laid_out_as_mlx_lays_a_cuda_kernel_out() -> None:
    src = mlx_source("dflash_k_4", "// header\n", "  y[0] = x[0] + n[0];",
                     [("x", mx.bfloat16), ("n", mx.int32)], [("y", mx.bfloat16), ("z", mx.float32)])
    assert src == ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n// header\n'
                   "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
                   "__global__ void custom_kernel_dflash_k_4(\n    const __nv_bfloat16* x,\n    const int32_t* n,\n"
                   "    __nv_bfloat16* y,\n    float* z) {\n  y[0] = x[0] + n[0];\n}\n\n} // namespace mlx::core::cu\n")
    assert module_name("dflash_k_4", src) == f"custom_kernel_dflash_k_4_{kernel_cache.std_hash(src):x}"
    assert src.count(kernel_cache.MLX_HEADER) == 1  # what the compile replaces


def test_files_and_folder_are_where_mlx_looks(monkeypatch, tmp_path: Path) -> None:
    assert module_path(tmp_path, "m") == tmp_path / "m.ptx"
    long = "a" * 245 + "b" * 245 + "c" * 10
    assert module_path(tmp_path, long) == tmp_path / ("a" * 245) / ("b" * 245) / ("c" * 10 + ".ptx")
    monkeypatch.delenv("MLX_PTX_CACHE_DIR", raising=False)
    for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(v, raising=False)
    assert kernel_cache.cache_dir() == Path("/tmp/mlx") / mx.__version__ / "ptx"
    monkeypatch.setenv("TEMP", str(tmp_path / "t"))
    assert kernel_cache.cache_dir() == tmp_path / "t" / "mlx" / mx.__version__ / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "named"))
    assert kernel_cache.cache_dir() == tmp_path / "named"


def test_the_compiler_is_the_library_the_process_loaded() -> None:
    assert kernel_cache.loaded("libmlx") and Path(kernel_cache.loaded("libmlx")).exists()  # what mlx.core loaded
    assert kernel_cache.loaded("libnot-a-library.so") is None


def test_the_compile_options_are_mlxs() -> None:
    assert kernel_cache.options(9, 0, [Path("/i")]) == [
        "--device-as-default-execution-space", "--gpu-architecture=sm_90a", "--include-path=/i"]
    assert kernel_cache.options(8, 6, [])[1] == "--gpu-architecture=sm_86"


class FakeNvrtc:
    """Compiles to a recognizable blob, or fails when told to."""

    def __init__(self, fail: str = ""):
        self.fail, self.calls = fail, []

    def compile(self, source: str, program: str, name: str, opts: list[str]) -> tuple[bytes, str]:
        self.calls.append((source, program, name))
        if self.fail:
            raise RuntimeError(self.fail)
        return b"CUBIN:" + name.encode(), "_Z" + name.replace(":", "")


VARIANT = ("dflash_k_4", "// header\n", "  y[0] = x[0];", [("x", mx.bfloat16)], [("y", mx.bfloat16)])


def test_a_variant_is_compiled_and_written_once_then_found(tmp_path: Path) -> None:
    nvrtc = FakeNvrtc()
    cache = KernelCache(tmp_path, nvrtc, ["--opt"])
    cache.keep(*VARIANT)
    cache.keep(*VARIANT)  # the same variant again in the process: nothing more
    cache.wait()
    source = mlx_source(*VARIANT)
    path = module_path(tmp_path, module_name("dflash_k_4", source))
    assert path.read_bytes() == b"CUBIN:mlx::core::cu::custom_kernel_dflash_k_4"
    assert path.with_suffix(".txt").read_text() == ("mlx::core::cu::custom_kernel_dflash_k_4\t"
                                                    "_Zmlxcorecucustom_kernel_dflash_k_4\n")
    assert len(nvrtc.calls) == 1 and (cache.kept, cache.found, cache.left) == (1, 0, 0)
    compiled, program, name = nvrtc.calls[0]
    assert compiled == source.replace(kernel_cache.MLX_HEADER, kernel_cache.COMPILED_HEADER)
    assert "utils.cuh" not in compiled and program == module_name("dflash_k_4", source) + ".cu"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".part-")]
    later = KernelCache(tmp_path, FakeNvrtc(), [])  # the next process
    later.keep(*VARIANT)
    assert (later.kept, later.found) == (0, 1) and "0 compiled and kept, 1 found" in later.status()
    other = KernelCache(tmp_path, FakeNvrtc(), [])  # other dtypes are another module
    other.keep(VARIANT[0], VARIANT[1], VARIANT[2], [("x", mx.float32)], [("y", mx.float32)])
    other.wait()
    assert other.kept == 1


def test_a_launch_does_not_wait_for_its_variants_compile(tmp_path: Path) -> None:
    import threading

    go = threading.Event()

    class Slow(FakeNvrtc):
        def compile(self, *args):
            assert go.wait(30)
            return super().compile(*args)

    cache = KernelCache(tmp_path, Slow(), [])
    cache.keep(*VARIANT)  # returns while the worker waits
    assert cache.kept == 0 and "1 compiling" in cache.status()
    go.set()
    cache.wait()
    assert cache.kept == 1 and "compiling" not in cache.status()


def test_what_cannot_be_kept_is_left_to_mlx_and_said(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path, FakeNvrtc(fail="nvrtcCompileProgram: error"), [])
    cache.keep(*VARIANT)
    cache.wait()
    assert (cache.kept, cache.left) == (0, 1) and not list(tmp_path.iterdir())
    assert "1 left to MLX (RuntimeError: nvrtcCompileProgram: error)" in cache.status()
    odd = FakeNvrtc()
    odd.compile = lambda *args: (_ for _ in ()).throw(ValueError("an odd failure"))  # any error: left, never raised
    other = KernelCache(tmp_path, odd, [])
    other.keep(*VARIANT)
    other.wait()
    assert other.left == 1 and "ValueError: an odd failure" in other.status()
    shaped = KernelCache(tmp_path, FakeNvrtc(), [])
    shaped.keep("k", "", "  y[0] = x_shape[0];", [("x", mx.float32)], [("y", mx.float32)])
    assert shaped.left == 1 and "shape" in shaped.why and not list(tmp_path.iterdir())


def test_a_baked_kernel_keeps_each_variant_at_its_first_launch(monkeypatch, tmp_path: Path) -> None:
    cache = KernelCache(tmp_path, FakeNvrtc(), [])
    monkeypatch.setattr(baked_kernel, "on_cuda", lambda: True)
    monkeypatch.setattr(kernel_cache, "active", lambda: cache)
    launched = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **made: lambda **call: launched.append((made, call)) or ["out"])
    kernel = baked_kernel.BakedKernel("dflash_k", ["x"], ["y"], "  y[0] = x[0];  // copy", "// header\n#define K 1\n")
    x = mx.zeros((2,), dtype=mx.bfloat16)
    for n in (4, 4, 8):
        assert kernel([x], [("N", n)], output_dtypes=[mx.bfloat16]) == ["out"]
    cache.wait()
    assert len(launched) == 3 and cache.kept == 2
    # kept under the module name of the source MLX is given: header and body compacted (cuda_source.compact)
    expected = mlx_source("dflash_k_4", "#define K 1\n", "  constexpr int N = 4;\n\ny[0] = x[0];\n", [("x", mx.bfloat16)],
                          [("y", mx.bfloat16)])
    assert module_path(tmp_path, module_name("dflash_k_4", expected)).exists()
    assert launched[0][0]["source"] == "  constexpr int N = 4;\n\ny[0] = x[0];\n"  # what MLX is given: the same body
    assert launched[0][0]["header"] == "#define K 1\n"


def test_off_a_cuda_gpu_no_variant_is_kept(monkeypatch) -> None:
    monkeypatch.setattr(baked_kernel, "on_cuda", lambda: False)
    monkeypatch.setattr(kernel_cache, "active", lambda: pytest.fail("the cache was asked for off CUDA"))
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **made: lambda **call: ["out"])
    assert baked_kernel.BakedKernel("k", ["x"], ["y"], "", "")([mx.zeros((1,))], [], output_dtypes=[mx.float32]) == ["out"]


def mlx_like(folder: Path):
    """Stands in for `mx.fast.cuda_kernel` as MLX behaves: a kernel whose module (by the name MLX would give it)
    is kept in `folder` runs the kept code, which for the canary writes 2; otherwise MLX's own compile, 1."""
    def make(name, input_names, output_names, source, header="", ensure_row_contiguous=True):
        def call(inputs, grid, threadgroup, output_shapes, output_dtypes):
            src = mlx_source(name, header, source, list(zip(input_names, (x.dtype for x in inputs))),
                             list(zip(output_names, output_dtypes)))
            return [mx.array([2.0 if module_path(folder, module_name(name, src)).exists() else 1.0])]
        return call
    return make


def test_the_cache_is_on_only_where_mlx_launches_what_it_keeps(monkeypatch, tmp_path: Path) -> None:
    nvrtc = FakeNvrtc()
    monkeypatch.setattr(mx.fast, "cuda_kernel", mlx_like(tmp_path))
    cache = KernelCache(tmp_path, nvrtc, [])
    kernel_cache.prove(cache)  # compiles the canary's kept code (writing 2) and launches it
    assert len(nvrtc.calls) == 1 and "out[0] = 2.0f;" in nvrtc.calls[0][0]
    kernel_cache.prove(KernelCache(tmp_path, nvrtc, []))  # kept already: one launch, no compile
    assert len(nvrtc.calls) == 1
    monkeypatch.setattr(mx.fast, "cuda_kernel", mlx_like(tmp_path / "elsewhere"))  # an MLX that looks elsewhere
    with pytest.raises(RuntimeError, match="MLX ran its own compile of the canary kernel"):
        kernel_cache.prove(cache)
    # in the process: off, with the reason on the startup line, and no variant kept
    monkeypatch.setattr(kernel_cache, "_cache", None)
    monkeypatch.setattr(kernel_cache, "_off", "")
    made = lambda path: type("N", (), {"version": lambda self: (13, 0), "path": path})()  # noqa: E731
    monkeypatch.setattr(kernel_cache, "Nvrtc", made)
    monkeypatch.setattr(kernel_cache, "Apart", lambda path: nvrtc)  # compiles in processes of their own: test_nvrtc.py
    monkeypatch.setattr(kernel_cache, "architecture", lambda: (9, 0))
    monkeypatch.setattr(kernel_cache, "cache_dir", lambda: tmp_path)
    assert kernel_cache.active() is None
    assert kernel_cache.status().startswith("kernel cache off: RuntimeError: MLX ran its own compile of the canary")
    monkeypatch.setattr(kernel_cache, "_off", "")
    monkeypatch.setattr(mx.fast, "cuda_kernel", mlx_like(tmp_path))
    assert kernel_cache.active().nvrtc is nvrtc and kernel_cache.status().startswith("kernels: 0 compiled and kept")
    # compiles in processes of their own run a core each (the warm-up waits for them); in this process NVRTC
    # compiles one at a time, and half the cores' threads only queue there
    monkeypatch.setattr(kernel_cache.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setattr(kernel_cache, "ThreadPoolExecutor", lambda threads, **_: ("threads", threads))
    assert kernel_cache.workers(apart=True) == ("threads", 12) and kernel_cache.workers(apart=False) == ("threads", 6)
    monkeypatch.setattr(kernel_cache, "_cache", None)
    assert kernel_cache.active().pool == ("threads", 12)


# -- on a CUDA GPU ----------------------------------------------------------------------------------------------

PROBE = r"""
import json, sys, time
import numpy as np
import mlx.core as mx
from dflash_bench.engine import kernel_cache, matmul_kernel
from dflash_bench.engine.targets import norm_rope_kernel
if sys.argv[1] == "mlx":  # MLX compiles every variant itself, as before the cache
    kernel_cache.active = lambda: None
mx.random.seed(0)
q, s, b = mx.quantize(mx.random.normal((256, 512)).astype(mx.bfloat16) * 0.05, group_size=64, bits=4)
x = mx.random.normal((16, 512)).astype(mx.bfloat16)
k, v = (mx.random.normal((16, 128)).astype(mx.bfloat16) for _ in range(2))
w = mx.random.normal((64,)).astype(mx.bfloat16)
pos = mx.arange(100, 116, dtype=mx.int32)
out, first = {}, {}
for name, launch in [("rows 1", lambda: matmul_kernel.rows_matmul(x[:1], q, s, b, 4, 64)),
                     ("rows 16", lambda: matmul_kernel.rows_matmul(x, q, s, b, 4, 64)),
                     ("norm and rope", lambda: norm_rope_kernel.keys(k, v, w, pos, 10000.0, 1e-6))]:
    t0 = time.perf_counter()
    y = launch()
    mx.eval(y)
    first[name] = time.perf_counter() - t0
    out[name] = np.array(y.view(mx.uint16)).tolist()
cache = kernel_cache.active()
if cache is not None:
    cache.wait()  # the compiles the launches started (they ran beside MLX's own)
print(json.dumps({"out": out, "first": first, "status": kernel_cache.status()}))
"""


def probe(mode: str, folder: Path) -> dict:
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(folder), PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    got = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


@on_cuda
def test_on_the_device_the_source_is_what_mlx_generates(capfd) -> None:
    q, s, b = mx.quantize(mx.random.normal((256, 512)).astype(mx.bfloat16), group_size=64, bits=4)
    x = mx.random.normal((3, 512)).astype(mx.bfloat16)
    call = matmul_kernel.launch(3, 512, 256, 4, 64, ())
    kernel = matmul_kernel._kernel(0)
    template = call.options["template"]
    inputs = [x, q, s, b, call.rows, x, x]
    capfd.readouterr()
    mx.eval(kernel.kernel(tuple(template))(inputs=inputs, verbose=True, **{
        k: v for k, v in call.options.items() if k != "template"}))
    printed = capfd.readouterr().out
    generated = printed.split("```\n", 1)[1].rsplit("\n```", 1)[0]
    assert generated == mlx_source(*kernel.variant(tuple(template), [a.dtype for a in inputs], [mx.bfloat16]))


@on_cuda
def test_on_the_device_kept_code_launches_with_mlxs_bits_and_is_what_mlx_launches(tmp_path: Path) -> None:
    mlx = probe("mlx", tmp_path / "mlx")  # MLX's own compile, nothing kept
    kept = probe("kept", tmp_path / "kept")  # MLX compiles each variant as a worker compiles and keeps it
    found = probe("kept", tmp_path / "kept")  # a later process: every variant found, MLX loads the kept code
    print("first launches (s): MLX compiles", mlx["first"], "| kept", kept["first"], "| found", found["first"])
    assert kept["out"] == mlx["out"] and found["out"] == mlx["out"]
    # two variants: one row and 16 rows launch the same one (the row count is an input, not baked)
    assert "2 compiled and kept, 0 found" in kept["status"] and "0 compiled and kept, 2 found" in found["status"]
    # the one-row variant's kept module swapped for a kernel of the same name that writes 7s: MLX launches it
    template = tuple(matmul_kernel.launch(1, 512, 256, 4, 64, ()).options["template"])
    dtypes = [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16, mx.int32, mx.bfloat16, mx.bfloat16]
    name, header, body, inputs, outputs = matmul_kernel._kernel(0).variant(template, dtypes, [mx.bfloat16])
    assert name.startswith("dflash_rows_matmul_")
    real = mlx_source(name, header, body, inputs, outputs)
    sevens = mlx_source(name, header, baked_kernel.constants(template) +
                        "  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0)\n"
                        "    for (int i = 0; i < rows[0] * N; ++i) y[i] = __float2bfloat16(7.0f);", inputs, outputs)
    cache = kernel_cache.active()
    assert cache is not None, kernel_cache.status()  # the canary proved MLX launches kept code here
    cubin, mangled = cache.nvrtc.compile(sevens.replace(kernel_cache.MLX_HEADER, kernel_cache.COMPILED_HEADER),
                                         "sevens.cu", f"mlx::core::cu::custom_kernel_{name}", cache.opts)
    path = module_path(tmp_path / "kept", module_name(name, real))
    assert path.exists()
    kernel_cache.write(path, cubin, f"mlx::core::cu::custom_kernel_{name}\t{mangled}\n")
    swapped = probe("kept", tmp_path / "kept")
    for rows in ("rows 1", "rows 16"):  # one variant for both
        assert np.all(np.array(swapped["out"][rows], dtype=np.uint16) == 0x40E0)  # bf16 7.0
    assert swapped["out"]["norm and rope"] == mlx["out"]["norm and rope"]
