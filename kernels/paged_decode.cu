// Paged decode attention: one query token per request against its cached context.
//
// Compiled once per dtype and head size (-DWITH_F16, -DWITH_BF16 or -DWITH_F32, and
// -DHEAD_DIM=...; kernels/variants.py lists the sizes built); extern "C" entry points per number
// of query heads one thread block serves (QPB: 1, 2, 4 or 8 heads that share one KV head), and
// the same again for a tiled main loop (paged_decode_tiled_*, described before its code; correct
// but slower in every case measured on an H200, 2026-11-27: off in the engine).
//
//   grid  = (num_heads / QPB, num_seqs, P)     block = 128 threads     (P = max_partitions)
//
//   Split-K: each sequence's context is cut into at most P partitions, laid out on the device
//   from the sequence's own length, so one launch shape (one CUDA graph per batch size) serves
//   every context up to the bound P was chosen for:
//     part_len  = max(MIN_PARTITION, round_up(ceil(seq_len / P), PARTITION_ALIGN))
//     num_parts = ceil(seq_len / part_len) <= P      thread blocks with part >= num_parts exit
//
//   seq_len = 1000, P = 4: part_len = max(128, round_up(250, 16)) = 256, num_parts = 4
//     |<- part 0: 0..255 ->|<- part 1: 256..511 ->|<- 2: 512..767 ->|<- 3: 768..999 ->|
//   seq_len = 300, P = 4:  part_len = 128, num_parts = 3 (the blocks of part 3 exit)
//
//   token t lives in block block_table[t / block_size], row t % block_size:
//     k_cache[block][t % block_size][kv_head][:]          (block tables are int32)
//
// Inside a thread block, TG lanes share one token (each lane owns 16-byte chunks of the head
// dimension) and the block's 128 / TG lane groups walk the partition's tokens in a stride,
// each keeping its own online softmax (running max m, running sum l, accumulator acc) in fp32.
// Scores are kept in the log2 domain (the query is pre-scaled by scale * log2(e)). The groups
// are merged through shared memory. A sequence with one partition writes `out` directly;
// otherwise each partition writes (acc, m, l) to float32 scratch, indexed with this launch's P
// ([num_seqs, num_heads, P, HEAD_DIM]: a prefix of the caller's workspace), and the reduce
// kernel merges the partitions:
//   M = max_p m_p,  L = sum_p l_p 2^(m_p - M),  out = sum_p acc_p 2^(m_p - M) / L
#include "tandem_common.cuh"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head size>"
#endif

#define DECODE_THREADS 128
// Equal to MIN_PARTITION and PARTITION_ALIGN in kernels/cuda_ops.py.
#define MIN_PARTITION 128
#define PARTITION_ALIGN 16

// Tokens per partition of a context of seq_len > 0 tokens split at most `partitions` ways (see
// the top of the file). Mirrored by kernels.cuda_ops.decode_partition_len, whose CPU test checks
// that the used partitions cover every token exactly once.
__device__ __forceinline__ int partition_len(int seq_len, int partitions) {
  const int even = (seq_len + partitions - 1) / partitions;
  const int aligned = (even + PARTITION_ALIGN - 1) / PARTITION_ALIGN * PARTITION_ALIGN;
  return max(MIN_PARTITION, aligned);
}

// K and V chunks of token t for this lane (zeros for padding lanes and for t >= end).
template <typename T, int CPL, int TG, int NCHUNK>
__device__ __forceinline__ void load_token(const T* __restrict__ k_cache,
                                           const T* __restrict__ v_cache,
                                           const int* __restrict__ bt, int block_size,
                                           i64 row_stride, i64 head_off, int t, int end, int gl,
                                           Pack<T>* kp, Pack<T>* vp) {
  constexpr int VEC = Pack<T>::N;
  const bool valid = t < end;
  i64 base = 0;
  if (valid)
    base = ((i64)bt[t / block_size] * block_size + t % block_size) * row_stride + head_off;
#pragma unroll
  for (int c = 0; c < CPL; ++c) {
    const int chunk = gl + c * TG;
    if (valid && chunk < NCHUNK) {
      kp[c] = load_pack(k_cache + base + chunk * VEC);
      vp[c] = load_pack(v_cache + base + chunk * VEC);
    } else {
      kp[c] = zero_pack<T>();
      vp[c] = zero_pack<T>();
    }
  }
}

// The scores of one token for the block's QPB query heads: q . k, each lane's chunks summed over
// its TG-lane group (every lane of the warp must call it).
template <typename T, int QPB, int CPL, int TG>
__device__ __forceinline__ void token_scores(const float (&qr)[QPB][CPL][Pack<T>::N],
                                             const Pack<T> (&k)[CPL], float (&s)[QPB]) {
#pragma unroll
  for (int g = 0; g < QPB; ++g) {
    float d = 0.0f;
#pragma unroll
    for (int c = 0; c < CPL; ++c)
#pragma unroll
      for (int i = 0; i < Pack<T>::N; ++i) d += qr[g][c][i] * to_float(k[c].v[i]);
#pragma unroll
    for (int off = TG / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
    s[g] = d;
  }
}

// U = 0: each lane group takes one token per iteration, the next one prefetched.
// U > 0, the tiled variant (paged_decode_tiled_<dtype>_q<QPB>): the same grid, partitions, merge
// and outputs as U = 0, a different main loop. Each lane group takes U tokens per iteration (tokens
// tb + u * GROUPS + group, u < U): it issues the U block-table loads, then all U tokens' K/V
// loads, before using any (U times the bytes in flight of the one-token prefetch), scores
// the U tokens, and rescales its running softmax once per tile instead of once per token:
//   m' = max(m, s_0 .. s_U-1),  l' = l 2^(m - m') + sum_u 2^(s_u - m'),
//   acc' = acc 2^(m - m') + sum_u 2^(s_u - m') v_u
// Tokens at or past `end` are neither loaded nor counted (score -inf, weight 0).
template <typename T, int QPB, int U>
__device__ __forceinline__ void paged_decode_impl(
    T* __restrict__ out,              // [num_seqs, num_heads, HEAD_DIM], contiguous
    float* __restrict__ part_out,     // [num_seqs, num_heads, P, HEAD_DIM]; P = max_partitions
    float* __restrict__ part_max,     // [num_seqs, num_heads, P]
    float* __restrict__ part_sum,     // [num_seqs, num_heads, P]
    const T* __restrict__ q,          // [num_seqs, num_heads, HEAD_DIM], last stride 1
    const T* __restrict__ k_cache,    // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    const T* __restrict__ v_cache,
    const int* __restrict__ block_tables,  // [>= num_seqs, bt_stride] int32
    const int* __restrict__ seq_lens,      // [num_seqs]
    int num_heads, int num_kv_heads, int block_size, int bt_stride, i64 q_stride_tok,
    int q_stride_head, int max_partitions, float scale_log2) {
  constexpr int VEC = Pack<T>::N;                             // elements per 16-byte chunk
  static_assert(HEAD_DIM % VEC == 0, "head_dim must fill whole 16-byte chunks");
  constexpr int NCHUNK = HEAD_DIM / VEC;                      // chunks per head row
  constexpr int TG = NCHUNK >= 32 ? 32 : pow2_ceil(NCHUNK);   // lanes per token
  constexpr int CPL = (NCHUNK + TG - 1) / TG;                 // chunks per lane
  constexpr int GROUPS = DECODE_THREADS / TG;                 // tokens in flight per block
  // q and acc hold CPL * VEC floats per lane and head: at most 8 (head_dim <= 256 in every
  // dtype) keeps the 8-head variant in 255 registers without spilling.
  static_assert(CPL * VEC <= 8, "head_dim > 256: the 8-head variant would spill registers");

  __shared__ float sm_acc[GROUPS][QPB][HEAD_DIM];
  __shared__ float sm_m[GROUPS][QPB];
  __shared__ float sm_l[GROUPS][QPB];
  __shared__ float sm_w[GROUPS][QPB];
  __shared__ float sm_total[QPB][2];

  const int head0 = blockIdx.x * QPB;
  const int seq = blockIdx.y;
  const int part = blockIdx.z;
  const int seq_len = seq_lens[seq];
  if (seq_len <= 0) {  // padding row: defined output instead of 0/0
    if (part == 0)
      for (int i = threadIdx.x; i < QPB * HEAD_DIM; i += DECODE_THREADS)
        out[((i64)seq * num_heads + head0) * HEAD_DIM + i] = from_float<T>(0.0f);
    return;
  }
  const int part_len = partition_len(seq_len, max_partitions);
  const int num_parts = (seq_len + part_len - 1) / part_len;
  if (part >= num_parts) return;

  const int kv_head = head0 / (num_heads / num_kv_heads);
  const int gl = threadIdx.x % TG;     // lane within the token group (groups never straddle warps)
  const int group = threadIdx.x / TG;

  // The query, pre-scaled, in registers. Chunks past HEAD_DIM (padding lanes) are zero.
  float qr[QPB][CPL][VEC];
#pragma unroll
  for (int g = 0; g < QPB; ++g) {
    const T* qrow = q + (i64)seq * q_stride_tok + (i64)(head0 + g) * q_stride_head;
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int chunk = gl + c * TG;
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        qr[g][c][i] = chunk < NCHUNK ? to_float(qrow[chunk * VEC + i]) * scale_log2 : 0.0f;
    }
  }

  float m[QPB], l[QPB], acc[QPB][CPL][VEC];
#pragma unroll
  for (int g = 0; g < QPB; ++g) {
    m[g] = TANDEM_NEG_INF;
    l[g] = 0.0f;
#pragma unroll
    for (int c = 0; c < CPL; ++c)
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[g][c][i] = 0.0f;
  }

  const int start = part * part_len;  // < seq_len, as part < num_parts
  const int end = min(start + part_len, seq_len);
  const int* bt = block_tables + (i64)seq * bt_stride;
  const i64 row_stride = (i64)num_kv_heads * HEAD_DIM;
  const i64 head_off = (i64)kv_head * HEAD_DIM;

  if constexpr (U == 0) {
    Pack<T> kcur[CPL], vcur[CPL], knext[CPL], vnext[CPL];
    load_token<T, CPL, TG, NCHUNK>(k_cache, v_cache, bt, block_size, row_stride, head_off,
                                   start + group, end, gl, kcur, vcur);
    // The loop bound is uniform over the block so every lane reaches the shuffles.
    for (int tb = start; tb < end; tb += GROUPS) {
      const int t = tb + group;
      // Prefetch the next token while this one computes.
      load_token<T, CPL, TG, NCHUNK>(k_cache, v_cache, bt, block_size, row_stride, head_off,
                                     t + GROUPS, end, gl, knext, vnext);
      float s[QPB];
      token_scores<T, QPB, CPL, TG>(qr, kcur, s);
      if (t < end) {
#pragma unroll
        for (int g = 0; g < QPB; ++g) {
          const float m_new = fmaxf(m[g], s[g]);
          const float alpha = exp2f(m[g] - m_new);  // 0 on the first token (m = -inf)
          const float p = exp2f(s[g] - m_new);
          l[g] = l[g] * alpha + p;
          m[g] = m_new;
#pragma unroll
          for (int c = 0; c < CPL; ++c)
#pragma unroll
            for (int i = 0; i < VEC; ++i)
              acc[g][c][i] = acc[g][c][i] * alpha + p * to_float(vcur[c].v[i]);
        }
      }
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        kcur[c] = knext[c];
        vcur[c] = vnext[c];
      }
    }
  } else {
    // The loop bound is uniform over the block so every lane reaches the shuffles.
    for (int tb = start; tb < end; tb += GROUPS * U) {
      int block[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = tb + u * GROUPS + group;
        block[u] = t < end ? bt[t / block_size] : 0;
      }
      Pack<T> kp[U][CPL], vp[U][CPL];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int t = tb + u * GROUPS + group;
        const i64 base = ((i64)block[u] * block_size + t % block_size) * row_stride + head_off;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const int chunk = gl + c * TG;
          if (t < end && chunk < NCHUNK) {
            kp[u][c] = load_pack(k_cache + base + chunk * VEC);
            vp[u][c] = load_pack(v_cache + base + chunk * VEC);
          } else {
            kp[u][c] = zero_pack<T>();
            vp[u][c] = zero_pack<T>();
          }
        }
      }
      float s[U][QPB];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        token_scores<T, QPB, CPL, TG>(qr, kp[u], s[u]);
        if (tb + u * GROUPS + group >= end)
#pragma unroll
          for (int g = 0; g < QPB; ++g) s[u][g] = TANDEM_NEG_INF;
      }
#pragma unroll
      for (int g = 0; g < QPB; ++g) {
        float m_new = m[g];
#pragma unroll
        for (int u = 0; u < U; ++u) m_new = fmaxf(m_new, s[u][g]);
        if (m_new == TANDEM_NEG_INF) continue;  // no token of this group yet
        const float alpha = exp2f(m[g] - m_new);  // 0 while m = -inf
        float p[U];
        float psum = 0.0f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          p[u] = exp2f(s[u][g] - m_new);  // 0 for a token past the end
          psum += p[u];
        }
        l[g] = l[g] * alpha + psum;
        m[g] = m_new;
#pragma unroll
        for (int c = 0; c < CPL; ++c)
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            float a = acc[g][c][i] * alpha;
#pragma unroll
            for (int u = 0; u < U; ++u) a += p[u] * to_float(vp[u][c].v[i]);
            acc[g][c][i] = a;
          }
      }
    }
  }

  // Merge the lane groups. A group that saw no token has m = -inf, l = 0, acc = 0.
#pragma unroll
  for (int g = 0; g < QPB; ++g) {
    if (gl == 0) {
      sm_m[group][g] = m[g];
      sm_l[group][g] = l[g];
    }
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int chunk = gl + c * TG;
      if (chunk < NCHUNK)
#pragma unroll
        for (int i = 0; i < VEC; ++i) sm_acc[group][g][chunk * VEC + i] = acc[g][c][i];
    }
  }
  __syncthreads();
  if (threadIdx.x < QPB) {
    const int g = threadIdx.x;
    float mx = TANDEM_NEG_INF;
    for (int j = 0; j < GROUPS; ++j) mx = fmaxf(mx, sm_m[j][g]);
    float sum = 0.0f;
    for (int j = 0; j < GROUPS; ++j) {
      const float w = sm_m[j][g] == TANDEM_NEG_INF ? 0.0f : exp2f(sm_m[j][g] - mx);
      sm_w[j][g] = w;
      sum += sm_l[j][g] * w;
    }
    sm_total[g][0] = mx;  // finite: token `start` always belongs to group 0
    sm_total[g][1] = sum;
  }
  __syncthreads();

  const bool direct = num_parts == 1;
  for (int idx = threadIdx.x; idx < QPB * HEAD_DIM; idx += DECODE_THREADS) {
    const int g = idx / HEAD_DIM, d = idx - g * HEAD_DIM;
    float a = 0.0f;
#pragma unroll 4
    for (int j = 0; j < GROUPS; ++j) a += sm_acc[j][g][d] * sm_w[j][g];
    const i64 row = (i64)seq * num_heads + head0 + g;
    if (direct) {
      out[row * HEAD_DIM + d] = from_float<T>(a / sm_total[g][1]);
    } else {
      part_out[(row * max_partitions + part) * HEAD_DIM + d] = a;
      if (d == 0) {
        part_max[row * max_partitions + part] = sm_total[g][0];
        part_sum[row * max_partitions + part] = sm_total[g][1];
      }
    }
  }
}

// grid = (num_heads, num_seqs), block = DECODE_THREADS, dynamic shared = max_partitions floats.
// Computes each sequence's num_parts as the partition kernel does, from seq_lens and P.
template <typename T>
__device__ __forceinline__ void paged_decode_reduce_impl(
    T* __restrict__ out, const float* __restrict__ part_out, const float* __restrict__ part_max,
    const float* __restrict__ part_sum, const int* __restrict__ seq_lens, int num_heads,
    int max_partitions) {
  extern __shared__ float weights[];
  __shared__ float scratch[33];
  const int head = blockIdx.x, seq = blockIdx.y;
  const int seq_len = seq_lens[seq];
  if (seq_len <= 0) return;  // a padding row, written by the partition kernel
  const int part_len = partition_len(seq_len, max_partitions);
  const int num_parts = (seq_len + part_len - 1) / part_len;
  if (num_parts <= 1) return;  // written directly by the partition kernel
  const i64 row = (i64)seq * num_heads + head;
  const float* pm = part_max + row * max_partitions;
  const float* ps = part_sum + row * max_partitions;

  float mx = TANDEM_NEG_INF;
  for (int p = threadIdx.x; p < num_parts; p += blockDim.x) mx = fmaxf(mx, pm[p]);
  mx = block_reduce<true>(mx, scratch);
  float sum = 0.0f;
  for (int p = threadIdx.x; p < num_parts; p += blockDim.x) {
    const float w = exp2f(pm[p] - mx);
    weights[p] = w;
    sum += ps[p] * w;
  }
  sum = block_reduce<false>(sum, scratch);  // its barriers also publish `weights`
  const float inv = 1.0f / sum;
  const float* po = part_out + row * max_partitions * HEAD_DIM;
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float a = 0.0f;
    for (int p = 0; p < num_parts; ++p) a += po[(i64)p * HEAD_DIM + d] * weights[p];
    out[row * HEAD_DIM + d] = from_float<T>(a * inv);
  }
}

// Register budgets (__launch_bounds__ minimum blocks per SM). U = 0: 4 blocks (128 registers) up
// to 4 heads per block, 2 for 8 heads. The tiled variant holds U = 4 tokens' K/V per lane: 4
// heads fit 170 registers (3 blocks per SM, 48 KiB of K/V in flight per SM at head_dim 128 in
// 16-bit types, where U = 0 keeps 32 KiB at 4 blocks), 8 heads 255 (2 blocks).
#define DECODE_MIN_BLOCKS(QPB) ((QPB) >= 8 ? 2 : 4)
#define TILE_TOKENS 4
#define TILED_MIN_BLOCKS(QPB) ((QPB) >= 8 ? 2 : (QPB) >= 4 ? 3 : 4)

#define DEFINE_DECODE(NAME, T, QPB, U, MIN_BLOCKS)                                             \
  extern "C" __global__ void __launch_bounds__(DECODE_THREADS, MIN_BLOCKS)                  \
      NAME(T* out, float* part_out, float* part_max, float* part_sum, const T* q,           \
           const T* k_cache, const T* v_cache, const int* block_tables, const int* seq_lens, \
           int num_heads, int num_kv_heads, int block_size, int bt_stride, i64 q_stride_tok, \
           int q_stride_head, int max_partitions, float scale_log2) {                       \
    paged_decode_impl<T, QPB, U>(out, part_out, part_max, part_sum, q, k_cache, v_cache,    \
                                 block_tables, seq_lens, num_heads, num_kv_heads,           \
                                 block_size, bt_stride, q_stride_tok, q_stride_head,        \
                                 max_partitions, scale_log2);                               \
  }

#define DEFINE_DECODE_HEADS(SUFFIX, T, QPB)                                                   \
  DEFINE_DECODE(paged_decode_##SUFFIX##_q##QPB, T, QPB, 0, DECODE_MIN_BLOCKS(QPB))          \
  DEFINE_DECODE(paged_decode_tiled_##SUFFIX##_q##QPB, T, QPB, TILE_TOKENS,                  \
                TILED_MIN_BLOCKS(QPB))

#define DEFINE_DECODE_DTYPE(SUFFIX, T)                                                        \
  DEFINE_DECODE_HEADS(SUFFIX, T, 1)                                                         \
  DEFINE_DECODE_HEADS(SUFFIX, T, 2)                                                         \
  DEFINE_DECODE_HEADS(SUFFIX, T, 4)                                                         \
  DEFINE_DECODE_HEADS(SUFFIX, T, 8)                                                         \
  extern "C" __global__ void __launch_bounds__(DECODE_THREADS)                              \
      paged_decode_reduce_##SUFFIX(T* out, const float* part_out, const float* part_max,    \
                                   const float* part_sum, const int* seq_lens, int num_heads, \
                                   int max_partitions) {                                    \
    paged_decode_reduce_impl<T>(out, part_out, part_max, part_sum, seq_lens, num_heads,     \
                                max_partitions);                                            \
  }

#if !defined(WITH_F16) && !defined(WITH_BF16) && !defined(WITH_F32)
#error "compile with -DWITH_F16, -DWITH_BF16 or -DWITH_F32"
#endif
#ifdef WITH_F16
DEFINE_DECODE_DTYPE(f16, half_t)
#endif
#ifdef WITH_BF16
DEFINE_DECODE_DTYPE(bf16, bf16_t)
#endif
#ifdef WITH_F32
DEFINE_DECODE_DTYPE(f32, float)
#endif
