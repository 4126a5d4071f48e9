"""Our CUDA kernels' compiled code kept on disk, so only a machine's first process compiles them.

MLX compiles a `mx.fast.cuda_kernel` with NVRTC at its first launch in a process and, unlike its own
kernels, never writes the result to its disk cache (`get_jit_module(..., false)` in MLX's
backend/cuda/custom_kernel.cpp), though it looks there first for every module, ours included. So every
process compiled each of our kernel variants again: on an H100, warming the 9B's 33 shapes took 144 s
and the default model's 99.6 s though the same model had run there minutes before
(docs/profiles/engine-speed-h100-42.txt). `KernelCache.keep`, at a variant's first launch in a process,
compiles it on a worker (in a process of its own: engine/nvrtc.py) and writes the code where MLX looks for
it, under the module name MLX gives it (the kernel's name and libstdc++'s `std::hash` of the source MLX
generates around our body: `mlx_source`, `module_name`), so every later process on the machine loads it
instead of compiling.

What is compiled is that source with MLX's NVRTC options (`options`), but for one line: MLX resolves its
default header (`mlx/backend/cuda/device/utils.cuh`) from headers built into its library, which no file
holds, so here it becomes the CUDA headers that one includes (`COMPILED_HEADER`). Our kernels use none
of MLX's own definitions, so the function compiled is the same: with NVRTC 13.0 for sm_90a, 82 of 88
variants (every launch of the kernel tests' emulated runs) gave MLX's machine code byte for byte, and the
other 6 (the drafter's norm-and-RoPE, whose sinf/cosf read a table) differed only in the constant-bank
offset that table's address is read from (2-8 instructions), which MLX's headers' own globals move
(docs/gpu-round-profile.md, session 42). On a GPU, tests/test_kernel_cache.py checks that launches from
the kept code equal MLX's own compile bit for bit, and that MLX launches what is kept (passed on an H100:
docs/profiles/engine-speed-h100-43.txt, where a later start warmed the 9B in 5.1 s against a first start's
91.3 s); the self-check proves every kernel where it runs, whichever compiled it (selfcheck.py).

The cache turns itself on in a process only after a canary proves MLX launches kept code (`prove`: the
kernel MLX is given writes 1, the code kept under its module name writes 2), so a name or folder that is
not this MLX's turns it off instead of compiling everything twice. Anything that stops a variant from
being kept (no NVRTC library, no writable folder, a compile error, a body reading an input's `_shape`)
leaves it to MLX, which compiles it as before; `status` says how many were compiled and kept, found and
left, or why the cache is off, for the startup line. With it on, the warm-up builds every forward first
so the workers compile their variants side by side before any runs (warmup.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import mlx.core as mx

from dflash_bench.engine.nvrtc import Apart, Nvrtc

SEED = 0xC70F6907  # libstdc++'s seed for std::hash<std::string> (`std::_Hash_bytes`)
MAX_NAME = 245  # MLX's longest cache file name before it nests folders (jit_module.cpp's get_ptx_path)
MLX_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
COMPILED_HEADER = """
#define LIBCUDACXX_ENABLE_SIMPLIFIED_COMPLEX_OPERATIONS
#include <cuda/std/complex>
#include <cuda/std/type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>

#include <cooperative_groups.h>

"""
# The C++ type MLX writes for an array of each dtype (its backend/cuda/utils.cpp's dtype_to_cuda_type)
CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
              mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
              mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double"}


def std_hash(text: str) -> int:
    """`std::hash<std::string>` of `text`, as MLX's process computes it (libstdc++'s `_Hash_bytes`)."""
    data = text.encode()
    return _hash_bytes()(data, len(data), SEED)


@lru_cache(maxsize=1)
def _hash_bytes():
    lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    fn = lib._ZSt11_Hash_bytesPKvmm
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return fn


def mlx_source(name: str, header: str, body: str, inputs: list[tuple[str, mx.Dtype]],
               outputs: list[tuple[str, mx.Dtype]]) -> str:
    """The source MLX generates for a `cuda_kernel` called `name` (no template arguments: baked_kernel.py
    writes them into the body) with these (name, dtype) inputs and outputs, none of whose `_shape`,
    `_strides` or `_ndim` the body reads (MLX would add parameters for them)."""
    params = [f"    const {CUDA_TYPES[d]}* {n},\n" for n, d in inputs]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in outputs]
    return (MLX_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            + f"__global__ void custom_kernel_{name}(\n" + "".join(params[:len(inputs)])
            + ",\n".join(params[len(inputs):]) + ") {\n" + body + "\n}\n\n} // namespace mlx::core::cu\n")


def module_name(name: str, source: str) -> str:
    """MLX's module name for the kernel (custom_kernel.cpp's `eval_gpu`)."""
    return f"custom_kernel_{name}_{std_hash(source):x}"


def cache_dir() -> Path:
    """The folder MLX reads compiled modules from (jit_module.cpp's `ptx_cache_dir`): MLX_PTX_CACHE_DIR, else
    the temporary folder's mlx/VERSION/ptx (std::filesystem::temp_directory_path's variables, then /tmp)."""
    named = os.environ.get("MLX_PTX_CACHE_DIR")
    if named is not None:
        return Path(named).absolute()
    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def module_path(folder: Path, module: str) -> Path:
    """Where MLX looks for a module's compiled code (jit_module.cpp's `get_ptx_path`)."""
    if len(module) <= MAX_NAME:
        return folder / f"{module}.ptx"
    parts = [module[i : i + MAX_NAME] for i in range(0, len(module), MAX_NAME)]
    return folder.joinpath(*parts[:-1], parts[-1] + ".ptx")


def architecture() -> tuple[int, int]:
    """The device's compute capability, from MLX's device info ("sm_90")."""
    digits = str(mx.device_info().get("architecture", "")).removeprefix("sm_")
    if not digits.isdigit() or len(digits) < 2:
        raise RuntimeError(f"no compute capability in MLX's device info: {digits!r}")
    return int(digits[:-1]), int(digits[-1])


def include_paths() -> list[Path]:
    """MLX's NVRTC include folders (jit_module.cpp's `include_path_args`): the headers in MLX's package, its
    CCCL, then the CUDA runtime's (the CUDA 13 pip package beside MLX's, as MLX's CUDA 13 builds look for it,
    else CUDA_HOME, CUDA_PATH or /usr/local/cuda)."""
    root = Path(mx.__file__).resolve().parent
    out = [p for p in (root / "include", root / "include" / "cccl") if p.exists()]
    cudart = root.parent / "nvidia" / "cu13" / "include"
    if not cudart.exists():
        cudart = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda") / "include"
    return out + [cudart]


def options(major: int, minor: int, includes: list[Path]) -> list[str]:
    """MLX's NVRTC options for a device it compiles machine code (SASS) for (jit_module.cpp's `compile`)."""
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return ["--device-as-default-execution-space", f"--gpu-architecture={arch}",
            *(f"--include-path={p}" for p in includes)]


def loaded(prefix: str) -> str | None:
    """The file of a shared library this process has loaded whose name starts with `prefix`, if any (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    return next((p for p in (line.rsplit(" ", 1)[-1] for line in maps.splitlines()) if Path(p).name.startswith(prefix)),
                None)


@dataclass
class KernelCache:
    """Keeps each kernel variant's compiled module in MLX's cache folder, from its first launch in the process
    (`keep`); counts what it did, for the startup line (`status`).

    A variant not on disk is compiled on a worker thread, which hands the compile to a process of its own
    (`nvrtc` is an `Apart` where `active` makes the cache and such a process works: NVRTC compiles one program
    at a time in a process, engine/nvrtc.py; `compiler`), and its launch does not wait: a launch that meets a variant first (one the warm-up did
    not build ahead) is MLX's own compile, as before, and the next process finds the kept code. The warm-up
    waits (`wait`) after building every forward without evaluating it, so a first start's variants compile
    side by side on the host's cores, where MLX compiles them one after another at their launches
    (warmup.py)."""

    folder: Path
    nvrtc: Nvrtc | Apart  # anything with Nvrtc.compile's signature
    opts: list[str]
    kept: int = 0  # compiled here and written
    found: int = 0  # already on disk: MLX loads it without compiling
    left: int = 0  # not kept (the reason in `why`): MLX compiles it itself
    why: str = ""
    note: str = ""  # how it compiles, where not in processes of their own (`compiler`)
    seen: set = field(default_factory=set)
    jobs: list[Future] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pool: ThreadPoolExecutor = field(default_factory=lambda: workers(apart=False))

    def keep(self, name: str, header: str, body: str, inputs: list[tuple[str, mx.Dtype]],
             outputs: list[tuple[str, mx.Dtype]]) -> None:
        """Make sure MLX will find this variant compiled: unless it is on disk already, compile and write it on a
        worker (`wait` joins the workers)."""
        key = (name, tuple(d for _, d in inputs), tuple(d for _, d in outputs))
        if key in self.seen:
            return
        self.seen.add(key)
        try:
            if any(f"{n}_{what}" in body for n, _ in inputs for what in ("shape", "strides", "ndim")):
                raise RuntimeError(f"{name} reads an input's shape, which MLX passes in parameters not written here")
            source = mlx_source(name, header, body, inputs, outputs)
            module = module_name(name, source)
            if module_path(self.folder, module).exists():
                self.found += 1
                return
            self.jobs.append(self.pool.submit(self.compile, name, source, module))
        except Exception as e:  # noqa: BLE001 (a variant not kept is MLX's to compile, never an error of its launch)
            self.leave(e)

    def build(self, name: str, source: str, module: str) -> None:
        """`source` (MLX's, with `COMPILED_HEADER` for MLX's header) compiled as MLX compiles module `module`, and
        written where MLX looks for that module."""
        function = f"mlx::core::cu::custom_kernel_{name}"
        cubin, mangled = self.nvrtc.compile(source.replace(MLX_HEADER, COMPILED_HEADER, 1), module + ".cu", function,
                                            self.opts)
        write(module_path(self.folder, module), cubin, f"{function}\t{mangled}\n")

    def compile(self, name: str, source: str, module: str) -> None:
        """`build`, on a worker: counted kept, or left to MLX with the reason. Any failure is caught: a variant
        the cache could not keep is MLX's to compile, never an error of the launch or of `wait`."""
        try:
            self.build(name, source, module)
        except Exception as e:  # noqa: BLE001 (see the docstring)
            self.leave(e)
            return
        with self.lock:
            self.kept += 1

    def leave(self, error: Exception) -> None:
        with self.lock:
            self.left += 1
            self.why = self.why or f"{type(error).__name__}: {error}"[:300]

    def wait(self) -> None:
        """Join the compiles started so far."""
        for job in self.jobs:
            job.result()

    def status(self) -> str:
        """What the process's first launches did: "kernels: 12 compiled and kept, 30 found in FOLDER"."""
        with self.lock:
            busy = sum(not job.done() for job in self.jobs)
            line = f"kernels: {self.kept} compiled and kept, {self.found} found in {self.folder}"
            line += f", {busy} compiling" if busy else ""
            line += f", {self.left} left to MLX ({self.why})" if self.left else ""
            return line + (f"; {self.note}" if self.note else "")


def workers(apart: bool) -> ThreadPoolExecutor:
    """The cache's compile threads: one a core this process may use where each compile is a process of its own
    (`apart`: the warm-up's build-ahead pass waits for them, so the cores are otherwise idle, and an NVRTC process
    is one core's work, engine/nvrtc.py), half of them in this process, where NVRTC compiles one program at a time
    whatever the threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return ThreadPoolExecutor(cores if apart else max(1, cores // 2), thread_name_prefix="kernel-cache")


def write(path: Path, cubin: bytes, names: str) -> None:
    """The module's files as MLX writes them (its code, then its kernels' lowered names), each renamed into
    place whole, so a process reading the folder meanwhile never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, data in ((path.with_suffix(".txt"), names.encode()), (path, cubin)):  # the code last: MLX reads it first
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)


TRIVIAL = "__global__ void dflash_kernel_cache_probe() {}\n"


def compiler(nvrtc: Nvrtc, opts: list[str]) -> tuple[Nvrtc | Apart, str]:
    """The cache's compiler and the note for its status: compiles in processes of their own (`Apart`, side by
    side) where a trivial one works there (about 0.1 s at a process's start), else `nvrtc` in this process,
    one compile at a time, as before engine/nvrtc.py, with the reason."""
    apart = Apart(nvrtc.path)
    try:
        apart.compile(TRIVIAL, "probe.cu", "dflash_kernel_cache_probe", opts)
    except Exception as e:  # noqa: BLE001 (no compile process here: the cache still keeps what it compiles)
        return nvrtc, f"compiling in this process, one at a time ({type(e).__name__}: {e})"[:300]
    return apart, ""


CANARY = "dflash_kernel_cache_canary"
ASKED, KEPT = "  out[0] = 1.0f;", "  out[0] = 2.0f;"  # the canary's body as MLX is given it, and as it is kept


def prove(cache: KernelCache) -> None:
    """Raise unless MLX launches the code kept in `cache`'s folder: the canary kernel MLX is asked to run writes
    1, the code kept under the module name MLX would give it writes 2 (compiled here once a folder). A 1 means
    MLX compiled the canary itself: the name or folder here is not MLX's (another MLX version's layout), and
    nothing is kept in that process. The check costs one small launch where the canary is kept already."""
    io = ([("x", mx.float32)], [("out", mx.float32)])
    module = module_name(CANARY, mlx_source(CANARY, "", ASKED, *io))
    if not module_path(cache.folder, module).exists():
        cache.build(CANARY, mlx_source(CANARY, "", KEPT, *io), module)
    kernel = mx.fast.cuda_kernel(name=CANARY, input_names=["x"], output_names=["out"], source=ASKED, header="",
                                 ensure_row_contiguous=True)
    (out,) = kernel(inputs=[mx.zeros((1,), dtype=mx.float32)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                    output_shapes=[(1,)], output_dtypes=[mx.float32])
    got = out.item()
    if got != 2.0:
        raise RuntimeError(f"MLX ran its own compile of the canary kernel (it wrote {got:g}), not the code kept in "
                           f"{cache.folder}: the module names or folder here are not this MLX's")


_cache: KernelCache | None = None
_off = ""  # why the cache is off, once `active` has found it so


def active() -> KernelCache | None:
    """The process's kernel cache on a CUDA device whose NVRTC makes machine code and whose MLX launches what is
    kept (`prove`), else None (`status` says why)."""
    global _cache, _off
    if _cache is None and not _off:
        try:
            nvrtc = Nvrtc(loaded("libnvrtc.so"))  # the library MLX loaded: MLX's compiler
            if nvrtc.version() < (11, 8):  # MLX compiles PTX then (jit_module.cpp), which this does not write
                raise RuntimeError(f"NVRTC {nvrtc.version()} makes PTX, not machine code")
            opts = options(*architecture(), include_paths())
            chosen, note = compiler(nvrtc, opts)
            cache = KernelCache(cache_dir(), chosen, opts, note=note, pool=workers(apart=chosen is not nvrtc))
            prove(cache)
            _cache = cache
        except Exception as e:  # noqa: BLE001 (anything that stops the cache leaves compiling to MLX, as before it)
            _off = f"kernel cache off: {type(e).__name__}: {e}"[:300]
    return _cache



def status() -> str:
    """The process's kernel cache for the startup line: what it did, or why it is off ("" before any launch)."""
    return _cache.status() if _cache is not None else _off
