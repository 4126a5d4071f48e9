"""Variants of the decode-row matmul kernel, checked and timed alone on a CUDA GPU (CuPy, no MLX).

usage (GPU machine, repo root): python3 tools/row_kernel_variants.py [--ncu] [--drafter | --wide [BEFORE.py] | --norm]

The engine's kernel (dflash_bench/engine/matmul_source.py, which imports no MLX) is
compiled beside variants of it with nvcc through CuPy, launched on the same weights, and timed from
CUDA graphs of many launches (device time; no host launch cost), cold (rotating over weight copies
that overflow the 60 MB L2) at 1, 16 and 64 rows. Each variant must keep the engine's bits (`same bits`: its
output equals the engine kernel's, bit for bit, at every row count tried) and rows alone (every row of a 64-row
call equals the row alone), with an error against a float32 product under 1e-2.
The variants asked of a verify window's 16 rows (a 9B drafted round's 16-row products cost 1.3-1.4x its
one-row ones: docs/gpu-round-profile.md; at the geometry's 2 column tiles a warp loads 4 bytes of x from L1 or
L2 for every byte of 4-bit weight at 16 rows, since each block re-reads the rows of x for its own columns):
`t4`, 4 column tiles a warp (matmul_kernel.tiles_a_warp's rule for several rows of wide weights), and `stream`,
whose weight loads skip L1 (`ld.global.nc.L1::no_allocate`), so the rows of x are not evicted by weights read
once, at the geometry's tiles and at 4. Which warp computes a column and where a load is cached never enter a
sum, so every variant must give the geometry's bits. (Column groups a block, 2 or 4 groups of a block's warps
side by side, were measured in job M and left out of the engine: docs/gpu-round-profile.md.)
`--ncu` launches the geometry's kernel and `stream t4` once each on the 9B's gate/up shape, for Nsight Compute
(with `--norm`: `--norm`'s launches but those with a look-ahead of 2, each at one and at 16 rows).
`--drafter` runs the 9B drafter's bf16 products and the 9B's 4-bit lm_head instead, with look-aheads of 2 and 4
(`PIPE`: when loads are issued) and one column tile a warp (twice the warps) beside the geometry and `t4`
(docs/profiles/row-kernel-variants-h100-46.txt).
`--wide` runs the 9B's 4-bit products and its drafter's as 4-bit copies (`--drafter-bits 4`) at 2, 4, 8 and 16
column tiles a warp, each at look-aheads 1 and 2: more tiles a warp load each row of x once for more columns
(16 rows of x are 2 bytes for every byte of 4-bit weight at 4 tiles, 0.5 at 16). With a BEFORE file (an earlier
matmul_kernel.py), its kernel runs first as `before`, and the engine's at the geometry must give its bits too.
(Session 47: 8 and 16 tiles were slower than 4 at 1 and 16 rows: docs/profiles/row-kernel-variants-h100-47.txt.)
With `--wide` or `--norm` each line shows the registers a thread and the bytes spilled to local memory at one and at four
row tiles.
`--norm` runs the 9B's 4-bit products at the geometry, 4 tiles and 4 tiles with a look-ahead of 2, each without and
with the RMS norm in its launch (`normed`, as the engine launches every product after a norm: rows_matmul's `norm`),
the normed ones checked against the normed float32 product and each other's bits: a round timeline's launches of
these products took about twice their time alone (docs/gpu-round-profile.md, session 47). Then the norm taken apart
(`norm_ablations`: its weights through the read-only path, and without its squares or its weighting, the last two
timed only), and two other ways to sum the squares, each with bits of its own (rows alone and the normed product
checked): `normed_sq4`, four chains a lane, and `normed_mma`, the tensor cores' (session 48: neither moved the cost,
which is the norm's instructions: docs/profiles/row-kernel-variants-norm-h100-48.txt).
docs/gpu-round-profile.md records what the runs found. Each timed line ends with the SM clock its timing ran at
where nvidia-smi gave samples then, and the run with the clocks over all of it (tools/gpu_clocks.py).
"""

from __future__ import annotations

import ast
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np
from gpu_clocks import ClockLog

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the engine's kernel source (engine_source), without MLX
L2_BYTES = 60 * 2**20


def engine_constants(path: pathlib.Path = ROOT / "dflash_bench/engine/matmul_kernel.py") -> dict:
    """The engine kernel module's top-level constants (literals), read from its text, so MLX is not needed."""
    tree = ast.parse(path.read_text())
    found = {}
    for t in tree.body:
        if isinstance(t, ast.Assign) and isinstance(t.targets[0], ast.Name):
            try:
                found[t.targets[0].id] = ast.literal_eval(t.value)
            except ValueError:  # not a literal
                continue
    return found


def engine_source(path: pathlib.Path | None = None) -> tuple[str, str]:
    """The engine kernel's header and one-output body (matmul_source.py's `HEADER` and `source(0)`, its placeholders
    filled; that module needs no MLX), or those of an earlier copy of matmul_kernel.py at `path` (its `_HEADER` and
    `_SOURCE`, read from its text, from before the source had a module of its own)."""
    if path is None:
        from dflash_bench.engine import matmul_source

        return matmul_source.HEADER, matmul_source.source(0)
    found = engine_constants(path)
    return found["_HEADER"], found["_SOURCE"].replace("{part}", "y + (size_t)M * lo")  # one output, as it wrote it


STREAM_LOAD = r"""
__device__ __forceinline__ uint4 mm_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
"""


def streamed(engine: str) -> str:
    """The engine kernel with its weight words loaded past L1 (`mm_stream`, in STREAM_LOAD): only where
    a load is cached changes, so its bits must be the engine's."""
    return swapped(engine, [("__ldg(reinterpret_cast<const uint4*>(wq", "mm_stream(reinterpret_cast<const uint4*>(wq")])


SQUARES4 = r"""
__device__ __forceinline__ void mm_squares4(uint4 v, float* s) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __uint_as_float(words[i] << 16), hi = __uint_as_float(words[i] & 0xFFFF0000u);
    s[i] = __fmaf_rn(hi, hi, __fmaf_rn(lo, lo, s[i]));
  }
}
"""


def swapped(engine: str, swaps: list[tuple[str, str]]) -> str:
    """The engine kernel with each (old, new) text swapped, every old text found exactly once (else the engine's
    kernel moved under the variant, which must then be rewritten)."""
    for old, new in swaps:
        assert engine.count(old) == 1, f"the engine kernel moved under a variant: {old}"
        engine = engine.replace(old, new)
    return engine


# the squares of each row half as four floats a lane (`squares4`'s chains, `squares_mma`'s MMA fragment)
FOUR_SQUARES = [("float ss[MT][2];", "float ss[MT][2][4];"),
                ("ss[i][0] = ss[i][1] = 0.0f;", "for (int e = 0; e < 8; ++e) ss[i][e / 4][e % 4] = 0.0f;")]


def squares4(engine: str) -> str:
    """The engine kernel with each row's squares in four chains a lane (one a word of a 16-byte load, `mm_squares4`
    in SQUARES4), added pairwise at the end: a norm's serial FMA chain a quarter as deep. The order of the squares'
    sum changes, so its bits are its own (rows alone, not the engine's)."""
    return swapped(engine, FOUR_SQUARES + [
        ("ss[i][0] = mm_squares(xa, ss[i][0]);", "mm_squares4(xa, ss[i][0]);"),
        ("ss[i][1] = mm_squares(xb, ss[i][1]);", "mm_squares4(xb, ss[i][1]);"),
        ("float v = ss[i][e];", "float v = __fadd_rn(__fadd_rn(ss[i][e][0], ss[i][e][1]), __fadd_rn(ss[i][e][2], ss[i][e][3]));")])


def squares_mma(engine: str) -> str:
    """The engine kernel with each row tile's squares taken by the tensor cores: the tile's x (16 rows) times its own
    rows 0-7 and 8-15 as B, two MMAs a 16-value k-step each, whose diagonals are each row's squares over the warp's
    chunks (an output of an MMA depends on its row of A and its column of B alone, here both the same row of x); a
    lane then reads its rows' diagonal from the lane holding it. No FMA chain a lane and no shuffle sums, four MMAs
    a k-step pair beside the product's 2 * NT. The order of the squares' sum is the MMA's, so its bits are its own."""
    return swapped(engine, FOUR_SQUARES + [
        ("ss[i][0] = mm_squares(xa, ss[i][0]);",
         "mm_mma(ss[i][0], xa.x, xb.x, xa.y, xb.y, xa.x, xa.y);\n"
         "            mm_mma(ss[i][0], xa.z, xb.z, xa.w, xb.w, xa.z, xa.w);"),
        ("ss[i][1] = mm_squares(xb, ss[i][1]);",
         "mm_mma(ss[i][1], xa.x, xb.x, xa.y, xb.y, xb.x, xb.y);\n"
         "            mm_mma(ss[i][1], xa.z, xb.z, xa.w, xb.w, xb.z, xb.w);"),
        ("float v = ss[i][e];",
         "const float diag = (grp & 1) ? ss[i][e][2 * e + 1] : ss[i][e][2 * e];\n"
         "        float v = __shfl_sync(0xffffffffu, diag, grp * 4 + (grp >> 1));"),
        ("v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));\n", ""),
        ("        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));\n", "")])


def norm_ablations(engine: str) -> dict[str, str]:
    """The normed kernel with one part of its norm taken out or changed, to find what the norm in the launch costs
    (session 47: 16 rows of gate/up 51.1 us normed against 43.3 without, at one row 42.0 against 29.6):
    `normed_ldg` loads the norm's weights through the read-only path (the engine's bits), `normed_nosq` sums no
    squares and `normed_nowt` weights no values (their values are not the norm's: timed, and only checked for NaN).
    Session 48's runs: docs/profiles/row-kernel-variants-norm-h100-48.txt."""
    load = "*reinterpret_cast<const uint4*>(norm + (size_t)c * VPT + h * 8)"
    return {"normed_ldg": swapped(engine, [(load, f"__ldg({load[1:]})")]),
            "normed_nosq": swapped(engine, [("ss[i][0] = mm_squares(xa, ss[i][0]);", ""),
                                            ("ss[i][1] = mm_squares(xb, ss[i][1]);", "")]),
            "normed_nowt": swapped(engine, [("xa = mm_weighted(xa, nw);", ""), ("xb = mm_weighted(xb, nw);", "")])}


def kernel_name(body: str, consts: tuple[int, ...]) -> str:
    return body + "_" + "_".join(map(str, consts))


def module(bodies: dict[str, str], header: str, wanted: list[tuple[str, tuple[int, ...]]]) -> cp.RawModule:
    """One nvcc module of plain `extern "C"` kernels, one per (body, K N BITS G NT SPLITK MT PIPE),
    each writing its output whole (the parts' starts P1..P3 at N: matmul_kernel.launch without `parts`), with no
    residual, and the rows RMS-normed (epsilon NORM_EPS) where the body's name starts with `normed`."""
    params = ("const __nv_bfloat16* x, const uint32_t* w, const __nv_bfloat16* scales, "
              "const __nv_bfloat16* biases, const int* rows, const __nv_bfloat16* residual, const __nv_bfloat16* norm, "
              "__nv_bfloat16* y")
    code = "#include <cuda_bf16.h>\n#include <cstdint>\n" + header
    for body, consts in wanted:
        defs = "".join(f"  constexpr int {n} = {v};\n"
                       for n, v in zip(("K", "N", "BITS", "G", "NT", "SPLITK", "MT", "PIPE"), consts))
        defs += "".join(f"  constexpr int {p} = N;\n" for p in ("P1", "P2", "P3"))  # one output, not parts
        defs += "  constexpr int RESID = 0;\n  constexpr int GLU = 0;\n"  # no residual added, no SwiGLU (rows_matmul's)
        normed = is_normed(body)  # rows_matmul's `norm`, or none
        defs += f"  constexpr int NORM = {int(normed)};\n  constexpr int EPS = {float_bits(NORM_EPS) if normed else 0};\n"
        code += f'extern "C" __global__ void {kernel_name(body, consts)}({params}) {{\n{defs}{bodies[body]}\n}}\n'
    return cp.RawModule(code=code, backend="nvcc", options=("-O3", "-std=c++17", "-arch=sm_90"))


TARGET_WARPS = engine_constants()["TARGET_WARPS"]
NORM_EPS = 1e-6


def float_bits(value: float) -> int:
    """matmul_kernel.float_bits: a float32's bits as an int (the template's EPS), here because importing the engine
    module needs MLX, which this tool does without."""
    return int(np.array([value], dtype=np.float32).view(np.int32)[0])


def is_normed(body: str) -> bool:
    """Whether a body's launches RMS-norm their rows (`--norm`'s bodies named `normed...`)."""
    return body.startswith("normed")


def geometry(k: int, n: int, bits: int, tiles: int = 0) -> tuple[int, int] | None:
    """matmul_kernel.geometry; `tiles` column tiles a warp instead of the geometry's (the split of the input
    width stays the geometry's, as in matmul_kernel.launch), None where the columns do not divide into them."""
    nt = 2 if n % 16 == 0 else 1
    blocks, chunks, split = n // (8 * nt), k // (128 // bits), 1
    while split < 8 and blocks * split < TARGET_WARPS and 4 * split * 2 <= chunks:
        split *= 2
    if tiles:
        if n % (8 * tiles):
            return None
        nt = tiles
    return nt, split


SHAPES = [  # name, in, out, bits, group
    ("9b gate_up", 4096, 24576, 4, 64), ("9b down", 12288, 4096, 4, 64), ("9b gdn in", 4096, 12352, 4, 64),
    ("9b o", 4096, 4096, 4, 64), ("9b lm_head", 4096, 248320, 4, 64), ("9b o 8-bit", 4096, 4096, 8, 64),
    ("135m gate_up bf16", 576, 3072, 16, 64), ("135m down bf16", 1536, 576, 16, 64),
]
DRAFTER_SHAPES = [  # the 9B drafter's bf16 products (`--drafter`): each a verify window's 16 rows a round
    ("9b-d fc bf16", 32768, 4096, 16, 64), ("9b-d k/v bf16", 4096, 2048, 16, 64), ("9b-d q/k/v bf16", 4096, 6144, 16, 64),
    ("9b-d gate_up bf16", 4096, 24576, 16, 64), ("9b-d down bf16", 12288, 4096, 16, 64),
    ("9b lm_head", 4096, 248320, 4, 64),
]
WIDE_SHAPES = SHAPES[:5] + [(name.replace("bf16", "q4"), k, n, 4, 64) for name, k, n, _, _ in DRAFTER_SHAPES[:5]]


def weights(k: int, n: int, bits: int, group: int, rng) -> tuple:
    """Random weights in the kernel's layout: packed uint32 words with bf16 scales and biases, or bf16."""
    if bits == 16:
        return cp.asarray(bf16(rng.standard_normal((n, k), dtype=np.float32) * 0.02).view(np.uint32)), None, None
    words = rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32)
    s = bf16(rng.uniform(-0.01, 0.01, size=(n, k // group)).astype(np.float32))
    b = bf16(rng.uniform(-0.05, 0.05, size=(n, k // group)).astype(np.float32))
    return cp.asarray(words), cp.asarray(s), cp.asarray(b)


def dequantized(w: tuple, k: int, cols: int, bits: int, group: int) -> np.ndarray:
    """The float32 weights of the first `cols` output columns."""
    if bits == 16:
        return as_f32(cp.asnumpy(w[0][:cols]).view(np.uint16))
    words, per = cp.asnumpy(w[0][:cols]), 32 // bits
    q = np.stack([(words >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], axis=-1).reshape(cols, k)
    s, b = (np.repeat(as_f32(cp.asnumpy(a[:cols])), group, axis=1) for a in w[1:])
    return q.astype(np.float32) * s + b


def bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def as_f32(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


class Kernel:
    def __init__(self, mod: cp.RawModule, name: str, k: int, n: int, bits: int, group: int, nt: int, split: int, pipe: int,
                 norm: cp.ndarray | None = None):
        self.n, self.nt, self.split, self.norm = n, nt, split, norm
        self.expr = lambda mt: kernel_name(name, (k, n, bits, group if bits != 16 else 1, nt, split, mt, pipe))
        self.mod = mod

    def registers(self) -> str:
        """Registers a thread / bytes spilled to local memory, at one and at four row tiles a block."""
        fs = [self.mod.get_function(self.expr(mt)) for mt in (1, 4)]
        return " ".join(f"mt{mt}:{f.num_regs}/{f.local_size_bytes}" for mt, f in zip((1, 4), fs))

    def __call__(self, x: cp.ndarray, w: tuple, m: int, rows: cp.ndarray, y: cp.ndarray) -> None:
        mt = min(4, -(-m // 16))
        f = self.mod.get_function(self.expr(mt))
        dummy = w[0]
        f((self.n // (8 * self.nt), -(-m // (16 * mt)), 1), (32 * self.split, 1, 1),
          (x, w[0], w[1] if w[1] is not None else dummy, w[2] if w[2] is not None else dummy, rows, x,
           x if self.norm is None else self.norm, y))


def timed(kernel: Kernel, copies: list, m: int, k: int, launches: int = 60, reps: int = 7,
          rows: cp.ndarray | None = None) -> float:
    """Median µs a launch, from CUDA-graph replays of `launches` launches over the weight copies; `rows`, the
    launch's row count (m) where it lies, by default in device memory (tools/placement_probe.py places it)."""
    xs = [cp.asarray(bf16(np.random.default_rng(i).standard_normal((m, k), dtype=np.float32))) for i in range(4)]
    rows = cp.asarray(np.array([m], dtype=np.int32)) if rows is None else rows
    y = cp.empty((m, kernel.n), dtype=cp.uint16)
    return graph_us(lambda i: kernel(xs[i % 4], copies[i % len(copies)], m, rows, y), launches, reps, warm=len(copies))


def graph_us(launch: Callable[[int], None], launches: int = 60, reps: int = 7, warm: int = 0) -> float:
    """Median µs a launch from CUDA-graph replays of launch(0) .. launch(launches - 1) on a stream of its own
    (device time, no host launch cost), after launch(0) .. launch(warm - 1) outside the graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(warm):
            launch(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(launches):
            launch(i)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        out = []
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            b.synchronize()
            out.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / launches)
    return statistics.median(out)


def run(kernel: Kernel, w: tuple, x: np.ndarray) -> np.ndarray:
    m = x.shape[0]
    y = cp.full((m, kernel.n), 0x7FC0, dtype=cp.uint16)  # NaN: an unwritten element shows
    kernel(cp.asarray(x), w, m, cp.asarray(np.array([m], dtype=np.int32)), y)
    return cp.asnumpy(y)


def plans(drafter: bool) -> list[tuple[str, str, str, int, int]]:
    """(label, body, claim, column tiles a warp or 0 for the geometry's, look-ahead) for one shape: the engine
    kernel at the weight's geometry (2 tiles a warp), then at 4 tiles a warp (matmul_kernel.tiles_a_warp's rule
    for several rows of wide weights), and both with weight loads past L1; all must give the geometry's bits.
    With `drafter`, look-aheads of 2 and 4 and one tile a warp (twice the warps) instead of the loads past L1:
    the 9B drafter's narrow bf16 products keep about a tenth of what an H100 needs in flight at the geometry's
    (docs/gpu-round-profile.md, session 46). Session 33's look-aheads, 8 tiles a warp, more warps along the input
    width and float dequantizing, and job M's column groups, were measured then
    (docs/profiles/row-kernel-variants-h200.txt)."""
    out = [("geometry", "engine", "reference", 0, 1), ("t4", "engine", "same bits", 4, 1)]
    if drafter:
        return out + [("pipe2", "engine", "same bits", 0, 2), ("pipe4", "engine", "same bits", 0, 4),
                      ("t1", "engine", "same bits", 1, 1), ("t1 pipe2", "engine", "same bits", 1, 2),
                      ("t1 pipe4", "engine", "same bits", 1, 4), ("t4 pipe2", "engine", "same bits", 4, 2)]
    return out + [("stream", "stream", "same bits", 0, 1), ("stream t4", "stream", "same bits", 4, 1)]


def norm_plans() -> list[tuple[str, str, str, int, int]]:
    """`--norm`: the geometry, 4 tiles and 4 tiles with a look-ahead of 2, without and then with the norm (each
    group checked against its own geometry's bits); the ablations (`norm_ablations`: `normed_ldg` with the normed
    bits, the others timed only); then the squares in four chains a lane (`normed_sq4`) and by the tensor cores
    (`normed_mma`), bits of their own, so checked for rows alone and the normed product only."""
    out = []
    for body in ("engine", "normed"):
        out += [(f"{body} geometry", body, "reference", 0, 1), (f"{body} t4", body, "same bits", 4, 1),
                (f"{body} t4 pipe2", body, "same bits", 4, 2)]
    for body in ("normed_ldg", "normed_nosq", "normed_nowt"):
        claim = "same bits" if body == "normed_ldg" else "timing only"
        out += [(f"{body} geometry", body, claim, 0, 1), (f"{body} t4", body, claim, 4, 1)]
    for body in ("normed_sq4", "normed_mma"):
        out += [(f"{body} geometry", body, "rows alone", 0, 1), (f"{body} t4", body, "rows alone", 4, 1),
                (f"{body} t4 pipe2", body, "rows alone", 4, 2)]
    return out


def wide_plans(before: bool) -> list[tuple[str, str, str, int, int]]:
    """`--wide`: the engine kernel at 2, 4, 8 and 16 column tiles a warp and look-aheads 1 and 2, after the
    earlier kernel (`before`, the reference) where one is given."""
    out = [("before", "before", "reference", 0, 1)] if before else []
    for tiles in (0, 4, 8, 16):
        for pipe in (1, 2):
            claim = "reference" if not out else "same bits"
            out.append((f"{'geometry' if not tiles else f't{tiles}'}{' pipe2' if pipe == 2 else ''}", "engine", claim, tiles, pipe))
    return out


def iterations(k: int, bits: int, split: int) -> int:
    """The kernel's ITERS: a look-ahead must divide it."""
    return -(-(k // (128 // bits)) // (4 * split))


def main() -> int:
    engine_header, engine = engine_source()
    header = engine_header + STREAM_LOAD + SQUARES4
    bodies = {"engine": engine, "stream": streamed(engine), "normed": engine, "normed_sq4": squares4(engine),
              "normed_mma": squares_mma(engine), **norm_ablations(engine)}
    ncu, drafter, wide, normed = "--ncu" in sys.argv, "--drafter" in sys.argv, "--wide" in sys.argv, "--norm" in sys.argv
    before = sys.argv[sys.argv.index("--wide") + 1:] if wide else []
    if before:  # one module holds both bodies, so the earlier kernel must share the engine's header
        old_header, bodies["before"] = engine_source(pathlib.Path(before[0]))
        if old_header != engine_header:
            sys.exit(f"{before[0]}: its kernel header differs from the engine's; compare bodies with one header")
    shapes = SHAPES[:1] if ncu else DRAFTER_SHAPES if drafter else WIDE_SHAPES if wide else SHAPES[:5] if normed else SHAPES
    profiled = ({label for label, *_ in norm_plans() if not label.endswith("pipe2")} if normed
                else {"geometry", "stream t4"})  # the launches `--ncu` makes
    kernels = {}
    for name, k, n, bits, group in shapes:
        names, found = [], []
        for label, body, claim, tiles, pipe in (wide_plans(bool(before)) if wide else norm_plans() if normed
                                                else plans(drafter)):
            shape = geometry(k, n, bits, tiles)
            if shape is None or (ncu and label not in profiled):
                continue
            nt, split = shape
            if iterations(k, bits, split) % pipe:
                continue
            found.append((label, body, nt, split, claim, pipe))
            names += [(body, (k, n, bits, group if bits != 16 else 1, nt, split, mt, pipe)) for mt in (1, 4)]
        kernels[name] = (module(bodies, header, names), found)
    with ThreadPoolExecutor(8) as pool:  # nvcc runs per module: compile them side by side
        list(pool.map(lambda mod: mod.compile(), [m for m, _ in kernels.values()]))
    with ClockLog() as clocks:  # the SM clock each kernel's timing ran at (tools/gpu_clocks.py)
        begun = time.monotonic()
        rng = np.random.default_rng(0)
        table, fails = [], 0
        for name, k, n, bits, group in shapes:
            mod, found = kernels[name]
            w = weights(k, n, bits, group, rng)
            wbytes = sum(a.nbytes for a in w if a is not None)
            x = bf16(rng.standard_normal((64, k), dtype=np.float32))
            cols = min(n, 4096)
            refs = {False: as_f32(x) @ dequantized(w, k, cols, bits, group).T}
            if normed:  # a norm's weights, and the normed float32 product, for the normed bodies
                gain = bf16(1.0 + 0.1 * rng.standard_normal(k, dtype=np.float32))
                rms = np.sqrt((as_f32(x) ** 2).mean(axis=1, keepdims=True) + NORM_EPS)
                refs[True] = (as_f32(x) * as_f32(gain)) @ dequantized(w, k, cols, bits, group).T / rms
            copies = [w] + [weights(k, n, bits, group, np.random.default_rng(9 + c))
                            for c in range(0 if ncu else max(0, min(12, -(-2 * L2_BYTES // wbytes)) - 1))]
            base = {}
            for label, body, nt, split, claim, pipe in found:
                kern = Kernel(mod, body, k, n, bits, group, nt, split, pipe,
                              cp.asarray(gain) if is_normed(body) else None)
                if ncu:
                    for m in (1, 16) if normed else (1,):
                        run(kern, w, x[:m])
                    continue
                outs = {m: run(kern, w, x[:m]) for m in (1, 16, 64)}
                alone = np.concatenate([run(kern, w, x[i : i + 1]) for i in range(64)])
                ok = all((outs[m] == alone[:m]).all() for m in outs) and not np.isnan(as_f32(alone)).any()
                timing_only = claim == "timing only"
                if claim == "reference":
                    base = outs
                elif claim == "same bits":
                    ok &= all((outs[m] == base[m]).all() for m in outs)
                want = refs[is_normed(body)]
                err = float(np.linalg.norm(as_f32(outs[64][:, :cols]) - want) / np.linalg.norm(want))
                ok &= err < 1e-2 or timing_only
                fails += not ok
                t0 = time.monotonic()
                us = {m: timed(kern, copies, m, k) for m in (1, 16, 64)}
                sm = clocks.sm_median(t0, time.monotonic())
                line = (f"{name:18s} {label:15s} nt{nt} sk{split} p{pipe} {claim:10s} {'PASS' if ok else 'FAIL'} err {err:.1e}  "
                        + "  ".join(f"M{m} {v:7.1f}us" for m, v in us.items()) + f"  @1 {wbytes / us[1] / 1e3:5.0f} GB/s"
                        + (f"  regs {kern.registers()}" if wide or normed else "") + (f"  SM {sm:.0f} MHz" if sm else ""))
                emit(table, line)
        ended = time.monotonic()
    return finish(table, clocks.describe(begun, ended), fails)


def emit(table: list[str], line: str) -> None:
    """A timed line, printed as it comes (a run its limit stops keeps what it printed) and kept for the table."""
    table.append(line)
    print(line, flush=True)


def finish(table: list[str], clocks: str, fails: int) -> int:
    """The run's lines again as one table, then the clocks over the run; the exit status (1 where a check failed)."""
    print("\n".join(table))
    print(clocks)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
