"""CUDA source the engine's kernels share (targets/delta_kernel.py, targets/attention_kernel.py,
targets/norm_rope_kernel.py, matmul_kernel.py).

`CONVERSIONS`: between the storage dtypes MLX hands a kernel and the float32 every kernel computes in,
rounding to nearest on the way back, so a kernel's arithmetic is the same whatever dtype it stores.
`ROTATION`: one pair of a head's values turned at a row's position, MLX's CUDA RoPE term for term
(targets/norm_rope_kernel.py's docstring says how it was matched), so every launch that turns keys or queries
turns them with the same bits.
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
