// device.cuh: the device helpers every loss kernel shares: math in the accumulation
// type, 16-byte vector access, warp and block reductions.
//
// Everything here serves a memory-bound loss: 16-byte vector access, fp32 math (fp64
// for float64 inputs), reductions without float atomics, and 64-bit indexing.
//
// No ATen: c10's two 2-byte float types are the only torch headers nvcc parses (ops.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ops.h"

namespace fused_losses {

// Loss sums accumulate in double: a per-thread fp32 running sum over millions of
// terms would lose digits that torch's tree reduction keeps, and one double add per
// 16-byte pack costs nothing next to the memory traffic.
using sum_t = double;

constexpr int kMaxThreads = 512;

// The accumulation type of T: double for double, else float (at::opmath_type's rule).
template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

// A failed check in host code: std::runtime_error, which the bindings raise as RuntimeError.
inline void check(bool ok, const char* message) {
  if (!ok) throw std::runtime_error(std::string("fused_losses: ") + message);
}

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error, as C10_CUDA_CHECK does
    throw std::runtime_error(std::string("fused_losses: CUDA error in ") + what + ": " + cudaGetErrorString(status));
  }
}

// Calls body(T{}) with T the C++ type of `dtype` when this build holds it (one dtype per
// build: FUSED_LOSSES_DTYPE, a DType code), else throws.
template <typename Body>
void dispatch_dtype(DType dtype, Body body) {
#ifndef FUSED_LOSSES_DTYPE
#error "a build names its dtype: -DFUSED_LOSSES_DTYPE=<DType code> (loader.py does)"
#endif
  constexpr auto built = static_cast<DType>(FUSED_LOSSES_DTYPE);
  if (dtype != built) {
    throw std::runtime_error("fused_losses: a call in dtype code " + std::to_string(int(dtype)) +
                             " reached the build of dtype code " + std::to_string(int(built)) +
                             " (loader.load_for_device picks the build by dtype)");
  }
  if constexpr (built == DType::kFloat32) body(float{});
  if constexpr (built == DType::kFloat64) body(double{});
  if constexpr (built == DType::kFloat16) body(c10::Half{});
  if constexpr (built == DType::kBFloat16) body(c10::BFloat16{});
}

// ---------------------------------------------------------------------------------
// Math in the accumulation type (float for half/bfloat16/float, double for double).
// load_inline defines __CUDA_NO_HALF_OPERATORS__, so half values are converted first.

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }
// A product rounded on its own, never fused into a following add (an FMA keeps the product's
// rounding error, which a difference of two near-equal terms then shows).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
// exp and log of values that came from, or go to, a 2-byte dtype (half, bfloat16): the
// hardware's approximations (about 2^-21 relative error) are invisible at 2^-11 output
// precision and several times cheaper. Wider dtypes get the correctly rounded ones.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x by the hardware, results below 2^-126 flushed to 0. exp2f compiles to the same
// instruction plus three more per call that scale subnormal results (a compare, two
// predicated multiplies): a third of a softmax's instructions per logit on the 2-byte
// cross-entropy paths, which were bound by instruction issue (notes, v16 and v20).
// A flushed term is below 2^-126 of the largest one in its sum or gradient: float16
// cannot hold it, and bfloat16 only as a subnormal 2^-126 below its row's scale.
__device__ __forceinline__ float exp2_flush_subnormal(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ acc_type<T> exp_for(acc_type<T> x) {
  if constexpr (sizeof(T) == 2) {
    return exp2_flush_subnormal(x * kLog2e);
  } else {
    return exp_acc(x);
  }
}

// exp(x - m) for a softmax over T: with 2-byte T, 2^(x log2e - m log2e), one fused
// multiply-add per value once m log2e is known (the subtraction and the multiply
// were two). The rounding of m log2e shifts every term of a row alike, by at most
// |m| 2^-24 in the exponent, the size of the rounding of lse = max + log(sum) itself.
template <typename T>
__device__ __forceinline__ acc_type<T> exp_minus(acc_type<T> x, acc_type<T> m) {
  if constexpr (sizeof(T) == 2) {
    return exp2_flush_subnormal(fmaf(x, kLog2e, -(m * kLog2e)));
  } else {
    return exp_acc(x - m);
  }
}

template <typename T>
__device__ __forceinline__ acc_type<T> log_for(acc_type<T> x) {
  if constexpr (sizeof(T) == 2) {
    return __logf(x);
  } else {
    return log_acc(x);
  }
}

// The larger of two values; NaN loses (as fmaxf), so a NaN must reach results another way.
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return fmax(a, b); }
// max that returns NaN where either is one (max.NaN, sm_80), as torch's amax.
__device__ __forceinline__ float max_nan_wins(float a, float b) {
  float m;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(m) : "f"(a), "f"(b));
  return m;
}
__device__ __forceinline__ double max_nan_wins(double a, double b) { return isnan(a) ? a : isnan(b) ? b : fmax(a, b); }

template <typename acc_t>
__device__ __forceinline__ acc_t infinity() {
  return std::numeric_limits<acc_t>::infinity();
}

template <typename acc_t>
__device__ __forceinline__ acc_t quiet_nan() {
  return std::numeric_limits<acc_t>::quiet_NaN();
}

// ---------------------------------------------------------------------------------
// Vector access: VEC elements moved as one aligned load/store (16 bytes when VEC is
// 16 / sizeof(T); VEC == 1 is the fallback for misaligned or odd-sized data).

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T val[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* ptr) {
  return *reinterpret_cast<const Pack<T, VEC>*>(ptr);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* ptr, const Pack<T, VEC>& pack) {
  *reinterpret_cast<Pack<T, VEC>*>(ptr) = pack;
}

// A store marked evict-first (st.global.cs): for output that nothing here reads again.
template <typename T, int VEC>
__device__ __forceinline__ void store_pack_streaming(T* ptr, const Pack<T, VEC>& pack) {
  if constexpr (sizeof(pack) == 16) {
    __stcs(reinterpret_cast<int4*>(ptr), *reinterpret_cast<const int4*>(&pack));
  } else {
    store_pack<T, VEC>(ptr, pack);
  }
}

// Elements per 16-byte vector of T.
template <typename T>
constexpr int vec16() {
  return 16 / sizeof(T);
}

inline bool is_aligned16(const void* ptr) {
  return offset_from_16_bytes(ptr) == 0;
}

// ---------------------------------------------------------------------------------
// Reductions. block_allreduce gives every thread the result; blockDim.x must be a
// multiple of 32 and at most 1024 (one scratch slot per warp).

__device__ __forceinline__ float shfl_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ double shfl_xor(double v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ long long shfl_xor(long long v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

template <typename T>
struct SumOp {
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return max_acc(a, b); }
};

template <typename T, typename Combine>
__device__ __forceinline__ T warp_allreduce(T value, Combine combine) {
#pragma unroll
  for (int mask = 16; mask > 0; mask /= 2) value = combine(value, shfl_xor(value, mask));
  return value;
}

// `scratch` is shared memory for 32 values. Ends with a barrier, so the same scratch
// can be used again right away.
template <typename T, typename Combine>
__device__ __forceinline__ T block_allreduce(T value, Combine combine, T identity, T* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int num_warps = blockDim.x / 32;
  value = warp_allreduce(value, combine);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < num_warps ? scratch[lane] : identity;
  value = warp_allreduce(value, combine);
  __syncthreads();
  return value;
}

template <typename T>
__device__ __forceinline__ T block_sum(T value, T* scratch) {
  return block_allreduce(value, SumOp<T>(), T(0), scratch);
}

// Barrier `id` (1-15; 0 is __syncthreads') for `threads` threads (a multiple of 32) of the block:
// sync waits for all of them, arrive counts this thread in and goes on. What a thread wrote
// before either is visible after the sync to those that waited.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Logits of the cross-entropy row passes and of the fused product's epilogue (gemm_sm90.cuh).

// The capped logit z' = s tanh(y), y = z / s, and its slope dz'/dz = 1 - tanh^2(y), as
// 4 q (1 - q) with q = 1 / (e^2|y| + 1): written 1 - tanh^2, a saturated logit's slope would be
// the difference of two numbers near 1 (z = 200, s = 30: 5 bf16 ulps off). For a 2-byte dtype
// in float, with the hardware's exp and division, tanh = 1 - 2q (absolute error about 1e-7; the
// logits carry 2^-9): 8192 x 256000 bf16, softcap 30, a 4096-class chunk's stats pass took 68 us
// with tanhf and a division, 37 us so. For float32 logits in double: tanhf's and expf's 2 ulps
// made a 6-class gradient 3x eager's error against float64.
template <typename T>
struct Softcap {
  using acc_t = acc_type<T>;
  using math_t = std::conditional_t<sizeof(T) == 2, float, double>;
  math_t cap, inverse;  // cap 0: none. For 2-byte logits a product, not a division per logit
                        // (a division's dozen instructions made the passes compute-bound)
  __device__ explicit Softcap(double softcap) : cap(softcap), inverse(softcap > 0 ? 1 / softcap : 0) {}
  // With the reciprocal from the host (the same value): a persistent kernel reads it from its
  // parameters where it would otherwise hold it in a register across every tile.
  __device__ Softcap(math_t softcap, math_t softcap_inverse) : cap(softcap), inverse(softcap_inverse) {}

  __device__ __forceinline__ math_t q_of(math_t y) const {
    if constexpr (sizeof(T) == 2) {
      return __fdividef(1.f, exp2_flush_subnormal(fabsf(y) * (2 * kLog2e)) + 1.f);
    } else {
      return 1 / (exp(2 * fabs(y)) + 1);
    }
  }
  __device__ __forceinline__ math_t y_of(acc_t z) const {
    return sizeof(T) == 2 ? static_cast<math_t>(z) * inverse : static_cast<math_t>(z) / cap;
  }
  __device__ __forceinline__ math_t tanh_of(math_t y, math_t q) const {
    if constexpr (sizeof(T) == 2) {
      return copysignf(1.f - 2.f * q, y);
    } else {
      return tanh(y);
    }
  }
  __device__ __forceinline__ acc_t apply(acc_t z) const {
    if (cap == 0) return z;
    const math_t y = y_of(z);
    return static_cast<acc_t>(cap * tanh_of(y, sizeof(T) == 2 ? q_of(y) : math_t(0)));
  }
  // z' and dz'/dz.
  __device__ __forceinline__ acc_t apply(acc_t z, acc_t& slope) const {
    if (cap == 0) {
      slope = 1;
      return z;
    }
    const math_t y = y_of(z);
    const math_t q = q_of(y);
    slope = static_cast<acc_t>(4 * q * (1 - q));
    return static_cast<acc_t>(cap * tanh_of(y, q));
  }
};

__device__ __forceinline__ int64_t target_of(const void* target, bool target_int32, int64_t row) {
  return target_int32 ? static_cast<const int32_t*>(target)[row] : static_cast<const int64_t*>(target)[row];
}

}  // namespace fused_losses
