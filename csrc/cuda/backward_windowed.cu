// Fast backward for encoder-shaped problems (Lq == S: every pixel of every
// level is a query), sm_90+. Same gradients as backward.cu; what changes is
// where grad_value's additions go.
//
// backward.cu adds every corner's contribution to the global fp32
// accumulator with vector atomics: 4 x 8 x 32 x 5.7 M corner rows on
// ddetr_enc, which keep the L2's atomic units busy for most of the kernel
// (benchmarks/NOTES.md). Here a block takes a patch of 16 x 8 query pixels of
// one level and one (n, m), and for each level l in turn:
//   1. finds the patch's footprint on level l (mean and extent of its
//      samples there) and places a window of at most `budget` bytes over it;
//   2. zeroes the window (fp32, D channels a pixel) in shared memory;
//   3. computes the gradients of the patch's level-l samples (the shared
//      corner_grads), adding each corner's grad_value contribution to the
//      window with 128-bit shared compare-and-swap when the corner lies in
//      it, or to the global accumulator as backward.cu does when not;
//   4. adds the window's non-zero pixels to the global accumulator, whole
//      128-byte lines per request.
// Neighbouring queries sample neighbouring pixels, so one global addition
// per window pixel replaces many. Patches are decoded from the level table
// on the device; when the levels do not tile [0, Lq) the block takes 128
// consecutive queries instead (correct either way, only slower).
//
// Layout: 4 lanes of 8 fp32 channels per (query, head) for D = 32 (lanes =
// D / 8), two 4-channel compare-and-swaps a corner; even and odd groups do
// their two halves in opposite order, so the two groups of a quarter-warp
// touch different banks.
#include <cuda_runtime.h>

#include "backward_common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

constexpr int kWinThreads = 256;
constexpr int kPatchW = 16, kPatchH = 8, kTileQueries = kPatchW * kPatchH;
constexpr int kVec = 8;                       // fp32 channels per lane
constexpr int64_t kDefaultWindow = 40 * 1024;  // bytes: 4 blocks an SM with L1 left over
constexpr int kWarps = kWinThreads / 32;

// Adds scale * go[0, 4) to the 4 fp32 at `dst` (shared memory, 16-byte
// aligned) with one 128-bit compare-and-swap, retried until no other thread
// wrote in between.
__device__ __forceinline__ void shared_add4(float* dst, float scale, float g0, float g1, float g2,
                                            float g3) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  float c0, c1, c2, c3;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(c0), "=f"(c1), "=f"(c2), "=f"(c3)
               : "r"(s));
  while (true) {
    const uint64_t e0 = __float_as_uint(c0) | uint64_t(__float_as_uint(c1)) << 32;
    const uint64_t e1 = __float_as_uint(c2) | uint64_t(__float_as_uint(c3)) << 32;
    const uint64_t n0 = __float_as_uint(fmaf(scale, g0, c0)) |
                        uint64_t(__float_as_uint(fmaf(scale, g1, c1))) << 32;
    const uint64_t n1 = __float_as_uint(fmaf(scale, g2, c2)) |
                        uint64_t(__float_as_uint(fmaf(scale, g3, c3))) << 32;
    uint64_t r0, r1;
    asm volatile(
        "{\n\t.reg .b128 cmp, swp, old;\n\t"
        "mov.b128 cmp, {%2, %3};\n\t"
        "mov.b128 swp, {%4, %5};\n\t"
        "atom.shared.cas.b128 old, [%6], cmp, swp;\n\t"
        "mov.b128 {%0, %1}, old;\n\t}"
        : "=l"(r0), "=l"(r1)
        : "l"(e0), "l"(e1), "l"(n0), "l"(n1), "r"(s)
        : "memory");
    if (r0 == e0 && r1 == e1) return;
    c0 = __uint_as_float(unsigned(r0));
    c1 = __uint_as_float(unsigned(r0 >> 32));
    c2 = __uint_as_float(unsigned(r1));
    c3 = __uint_as_float(unsigned(r1 >> 32));
  }
#else
  atomicAdd(dst, scale * g0);
  atomicAdd(dst + 1, scale * g1);
  atomicAdd(dst + 2, scale * g2);
  atomicAdd(dst + 3, scale * g3);
#endif
}

// A level's window: pixels [ox, ox + wx) x [oy, oy + wy), row-major, D fp32
// channels each. wx = 0: no window (every corner goes to global memory).
struct Window {
  int ox, oy, wx, wy;
};

// Footprint statistics of the samples on one level, per warp: sum of x, y,
// count, min x, max x, min y, max y (pixel coordinates of the top-left
// corner's row/column, as in Bilinear).
constexpr int kStats = 7;

__device__ __forceinline__ void warp_stats(float (&s)[kStats]) {
  for (int o = 16; o > 0; o >>= 1) {
    s[0] += __shfl_xor_sync(0xffffffffu, s[0], o);
    s[1] += __shfl_xor_sync(0xffffffffu, s[1], o);
    s[2] += __shfl_xor_sync(0xffffffffu, s[2], o);
    s[3] = fminf(s[3], __shfl_xor_sync(0xffffffffu, s[3], o));
    s[4] = fmaxf(s[4], __shfl_xor_sync(0xffffffffu, s[4], o));
    s[5] = fminf(s[5], __shfl_xor_sync(0xffffffffu, s[5], o));
    s[6] = fmaxf(s[6], __shfl_xor_sync(0xffffffffu, s[6], o));
  }
}

// The window for a level from the block's statistics: the bounding box of
// the samples' corners when it fits in cap pixels, else a box of the same
// aspect and cap pixels centred on the samples' mean. Every thread computes
// it from the same shared values, so all get the same window.
__device__ __forceinline__ Window place_window(const float (*part)[kStats], int H, int W, int cap) {
  float s[kStats] = {0.f, 0.f, 0.f, INFINITY, -INFINITY, INFINITY, -INFINITY};
  for (int w = 0; w < kWarps; ++w) {
    s[0] += part[w][0];
    s[1] += part[w][1];
    s[2] += part[w][2];
    s[3] = fminf(s[3], part[w][3]);
    s[4] = fmaxf(s[4], part[w][4]);
    s[5] = fminf(s[5], part[w][5]);
    s[6] = fmaxf(s[6], part[w][6]);
  }
  Window win{0, 0, 0, 0};
  if (s[2] == 0.f || cap <= 0) return win;
  // Corner pixels touched: columns [x0, x1], rows [y0, y1], inside the level.
  const int x0 = max(0, static_cast<int>(s[3])), x1 = min(W - 1, static_cast<int>(s[4]) + 1);
  const int y0 = max(0, static_cast<int>(s[5])), y1 = min(H - 1, static_cast<int>(s[6]) + 1);
  const int bw = x1 - x0 + 1, bh = y1 - y0 + 1;
  if (bw <= 0 || bh <= 0) return win;
  if (int64_t(bw) * bh <= cap) return Window{x0, y0, bw, bh};
  int wx = static_cast<int>(sqrtf(float(cap) * float(bw) / float(bh)));
  wx = max(1, min(bw, wx));
  const int wy = max(1, min(bh, cap / wx));
  wx = max(1, min(bw, cap / wy));
  const float mx = s[0] / s[2] + 0.5f, my = s[1] / s[2] + 0.5f;  // centre of the mean footprint
  const int ox = min(max(static_cast<int>(floorf(mx - 0.5f * wx + 0.5f)), x0), x1 - wx + 1);
  const int oy = min(max(static_cast<int>(floorf(my - 0.5f * wy + 0.5f)), y0), y1 - wy + 1);
  return Window{ox, oy, wx, wy};
}

// How the (n, m)'s queries are cut into tiles of kTileQueries.
struct Tiling {
  bool patches;                   // the levels tile [0, Lq): 2-d patches of query pixels
  int64_t tiles;                  // tiles per (n, m)
  int64_t first[kMaxLevels + 1];  // first patch of each level
};

// One tile: patch (y0, x0) of level `level` (query pixels [y0, y0 + kPatchH)
// x [x0, x0 + kPatchW)), or, without patches, queries [q0, q0 + kTileQueries).
struct Tile {
  int64_t q0, y0, x0;
  int H, W;
};

__device__ __forceinline__ Tile tile_at(const Tiling& t, const Level* levels, int L, int64_t tile) {
  if (!t.patches) return Tile{tile * kTileQueries, 0, 0, 0, 0};
  int l = 0;
  while (l + 1 < L && tile >= t.first[l + 1]) ++l;
  const Level lv = levels[l];
  const int64_t local = tile - t.first[l];
  const int64_t across = (lv.W + kPatchW - 1) / kPatchW;
  return Tile{lv.start, (local / across) * kPatchH, (local % across) * kPatchW, lv.H, lv.W};
}

// Query of slot i (< kTileQueries) of a tile, or -1 past the level's (or
// the problem's) edge.
__device__ __forceinline__ int64_t tile_query(const Tiling& t, const Tile& tl, int64_t Lq, int i) {
  if (!t.patches) {
    const int64_t q = tl.q0 + i;
    return q < Lq ? q : -1;
  }
  const int64_t y = tl.y0 + i / kPatchW, x = tl.x0 + i % kPatchW;
  return (y < tl.H && x < tl.W) ? tl.q0 + y * tl.W + x : -1;
}

template <typename T, typename LT>
__global__ void __launch_bounds__(kWinThreads, 4)
    windowed_backward_kernel(const BackwardParams p, const int lanes, const int cap) {
  using A = float;
  const Problem& pb = p.pb;
  extern __shared__ float4 window4[];
  float* window = reinterpret_cast<float*>(window4);
  __shared__ Level levels[kMaxLevels];
  __shared__ Tiling tiling;
  __shared__ float part[kWarps][kStats];
  load_levels(levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  __syncthreads();
  if (threadIdx.x == 0) {
    // Patches when the levels lie back to back from 0 and cover Lq exactly.
    int64_t next = 0, tiles = 0;
    bool ok = true;
    for (int l = 0; l < pb.L; ++l) {
      const Level lv = levels[l];
      ok = ok && lv.H > 0 && lv.start == next;
      next += int64_t(lv.H) * lv.W;
      tiling.first[l] = tiles;
      tiles += ((lv.H + kPatchH - 1) / kPatchH) * int64_t((lv.W + kPatchW - 1) / kPatchW);
    }
    tiling.first[pb.L] = tiles;
    tiling.patches = ok && next == pb.Lq;
    tiling.tiles = tiling.patches ? tiles : (pb.Lq + kTileQueries - 1) / kTileQueries;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % lanes;
  const int group = threadIdx.x / lanes;
  const int groups = kWinThreads / lanes;
  const int queries_per_group = (kTileQueries + groups - 1) / groups;
  const int64_t c = int64_t(lane) * kVec;
  const bool channels = c < pb.D;  // lanes past D only join the shuffles
  const bool odd = group & 1;
  const int64_t row_stride = pb.M * pb.D;
  const int64_t LP = int64_t(pb.L) * pb.P;
  const int64_t total = pb.N * pb.M * tiling.tiles;
  const int vec4_per_pixel = static_cast<int>(pb.D / 4);

  for (int64_t t = blockIdx.x; t < total; t += gridDim.x) {
    const int64_t nm = t / tiling.tiles, tile = t % tiling.tiles;
    const int64_t n = nm / pb.M, m = nm % pb.M;
    const int64_t vrow0 = value_row(n, 0, m, pb.S, pb.M) * pb.D;
    const Tile tl = tile_at(tiling, levels, pb.L, tile);
    const T* vbase = static_cast<const T*>(p.value) + vrow0;
    A* gvbase = static_cast<A*>(p.grad_value_acc) + vrow0;

    for (int l = 0; l < pb.L; ++l) {
      // A level rejected by load_levels (H = W = 0) has no samples inside
      // and no window; its samples' gradients are still written (zeros).
      const Level lv = levels[l];
      const int64_t lbase = lv.start * row_stride;

      // 1. Footprint of the tile's level-l samples.
      float s[kStats] = {0.f, 0.f, 0.f, INFINITY, -INFINITY, INFINITY, -INFINITY};
      for (int j = threadIdx.x; j < kTileQueries * pb.P; j += kWinThreads) {
        const int64_t q = tile_query(tiling, tl, pb.Lq, j / pb.P);
        if (q < 0) continue;
        const auto [loc, attn] = query_row<LT>(p, (n * pb.Lq + q) * pb.M + m);
        A xy[2];
        load_xy(loc + 2 * (int64_t(l) * pb.P + j % pb.P), xy);
        const auto b = make_bilinear<A>(xy[0], xy[1], lv.H, lv.W);
        if (!b.inside) continue;
        s[0] += float(b.w0);
        s[1] += float(b.h0);
        s[2] += 1.f;
        s[3] = fminf(s[3], float(b.w0));
        s[4] = fmaxf(s[4], float(b.w0));
        s[5] = fminf(s[5], float(b.h0));
        s[6] = fmaxf(s[6], float(b.h0));
      }
      warp_stats(s);
      if (threadIdx.x % 32 == 0) {
#pragma unroll
        for (int k = 0; k < kStats; ++k) part[warp][k] = s[k];
      }
      __syncthreads();  // A: statistics complete; the previous level's flush done
      const Window win = place_window(part, lv.H, lv.W, cap);

      // 2. Zero the window.
      const int win_vec4 = win.wx * win.wy * vec4_per_pixel;
      for (int f = threadIdx.x; f < win_vec4; f += kWinThreads) window4[f] = make_float4(0, 0, 0, 0);
      __syncthreads();  // B: window zeroed

      // 3. The tile's level-l samples.
      for (int k = 0; k < queries_per_group; ++k) {
        const int slot = group + k * groups;
        const int64_t q = slot < kTileQueries
                              ? tile_query(tiling, tl, pb.Lq, slot)
                              : int64_t(-1);
        const bool live = q >= 0;
        const int64_t row = live ? (n * pb.Lq + q) * pb.M + m : 0;
        const auto [loc, attn] = query_row<LT>(p, row);
        LT* gloc = static_cast<LT*>(p.grad_loc) + row * LP * 2;
        LT* gattn = static_cast<LT*>(p.grad_attn) + row * LP;
        A go[kVec];
        if (live && channels) {
          load_vec<T, kVec>(static_cast<const T*>(p.grad_out) + row * pb.D + c, go);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) go[e] = A(0);
        }
        for (int step = 0; step < pb.P; ++step) {
          // Groups start at different points, so that neighbouring queries
          // of a warp add to different pixels at a time.
          const int i = l * pb.P + (step + group) % pb.P;
          A xy[2] = {A(-2), A(-2)};  // outside: dead slots sample nothing
          A w = A(0);
          if (live) {
            load_xy(loc + 2 * i, xy);
            w = to_acc(attn[i]);
          }
          const auto b = make_bilinear<A>(xy[0], xy[1], lv.H, lv.W);
          SampleGrads<A> g;
          if (b.inside && channels) {
            corner_grads<T, kVec>(
                vbase, lbase, row_stride, c, go, b, lv, w, true, g,
                [&](int corner, int64_t off, A scale) {
                  const int wr = b.h0 + (corner >> 1) - win.oy;
                  const int wc = b.w0 + (corner & 1) - win.ox;
                  if (unsigned(wr) < unsigned(win.wy) && unsigned(wc) < unsigned(win.wx)) {
                    float* dst = window + (int64_t(wr) * win.wx + wc) * pb.D + c;
                    // Halves in opposite orders for even and odd groups (banks).
                    const int h = odd ? 4 : 0;
                    shared_add4(dst + h, scale, odd ? go[4] : go[0], odd ? go[5] : go[1],
                                odd ? go[6] : go[2], odd ? go[7] : go[3]);
                    shared_add4(dst + (4 - h), scale, odd ? go[0] : go[4], odd ? go[1] : go[5],
                                odd ? go[2] : go[6], odd ? go[3] : go[7]);
                  } else {
                    A add[kVec];
#pragma unroll
                    for (int e = 0; e < kVec; ++e) add[e] = scale * go[e];
                    atomic_add_vec<kVec>(gvbase + off, add);
                  }
                });
          }
          write_sample_grads(g, lanes, live && lane == 0, i, w, lv, gloc, gattn);
        }
      }
      __syncthreads();  // C: every addition to the window done

      // 4. Flush: one 16-byte vector atomic per non-zero part of a pixel;
      // consecutive threads take consecutive parts of a pixel's row.
      for (int f = threadIdx.x; f < win_vec4; f += kWinThreads) {
        const float4 v = window4[f];
        if (v.x == 0.f && v.y == 0.f && v.z == 0.f && v.w == 0.f) continue;
        const int pix = f / vec4_per_pixel, part4 = f % vec4_per_pixel;
        const int64_t y = win.oy + pix / win.wx, x = win.ox + pix % win.wx;
        const float add[4] = {v.x, v.y, v.z, v.w};
        atomic_add_vec<4>(gvbase + lbase + (y * lv.W + x) * row_stride + part4 * 4, add);
      }
      // The next level's barrier A orders this flush before its zeroing.
    }
  }
}

template <typename T, typename LT>
cudaError_t launch(const BackwardParams& p, cudaStream_t stream) {
  auto kernel = windowed_backward_kernel<T, LT>;
  SmemPlan plan;
  cudaError_t err = plan_smem(kernel, 0, p.smem_budget, kDefaultWindow, plan);
  if (err != cudaSuccess) return err;
  int per_sm = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWinThreads,
                                                      static_cast<size_t>(plan.dynamic));
  if (err != cudaSuccess) return err;
  const int64_t pixel_bytes = p.pb.D * int64_t(sizeof(float));
  const int cap = static_cast<int>(plan.budget / pixel_bytes);
  const int lanes = lanes_for(p.pb.D, kVec);
  // Enough blocks to fill the device; each walks tiles with a grid stride.
  const int64_t blocks = int64_t(std::max(per_sm, 1)) * plan.sms;
  kernel<<<static_cast<unsigned>(blocks), kWinThreads, plan.dynamic, stream>>>(p, lanes, cap);
  return cudaGetLastError();
}

}  // namespace

bool windowed_backward_ok(const Problem& pb, int vec, int major) {
  return major >= 9 && pb.Lq == pb.S && pb.value_dtype != DType::f64 && vec == kVec &&
         pb.D % kVec == 0 && pb.D <= 32 * kVec && pb.L > 0 && pb.P > 0;
}

cudaError_t windowed_backward(const BackwardParams& p, cudaStream_t stream) {
  const bool loc32 = p.pb.loc_dtype == DType::f32;
  switch (p.pb.value_dtype) {
    case DType::f32: return launch<float, float>(p, stream);
    case DType::f16: return loc32 ? launch<__half, float>(p, stream) : launch<__half, __half>(p, stream);
    case DType::bf16:
      return loc32 ? launch<__nv_bfloat16, float>(p, stream)
                   : launch<__nv_bfloat16, __nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace msda::cuda
