// RMSNorm (optionally fused with the residual add) and neox-style rotary embedding.
//
// rms_norm_<dtype>: one thread block per row, with the rounding of the torch reference:
//   x = round_T(x + residual)                      (only with a residual; written to residual_out)
//   out = round_T(weight * round_T(x * rsqrt(mean(x^2) + eps)))   with mean and rsqrt in fp32
//
// rotary_neox_<dtype>: in place on q [T, H, D] and k [T, Hkv, D], one thread block per token.
//   With rot = cos.shape[1] and half = rot / 2, for i < half (dims >= rot untouched):
//   x[i]        <- x[i] cos[p, i] - x[i + half] sin[p, i]
//   x[i + half] <- x[i + half] cos[p, i] + x[i] sin[p, i]
//   (the table repeats its first half: cos[p, i + half] == cos[p, i])
#include "tandem_common.cuh"

#define NORM_THREADS 256

template <typename T>
__device__ __forceinline__ void rms_norm_impl(T* __restrict__ out, T* __restrict__ residual_out,
                                              const T* __restrict__ x,
                                              const T* __restrict__ residual,
                                              const T* __restrict__ weight, int hidden,
                                              i64 x_stride, i64 residual_stride, float eps) {
  __shared__ float scratch[33];
  const i64 row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* orow = out + row * hidden;
  T* rrow = residual_out + row * hidden;  // only touched with a residual
  float sq = 0.0f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = to_float(xr[i]);
    if (residual != nullptr) {
      const T sum = from_float<T>(v + to_float(residual[row * residual_stride + i]));
      rrow[i] = sum;
      v = to_float(sum);
    }
    sq += v * v;
  }
  const float inv = rsqrtf(block_reduce<false>(sq, scratch) / (float)hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    // Same thread, same index as above: its own store is visible without a barrier.
    const float v = residual != nullptr ? to_float(rrow[i]) : to_float(xr[i]);
    const float n = to_float(from_float<T>(v * inv));
    orow[i] = from_float<T>(to_float(weight[i]) * n);
  }
}

template <typename T>
__device__ __forceinline__ void rotary_neox_impl(T* __restrict__ q, T* __restrict__ k,
                                                 const i64* __restrict__ positions,
                                                 const float* __restrict__ cos_table,
                                                 const float* __restrict__ sin_table,
                                                 int rot_dim, int table_stride, int num_heads,
                                                 int num_kv_heads, i64 q_stride_tok,
                                                 int q_stride_head, i64 k_stride_tok,
                                                 int k_stride_head) {
  const i64 token = blockIdx.x;
  const i64 pos = positions[token];
  const float* cr = cos_table + pos * table_stride;
  const float* sr = sin_table + pos * table_stride;
  const int half = rot_dim / 2;
  const int pairs = (num_heads + num_kv_heads) * half;
  for (int idx = threadIdx.x; idx < pairs; idx += blockDim.x) {
    const int h = idx / half, i = idx - h * half;
    T* base = h < num_heads ? q + token * q_stride_tok + (i64)h * q_stride_head
                            : k + token * k_stride_tok + (i64)(h - num_heads) * k_stride_head;
    const float x1 = to_float(base[i]), x2 = to_float(base[i + half]);
    const float c = cr[i], s = sr[i];
    base[i] = from_float<T>(x1 * c - x2 * s);
    base[i + half] = from_float<T>(x2 * c + x1 * s);
  }
}

#define DEFINE_NORM_ROPE(SUFFIX, T)                                                             \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS)                                  \
      rms_norm_##SUFFIX(T* out, T* residual_out, const T* x, const T* residual,               \
                        const T* weight, int hidden, i64 x_stride, i64 residual_stride,       \
                        float eps) {                                                          \
    rms_norm_impl<T>(out, residual_out, x, residual, weight, hidden, x_stride,                \
                     residual_stride, eps);                                                   \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(NORM_THREADS) rotary_neox_##SUFFIX(            \
      T* q, T* k, const i64* positions, const float* cos_table, const float* sin_table,      \
      int rot_dim, int table_stride, int num_heads, int num_kv_heads, i64 q_stride_tok,       \
      int q_stride_head, i64 k_stride_tok, int k_stride_head) {                               \
    rotary_neox_impl<T>(q, k, positions, cos_table, sin_table, rot_dim, table_stride,         \
                        num_heads, num_kv_heads, q_stride_tok, q_stride_head, k_stride_tok,   \
                        k_stride_head);                                                       \
  }

DEFINE_NORM_ROPE(f16, half_t)
DEFINE_NORM_ROPE(bf16, bf16_t)
DEFINE_NORM_ROPE(f32, float)
