"""CUDA source the engine's kernels share (targets/delta_kernel.py, targets/attention_kernel.py).

Conversions between the storage dtypes MLX hands a kernel and the float32 every kernel computes in,
rounding to nearest on the way back, so a kernel's arithmetic is the same whatever dtype it stores.
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
