// Launch helpers of the CUDA launchers: the dtype dispatch onto kernel
// templates, the shared-memory carve-out, division by a launch-time
// constant, and grids of kThreads-thread blocks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>

#include "../../core/dispatch.h"
#include "../../plan/launch_shapes.h"
#include "../device_info.h"
#include "common.cuh"

namespace msda::cuda {

// ---- dtype dispatch --------------------------------------------------------
// Runs Launch<T, LT, VEC>::run(p, stream) for the problem's dtype pair, with
// VEC = kVecBytes bytes (of T, or of the accumulator type when kVecOfAcc)
// when the binding allowed vector access (p.vec), else 1. The kernels are
// instantiated for exactly these two widths.
template <template <typename, typename, int> class Launch, bool kVecOfAcc = false,
          int kVecBytes = 16, typename Params>
cudaError_t launch_for_dtypes(const Params& p, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  dispatch_dtypes<__half, __nv_bfloat16>(p.pb, [&](auto t, auto lt) {
    using T = typename decltype(t)::type;
    using LT = typename decltype(lt)::type;
    constexpr int kVec =
        kVecBytes / static_cast<int>(kVecOfAcc ? sizeof(acc_t<T>) : sizeof(T));
    err = p.vec == kVec ? Launch<T, LT, kVec>::run(p, stream) : Launch<T, LT, 1>::run(p, stream);
  });
  return err;
}

// Runs Launch<T, LT, 16 / sizeof(T)>::run(p, stream) for the problem's
// dtype pair where p.vec is that width and T is not double: for the kernels
// built only for 16-byte vectors (tma, the block-local grad_value), whose
// predicates keep every other problem away. Anything else is refused here,
// with nothing instantiated for it.
template <template <typename, typename, int> class Launch, typename Params>
cudaError_t launch_16_byte_vectors(const Params& p, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  dispatch_dtypes<__half, __nv_bfloat16>(p.pb, [&](auto t, auto lt) {
    using T = typename decltype(t)::type;
    using LT = typename decltype(lt)::type;
    if constexpr (!std::is_same_v<T, double>) {
      constexpr int kVec = 16 / static_cast<int>(sizeof(T));
      if (p.vec == kVec) err = Launch<T, LT, kVec>::run(p, stream);
    }
  });
  return err;
}

// The current device's DeviceInfo (device_info.h, asked of the runtime once).
inline cudaError_t current_device_info(DeviceInfo& d) { return device_info(-1, d); }

// The shared-memory carve-out that `blocks` resident blocks of kKernel need
// (its static shared memory and the system's reservation each), in percent
// of the most an SM can hold, rounded up: the driver takes the smallest
// configuration that holds it, and the rest of the SM's unified memory is
// L1. Left to itself the driver sizes the carve-out for as many blocks as
// the SM's thread limit allows, not for the register-bound count the kernel
// runs at (docs/performance.md). The attribute is set again only when the
// figure changes (one kernel launched with several block sizes).
template <auto kKernel>
cudaError_t fit_carveout(int blocks) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  constexpr int kMaxDevices = 64;
  if (dev < 0 || dev >= kMaxDevices) return cudaSuccess;  // a hint: left to the driver
  static std::once_flag once[kMaxDevices];
  static int static_bytes[kMaxDevices];
  static cudaError_t status[kMaxDevices];
  static std::atomic<int> last[kMaxDevices];
  std::call_once(once[dev], [dev] {
    cudaFuncAttributes attr;
    status[dev] = cudaFuncGetAttributes(&attr, kKernel);
    static_bytes[dev] = static_cast<int>(attr.sharedSizeBytes);
    last[dev] = -1;  // the driver's default
  });
  if (status[dev] != cudaSuccess) return status[dev];
  DeviceInfo d;
  err = current_device_info(d);
  if (err != cudaSuccess || d.smem_per_sm <= 0) return err;
  const int64_t need = int64_t(blocks) * (static_bytes[dev] + d.smem_reserved);
  const int pct =
      static_cast<int>(std::min<int64_t>(100, (100 * need + d.smem_per_sm - 1) / d.smem_per_sm));
  if (last[dev].exchange(pct) == pct) return cudaSuccess;
  return cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout, pct);
}

// Division of a 31-bit numerator by a divisor fixed at launch: a multiply-
// high, an add and a shift instead of the division routine (Granlund and
// Montgomery's method; the numerator below 2^31 keeps the add in 32 bits).
struct FastDiv {
  uint32_t mul = 1, shift = 0;
  FastDiv() = default;
  __host__ __device__ explicit FastDiv(uint32_t d) {  // d >= 1
    while ((uint64_t(1) << shift) < d) ++shift;
    mul = static_cast<uint32_t>((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
  }
  __device__ __forceinline__ uint32_t operator()(uint32_t n) const {
    return (__umulhi(n, mul) + n) >> shift;
  }
};

inline unsigned grid_for(int64_t threads) {
  return static_cast<unsigned>((threads + kThreads - 1) / kThreads);
}

}  // namespace msda::cuda
