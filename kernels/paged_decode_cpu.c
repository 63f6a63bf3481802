// Paged decode attention on the CPU: one query token per request over its cached context, read
// in place from the paged KV cache (no gather, no padding, the cache's own dtype).
//
// Built at run time by kernels/cpu.py with the system C compiler (-O3 -march=native -fopenmp)
// per (HEAD_DIM, BLOCK_SIZE), loaded with ctypes after torch, so the OpenMP runtime is torch's
// own libgomp (same soname, already loaded) and both share one thread pool.
//
//   q, out        [num_reqs, num_heads, HEAD_DIM]
//   k/v cache     [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
//   block_tables  [num_reqs, max_blocks] int32, seq_lens [num_reqs] int32 (>= 1)
//
// One task per (request, kv head): the group of query heads that share the kv head walks the
// request's blocks once with an online softmax, tile by tile (a block at a time), prefetching the
// next block (a block's rows are scattered over 4 KiB pages the hardware prefetcher will not
// follow). Built with -ffast-math: nothing here may be an infinity (the running max starts at
// -FLT_MAX, not -INFINITY).

#include <float.h>
#include <math.h>
#include <stdint.h>

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE must be defined"
#endif

typedef uint16_t bf16_t;

static inline float load_f32(const float* p) { return *p; }
static inline float load_bf16(const bf16_t* p) {
  union { uint32_t u; float f; } v = {.u = ((uint32_t)*p) << 16};
  return v.f;
}
static inline void store_f32(float* p, float x) { *p = x; }
static inline void store_bf16(bf16_t* p, float x) {
  union { float f; uint32_t u; } v = {.f = x};
  if ((v.u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
    *p = (bf16_t)((v.u >> 16) | 0x40u);
    return;
  }
  v.u += 0x7fffu + ((v.u >> 16) & 1u);  // round to nearest, ties to even
  *p = (bf16_t)(v.u >> 16);
}

// CONVERT: 1 when T is not float. A block's K and V rows are then converted to float once into
// a small buffer (L1-resident), instead of once per query head of the group.
#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE, CONVERT)                                     \
  void NAME(const T* q, const T* key_cache, const T* value_cache, const int32_t* block_tables, \
            int max_blocks, const int32_t* seq_lens, T* out, int num_reqs, int num_heads,      \
            int num_kv_heads, float scale) {                                                   \
    const int G = num_heads / num_kv_heads;                                                    \
    const int64_t row = (int64_t)num_kv_heads * HEAD_DIM; /* between two tokens of a block */  \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                              \
    for (int b = 0; b < num_reqs; ++b) {                                                       \
      for (int kh = 0; kh < num_kv_heads; ++kh) {                                              \
        float qv[G][HEAD_DIM] __attribute__((aligned(64)));                                    \
        float acc[G][HEAD_DIM] __attribute__((aligned(64)));                                   \
        float kf[CONVERT ? BLOCK_SIZE : 1][HEAD_DIM] __attribute__((aligned(64)));             \
        float vf[CONVERT ? BLOCK_SIZE : 1][HEAD_DIM] __attribute__((aligned(64)));             \
        float m[G], l[G], p[G][BLOCK_SIZE];                                                    \
        for (int g = 0; g < G; ++g) {                                                          \
          const T* qp = q + ((int64_t)b * num_heads + (int64_t)kh * G + g) * HEAD_DIM;         \
          for (int d = 0; d < HEAD_DIM; ++d) {                                                 \
            qv[g][d] = LOAD(qp + d) * scale;                                                   \
            acc[g][d] = 0.f;                                                                   \
          }                                                                                    \
          m[g] = -FLT_MAX;                                                                     \
          l[g] = 0.f;                                                                          \
        }                                                                                      \
        const int len = seq_lens[b];                                                           \
        const int32_t* table = block_tables + (int64_t)b * max_blocks;                         \
        for (int t0 = 0; t0 < len; t0 += BLOCK_SIZE) {                                         \
          const int n = len - t0 < BLOCK_SIZE ? len - t0 : BLOCK_SIZE;                         \
          const int64_t base = ((int64_t)table[t0 / BLOCK_SIZE] * BLOCK_SIZE * num_kv_heads +  \
                                kh) * HEAD_DIM;                                                \
          const T* kb = key_cache + base;                                                      \
          const T* vb = value_cache + base;                                                    \
          if (t0 + BLOCK_SIZE < len) {                                                         \
            const int64_t next = ((int64_t)table[t0 / BLOCK_SIZE + 1] * BLOCK_SIZE *           \
                                  num_kv_heads + kh) * HEAD_DIM;                               \
            for (int t = 0; t < BLOCK_SIZE; ++t)                                               \
              for (int d = 0; d < HEAD_DIM; d += 64 / (int)sizeof(T)) {                        \
                __builtin_prefetch(key_cache + next + t * row + d, 0, 3);                      \
                __builtin_prefetch(value_cache + next + t * row + d, 0, 3);                    \
              }                                                                                \
          }                                                                                    \
          if (CONVERT)                                                                         \
            for (int t = 0; t < n; ++t)                                                        \
              for (int d = 0; d < HEAD_DIM; ++d) {                                             \
                kf[t][d] = LOAD(kb + t * row + d);                                             \
                vf[t][d] = LOAD(vb + t * row + d);                                             \
              }                                                                                \
          for (int g = 0; g < G; ++g) {                                                        \
            float s[BLOCK_SIZE] __attribute__((aligned(64)));                                  \
            for (int t = 0; t < n; ++t) {                                                      \
              float a = 0.f;                                                                   \
              if (CONVERT)                                                                     \
                for (int d = 0; d < HEAD_DIM; ++d) a += qv[g][d] * kf[t][d];                   \
              else                                                                             \
                for (int d = 0; d < HEAD_DIM; ++d) a += qv[g][d] * LOAD(kb + t * row + d);     \
              s[t] = a;                                                                        \
            }                                                                                  \
            float mx = m[g];                                                                   \
            for (int t = 0; t < n; ++t) mx = s[t] > mx ? s[t] : mx;                            \
            const float correction = expf(m[g] - mx);                                          \
            float sum = 0.f;                                                                   \
            for (int t = 0; t < n; ++t) {                                                      \
              p[g][t] = expf(s[t] - mx);                                                       \
              sum += p[g][t];                                                                  \
            }                                                                                  \
            m[g] = mx;                                                                         \
            l[g] = l[g] * correction + sum;                                                    \
            float a2[HEAD_DIM] __attribute__((aligned(64)));                                   \
            for (int d = 0; d < HEAD_DIM; ++d) a2[d] = acc[g][d] * correction;                 \
            for (int t = 0; t < n; ++t) {                                                      \
              const float w = p[g][t];                                                         \
              if (CONVERT)                                                                     \
                for (int d = 0; d < HEAD_DIM; ++d) a2[d] += w * vf[t][d];                      \
              else                                                                             \
                for (int d = 0; d < HEAD_DIM; ++d) a2[d] += w * LOAD(vb + t * row + d);        \
            }                                                                                  \
            for (int d = 0; d < HEAD_DIM; ++d) acc[g][d] = a2[d];                              \
          }                                                                                    \
        }                                                                                      \
        for (int g = 0; g < G; ++g) {                                                          \
          T* op = out + ((int64_t)b * num_heads + (int64_t)kh * G + g) * HEAD_DIM;             \
          const float inv = 1.f / l[g];                                                        \
          for (int d = 0; d < HEAD_DIM; ++d) STORE(op + d, acc[g][d] * inv);                   \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
  }

DEFINE_PAGED_DECODE(paged_decode_f32, float, load_f32, store_f32, 0)
DEFINE_PAGED_DECODE(paged_decode_bf16, bf16_t, load_bf16, store_bf16, 1)
