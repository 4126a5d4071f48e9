"""A CPU stand-in for `mx.fast.cuda_kernel`, to run our kernels' CUDA source where there is no GPU.

The kernel body is compiled as C++ (g++) with the CUDA built-ins it uses defined on the host: one
std::thread per CUDA thread, one block at a time, std::barrier for `__syncthreads`/`__syncwarp`, a
shared buffer for `__shfl_xor_sync`, `__shared__` arrays as the block's statics, bf16 as its bits.
It runs what the source says (indexing, staging, masking, the order of every sum, synchronization), so
a wrong index or a missing barrier shows on a CPU; what it cannot show is the device's own `expf` or
its scheduling (tests/test_attention_kernel.py's CUDA tests and the engine's self-check cover those).
Outputs start as NaN, so an element the kernel never writes stays NaN. Every input and output lies at
the end of its own mapping, right before a page with no access (`guarded`), so a read or write past
any buffer's end stops the process with SIGSEGV (pytest's faulthandler names the test) instead of
passing unseen, as it can on a GPU until a later launch trips over what it overwrote.
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

import mlx.core as mx

PRELUDE = r"""
#include <cstdint>
#include <cmath>
#include <cstring>
#include <thread>
#include <barrier>
#include <vector>
#include <algorithm>
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
static std::barrier<>* g_block_bar;
static std::barrier<>* g_warp_bars[32];
static float g_shfl[1024];
struct __nv_bfloat16 { uint16_t x; operator float() const; };
struct __half { uint16_t x; };
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = uint32_t(b.x) << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u); return {uint16_t(u >> 16)};
}
inline __nv_bfloat16::operator float() const { return __bfloat162float(*this); }
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline float __half2float(__half) { return NAN; }
inline __half __float2half_rn(float) { return {0}; }
#define __device__
#define __forceinline__ inline
#define __global__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct alignas(16) uint4 { uint32_t x, y, z, w; };
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(uint32_t i) { float f; memcpy(&f, &i, 4); return f; }
inline uint4 __ldg(const uint4* p) { return *p; }
inline uint32_t __byte_perm(uint32_t a, uint32_t b, uint32_t s) {
  const uint64_t v = (uint64_t(b) << 32) | a; uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
// bf16 arithmetic rounds its exact result once: a bf16 product and sum are exact in double here
inline __nv_bfloat16 bf16_once(double r) {
  int e; const double m = std::frexp(r, &e);
  return __float2bfloat16_rn(float(std::ldexp(std::nearbyint(std::ldexp(m, 8)), e - 8)));
}
inline __nv_bfloat162 __float2bfloat162_rn(float f) { const __nv_bfloat16 b = __float2bfloat16_rn(f); return {b, b}; }
inline __nv_bfloat162 __hsub2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {bf16_once(double(float(a.x)) - float(b.x)), bf16_once(double(float(a.y)) - float(b.y))};
}
inline __nv_bfloat162 __hmul2(__nv_bfloat162 a, __nv_bfloat162 b) {
  return {bf16_once(double(float(a.x)) * float(b.x)), bf16_once(double(float(a.y)) * float(b.y))};
}
inline __nv_bfloat162 __hfma2(__nv_bfloat162 a, __nv_bfloat162 b, __nv_bfloat162 c) {
  return {bf16_once(double(float(a.x)) * float(b.x) + float(c.x)), bf16_once(double(float(a.y)) * float(b.y) + float(c.y))};
}
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { g_warp_bars[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  int t = threadIdx.x; g_shfl[t] = v; __syncwarp();
  float r = g_shfl[(t & ~31) | ((t & 31) ^ o)]; __syncwarp(); return r;
}
inline float __shfl_sync(unsigned, float v, int src) {
  int t = threadIdx.x; g_shfl[t] = v; __syncwarp();
  float r = g_shfl[(t & ~31) | (src & 31)]; __syncwarp(); return r;
}
using std::min; using std::max;
"""

CT = {mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.int32: "int32_t", mx.uint32: "uint32_t"}  # what MLX declares
NP = {mx.bfloat16: np.uint16, mx.float32: np.float32}
# the mark of every test that runs a kernel source through the emulator
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator compiles the kernel source with g++")
_LIBS: dict[str, ctypes.CDLL] = {}
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def guarded(a: np.ndarray) -> np.ndarray:
    """A copy of `a` ending where a no-access page begins (its size rounded up to 16 bytes, the widest
    load a kernel makes): an access past its end faults."""
    nbytes = -(-max(a.nbytes, 1) // 16) * 16
    pages = -(-nbytes // mmap.PAGESIZE) + 1
    region = mmap.mmap(-1, pages * mmap.PAGESIZE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    if _LIBC.mprotect(base + (pages - 1) * mmap.PAGESIZE, mmap.PAGESIZE, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    out = np.frombuffer(region, dtype=a.dtype, count=a.size, offset=(pages - 1) * mmap.PAGESIZE - nbytes)
    out = out.reshape(a.shape)
    out[...] = a
    return out


def _to_np(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return np.ascontiguousarray(np.array(a.view(mx.uint16)))
    return np.ascontiguousarray(np.array(a))


def _from_np(x: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(x).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(x)


class Emu:
    """Stands in for the object `mx.fast.cuda_kernel` returns (same call: inputs, template, grid in threads,
    threadgroup, output shapes and dtypes)."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], source: str, header: str):
        self.name, self.input_names, self.output_names = name, input_names, output_names
        self.source, self.header = source, header

    def __call__(self, inputs: list[mx.array], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 output_shapes: list[tuple[int, ...]], output_dtypes: list[mx.Dtype],
                 template: list[tuple[str, int | mx.Dtype]] = ()) -> list[mx.array]:
        consts = "".join(f"  using {n} = {CT[v]};\n" if isinstance(v, mx.Dtype) else f"  constexpr int {n} = {int(v)};\n"
                         for n, v in template)
        params = [f"const {CT[a.dtype]}* {n}" for n, a in zip(self.input_names, inputs)]
        params += [f"{CT[d]}* {n}" for n, d in zip(self.output_names, output_dtypes)]
        body = f"void {self.name}({', '.join(params)}) {{\n{consts}{self.source}\n}}\n"
        casts = ", ".join(f"({p.rsplit(' ', 1)[0]})args[{i}]" for i, p in enumerate(params))
        launch = f"""
extern "C" void launch(void** args, int gx, int gy, int gz, int tx) {{
  blockDim = {{unsigned(tx), 1, 1}}; gridDim = {{unsigned(gx), unsigned(gy), unsigned(gz)}};
  for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {{
    std::barrier<> bar(tx); g_block_bar = &bar;
    std::vector<std::barrier<>*> wb; for (int w = 0; w < tx / 32; ++w) {{ wb.push_back(new std::barrier<>(32)); g_warp_bars[w] = wb.back(); }}
    std::vector<std::thread> ts;
    for (int t = 0; t < tx; ++t) ts.emplace_back([=] {{ threadIdx = {{unsigned(t), 1, 1}}; threadIdx.y = 0; threadIdx.z = 0;
      blockIdx = {{x, y, z}}; {self.name}({casts}); }});
    for (auto& th : ts) th.join();
    for (auto* b : wb) delete b;
  }}
}}
"""
        src = PRELUDE + self.header + body + launch
        key = hashlib.sha256(src.encode()).hexdigest()[:16]
        if key not in _LIBS:
            d = tempfile.mkdtemp(prefix="cuda_emu_")
            cpp, so = os.path.join(d, "k.cpp"), os.path.join(d, "k.so")
            open(cpp, "w").write(src)
            r = subprocess.run(["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-pthread", cpp, "-o", so],
                               capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(r.stderr[:4000])
            _LIBS[key] = ctypes.CDLL(so)
        ins = [guarded(_to_np(a)) for a in inputs]
        outs = [guarded(np.full(shape, 0x7FC0 if d == mx.bfloat16 else np.nan, dtype=NP[d]))  # NaN, as bits for bf16
                for shape, d in zip(output_shapes, output_dtypes)]
        ptrs = (ctypes.c_void_p * (len(ins) + len(outs)))(*[x.ctypes.data for x in ins + outs])
        blocks = [-(-g // t) for g, t in zip(grid, threadgroup)]
        assert threadgroup[1] == threadgroup[2] == 1
        _LIBS[key].launch(ptrs, blocks[0], blocks[1], blocks[2], threadgroup[0])
        return [_from_np(o, d) for o, d in zip(outs, output_dtypes)]


# The tensor-core product matmul_kernel.py's `mm_mma` issues (mma.sync m16n8k16, bf16 in, float32
# accumulate), for the emulator: each lane posts its fragments, then computes its four outputs from the
# warp's whole A (16 x 16) and B (16 x 8), with PTX's fragment layout (lane = 4 * group + t; A's a0 holds
# row group, columns 2t and 2t + 1, a1 row group + 8, a2 and a3 the same rows 8 columns on; b0 holds
# B's rows 2t, 2t + 1 of column group, b1 rows 2t + 8, 2t + 9; d0, d1 row group, columns 2t, 2t + 1,
# d2, d3 row group + 8). The sum over k runs in ascending order: the device's own order is not
# documented, so this checks the source's indexing and row independence, not the device's bits.
EMULATED_MMA = r"""
static uint32_t g_mma[32][32][6];
inline float mm_lo(uint32_t r) { return __bfloat162float(__nv_bfloat16{uint16_t(r & 0xffffu)}); }
inline float mm_hi(uint32_t r) { return __bfloat162float(__nv_bfloat16{uint16_t(r >> 16)}); }
inline void mm_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t mine[6] = {a0, a1, a2, a3, b0, b1};
  for (int i = 0; i < 6; ++i) g_mma[w][lane][i] = mine[i];
  __syncwarp();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    const uint32_t* r = g_mma[w][l];
    A[g][2 * t] = mm_lo(r[0]); A[g][2 * t + 1] = mm_hi(r[0]);
    A[g + 8][2 * t] = mm_lo(r[1]); A[g + 8][2 * t + 1] = mm_hi(r[1]);
    A[g][2 * t + 8] = mm_lo(r[2]); A[g][2 * t + 9] = mm_hi(r[2]);
    A[g + 8][2 * t + 8] = mm_lo(r[3]); A[g + 8][2 * t + 9] = mm_hi(r[3]);
    B[2 * t][g] = mm_lo(r[4]); B[2 * t + 1][g] = mm_hi(r[4]);
    B[2 * t + 8][g] = mm_lo(r[5]); B[2 * t + 9][g] = mm_hi(r[5]);
  }
  __syncwarp();
  const int g = lane >> 2, t = lane & 3;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc = std::fma(A[row][k], B[k][col], acc);
    d[e] = acc;
  }
}
"""


# libcu++'s bf16 exp and abs and cuda_bf16's `__float2bfloat16` and `__hmul`, which matmul_source.py's `mm_sigmoid` and
# `mm_glu` call, for the emulator: in place of its `#include <cuda/std/cmath>`. A product is its exact result rounded
# to bf16 once; the exponential is the host's, rounded to bf16, where the device's is `hexp` (tests/test_matmul_glu.py's
# GPU tests compare the launch with MLX's sigmoid and compiled SwiGLU there).
EMULATED_CMATH = r"""
namespace cuda::std {
inline __nv_bfloat16 abs(__nv_bfloat16 x) { return {uint16_t(x.x & 0x7fffu)}; }
inline __nv_bfloat16 exp(__nv_bfloat16 x) { return __float2bfloat16_rn(float(::std::exp(double(float(x))))); }
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return bf16_once(double(float(a)) * float(b)); }
"""
CMATH_INCLUDE = "#include <cuda/std/cmath>\n"


def emulated(header: str) -> str:
    """A kernel's header as the emulator compiles it: its libcu++ include replaced by EMULATED_CMATH, and
    matmul_source.py's inline-PTX MMA (its last definition) by EMULATED_MMA; any other header as it is."""
    header = header.replace(CMATH_INCLUDE, EMULATED_CMATH)
    at = header.find("__device__ __forceinline__ void mm_mma")
    return header if at < 0 else header[:at] + EMULATED_MMA


def install_matmul(monkeypatch) -> None:
    """Route matmul_kernel.py's launch through the emulator for one test, its template arguments passed
    as MLX's `cuda_kernel` takes them."""
    from dflash_bench.engine import matmul_kernel as mk
    from dflash_bench.engine import matmul_source as ms

    monkeypatch.setattr(mk, "_kernel", lambda parts=0, rope=False: Emu(
        f"dflash_rows_matmul_{parts}{'_rope' if rope else ''}", ms.ROPE_INPUTS if rope else ms.INPUTS,
        ms.outputs(parts, rope), ms.source(parts, rope), emulated((ms.ROPE_HEADER if rope else "") + ms.HEADER)))


def install_cuda_kernel(monkeypatch) -> None:
    """Stand the emulator in for `mx.fast.cuda_kernel` itself for one test, so the engine's own launch
    objects (engine/baked_kernel.py's, their constants written into each source) run on the CPU. The
    caller clears the kernel modules' cached launch objects before and after (they would hold emulators)."""
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda name, input_names, output_names, source, header="",
                        ensure_row_contiguous=True: Emu(name, input_names, output_names, source, emulated(header)))


def install_delta(monkeypatch) -> None:
    """Route delta_kernel.py's launches (a forward's, a rollback's with its conv tails) through the emulator
    for one test."""
    from dflash_bench.engine.targets import delta_kernel as dk

    monkeypatch.setattr(dk, "_kernel", lambda layers, windows, tail: Emu(
        f"dflash_delta_{layers}x{windows}_{int(tail)}", dk.inputs(layers, windows, tail), dk.outputs(tail),
        dk.source(layers, windows, tail), dk._HEADER))


def install(monkeypatch) -> None:
    """Route attention_kernel.py's two launches through the emulator for one test."""
    from dflash_bench.engine.targets import attention_kernel as ak

    monkeypatch.setattr(ak, "_partial_kernel", lambda s, block=False, joint=False, layered=False, onepass=False: Emu(
        ak.partial_name(s, block, joint, layered, onepass), ak.partial_inputs(s, block, joint, layered),
        ak.partial_outputs(onepass), ak.partial_source(s, block, joint, layered, onepass), ak.HEADER))
    monkeypatch.setattr(ak, "_combine_kernel", lambda: Emu("dflash_attention_combine", ["meta", "ml", "part_out"], ["out"],
                                                           ak.COMBINE, ak.HEADER))


def install_norm_rope(monkeypatch) -> None:
    """Route targets/norm_rope_kernel.py's launches (keys, every layer's keys, and q/k with or without norms) through
    the emulator for one test."""
    from dflash_bench.engine.targets import norm_rope_kernel as nr

    monkeypatch.setattr(nr, "_keys_kernel", lambda: Emu("dflash_norm_rope_keys", nr.KEYS_INPUTS, ["out"], nr._KEYS, nr._HEADER))
    monkeypatch.setattr(nr, "_layer_keys_kernel", lambda: Emu(
        "dflash_norm_rope_layer_keys", nr.LAYER_KEYS_INPUTS, ["out"], nr._LAYER_KEYS, nr._HEADER))
    monkeypatch.setattr(nr, "_qk_kernel", lambda norm=True: Emu(
        "dflash_norm_rope_qk" if norm else "dflash_rope_qk", nr.QK_INPUTS if norm else nr.QK_PLAIN_INPUTS,
        ["q_out", "kv_out"], nr.qk_source(norm), nr._HEADER))
