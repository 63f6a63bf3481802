// silu_and_mul_<dtype>: the gated MLP activation, rows of [gate | up] -> silu(gate) * up.
//
//   input row r:   | gate[0 .. I) | up[0 .. I) |     at gate_up + r * row_stride
//   output row r:  | silu(gate) * up [0 .. I) |      at out + r * I (contiguous)
//
//   grid = (rows, min(ceil(units / ACT_THREADS), 65535))     block = ACT_THREADS
//
// A unit is 16 bytes (one 128-bit load of gate, one of up, one store) when `vec` is set: the
// wrapper sets it when I, the row stride and both pointers keep every unit 16-byte aligned;
// otherwise a unit is one element. The threads of grid column y stride over a row's units.
//
// Rounding as the torch reference (F.silu in the dtype, then mul by up in the dtype):
//   out = round_T(round_T(g / (1 + exp(-g))) * u)      arithmetic in fp32
#include "tandem_common.cuh"

#define ACT_THREADS 256

template <typename T>
__device__ __forceinline__ T silu_mul(T gate, T up) {
  const float g = to_float(gate);
  const float silu = to_float(from_float<T>(g / (1.0f + expf(-g))));
  return from_float<T>(silu * to_float(up));
}

template <typename T>
__device__ __forceinline__ void silu_and_mul_impl(T* __restrict__ out,
                                                  const T* __restrict__ gate_up, int inter,
                                                  i64 row_stride, int vec) {
  const i64 row = blockIdx.x;
  const T* gate = gate_up + row * row_stride;
  const T* up = gate + inter;
  T* orow = out + row * inter;
  const int first = blockIdx.y * ACT_THREADS + threadIdx.x;
  const int step = gridDim.y * ACT_THREADS;
  if (vec) {
    constexpr int N = Pack<T>::N;
    for (int u = first; u < inter / N; u += step) {
      const Pack<T> g = load_pack(gate + u * N), v = load_pack(up + u * N);
      Pack<T> o;
#pragma unroll
      for (int i = 0; i < N; ++i) o.v[i] = silu_mul(g.v[i], v.v[i]);
      *reinterpret_cast<Pack<T>*>(orow + u * N) = o;
    }
  } else {
    for (int i = first; i < inter; i += step) orow[i] = silu_mul(gate[i], up[i]);
  }
}

#define DEFINE_ACTIVATION(SUFFIX, T)                                                          \
  extern "C" __global__ void __launch_bounds__(ACT_THREADS)                                  \
      silu_and_mul_##SUFFIX(T* out, const T* gate_up, int inter, i64 row_stride, int vec) { \
    silu_and_mul_impl<T>(out, gate_up, inter, row_stride, vec);                              \
  }

DEFINE_ACTIVATION(f16, half_t)
DEFINE_ACTIVATION(bf16, bf16_t)
DEFINE_ACTIVATION(f32, float)
