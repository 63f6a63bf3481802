// Paged prefill / chunked-prefill attention: the multi-token requests of a step, each attending
// causally over its whole cached context (a cached prefix plus this step's chunk).
//
// Compiled once per dtype and head size (-DWITH_F16, -DWITH_BF16 or -DWITH_F32, and
// -DHEAD_DIM=...; kernels/variants.py lists the sizes built).
//
//   grid  = (ceil(max_q_len / BLOCK_M), num_prefill_reqs, num_heads)    block = 128 threads
//   block tables are int32: key at position pos lives in block bt[pos / block_size]
//
//   request r owns query rows query_start_loc[r] .. query_start_loc[r+1]; its context holds
//   seq_len tokens, the last q_len of which are this step's queries, so query i sits at
//   absolute position (seq_len - q_len) + i and sees keys 0 .. that position:
//
//       keys:    0 1 2 3 4 5 6 7        seq_len = 8, q_len = 3 (5 cached tokens)
//       q0 (5):  x x x x x x . .
//       q1 (6):  x x x x x x x .
//       q2 (7):  x x x x x x x x
//
// One thread block holds BLOCK_M query rows of one head in shared memory and walks the keys in
// tiles of BLOCK_N (gathered through the block table), with an fp32 online softmax per row.
// Four threads share a row: each scores every fourth key of the tile and accumulates every
// fourth output dimension. A straightforward tiled kernel: correctness first, no tensor cores.
#include "tandem_common.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head size>"
#endif

#define PREFILL_THREADS 128
#define BLOCK_M 32

template <typename T>
__device__ __forceinline__ void paged_prefill_impl(
    T* __restrict__ out,              // [num_tokens, num_heads, HEAD_DIM], contiguous
    const T* __restrict__ q,          // [num_tokens, num_heads, HEAD_DIM], last stride 1
    const T* __restrict__ k_cache,    // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v_cache,
    const int* __restrict__ block_tables,     // [num_reqs, bt_stride] int32
    const int* __restrict__ seq_lens,         // [num_reqs]
    const int* __restrict__ query_start_loc,  // [num_reqs + 1]
    int req_offset, int num_heads, int num_kv_heads, int block_size, int bt_stride,
    i64 q_stride_tok, int q_stride_head, float scale_log2) {
  constexpr int VEC = Pack<T>::N;
  static_assert(HEAD_DIM % VEC == 0, "head_dim must fill whole 16-byte chunks");
  static_assert(HEAD_DIM * sizeof(T) <= 512, "head row too large for the shared-memory tiles");
  constexpr int NCHUNK = HEAD_DIM / VEC;
  constexpr int BLOCK_N = HEAD_DIM * sizeof(T) <= 256 ? 32 : 16;
  constexpr int KPT = BLOCK_N / 4;     // keys scored per thread
  constexpr int DPT = HEAD_DIM / 4;    // output dims per thread
  // Rows padded by 4 bytes so the 8 different rows a warp reads fall in different banks.
  constexpr int LD = HEAD_DIM + 4 / sizeof(T);

  __shared__ T q_s[BLOCK_M][LD];
  __shared__ T k_s[BLOCK_N][LD];
  __shared__ T v_s[BLOCK_N][LD];
  __shared__ float p_s[BLOCK_M][BLOCK_N + 1];

  const int req = req_offset + blockIdx.y;
  const int head = blockIdx.z;
  const int q_begin = query_start_loc[req];
  const int q_len = query_start_loc[req + 1] - q_begin;
  const int m0 = blockIdx.x * BLOCK_M;
  if (m0 >= q_len) return;
  const int seq_len = seq_lens[req];
  const int ctx = seq_len - q_len;  // tokens before this step's first query
  const int kv_head = head / (num_heads / num_kv_heads);
  const int* bt = block_tables + (i64)req * bt_stride;
  const i64 row_stride = (i64)num_kv_heads * HEAD_DIM;

  for (int idx = threadIdx.x; idx < BLOCK_M * HEAD_DIM; idx += PREFILL_THREADS) {
    const int r = idx / HEAD_DIM, d = idx - r * HEAD_DIM;
    T v = from_float<T>(0.0f);
    if (m0 + r < q_len)
      v = q[(i64)(q_begin + m0 + r) * q_stride_tok + (i64)head * q_stride_head + d];
    q_s[r][d] = v;
  }

  const int r = threadIdx.x >> 2;  // this thread's query row in the tile
  const int c = threadIdx.x & 3;   // its quarter: keys c, c+4, ...; dims c, c+4, ...
  const int q_pos = ctx + m0 + r;  // absolute position of that row
  float m_i = TANDEM_NEG_INF, l_i = 0.0f;
  float acc[DPT];
#pragma unroll
  for (int i = 0; i < DPT; ++i) acc[i] = 0.0f;

  // Keys past the tile's last query are never seen by any of its rows.
  const int kv_end = min(seq_len, ctx + min(m0 + BLOCK_M, q_len));
  for (int n0 = 0; n0 < kv_end; n0 += BLOCK_N) {
    __syncthreads();  // previous tile fully consumed (and q_s written, on the first pass)
    for (int idx = threadIdx.x; idx < BLOCK_N * NCHUNK; idx += PREFILL_THREADS) {
      const int j = idx / NCHUNK, ch = idx - j * NCHUNK;
      const int pos = n0 + j;
      Pack<T> kp = zero_pack<T>(), vp = zero_pack<T>();  // zeros keep 0 * V finite
      if (pos < kv_end) {
        const i64 slot = (i64)bt[pos / block_size] * block_size + pos % block_size;
        const i64 base = slot * row_stride + (i64)kv_head * HEAD_DIM + ch * VEC;
        kp = load_pack(k_cache + base);
        vp = load_pack(v_cache + base);
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        k_s[j][ch * VEC + i] = kp.v[i];
        v_s[j][ch * VEC + i] = vp.v[i];
      }
    }
    __syncthreads();

    float s[KPT];
    float mx = TANDEM_NEG_INF;
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      const int j = c + 4 * k;
      float d = 0.0f;
#pragma unroll 8
      for (int e = 0; e < HEAD_DIM; ++e) d += to_float(q_s[r][e]) * to_float(k_s[j][e]);
      const int pos = n0 + j;
      s[k] = (pos <= q_pos && pos < kv_end) ? d * scale_log2 : TANDEM_NEG_INF;
      mx = fmaxf(mx, s[k]);
    }
    // The row's four threads are adjacent lanes.
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_i, mx);
    const float m_use = m_new == TANDEM_NEG_INF ? 0.0f : m_new;  // row with no key yet
    const float alpha = exp2f(m_i - m_use);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < KPT; ++k) {
      const float p = exp2f(s[k] - m_use);
      p_s[r][c + 4 * k] = p;
      sum += p;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    l_i = l_i * alpha + sum;
    m_i = m_new;
    __syncwarp();  // p_s row r is written and read by the same four lanes
#pragma unroll
    for (int i = 0; i < DPT; ++i) acc[i] *= alpha;
    for (int j = 0; j < BLOCK_N; ++j) {
      const float p = p_s[r][j];
#pragma unroll
      for (int i = 0; i < DPT; ++i) acc[i] += p * to_float(v_s[j][c + 4 * i]);
    }
    __syncwarp();
  }

  if (m0 + r < q_len) {
    const float inv = 1.0f / l_i;
    T* orow = out + ((i64)(q_begin + m0 + r) * num_heads + head) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < DPT; ++i) orow[c + 4 * i] = from_float<T>(acc[i] * inv);
  }
}

#define DEFINE_PREFILL(NAME, T)                                                                \
  extern "C" __global__ void __launch_bounds__(PREFILL_THREADS)                              \
      NAME(T* out, const T* q, const T* k_cache, const T* v_cache, const int* block_tables,  \
           const int* seq_lens, const int* query_start_loc, int req_offset, int num_heads,   \
           int num_kv_heads, int block_size, int bt_stride, i64 q_stride_tok,                \
           int q_stride_head, float scale_log2) {                                            \
    paged_prefill_impl<T>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, \
                          req_offset, num_heads, num_kv_heads, block_size, bt_stride,        \
                          q_stride_tok, q_stride_head, scale_log2);                          \
  }

#if !defined(WITH_F16) && !defined(WITH_BF16) && !defined(WITH_F32)
#error "compile with -DWITH_F16, -DWITH_BF16 or -DWITH_F32"
#endif
#ifdef WITH_F16
DEFINE_PREFILL(paged_prefill_f16, half_t)
#endif
#ifdef WITH_BF16
DEFINE_PREFILL(paged_prefill_bf16, bf16_t)
#endif
#ifdef WITH_F32
DEFINE_PREFILL(paged_prefill_f32, float)
#endif
