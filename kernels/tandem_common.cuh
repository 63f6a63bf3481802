// Shared helpers for Tandem's CUDA C kernels.
//
// No system headers on purpose: the same source builds under nvcc (CI compile test) and NVRTC
// (CuPy RawModule at run time) without a CUDA include path. Half and bfloat16 are carried as raw
// 16-bit patterns and converted with PTX `cvt` (float -> bfloat16 in software below sm_80), so
// arithmetic is always done in float32. Builds for sm_75 (Turing) and newer: nothing here or in
// the kernels needs more (no bf16 arithmetic, no cp.async, no tensor-core instructions).
#pragma once

typedef long long i64;
typedef unsigned short u16;

struct half_t {
  u16 x;
};
struct bf16_t {
  u16 x;
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
  return f;
}
__device__ __forceinline__ float to_float(bf16_t v) {
  return __uint_as_float(((unsigned int)v.x) << 16);
}

template <typename T>
__device__ __forceinline__ T from_float(float f);
template <>
__device__ __forceinline__ float from_float<float>(float f) {
  return f;
}
template <>
__device__ __forceinline__ half_t from_float<half_t>(float f) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
  return h;
}
// float32 bits -> bfloat16 bits, rounding to nearest even: what `cvt.rn.bf16.f32` does on sm_80+,
// in integer arithmetic for older GPUs (and for the host-side test of this header). Every NaN
// becomes the canonical quiet NaN 0x7fff, as the hardware instruction (and CUDA's own sm_75
// fallback) returns; +-inf and the round-up of the largest finite values to +-inf fall out of
// the rounding add.
__host__ __device__ constexpr u16 bf16_bits_rn(unsigned int bits) {
  return (bits & 0x7fffffffu) > 0x7f800000u
             ? (u16)0x7fffu
             : (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float f) {
  bf16_t h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
#else
  h.x = bf16_bits_rn(__float_as_uint(f));
#endif
  return h;
}

// 16 bytes of T, loaded and stored as one 128-bit access (callers guarantee the alignment).
template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}

template <typename T>
__device__ __forceinline__ Pack<T> zero_pack() {
  union {
    unsigned int w[4];
    Pack<T> p;
  } u = {{0u, 0u, 0u, 0u}};  // all-zero bits are +0.0 in every dtype
  return u.p;
}

__host__ __device__ constexpr int pow2_ceil(int n) { return n <= 1 ? 1 : 2 * pow2_ceil((n + 1) / 2); }

#define TANDEM_NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Sum (or max) over the whole thread block; every thread gets the result. `scratch` holds 33
// floats of shared memory; blockDim.x must be a multiple of 32.
template <bool IS_MAX>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = IS_MAX ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < nwarps ? scratch[lane] : (IS_MAX ? TANDEM_NEG_INF : 0.0f);
    w = IS_MAX ? warp_max(w) : warp_sum(w);
    if (lane == 0) scratch[32] = w;
  }
  __syncthreads();
  return scratch[32];
}
