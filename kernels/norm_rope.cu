// RMSNorm (optionally fused with the residual add), neox-style rotary embedding, and the two
// fused into one attention prologue with the KV cache write.
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
//
// qk_norm_rope_kv_<dtype>: one layer's attention prologue over the fused projection output
// qkv [T, (H + 2 Hkv) * D] (unit stride within a row, row stride qkv_stride), in one launch:
//   q heads: RMSNorm with q_weight (when given), then neox rotary    -> in place in qkv
//   k heads: the same with k_weight                                  -> in place in qkv, and
//            into key_cache at slot_mapping[t]
//   v heads: copied into value_cache at slot_mapping[t]      (slot < 0: a padding token, its
//                                                              K/V written nowhere)
//
//   grid = (T, ceil((H + 2 Hkv) / QKV_WARPS))     block = QKV_WARPS warps, one head row each
//
//   row t of qkv:  | q_0 | ... | q_H-1 | k_0 | ... | k_Hkv-1 | v_0 | ... | v_Hkv-1 |  (D each)
//                    ^ job 0            ^ job H                ^ job H + Hkv
//   warp w of thread block (t, y) takes job y * QKV_WARPS + w of row t
//   k_j, v_j -> key_cache / value_cache .view(num_slots, Hkv, D)[slot_mapping[t], j, :]
//
// A warp stages its q or k row in shared memory as floats: the norm needs the whole row before
// the rotation, which pairs dims i and i + rot/2 held by different lanes. Rounding follows the
// torch reference (reference_norm_rope.qk_norm_rope_kv, i.e. the model's unfused layers):
//   n = round_T(w * round_T(x * rsqrt(mean(x^2) + eps)))    mean and rsqrt in fp32
//   c, s = round_T(cos[p, i]), round_T(sin[p, i])
//   out[i]        = round_T(round_T(n[i] c) - n[i + half] s)        (torch.mul, then addcmul_)
//   out[i + half] = round_T(round_T(n[i + half] c) + n[i] s)
#include "tandem_common.cuh"

#define NORM_THREADS 256
#define QKV_WARPS 4
#define QKV_MAX_HEAD_DIM 256  // the shared-memory row of each warp; the wrapper checks it

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

template <typename T>
__device__ __forceinline__ void qk_norm_rope_kv_impl(
    T* __restrict__ qkv, T* __restrict__ key_cache, T* __restrict__ value_cache,
    const i64* __restrict__ positions, const i64* __restrict__ slot_mapping,
    const float* __restrict__ cos_table, const float* __restrict__ sin_table,
    const T* __restrict__ q_weight, const T* __restrict__ k_weight, i64 qkv_stride,
    int num_heads, int num_kv_heads, int head_dim, int rot_dim, int table_stride, float eps) {
  __shared__ float stage[QKV_WARPS][QKV_MAX_HEAD_DIM];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int job = blockIdx.y * QKV_WARPS + warp;
  // Whole warps leave here; nothing below synchronises more than one warp.
  if (job >= num_heads + 2 * num_kv_heads) return;
  const i64 token = blockIdx.x;
  const i64 slot = slot_mapping[token];
  T* row = qkv + token * qkv_stride + (i64)job * head_dim;
  const int kv_job = job - num_heads;  // < 0: a q head; [0, Hkv): a k head; [Hkv, 2 Hkv): v
  const i64 cache_row = slot * num_kv_heads;  // the slot's first head row (when slot >= 0)

  if (kv_job >= num_kv_heads) {
    if (slot >= 0) {
      T* dst = value_cache + (cache_row + kv_job - num_kv_heads) * head_dim;
      for (int d = lane; d < head_dim; d += 32) dst[d] = row[d];
    }
    return;
  }
  const T* weight = kv_job < 0 ? q_weight : k_weight;  // both null: no q/k norm (Llama)
  T* cached = kv_job >= 0 && slot >= 0 ? key_cache + (cache_row + kv_job) * head_dim : nullptr;

  float* x = stage[warp];
  float sq = 0.0f;
  for (int d = lane; d < head_dim; d += 32) {
    const float v = to_float(row[d]);
    x[d] = v;
    sq += v * v;
  }
  if (weight != nullptr) {  // uniform over the warp: every lane reaches the shuffles
    const float inv = rsqrtf(warp_sum(sq) / (float)head_dim + eps);
    for (int d = lane; d < head_dim; d += 32) {
      const float n = to_float(from_float<T>(x[d] * inv));
      x[d] = to_float(from_float<T>(to_float(weight[d]) * n));
    }
  }
  __syncwarp();  // the row is staged (and normed); lanes now read each other's dims

  const i64 pos = positions[token];
  const float* cr = cos_table + pos * table_stride;
  const float* sr = sin_table + pos * table_stride;
  const int half = rot_dim / 2;
  for (int i = lane; i < half; i += 32) {
    const float x1 = x[i], x2 = x[i + half];
    const float c = to_float(from_float<T>(cr[i])), s = to_float(from_float<T>(sr[i]));
    // torch.mul rounds the first product; addcmul_ is one fma (the product of two 16-bit
    // values is exact in fp32, so only float32 sees the difference).
    const float r1 = to_float(from_float<T>(__fmul_rn(x1, c)));
    const float r2 = to_float(from_float<T>(__fmul_rn(x2, c)));
    const T o1 = from_float<T>(__fsub_rn(r1, __fmul_rn(x2, s)));
    const T o2 = from_float<T>(__fmaf_rn(x1, s, r2));
    row[i] = o1;
    row[i + half] = o2;
    if (cached != nullptr) {
      cached[i] = o1;
      cached[i + half] = o2;
    }
  }
  for (int d = rot_dim + lane; d < head_dim; d += 32) {  // partial rotary: the rest as normed
    const T o = from_float<T>(x[d]);
    if (weight != nullptr) row[d] = o;
    if (cached != nullptr) cached[d] = o;
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
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(QKV_WARPS * 32) qk_norm_rope_kv_##SUFFIX(      \
      T* qkv, T* key_cache, T* value_cache, const i64* positions, const i64* slot_mapping,   \
      const float* cos_table, const float* sin_table, const T* q_weight, const T* k_weight,  \
      i64 qkv_stride, int num_heads, int num_kv_heads, int head_dim, int rot_dim,            \
      int table_stride, float eps) {                                                          \
    qk_norm_rope_kv_impl<T>(qkv, key_cache, value_cache, positions, slot_mapping, cos_table,  \
                            sin_table, q_weight, k_weight, qkv_stride, num_heads,             \
                            num_kv_heads, head_dim, rot_dim, table_stride, eps);              \
  }

DEFINE_NORM_ROPE(f16, half_t)
DEFINE_NORM_ROPE(bf16, bf16_t)
DEFINE_NORM_ROPE(f32, float)
