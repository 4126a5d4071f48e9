"""NVRTC through ctypes, and compiles run in processes of their own (`Apart`), for engine/kernel_cache.py.

NVRTC compiles one program at a time in a process, whatever the threads: on this project's 2-core CPU, 8 of
the row kernel's variants compiled in 8.8 s one after another, 8.6 s on 2 threads and 5.6 s in 2 processes
(NVRTC 13.0, tools/nvrtc_probe.py, docs/profiles/nvrtc-probe-cpu.txt), and on an H100's 16-core host 8
threads compiled the 9B's 126 variants in 82 s, about 5 s a variant a thread against ~1.1 s alone
(docs/profiles/engine-speed-h100-43.txt). So the kernel cache's workers each hand their compile to a Python
process running this file (`python -I`: the standard library only, no MLX, no package import) with the
library MLX loaded, and its compiles run side by side on the host's cores. A compile that crashes NVRTC
takes down that process, not the server.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 600  # one compile; MLX's naive quantized matmul took minutes in NVRTC (issue 15), ours take seconds


class Nvrtc:
    """The few NVRTC calls a compile needs, through ctypes, from the library at `path` (a file or a name for
    the loader)."""

    def __init__(self, path: str | None = None):
        self.path = path or ctypes.util.find_library("nvrtc") or "libnvrtc.so"
        preload_builtins(self.path)
        self.lib = ctypes.CDLL(self.path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def _check(self, result: int, call: str, log: str = "") -> None:
        if result:
            raise RuntimeError(f"{call}: {self.lib.nvrtcGetErrorString(result).decode()}{log}")

    def compile(self, source: str, program: str, name: str, opts: list[str]) -> tuple[bytes, str]:
        """(cubin, the lowered name of the function `name`) of `source` compiled with `opts`."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), program.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            self._check(self.lib.nvrtcAddNameExpression(prog, name.encode()), "nvrtcAddNameExpression")
            args = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
            result = self.lib.nvrtcCompileProgram(prog, len(opts), args)
            if result:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(prog, log)
                self._check(result, "nvrtcCompileProgram", f": {log.value.decode(errors='replace')[:2000]}")
            lowered = ctypes.c_char_p()
            self._check(self.lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
            mangled = lowered.value.decode()
            size = ctypes.c_size_t()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw, mangled
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def preload_builtins(path: str) -> None:
    """NVRTC opens its builtins library (`libnvrtc-builtins.so.MAJOR.MINOR`) by name at its first compile; the
    pip package's library has no run path to find it beside itself, so a process that loads NVRTC by its file
    (a compile process here, with none of MLX's loading done) loads the builtins beside it first."""
    folder = Path(path).parent
    if not Path(path).is_absolute() or not folder.is_dir():
        return
    for builtins in sorted(folder.glob("libnvrtc-builtins.so.*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)


class Apart:
    """`Nvrtc.compile`, each call in a process of its own running this file (module docstring); the same
    signature, so the kernel cache takes either."""

    def __init__(self, path: str):
        self.path = path

    def compile(self, source: str, program: str, name: str, opts: list[str]) -> tuple[bytes, str]:
        job = json.dumps({"library": self.path, "source": source, "program": program, "name": name, "opts": opts})
        done = subprocess.run([sys.executable, "-I", str(Path(__file__).resolve())], input=job.encode(),
                              capture_output=True, timeout=TIMEOUT_S)
        if done.returncode != 0:
            last = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise RuntimeError(f"NVRTC's process: {last}"[:2000])
        mangled, _, cubin = done.stdout.partition(b"\n")
        if not cubin:
            raise RuntimeError("NVRTC's process wrote no code")
        return cubin, mangled.decode()


def main() -> None:
    """A compile process: the job (JSON on stdin) compiled; the lowered name, a newline, then the code, on stdout."""
    job = json.loads(sys.stdin.buffer.read())
    cubin, mangled = Nvrtc(job["library"]).compile(job["source"], job["program"], job["name"], job["opts"])
    sys.stdout.buffer.write(mangled.encode() + b"\n" + cubin)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001 (one line for the parent, which leaves the variant to MLX)
        print(f"{type(e).__name__}: {e}".replace("\n", " "), file=sys.stderr)
        sys.exit(1)
