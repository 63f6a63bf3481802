// write_kv_cache: scatter this step's K/V rows into the paged cache through slot_mapping.
//
//   key[t, h, :]  ->  key_cache.view(num_slots, num_kv_heads, head_dim)[slot_mapping[t], h, :]
//   slot < 0 marks a padding token and is skipped.
//
// A pure copy (input and cache share one dtype), so the entry points are per access width, not
// per dtype: the wrapper picks the widest unit (16, 4 or 2 bytes) that divides every row and
// stride and matches every pointer's alignment. Strides are in units.
#include "tandem_common.cuh"

struct alignas(16) Unit16 {
  unsigned int a, b, c, d;
};

template <typename U>
__device__ __forceinline__ void write_kv_cache_impl(
    const U* __restrict__ key, const U* __restrict__ value, U* __restrict__ key_cache,
    U* __restrict__ value_cache, const i64* __restrict__ slot_mapping, int num_kv_heads,
    int units_per_head, i64 key_stride_tok, i64 key_stride_head, i64 value_stride_tok,
    i64 value_stride_head) {
  const i64 token = blockIdx.x;
  const i64 slot = slot_mapping[token];
  if (slot < 0) return;
  const int units_per_row = num_kv_heads * units_per_head;
  U* kdst = key_cache + slot * units_per_row;
  U* vdst = value_cache + slot * units_per_row;
  for (int i = threadIdx.x; i < units_per_row; i += blockDim.x) {
    const int h = i / units_per_head, u = i - h * units_per_head;
    kdst[i] = key[token * key_stride_tok + h * key_stride_head + u];
    vdst[i] = value[token * value_stride_tok + h * value_stride_head + u];
  }
}

#define DEFINE_WRITE_KV_CACHE(NAME, U)                                                         \
  extern "C" __global__ void __launch_bounds__(256)                                          \
      NAME(const U* key, const U* value, U* key_cache, U* value_cache, const i64* slot_mapping, \
           int num_kv_heads, int units_per_head, i64 key_stride_tok, i64 key_stride_head,    \
           i64 value_stride_tok, i64 value_stride_head) {                                    \
    write_kv_cache_impl<U>(key, value, key_cache, value_cache, slot_mapping, num_kv_heads,   \
                           units_per_head, key_stride_tok, key_stride_head, value_stride_tok, \
                           value_stride_head);                                               \
  }

DEFINE_WRITE_KV_CACHE(write_kv_cache_b16, Unit16)
DEFINE_WRITE_KV_CACHE(write_kv_cache_b4, unsigned int)
DEFINE_WRITE_KV_CACHE(write_kv_cache_b2, u16)
