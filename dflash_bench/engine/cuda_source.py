"""CUDA source the engine's kernels share (targets/delta_kernel.py, targets/attention_kernel.py,
targets/norm_rope_kernel.py, matmul_kernel.py).

`CONVERSIONS`: between the storage dtypes MLX hands a kernel and the float32 every kernel computes in,
rounding to nearest on the way back, so a kernel's arithmetic is the same whatever dtype it stores.
`ROTATION`: one pair of a head's values turned at a row's position, MLX's CUDA RoPE term for term
(targets/norm_rope_kernel.py's docstring says how it was matched), so every launch that turns keys or queries
turns them with the same bits. `compact`: a source as the engine hands it to MLX (baked_kernel.py).
"""

CONVERSIONS = r"""
__device__ __forceinline__ float cvt_to_f(float x) { return x; }
__device__ __forceinline__ float cvt_to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float cvt_to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T cvt_from_f(float x);
template <> __device__ __forceinline__ float cvt_from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half cvt_from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 cvt_from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
"""

ROTATION = r"""
__device__ __forceinline__ void nr_store(float* p, float v) { *p = __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ void nr_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// values x1 (j) and x2 (j + RH) of a head turned at position p (pairs j, j + RH of the first 2 * RH values), into
// lo and hi, rounded to bf16 (a float output holds the bf16 value)
template <int RH, typename O>
__device__ __forceinline__ void nr_rotate(int j, float x1, float x2, float p, float log2_theta, O* lo, O* hi) {
  // MLX's CUDA RoPE, term for term (the same expressions, so the same contractions into fmas)
  const float d = static_cast<float>(j) / static_cast<float>(RH);
  const float inv_freq = exp2f(-d * log2_theta);
  const float theta = p * inv_freq;
  const float costheta = cosf(theta), sintheta = sinf(theta);
  // x1 * cos - x2 * sin and x1 * sin + x2 * cos as MLX's build contracts them: each first product fused
  const float rx1 = __fmaf_rn(x1, costheta, -__fmul_rn(x2, sintheta));
  const float rx2 = __fmaf_rn(x1, sintheta, __fmul_rn(x2, costheta));
  nr_store(lo, rx1);
  nr_store(hi, rx2);
}
"""


def compact(source: str) -> str:
    """CUDA source without its comments, indentation and blank lines: the same tokens, so the same compiled code.

    MLX hashes a kernel's whole source at every evaluation of a launch (its module name: `std::hash` in
    backend/cuda/custom_kernel.cpp's `eval_gpu`), and on session 53's H100 an evaluation cost 2.8 us with an empty
    body and no header, 6.1 us with 16 KB and 16.1 us with 64 KB (`tools/build_eval_split.py --profile`'s source
    sweep, docs/profiles/session-53-h100.txt), where the row kernel's source was 12.8 KB, a third of it comments.
    So baked_kernel.py hands MLX each source compacted. String and character literals (inline PTX) are kept as
    they are; a preprocessor line keeps its own line, and every other line does too, so nothing can join."""
    out, line, i, n = [], [], 0, len(source)
    while i < n:
        c = source[i]
        if c in "\"'":  # a literal, escapes and all, up to its closing quote
            j = i + 1
            while j < n and source[j] != c:
                j += 2 if source[j] == "\\" else 1
            line.append(source[i:j + 1])
            i = j + 1
        elif source.startswith("//", i):
            while i < n and source[i] != "\n":
                i += 1
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            i = n if end < 0 else end + 2
            line.append(" ")
        elif c == "\n":
            out.append("".join(line))
            line = []
            i += 1
        elif c in " \t":
            while i < n and source[i] in " \t":
                i += 1
            line.append(" ")
        else:
            line.append(c)
            i += 1
    out.append("".join(line))
    kept = [text.strip() for text in out]
    return "".join(text + "\n" for text in kept if text)
