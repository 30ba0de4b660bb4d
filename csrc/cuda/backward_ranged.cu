// grad_value for problems with few samples per value pixel (decoders: a few
// hundred queries over a whole feature pyramid), without a dense fp32
// accumulator of the whole map.
//
// The plain path (backward.cu) adds every corner's contribution to a zeroed
// fp32 copy of the map with atomics, then converts it to the value's dtype.
// On a decoder the map is far larger than what the samples touch, so the
// zero-fill and the conversion cost more than the kernel (ddetr_dec bf16:
// 10.6 + 16.9 us beside a 24.6 us kernel; benchmarks/NOTES.md).
//
// Here a block owns a range of pixels of one (n, m), holds their sums in
// shared memory (fp32; fp64 for fp64), scans every sample of that (n, m)
// (the locations and weights only), adds the contributions of the corners
// that fall in its range, and writes the range's grad_value once, in the
// value's dtype:
// every element of grad_value is written exactly once, with no fill, no
// conversion pass and no global atomics. The scan is repeated by every range
// of an (n, m), so this pays only while samples are few beside pixels
// (ranged_value_grad_ok).
//
// A warp scans 32 samples at a time, one a lane; the samples with a corner
// in range are then taken one after the other by the whole warp, lane c
// adding channel c (shared-memory atomics; lanes never collide, warps
// rarely: few samples a pixel).
#include "common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

constexpr int kRangeThreads = 256;
constexpr int64_t kDefaultRangeBytes = 96 * 1024;  // fp32 sums: two blocks an SM
// At most this many corner additions per value pixel on average (the scan
// of all of an (n, m)'s samples is repeated by each of its ranges).
constexpr int64_t kMaxAddsPerPixel = 8;

template <typename T, typename LT, int VEC>
__global__ void __launch_bounds__(kRangeThreads)
    ranged_value_grad_kernel(const BackwardParams p, T* __restrict__ grad_value,
                             const int range, const int64_t ranges) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  extern __shared__ float4 sums4[];  // 16-byte aligned storage of the A sums
  A* sums = reinterpret_cast<A*>(sums4);
  __shared__ Level levels[kMaxLevels];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);

  const int64_t nm = blockIdx.x / ranges;
  const int64_t n = nm / pb.M, m = nm % pb.M;
  const int64_t s0 = (blockIdx.x % ranges) * range;
  const int pixels = static_cast<int>(min(int64_t(range), pb.S - s0));
  const int64_t bytes = int64_t(pixels) * pb.D * int64_t(sizeof(A));
  for (int i = threadIdx.x; i < (bytes + 15) / 16; i += kRangeThreads) {
    sums4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  __syncthreads();

  // Scan: sample j = q * L * P + l * P + pt of this (n, m).
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int LP = pb.L * pb.P;
  const int samples = static_cast<int>(pb.Lq * LP);
  const int64_t row_step = pb.M * int64_t(LP);  // loc / attn rows of consecutive queries
  const LT* loc = static_cast<const LT*>(p.loc) + (n * pb.Lq * pb.M + m) * LP * 2;
  const LT* attn = static_cast<const LT*>(p.attn) + (n * pb.Lq * pb.M + m) * LP;
  const T* gout = static_cast<const T*>(p.grad_out) + (n * pb.Lq * pb.M + m) * pb.D;
  for (int base = warp * 32; base < samples; base += kRangeThreads) {
    const int j = base + lane;  // < 2^31: ranged_value_grad_ok
    int pix[4] = {-1, -1, -1, -1};  // corner k's pixel inside the range, or -1
    A scale[4] = {A(0), A(0), A(0), A(0)};
    int q = 0;
    if (j < samples) {
      q = j / LP;
      const int lp = j - q * LP;
      const Level lv = levels[lp / pb.P];
      A xy[2];
      load_xy(loc + q * row_step * 2 + 2 * lp, xy);
      const A w = A(to_acc(attn[q * row_step + lp]));
      const auto b = make_bilinear<A>(xy[0], xy[1], lv.H, lv.W);
      if (b.inside) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (!b.corner_ok(k, lv.H, lv.W)) continue;
          const int64_t local = lv.start + b.corner_offset(k, lv.W) - s0;
          if (local >= 0 && local < pixels) {
            pix[k] = static_cast<int>(local);
            scale[k] = w * b.weight(k);
          }
        }
      }
    }
    const bool hit = max(max(pix[0], pix[1]), max(pix[2], pix[3])) >= 0;
    unsigned hits = __ballot_sync(0xffffffffu, hit);
    while (hits) {
      const int src = __ffs(hits) - 1;
      hits &= hits - 1;
      const int qs = __shfl_sync(0xffffffffu, q, src);
      int cp[4];
      A cs[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        cp[k] = __shfl_sync(0xffffffffu, pix[k], src);
        cs[k] = __shfl_sync(0xffffffffu, scale[k], src);
      }
      const T* g = gout + int64_t(qs) * pb.M * pb.D;
      for (int64_t c = lane; c < pb.D; c += 32) {
        const A go = to_acc(g[c]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (cp[k] >= 0) atomicAdd(sums + int64_t(cp[k]) * pb.D + c, cs[k] * go);
        }
      }
    }
  }
  __syncthreads();

  // Write the range: VEC elements a thread, pixel rows of D at a stride of M * D.
  const int vecs_per_pixel = static_cast<int>(pb.D / VEC);
  T* out = grad_value + (n * pb.S + s0) * pb.M * pb.D + m * pb.D;
  for (int i = threadIdx.x; i < pixels * vecs_per_pixel; i += kRangeThreads) {
    const int px = i / vecs_per_pixel, c = (i % vecs_per_pixel) * VEC;
    A v[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = sums[px * pb.D + c + e];
    store_vec<T, VEC>(out + int64_t(px) * pb.M * pb.D + c, v);
  }
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const BackwardParams& p, void* grad_value, cudaStream_t stream) {
    auto kernel = ranged_value_grad_kernel<T, LT, VEC>;
    SmemPlan plan;
    cudaError_t err = plan_smem(kernel, 0, p.smem_budget, kDefaultRangeBytes, plan);
    if (err != cudaSuccess) return err;
    const int64_t pixel_bytes = p.pb.D * int64_t(sizeof(acc_t<T>));
    // At least one pixel a block, whatever the budget (a test hook may ask for 0).
    const int64_t range = std::max<int64_t>(1, std::min(plan.budget / pixel_bytes, p.pb.S));
    const int64_t ranges = (p.pb.S + range - 1) / range;
    const int64_t blocks = p.pb.N * p.pb.M * ranges;
    if (blocks == 0) return cudaSuccess;
    const int64_t dynamic = std::max(plan.dynamic, (range * pixel_bytes + 15) / 16 * 16);
    if (dynamic > plan.dynamic) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(dynamic));
      if (err != cudaSuccess) return err;
    }
    kernel<<<static_cast<unsigned>(blocks), kRangeThreads, dynamic, stream>>>(
        p, static_cast<T*>(grad_value), static_cast<int>(range), ranges);
    return cudaGetLastError();
  }
};

}  // namespace

bool ranged_value_grad_ok(const Problem& pb) {
  const int64_t adds = pb.Lq * pb.L * pb.P * 4;
  return pb.Lq * pb.L * pb.P < INT32_MAX / 2 && adds <= kMaxAddsPerPixel * pb.S &&
         pb.N * pb.M * pb.S < INT32_MAX && pb.D * 8 <= 48 * 1024;
}

cudaError_t ranged_value_grad(const BackwardParams& p, void* grad_value, int vec,
                              cudaStream_t stream) {
  const bool loc32 = p.pb.loc_dtype == DType::f32;
  auto go = [&](auto t, auto lt) -> cudaError_t {
    using T = typename decltype(t)::type;
    using LT = typename decltype(lt)::type;
    constexpr int kVec = 16 / sizeof(T);
    return vec == kVec ? Launch<T, LT, kVec>::run(p, grad_value, stream)
                       : Launch<T, LT, 1>::run(p, grad_value, stream);
  };
  switch (p.pb.value_dtype) {
    case DType::f32: return go(Tag<float>{}, Tag<float>{});
    case DType::f64:
      return loc32 ? go(Tag<double>{}, Tag<float>{}) : go(Tag<double>{}, Tag<double>{});
    case DType::f16: return loc32 ? go(Tag<__half>{}, Tag<float>{}) : go(Tag<__half>{}, Tag<__half>{});
    case DType::bf16:
      return loc32 ? go(Tag<__nv_bfloat16>{}, Tag<float>{})
                   : go(Tag<__nv_bfloat16>{}, Tag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace msda::cuda
