"""engine/nvrtc.py: the kernel cache's compiles, each in a process of its own.

NVRTC compiles one program at a time in a process (the module's docstring has the figures), so `Apart` runs
each compile in a Python process of its own. On any machine with a C compiler, a stand-in NVRTC library (the
calls `Nvrtc` makes, compiling a program to its source's bytes behind a NUL and a newline) shows: the code and
lowered name come back byte for byte; a compile error comes back as one line and leaves the variant to MLX;
the builtins library beside NVRTC is loaded before it (the pip package's NVRTC cannot find it otherwise); and
two compiles run at the same time in two processes, where two threads of one process never meet one in
another process (the negative control)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from dflash_bench.engine import kernel_cache
from dflash_bench.engine.kernel_cache import KernelCache, mlx_source, module_name, module_path
from dflash_bench.engine.nvrtc import Apart, Nvrtc

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="builds a stand-in NVRTC library with a C compiler")

FAKE = r"""
#include <dirent.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
typedef struct { char *src; char name[256]; char lowered[300]; char log[256]; } prog_t;
const char *nvrtcGetErrorString(int r) { return r ? "FAKE_ERROR" : "FAKE_SUCCESS"; }
int nvrtcVersion(int *a, int *b) { *a = 13; *b = 0; return 0; }
int nvrtcCreateProgram(prog_t **p, const char *src, const char *name, int n, const char **h, const char **i) {
  *p = calloc(1, sizeof(prog_t)); (*p)->src = strdup(src); return 0; }
int nvrtcAddNameExpression(prog_t *p, const char *name) { snprintf(p->name, sizeof p->name, "%s", name); return 0; }
/* FAKE_NVRTC_MEET=FOLDER:SECONDS: wait until a compile of another process has written its pid into FOLDER */
static int meet(const char *spec) {
  char folder[512], mine[600]; double limit = 0;
  if (sscanf(spec, "%511[^:]:%lf", folder, &limit) != 2) return 0;
  snprintf(mine, sizeof mine, "%s/%d", folder, (int)getpid());
  FILE *f = fopen(mine, "w"); if (f) fclose(f);
  char me[32]; snprintf(me, sizeof me, "%d", (int)getpid());
  for (double waited = 0; waited < limit; waited += 0.01) {
    DIR *d = opendir(folder); struct dirent *e; int other = 0;
    while (d && (e = readdir(d))) if (e->d_name[0] != '.' && strcmp(e->d_name, me)) other = 1;
    if (d) closedir(d);
    if (other) return 1;
    struct timespec t = {0, 10000000}; nanosleep(&t, 0);
  }
  return 0;
}
int nvrtcCompileProgram(prog_t *p, int n, const char **opts) {
  if (!dlsym(RTLD_DEFAULT, "fake_builtins_loaded")) { strcpy(p->log, "no builtins"); return 6; }
  if (strstr(p->src, "#error")) { strcpy(p->log, "x.cu(1): error: told to fail"); return 6; }
  const char *spec = getenv("FAKE_NVRTC_MEET");
  if (spec && !meet(spec)) { strcpy(p->log, "met no compile of another process"); return 6; }
  snprintf(p->lowered, sizeof p->lowered, "_Z%s", p->name); return 0; }
int nvrtcGetProgramLogSize(prog_t *p, size_t *s) { *s = strlen(p->log) + 1; return 0; }
int nvrtcGetProgramLog(prog_t *p, char *log) { strcpy(log, p->log); return 0; }
int nvrtcGetLoweredName(prog_t *p, const char *name, const char **out) { *out = p->lowered; return 0; }
int nvrtcGetCUBINSize(prog_t *p, size_t *s) { *s = strlen(p->src) + 2; return 0; }
int nvrtcGetCUBIN(prog_t *p, char *out) {
  out[0] = '\0'; out[1] = '\n'; memcpy(out + 2, p->src, strlen(p->src)); return 0; }
int nvrtcDestroyProgram(prog_t **p) { free((*p)->src); free(*p); *p = 0; return 0; }
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> str:
    """A stand-in NVRTC in a folder beside its builtins library, as the pip package lays them out."""
    folder = tmp_path_factory.mktemp("nvrtc")
    (folder / "fake.c").write_text(FAKE)
    (folder / "builtins.c").write_text("int fake_builtins_loaded = 1;\n")
    for src, out in (("fake.c", "libnvrtc.so.13"), ("builtins.c", "libnvrtc-builtins.so.13.0")):
        subprocess.run([CC, "-shared", "-fPIC", "-o", str(folder / out), str(folder / src), "-ldl"], check=True)
    return str(folder / "libnvrtc.so.13")


def test_a_compile_apart_gives_the_code_and_name_byte_for_byte(library: str) -> None:
    source = "__global__ void k() {}\n\t\u00e9"
    cubin, mangled = Apart(library).compile(source, "k.cu", "mlx::core::cu::k", ["--opt"])
    assert cubin == b"\0\n" + source.encode() and mangled == "_Zmlx::core::cu::k"
    assert (cubin, mangled) == Nvrtc(library).compile(source, "k.cu", "mlx::core::cu::k", ["--opt"])


def test_the_builtins_beside_nvrtc_are_loaded_first(library: str, tmp_path: Path) -> None:
    alone = tmp_path / "libnvrtc.so.13"  # the same library without its builtins beside it
    shutil.copy(library, alone)
    with pytest.raises(RuntimeError, match="no builtins"):
        Apart(str(alone)).compile("x", "x.cu", "k", [])
    Apart(library).compile("x", "x.cu", "k", [])


def test_a_failed_compile_apart_is_one_line_and_left_to_mlx(library: str, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"^NVRTC's process: RuntimeError: nvrtcCompileProgram: FAKE_ERROR: "
                                           r"x.cu\(1\): error: told to fail$"):
        Apart(library).compile("#error", "x.cu", "k", [])
    with pytest.raises(RuntimeError, match=r"NVRTC's process: OSError: .*no-such-nvrtc"):
        Apart(str(tmp_path / "no-such-nvrtc.so")).compile("x", "x.cu", "k", [])
    cache = KernelCache(tmp_path / "ptx", Apart(library), [])
    cache.keep("k", "#error\n", "", [("x", mx.float32)], [("y", mx.float32)])
    cache.wait()
    assert (cache.kept, cache.left) == (0, 1) and "told to fail" in cache.status()


def test_the_cache_keeps_what_a_process_compiled(library: str, tmp_path: Path) -> None:
    cache = KernelCache(tmp_path, Apart(library), ["--opt"])
    variant = ("dflash_k_4", "// header\n", "  y[0] = x[0];", [("x", mx.bfloat16)], [("y", mx.bfloat16)])
    cache.keep(*variant)
    cache.wait()
    source = mlx_source(*variant)
    path = module_path(tmp_path, module_name("dflash_k_4", source))
    code = path.read_bytes()
    assert cache.kept == 1 and code.startswith(b"\0\n") and b"custom_kernel_dflash_k_4" in code
    assert path.with_suffix(".txt").read_text() == ("mlx::core::cu::custom_kernel_dflash_k_4\t"
                                                    "_Zmlx::core::cu::custom_kernel_dflash_k_4\n")


def compile_two(nvrtc, monkeypatch, folder: Path, seconds: float) -> list[str]:
    """Two compiles on two threads, each waiting (in the stand-in) for one of another process; their errors."""
    folder.mkdir()
    monkeypatch.setenv("FAKE_NVRTC_MEET", f"{folder}:{seconds}")
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            nvrtc.compile(f"// {i}", f"{i}.cu", "k", [])
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_two_compiles_apart_run_at_once_in_two_processes(library: str, monkeypatch, tmp_path: Path) -> None:
    assert compile_two(Apart(library), monkeypatch, tmp_path / "apart", 60.0) == []
    # the negative control: in one process, a compile never meets one of another process
    errors = compile_two(Nvrtc(library), monkeypatch, tmp_path / "threads", 1.0)
    assert len(errors) == 2 and all("met no compile of another process" in e for e in errors)


def test_the_probe_times_the_three_ways(library: str) -> None:
    """tools/nvrtc_probe.py (the figures in engine/nvrtc.py's docstring) against the stand-in library."""
    root = Path(__file__).resolve().parents[1]
    got = subprocess.run([sys.executable, str(root / "tools" / "nvrtc_probe.py"), "--variants", "4", "--workers", "2",
                          "--library", library, "--include", "/x", "--arch", "90"],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.splitlines()
    assert "4 row-kernel variants for sm_90" in lines[0] and len(lines) == 4
    assert [line.split(":")[0].strip() for line in lines[1:]] == ["one after another", "2 threads", "2 processes"]
    too_many = subprocess.run([sys.executable, str(root / "tools" / "nvrtc_probe.py"), "--variants", "99", "--library",
                               library, "--arch", "90"], capture_output=True, text=True, timeout=300, cwd=root)
    assert too_many.returncode != 0 and "at most 17 distinct variants" in too_many.stderr


def test_the_cache_compiles_apart_where_a_process_can_else_in_this_one(library: str, tmp_path: Path) -> None:
    chosen, note = kernel_cache.compiler(Nvrtc(library), ["--opt"])
    assert isinstance(chosen, Apart) and chosen.path == library and note == ""

    class Here:  # compiles in this process; its library cannot be loaded by another one
        path = str(tmp_path / "gone" / "libnvrtc.so.13")

        def compile(self, *args) -> tuple[bytes, str]:
            return b"code", "_Zk"

    here = Here()
    chosen, note = kernel_cache.compiler(here, [])
    assert chosen is here and note.startswith("compiling in this process, one at a time (RuntimeError: NVRTC's process")
    cache = KernelCache(tmp_path / "ptx", chosen, [], note=note)
    cache.keep("k", "", "  y[0] = x[0];", [("x", mx.float32)], [("y", mx.float32)])
    cache.wait()
    assert cache.kept == 1 and cache.status().endswith("; " + note)
