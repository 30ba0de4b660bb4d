// Backward shared by every forward backend. `lanes` threads per (query,
// head), VEC channels each. Two shapes, both measured best for their job
// (benchmarks/NOTES.md):
//   with grad_value atomics: VEC = 16 bytes of the accumulator (4 channels, 8
//   lanes for D = 32), so that a group's vector atomic instruction covers a
//   whole 128-byte line;
//   without (deterministic path): VEC = 32 bytes of the accumulator (8
//   channels, 4 lanes), halving the per-sample work every lane repeats
//   (location, bilinear weights, shuffle reductions).
//   grad_value: fp32 (fp64 for fp64) atomicAdd into a zeroed accumulator,
//   VEC channels per instruction on sm_90+ (vector atomics);
//   grad of locations and weights: per-lane partial dot products over
//   channels, reduced across the group's lanes with warp shuffles, written
//   once by lane 0 (no atomics).
// Deterministic path (backward_deterministic.cu): no grad_value here; lane 0
// writes each sample's cell key and index instead, for the sort.
#include <algorithm>

#include "common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

// Key of the cell sample `sample` lies in, or the largest key (past every
// cell) when its footprint misses the level.
template <typename A>
__device__ __forceinline__ void write_key(const BackwardParams& p, int64_t sample, bool inside,
                                          int64_t nm, int64_t level_base, const Bilinear<A>& b,
                                          int W) {
  const uint64_t key = inside ? cell_key(nm, p.cell_stride, level_base, b.h0, b.w0, W)
                              : uint64_t(p.pb.N * p.pb.M * p.cell_stride);
  if (p.wide_keys) {
    static_cast<uint64_t*>(p.cell_keys)[sample] = key;
    static_cast<uint64_t*>(p.sample_ids)[sample] = uint64_t(sample);
  } else {
    static_cast<unsigned*>(p.cell_keys)[sample] = unsigned(key);
    static_cast<unsigned*>(p.sample_ids)[sample] = unsigned(sample);
  }
}

// One channel slice [c, c + VEC) of sample b (inside level lv): the four
// corners clamped into the level (so always loadable) and loaded back to
// back, their dot products with go added to the sample's gradient sums
// (corners outside the level contribute nothing, as before clamping), and,
// when `gv` is set, each valid corner's w * weight * go added to grad_value
// with vector atomics. `vl` / `gv` point at channel c of the level's pixel 0
// of this (n, m); consecutive pixels are `vstride` / `gstride` bytes apart.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void corner_grads(const T* vl, unsigned vstride, A* gv, uint64_t gstride,
                                             const Bilinear<A>& b, const Level& lv, A w,
                                             const A (&go)[VEC], A& g_attn, A& g_lw, A& g_lh) {
  int pix[4];
  clamped_corners(b, lv.H, lv.W, pix);
  A v[4][VEC];
#pragma unroll
  for (int k = 0; k < 4; ++k) load_vec<T, VEC>(pixel_ptr(vl, pix[k], vstride), v[k]);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const bool ok = b.corner_ok(k, lv.H, lv.W);
    A dot = A(0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) dot += go[e] * v[k][e];
    dot = ok ? dot : A(0);
    const A wk = b.weight(k);
    g_attn += wk * dot;
    g_lw += b.dweight_dlw(k) * dot;
    g_lh += b.dweight_dlh(k) * dot;
    if (gv != nullptr && ok) {
      const A scale = w * wk;
      A add[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) add[e] = scale * go[e];
      // Byte arithmetic on the pointer itself (not an integer), so that the
      // compiler still knows it is global memory and emits REDG.
      A* dst = reinterpret_cast<A*>(reinterpret_cast<char*>(gv) +
                                    static_cast<uint64_t>(static_cast<unsigned>(pix[k])) * gstride);
      atomic_add_vec<VEC>(dst, add);
    }
  }
}

// kMulti: D spans more than one pass of the group's lanes (D > 32 * VEC), so
// grad_output is re-read per pass instead of being kept in registers.
template <typename T, typename LT, int VEC, bool kMulti>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const BackwardParams p, const int lanes, const int chunk) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  const bool keys = p.cell_keys != nullptr;  // uniform: deterministic path
  const bool value_grad = p.grad_value_acc != nullptr;
  load_levels_and_cells(levels, cell_base, p.spatial_shapes, p.level_start, pb.L, pb.S, keys);

  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // A task is `chunk` consecutive samples (level-major) of one group; the
  // group's tasks are consecutive.
  const int64_t LP = int64_t(pb.L) * pb.P;
  const int64_t tasks = (LP + chunk - 1) / chunk;
  const int64_t group = tid / lanes / tasks;
  const int i0 = static_cast<int>((tid / lanes) % tasks) * chunk;
  const int i1 = static_cast<int>(min(LP, int64_t(i0) + chunk));
  // Threads past the last group stay for the shuffles and do nothing else.
  const bool active = group < pb.N * pb.Lq * pb.M;
  const int lane = static_cast<int>(tid % lanes);
  const int64_t m = group % pb.M, n = group / (pb.Lq * pb.M);
  const int64_t row_stride = pb.M * pb.D;
  const unsigned vstride = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const uint64_t gstride = static_cast<uint64_t>(row_stride) * sizeof(A);
  const int64_t vrow0 = value_row(n, 0, m, pb.S, pb.M) * pb.D;
  const T* vbase = static_cast<const T*>(p.value) + vrow0;
  A* gvbase = static_cast<A*>(p.grad_value_acc) + vrow0;
  const auto [loc, attn] = query_row<LT>(p, group);
  const T* gout = static_cast<const T*>(p.grad_out) + group * pb.D;
  LT* gloc = static_cast<LT*>(p.grad_loc) + group * LP * 2;
  LT* gattn = static_cast<LT*>(p.grad_attn) + group * LP;

  const int64_t c0 = int64_t(lane) * VEC;
  const int64_t cstep = int64_t(lanes) * VEC;
  A go[VEC];
  if (!kMulti) {
    if (active && c0 < pb.D) {
      load_vec<T, VEC>(gout + c0, go);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) go[e] = A(0);
    }
  }

  // Every thread runs `chunk` iterations (the group sums shuffle across the
  // whole warp); samples past the group's last one are inactive.
  for (int step = 0, l = i0 / pb.P; step < chunk; ++step) {
    const int i = i0 + step;
    if (i == (l + 1) * pb.P && l + 1 < pb.L) ++l;  // level-major: at most one step a sample
    const bool live = active && i < i1;
    const Level lv = levels[l];
    const int64_t lbase = lv.start * row_stride;
    A xy[2] = {A(-2), A(-2)};  // outside: inactive threads sample nothing
    A w = A(0);
    if (live) {
      load_xy(loc + 2 * i, xy);
      w = to_acc(attn[i]);
    }
    const auto b = make_bilinear<A>(xy[0], xy[1], lv.H, lv.W);
    // A level load_levels() emptied samples nothing (make_bilinear calls a
    // 0 x 0 map's centre "inside", and its clamped corners would be pixel -1).
    const bool inside = b.inside && lv.H > 0;
    A g_attn = A(0), g_lw = A(0), g_lh = A(0);
    if (inside) {
      const T* vl = vbase + lbase;
      A* gl = value_grad ? gvbase + lbase : nullptr;
      for (int64_t c = c0; c < pb.D; c += cstep) {
        if (kMulti) load_vec<T, VEC>(gout + c, go);
        corner_grads<T, VEC>(vl + c, vstride, value_grad ? gl + c : nullptr, gstride, b, lv, w,
                             go, g_attn, g_lw, g_lh);
        if (!kMulti) break;
      }
    }
    g_attn = group_sum(g_attn, lanes);
    g_lw = group_sum(g_lw, lanes);
    g_lh = group_sum(g_lh, lanes);
    if (live && lane == 0) {
      if (keys) write_key(p, group * LP + i, inside, m + n * pb.M, cell_base[l], b, lv.W);
      gattn[i] = from_acc<LT>(acc_t<LT>(g_attn));
      gloc[2 * i] = from_acc<LT>(acc_t<LT>(w * g_lw * A(lv.W)));
      gloc[2 * i + 1] = from_acc<LT>(acc_t<LT>(w * g_lh * A(lv.H)));
    }
  }
}

// Samples per task: all of a group's (one task a group) when the groups
// alone give kFillPerSm threads a multiprocessor; otherwise (decoders: a few
// thousand groups) fewer, so that about that many threads run. More threads
// put more of the backward's latency-bound corner loads and atomics in
// flight.
constexpr int64_t kFillPerSm = 4 * 2048;

int samples_per_task(const Problem& pb, int lanes) {
  const int64_t LP = int64_t(pb.L) * pb.P;
  DeviceLimits d;
  if (device_limits(d) != cudaSuccess) {
    (void)cudaGetLastError();
    return static_cast<int>(LP);
  }
  const int64_t threads = pb.N * pb.Lq * pb.M * lanes;
  const int64_t want = kFillPerSm * d.sms;
  if (threads >= want) return static_cast<int>(LP);
  const int64_t split = std::min(LP, (want + threads - 1) / threads);
  return static_cast<int>((LP + split - 1) / split);
}

template <typename T, typename LT, int VEC>
struct Launch {
  static cudaError_t run(const BackwardParams& p, cudaStream_t stream) {
    const int lanes = lanes_for(p.pb.D, VEC);
    const int chunk = samples_per_task(p.pb, lanes);
    const int64_t LP = int64_t(p.pb.L) * p.pb.P;
    const int64_t threads = p.pb.N * p.pb.Lq * p.pb.M * ((LP + chunk - 1) / chunk) * lanes;
    const bool multi = p.pb.D > int64_t(lanes) * VEC;
    if (multi) {
      backward_kernel<T, LT, VEC, true><<<grid_for(threads), kThreads, 0, stream>>>(p, lanes, chunk);
    } else {
      backward_kernel<T, LT, VEC, false><<<grid_for(threads), kThreads, 0, stream>>>(p, lanes, chunk);
    }
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t backward(const BackwardParams& p, cudaStream_t stream) {
  return p.grad_value_acc != nullptr
             ? launch_for_dtypes<Launch, /*kVecOfAcc=*/true, /*kVecBytes=*/16>(p, stream)
             : launch_for_dtypes<Launch, /*kVecOfAcc=*/true, /*kVecBytes=*/32>(p, stream);
}

}  // namespace msda::cuda
