// Backward shared by every forward backend. `lanes` threads per (query,
// head), VEC channels each. Two shapes, both measured best for their job
// (benchmarks/NOTES.md):
//   with grad_value atomics: VEC = 16 bytes of the accumulator (4 channels, 8
//   lanes for D = 32), so that a group's vector atomic instruction covers a
//   whole 128-byte line;
//   without (deterministic path): VEC = 32 bytes of the accumulator (8
//   channels, 4 lanes), halving the per-sample work every lane repeats
//   (shuffle reductions, corner bookkeeping).
//   grad_value: fp32 (fp64 for fp64) atomicAdd into a zeroed accumulator,
//   VEC channels per instruction on sm_90+ (vector atomics);
//   grad of locations and weights: per-lane partial dot products over
//   channels, reduced across the group's lanes with warp shuffles, written
//   once per sample (no atomics).
// Two ways to take a group's samples (backward_kernel's kShared): set up by
// one lane each and handed round through shared memory (encoders), or set
// up by every lane (decoders).
// Deterministic path (backward_deterministic.cu): no grad_value here; each
// sample's cell key and index are written instead, for the sort. With 16-bit
// values its corner dots run on tensor cores (dots_mma_kernel, below) where
// dots_mma_ok says so.
#include <algorithm>

#include "sampler.cuh"
#include "launch.h"
#include "tensor_core.cuh"

namespace msda::cuda {
namespace {

// Key of the cell sample `sample` lies in, or the largest key (past every
// cell) when it adds nothing to grad_value (footprint off the level, or
// poisoned).
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

// A round's samples hand their corners through CornerSlots (sampler.cuh):
// sample_corners()'s, with a corner outside the map, or any corner of a
// poisoned sample, flagged by the sign bit (still loadable as
// pix & INT32_MAX): it gets no grad_value. pix[0] == kNoSample
// marks a sample that touches nothing (-1 is no flagged pixel: pixels are
// below INT32_MAX, load_levels).
template <typename A>
__device__ __forceinline__ Corners<A> backward_corners(const Bilinear<A>& b, const Level& lv, A w) {
  Corners<A> c = sample_corners(b, w, lv.H, lv.W, RowMajor{lv.W});
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    c.pix[k] = b.corner_ok(k, lv.H, lv.W) && !b.poisoned() ? c.pix[k] : c.pix[k] | INT32_MIN;
  }
  return c;
}

// Samples a group resolves at once (one a lane), for `lanes` lanes a group.
constexpr int kRound = 8;
__host__ __device__ constexpr int round_width(int lanes) { return lanes < kRound ? lanes : kRound; }

// One channel slice [c, c + VEC) of a resolved sample: its four corners
// loaded back to back, their dot products with go added to dot[k] (the
// resolving lane masks the corners outside the map), and, when `gv` is set,
// each corner inside the map gets c.w[k] * go added to grad_value with vector
// atomics. `vl` / `gv` point at channel c of the level's pixel 0 of this
// (n, m); consecutive pixels are `vstride` / `gstride` bytes apart.
template <typename T, int VEC, typename A>
__device__ __forceinline__ void corner_grads(const T* vl, unsigned vstride, A* gv, uint64_t gstride,
                                             const Corners<A>& c, const A (&go)[VEC], A (&dot)[4]) {
  A v[4][VEC];
#pragma unroll
  for (int k = 0; k < 4; ++k) load_vec<T, VEC>(pixel_ptr(vl, c.pix[k] & INT32_MAX, vstride), v[k]);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) dot[k] += go[e] * v[k][e];
    if (gv != nullptr && c.pix[k] >= 0) {
      A add[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) add[e] = c.w[k] * go[e];
      // Byte arithmetic on the pointer itself (not an integer), so that the
      // compiler still knows it is global memory and emits REDG.
      A* dst = reinterpret_cast<A*>(reinterpret_cast<char*>(gv) +
                                    static_cast<uint64_t>(static_cast<unsigned>(c.pix[k])) * gstride);
      atomic_add_vec<VEC>(dst, add);
    }
  }
}

// A sample of one group resolved: its level, bilinear footprint (b.inside:
// it touches the map) and weight.
template <typename A>
struct BackwardSample {
  Bilinear<A> b{};  // value-initialised: not inside
  Level lv{0, 0, 0, false};
  A w = A(0);
};

template <typename A>
__device__ __forceinline__ BackwardSample<A> make_sample(A x, A y, A w, const Level& lv) {
  BackwardSample<A> s;
  s.lv = lv;
  s.w = lv.weight(w);
  s.b = make_bilinear<A>(x, y, s.w, lv.H, lv.W);
  return s;
}

template <typename A, typename LT>
__device__ __forceinline__ BackwardSample<A> load_sample(const LT* loc, const LT* attn, int i,
                                                         const Level& lv) {
  A xy[2];
  load_xy(loc + 2 * i, xy);
  return make_sample(xy[0], xy[1], A(to_acc(attn[i])), lv);
}

// ms_deform_attn_fused: point i of a row from its offset and logit, its
// query's reference on the level `r` and the row's softmax max and 1 / sum
// (the same arithmetic as the forward's FusedPoints and pack_samples').
template <typename LT>
__device__ __forceinline__ BackwardSample<float> load_fused_sample(const LT* off, const LT* logits,
                                                                   int i, const Level& lv,
                                                                   const float* r, int ref_dim,
                                                                   float half_p, float max,
                                                                   float inv_sum) {
  float o[2], x, y;
  load_xy(off + 2 * i, o);
  fused_location(o, r, ref_dim, half_p, lv, x, y);
  return make_sample(x, y, fused_weight(float(to_acc(logits[i])), max, inv_sum), lv);
}

// d out / d attention weight and d out / d (lw, lh) of sample s from its four
// corner dots with grad_output (corners outside the map count nothing).
// Linear in the dots: partial dots give partial sums.
template <typename A>
__device__ __forceinline__ void sample_grads(const BackwardSample<A>& s, const A (&dot)[4],
                                             A (&g)[3]) {
  g[0] = g[1] = g[2] = A(0);
  if (!s.b.inside) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const A d = s.b.corner_ok(k, s.lv.H, s.lv.W) ? dot[k] : A(0);
    g[0] += s.b.weight(k) * d;
    g[1] += s.b.dweight_dlw(k) * d;
    g[2] += s.b.dweight_dlh(k) * d;
  }
}

// The block-local record index of sample (q, level l, point pt) of (n, m)
// (nm = n M + m; see BackwardParams::local_cell): records by (n, m, level),
// then query, then point; 32-bit indices, the launch keeps the samples below
// 2^31 and A float.
__device__ __forceinline__ uint32_t local_record_at(const Problem& pb, uint32_t nm, uint32_t l, uint32_t q,
                                                   uint32_t pt) {
  return (nm * uint32_t(pb.L) + l) * (uint32_t(pb.Lq) * uint32_t(pb.P)) + q * uint32_t(pb.P) + pt;
}

// The same for sample i of group (n, q, m), the group's index decoded.
__device__ __forceinline__ uint32_t local_record_index(const BackwardParams& p, int64_t group, int i,
                                                      int64_t nm) {
  const uint32_t M = uint32_t(p.pb.M), Lq = uint32_t(p.pb.Lq), P = uint32_t(p.pb.P);
  const uint32_t n = uint32_t(nm) / M, q = uint32_t(group) / M - n * Lq, l = uint32_t(i) / P;
  return local_record_at(p.pb, uint32_t(nm), l, q, uint32_t(i) - l * P);
}

// Writes the attention weight and location gradients of sample i of group
// `group` (g summed over the group) and, on the deterministic path, its cell
// key (nm = n M + m of the group (n, q, m), level_base = its level's first
// cell) or its block-local record (unless !kRecord: the fused FFMA kernel
// leaves them to local_footprints), at record() where given (the caller's
// cheaper index arithmetic), else at local_record_index().
// The same with the three values given: the weight's (or logit's) gradient
// ga and the location's (or offset's) (gx, gy).
template <typename A, typename LT, bool kRecord = true, typename Record = std::nullptr_t>
__device__ __forceinline__ void write_sample_grads(const BackwardParams& p, const BackwardSample<A>& s,
                                                   A ga, A gx, A gy, int64_t group, int i, int64_t nm,
                                                   int64_t level_base, const Record& record = nullptr) {
  const int64_t sample = group * p.pb.L * p.pb.P + i;
  if (p.cell_keys != nullptr) {
    write_key(p, sample, s.b.inside && !s.b.poisoned(), nm, level_base, s.b, s.lv.W);
  }
  if constexpr (kRecord) {
    if (p.local_cell != nullptr) {
      if constexpr (std::is_same_v<Record, std::nullptr_t>) {
        write_local_record(p, local_record_index(p, group, i, nm), s.b, s.lv.W, s.w);
      } else {
        write_local_record(p, record(), s.b, s.lv.W, s.w);
      }
    }
  }
  static_cast<LT*>(p.grad_attn)[sample] = from_acc<LT>(acc_t<LT>(ga));
  LT* gloc = static_cast<LT*>(p.grad_loc) + sample * 2;
  gloc[0] = from_acc<LT>(acc_t<LT>(gx));
  gloc[1] = from_acc<LT>(acc_t<LT>(gy));
}

template <typename A, typename LT>
__device__ __forceinline__ void write_grads(const BackwardParams& p, const BackwardSample<A>& s,
                                            const A (&g)[3], int64_t group, int i, int64_t nm,
                                            int64_t level_base) {
  write_sample_grads<A, LT>(p, s, g[0], s.w * g[1] * A(s.lv.W), s.w * g[2] * A(s.lv.H), group, i,
                            nm, level_base);
}

// kMulti: D spans more than one pass of the group's lanes (D > 32 * VEC), so
// grad_output is re-read per pass instead of being kept in registers.
//
// kShared (a task is a whole group's samples: the groups alone fill the GPU,
// the encoders): samples go in rounds of R = round_width(lanes); lane j of a
// group resolves sample r0 + j (location, weight, bilinear footprint) into
// its slot; the group then takes the round's samples one after the other
// from the slots (corner loads, dot products, atomics, one group sum of the
// four corner dots); the resolving lane keeps its sample's dots and writes
// its gradients. So the set-up runs once a sample, not once a lane.
// !kShared (tasks of a few samples: the decoders): every lane resolves each
// sample itself and the group sums the three gradients, which keeps the
// samples of a lane independent of the other lanes' (measured faster there:
// fewer registers, no resolve-then-gather chain; benchmarks/NOTES.md).
//
// kFused (ms_deform_attn_fused, p.ref set; float accumulation, a task a
// whole row): the group forms the row's softmax (row_softmax) and each
// sample's location and weight from offsets and logits; it writes the
// offsets' gradients and, in a second pass once the row's sum of a_j g_j is
// known, the logits' a_i (g_i - sum_j a_j g_j), both into float32 buffers;
// with p.row_stats set (the sorted path) also each row's softmax max and
// reciprocal sum for pack_samples.
template <typename T, typename LT, int VEC, bool kMulti, bool kShared, bool kFused = false>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const BackwardParams p, const int lanes, const int chunk) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  __shared__ __align__(16) unsigned char slot_mem[kShared ? CornerSlots<A>::kBytesPerThread * kThreads : 16];
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
  const int64_t row_stride = value_pixel_rows(pb) * pb.D;
  const unsigned vstride = static_cast<unsigned>(row_stride * sizeof(T));  // < 4 GiB (binding)
  const uint64_t gstride = static_cast<uint64_t>(row_stride) * sizeof(A);
  const int64_t vrow0 = value_row(pb, n, 0, m) * pb.D;
  const T* vbase = static_cast<const T*>(p.value) + vrow0;
  A* gvbase = value_grad ? static_cast<A*>(p.grad_value_acc) + vrow0 : nullptr;
  const auto [loc, attn] = query_row<LT>(p, group);
  const T* gout = static_cast<const T*>(p.grad_out) + group * pb.D;
  // kFused: the row's softmax, its query's reference points, and this
  // lane's part of sum_j a_j g_j.
  float row_max = 0.f, row_inv = 0.f, ag = 0.f;
  const float half_p = 0.5f / float(pb.P);
  const float* ref = nullptr;
  if constexpr (kFused) {
    row_softmax(attn, active ? static_cast<int>(LP) : 0, group_lanes(lane, lanes), row_max, row_inv);
    ref = p.ref + (active ? group / pb.M : 0) * pb.L * p.ref_dim;
  }
  auto load = [&](int i, int l) {
    if constexpr (kFused) {
      return load_fused_sample(loc, attn, i, levels[l], ref + l * p.ref_dim, p.ref_dim, half_p,
                               row_max, row_inv);
    } else {
      return load_sample<A>(loc, attn, i, levels[l]);
    }
  };
  auto write = [&](const BackwardSample<A>& s, const A (&gr)[3], int i, int l) {
    const int64_t base = keys ? cell_base[l] : 0;
    if constexpr (kFused) {
      float sx, sy;
      fused_offset_scale(ref + l * p.ref_dim, p.ref_dim, half_p, s.lv, sx, sy);
      write_sample_grads<A, float, false>(p, s, gr[0], s.w * gr[1] * sx, s.w * gr[2] * sy, group, i,
                                          n * pb.M + m, base);
      ag += s.w * gr[0];
    } else {
      write_grads<A, LT>(p, s, gr, group, i, n * pb.M + m, base);
    }
  };

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
  // Adds this lane's channel slices of sample c (on level l) into dot.
  auto gather = [&](const Corners<A>& c, int l, A(&dot)[4]) {
    const int64_t lbase = levels[l].start * row_stride;
    for (int64_t ch = c0; ch < pb.D; ch += cstep) {
      if (kMulti) load_vec<T, VEC>(gout + ch, go);
      corner_grads<T, VEC>(vbase + lbase + ch, vstride,
                           value_grad ? gvbase + lbase + ch : nullptr, gstride, c, go, dot);
      if (!kMulti) break;
    }
  };

  if constexpr (kShared) {
    const GroupLanes g = group_lanes(lane, lanes);
    CornerSlots<A> slots(slot_mem, kThreads);
    // Every thread runs the same rounds and steps (the group sums shuffle
    // across the whole warp); samples past the group's last one are inactive.
    const int R = round_width(lanes);
    for (int r0 = i0; r0 < i1; r0 += R) {
      // Resolve: lane j < R takes sample r0 + j.
      const int i = r0 + lane;
      const bool live = active && lane < R && i < i1;
      const int l = i / pb.P;
      BackwardSample<A> s;
      if (live) s = load(i, l);
      if (lane < R) {
        Corners<A> c{{kNoSample, kNoSample, kNoSample, kNoSample}, {A(0), A(0), A(0), A(0)}};
        if (s.b.inside) c = backward_corners(s.b, s.lv, s.w);
        slots.put(g.slot(lane), c);
      }
      __syncwarp(g.mask);
      // Gather: the round's samples one after the other.
      A mine[4] = {A(0), A(0), A(0), A(0)};  // this lane's own sample's corner dots
      const int steps = min(R, i1 - r0);      // uniform: every group's task is all LP samples
      for (int j = 0, lj = r0 / pb.P; j < steps; ++j) {
        const int ij = r0 + j;
        if (j > 0 && ij == (lj + 1) * pb.P) ++lj;  // level-major: at most one step a sample
        A dot[4] = {A(0), A(0), A(0), A(0)};
        if (active && ij < i1) {
          const Corners<A> c = slots.get(g.slot(j));
          if (c.pix[0] != kNoSample) gather(c, lj, dot);
        }
        group_sum(dot, lanes);
#pragma unroll
        for (int k = 0; k < 4; ++k) mine[k] = lane == j ? dot[k] : mine[k];
      }
      __syncwarp(g.mask);  // slots are rewritten by the next round
      if (live) {
        A gr[3];
        sample_grads(s, mine, gr);
        write(s, gr, i, l);
      }
    }
  } else {
    // Every thread runs `chunk` iterations (the group sums shuffle across
    // the whole warp); samples past the group's last one are inactive.
    for (int step = 0, l = i0 / pb.P; step < chunk; ++step) {
      const int i = i0 + step;
      if (i == (l + 1) * pb.P && l + 1 < pb.L) ++l;  // level-major: at most one step a sample
      const bool live = active && i < i1;
      BackwardSample<A> s;
      if (live) s = load(i, l);
      A dot[4] = {A(0), A(0), A(0), A(0)};
      if (s.b.inside) gather(backward_corners(s.b, s.lv, s.w), l, dot);
      A gr[3];
      sample_grads(s, dot, gr);
      group_sum(gr, lanes);
      if (live && lane == 0) write(s, gr, i, l);
    }
  }
  if constexpr (kFused) {
    // Softmax: the first pass left g_i in grad_attn; now a_i (g_i - sum).
    A sum_ag[1] = {ag};
    group_sum(sum_ag, lanes);
    __syncwarp();  // the group's writes of g_i, visible to its lanes
    if (active) {
      float* ga = static_cast<float*>(p.grad_attn) + group * LP;
      for (int i = i0 + lane; i < i1; i += lanes) {
        const float a = levels[i / pb.P].weight(fused_weight(float(to_acc(attn[i])), row_max, row_inv));
        ga[i] = a * (ga[i] - sum_ag[0]);
      }
      if (p.row_stats != nullptr && lane == 0) {
        reinterpret_cast<float2*>(p.row_stats)[group] = make_float2(row_max, row_inv);
      }
    }
  }
}

// Samples per task: all of a group's (one task a group) when the groups
// alone give kFillPerSm threads a multiprocessor; otherwise (decoders: a few
// thousand groups) fewer, so that about that many threads run. More threads
// put more of the backward's latency-bound corner loads and atomics in
// flight.
constexpr int64_t kFillPerSm = 2 * 2048;

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
    if (p.ref != nullptr) return run_fused(p, stream, lanes);
    const int chunk = samples_per_task(p.pb, lanes);
    const int64_t LP = int64_t(p.pb.L) * p.pb.P;
    const int64_t threads = p.pb.N * p.pb.Lq * p.pb.M * ((LP + chunk - 1) / chunk) * lanes;
    const bool multi = p.pb.D > int64_t(lanes) * VEC;
    // One task a group, and rounds of full width (see backward_kernel; with
    // fewer samples than lanes, bevformer_tsa's L * P = 4, the rounds leave
    // lanes idle and measured slower).
    const bool shared = chunk == LP && LP >= round_width(lanes);
    const unsigned grid = grid_for(threads);
    if (multi) {
      shared ? backward_kernel<T, LT, VEC, true, true><<<grid, kThreads, 0, stream>>>(p, lanes, chunk)
             : backward_kernel<T, LT, VEC, true, false><<<grid, kThreads, 0, stream>>>(p, lanes, chunk);
    } else {
      shared ? backward_kernel<T, LT, VEC, false, true><<<grid, kThreads, 0, stream>>>(p, lanes, chunk)
             : backward_kernel<T, LT, VEC, false, false><<<grid, kThreads, 0, stream>>>(p, lanes, chunk);
    }
    return cudaGetLastError();
  }

  // The fused operator: a task a whole row (the softmax needs it), vector
  // accesses, one channel pass (fused_backward_cuda sends no other); float
  // accumulation.
  static cudaError_t run_fused(const BackwardParams& p, cudaStream_t stream, int lanes) {
    if constexpr (std::is_same_v<acc_t<T>, float> && VEC > 1) {
      const int LP = p.pb.L * p.pb.P;
      if (p.pb.D > int64_t(lanes) * VEC) return cudaErrorInvalidValue;
      const unsigned grid = grid_for(p.pb.N * p.pb.Lq * p.pb.M * lanes);
      LP >= round_width(lanes)
          ? backward_kernel<T, LT, VEC, false, true, true><<<grid, kThreads, 0, stream>>>(p, lanes, LP)
          : backward_kernel<T, LT, VEC, false, false, true><<<grid, kThreads, 0, stream>>>(p, lanes, LP);
      return cudaGetLastError();
    }
    return cudaErrorInvalidValue;
  }
};

// ---- the deterministic path's dots on tensor cores (16-bit values) --------
// Without grad_value, the backward of a sample is its four corner dots
// grad_output . value[corner] and what follows from them. Those dots contract
// over channels, the direction value rows lie in memory, so value rows are
// an mma A operand loaded with plain 16-byte loads, no shuffling: a tile is
// 8 corner rows (two samples) of 32 channels, A's row g their corner g's
// first 16 channels and row g + 8 its last 16. Lane 4 g + t loads channels
// 8 t .. 8 t + 7 of corner g, words w0..w3, which are A's a0..a3 as they
// stand: word 4 t + h is (half h, k = 2 t), word 4 t + 2 + h (half h, k =
// 2 t + 8). B's columns 2 j and 2 j + 1 are the two halves of grad_output
// row j of four (query, head) groups in the same k order, so C[g][2 j] +
// C[g + 8][2 j + 1] (c0 + c3 of lane 4 g + j) is corner g's dot with group
// j's grad_output: one m16n8k16 a tile and 32 channels.
//
// A warp takes 32 sample slots at once: 32 / (L Pp) (query, head) groups,
// Pp = P rounded up to 4 (padding slots do nothing). Lane s resolves slot s
// (location, weight, footprint, the value rows of its four clamped corners)
// into the warp's table; tile k is slots 2 k and 2 k + 1 (table entries
// 8 k .. 8 k + 7); the dots go back to the table and each resolving lane
// writes its sample's gradients and cell key.
constexpr int kDotsWarps = kThreads / 32;
constexpr int kDotsTiles = 16;  // a warp task's tiles: 32 slots, 2 a tile

// Sample slots a level takes in a warp task: P rounded up to 4.
__host__ __device__ __forceinline__ int padded_points(int P) { return (P + 3) / 4 * 4; }

__device__ __forceinline__ uint4 load16(const char* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Reduces v over the sample slots of each (query, head) row of a dots warp
// task (lanes rj LPp .. rj LPp + LPp - 1), every lane getting its row's
// result, in a fixed order: xor shuffles when LPp is a power of two (the rows
// are then aligned segments of the warp), else through the warp's table
// `tab`. Every lane of the warp calls it.
template <typename Op>
__device__ __forceinline__ float row_reduce(float v, int LPp, int lane, float* tab, Op op) {
  if ((LPp & (LPp - 1)) == 0) {
    for (int o = 1; o < LPp; o <<= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
  }
  tab[lane] = v;
  __syncwarp();
  const int first = lane / LPp * LPp, end = min(first + LPp, 32);
  float r = tab[first];
  for (int j = first + 1; j < end; ++j) r = op(r, tab[j]);
  __syncwarp();  // the table is rewritten by the next reduction
  return r;
}

// The same over the rows of a block task (kFused with kFlat): slot s (=
// threadIdx.x) of row gl < gb (gb = kThreads / L Pp rows a block task),
// through the block's table; every thread of the block calls it.
template <typename Op>
__device__ __forceinline__ float block_row_reduce(float v, int LPp, int s, int gl, int gb, float* tab, Op op) {
  tab[s] = v;
  __syncthreads();
  float r = 0.f;
  if (gl < gb) {
    const int first = gl * LPp;
    r = tab[first];
    for (int j = 1; j < LPp; ++j) r = op(r, tab[first + j]);
  }
  __syncthreads();  // the table is rewritten by the next reduction
  return r;
}

// by_lqm, by_m: division by Lq M and by M (groups below 2^31); tasks: warp
// tasks in all (block tasks with kFused and kFlat). kFlat (by_lpp: division
// by L Pp): no lane idles when L Pp does not divide 32 (L = 3 or 5 at P =
// 4: a quarter or 3/8 of the lanes otherwise). Without kFused the slots of
// all groups are one sequence, 32 a warp task, so that a group may straddle
// two tasks; kFused reduces over a group's slots (its softmax), so there a
// task is a block's: kThreads / (L Pp) whole groups over its warps, reduced
// through shared memory. Without kFlat a warp task is 32 / (L Pp) whole
// groups (the same as the flat sequence when L Pp divides 32).
// kOnePass: D == 32, one channel pass a tile, so that the
// unrolled tiles' loads may be in flight together. kFused
// (ms_deform_attn_fused, p.ref set): the samples are formed from offsets and
// logits (the row's softmax by row_reduce over its slots), the gradients
// written are those of the offsets and logits, and each row's softmax max
// and reciprocal sum go to p.row_stats for pack_samples.
template <typename T, typename LT, bool kOnePass, bool kFused, bool kFlat = false>
__global__ void __launch_bounds__(kThreads, 4)
    dots_mma_kernel(const BackwardParams p, const FastDiv by_lqm, const FastDiv by_m,
                    const FastDiv by_lpp, const int64_t tasks) {
  using A = float;
  constexpr bool kBlockRows = kFused && kFlat;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  __shared__ uint4 rows_tab[kDotsWarps][32];   // a slot's four corner rows of value
  __shared__ float4 dots_tab[kDotsWarps][32];  // a slot's four corner dots
  __shared__ float red_tab[kDotsWarps][kFused ? 32 : 1];  // row_reduce's (block_row_reduce's: flat)
  load_levels_and_cells(levels, cell_base, p.spatial_shapes, p.level_start, pb.L, pb.S, true);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int Pp = padded_points(pb.P), LPp = pb.L * Pp, groups = 32 / LPp;
  const int rj = lane / LPp;
  int l = (lane % LPp) / Pp, pt = (lane % LPp) % Pp;
  bool slot_ok = lane < groups * LPp && pt < pb.P;
  const int g = lane >> 2, t = lane & 3;
  const float half_p = 0.5f / float(pb.P);  // kFused, boxes
  const int64_t G = pb.N * pb.Lq * pb.M;
  const uint32_t last_group = static_cast<uint32_t>(G - 1);  // G < 2^31 (dots_mma_ok)
  // B holds four groups: tiles 0-7 (slots 0-15) those from the task's first,
  // tiles 8-15 those from the group of slot 16 (either way the tiles' groups
  // are among the four). Bit k of `writes`: tile k's group is this lane's t
  // of its four, so this lane holds its corner g's dot.
  int first_hi = 16 / LPp;
  uint32_t writes = 0;
#pragma unroll
  for (int k = 0; k < kDotsTiles; ++k) {
    writes |= (2 * k / LPp - (k < 8 ? 0 : first_hi) == t ? 1u : 0u) << k;
  }
  // Byte addresses: lane t's 16 bytes of a row (channels 8 t .. 8 t + 7 of
  // every 32), rows of D elements.
  const unsigned row_bytes = static_cast<unsigned>(pb.D * sizeof(T));
  const char* vlane = static_cast<const char*>(p.value) + 16 * t;
  const char* glane = static_cast<const char*>(p.grad_out) + 16 * t;
  const uint32_t* rows_u = reinterpret_cast<const uint32_t*>(rows_tab[warp]) + g;
  float* dots_f = reinterpret_cast<float*>(dots_tab[warp]) + g;

  // Block tasks: gb rows each; slot threadIdx.x of row gl.
  const int gb = kThreads / LPp;
  const int gl = kBlockRows ? static_cast<int>(by_lpp(threadIdx.x)) : 0;
  // A row's reduction (kFused): within the warp, or over the block task.
  auto reduce_row = [&](float v, auto op) {
    if constexpr (kBlockRows) {
      return block_row_reduce(v, LPp, static_cast<int>(threadIdx.x), gl, gb, &red_tab[0][0], op);
    } else {
      return row_reduce(v, LPp, lane, red_tab[warp], op);
    }
  };
  const int64_t first_task = kBlockRows ? int64_t(blockIdx.x) : int64_t(blockIdx.x) * kDotsWarps + warp;
  const int64_t task_stride = kBlockRows ? int64_t(gridDim.x) : int64_t(gridDim.x) * kDotsWarps;
  for (int64_t task = first_task; task < tasks; task += task_stride) {
    int64_t group = task * groups + rj;
    uint32_t task_group = static_cast<uint32_t>(task) * groups;
    if constexpr (kFlat) {
      // This lane's slot: of group grp, in group rel of the four from the
      // warp's first group task_group. Without kFused slot task * 32 + lane
      // of the sequence (below 2^31: the launch); with it slot threadIdx.x
      // of the block task's gb rows (past them: idle).
      uint32_t grp, ip;
      if constexpr (kBlockRows) {
        const uint32_t row0 = static_cast<uint32_t>(task) * static_cast<uint32_t>(gb);
        task_group = row0 + by_lpp(32u * warp);
        grp = row0 + static_cast<uint32_t>(gl);
        ip = threadIdx.x - static_cast<uint32_t>(gl * LPp);
      } else {
        const uint32_t s0 = static_cast<uint32_t>(task) * 32u, sl = s0 + lane;
        task_group = by_lpp(s0);
        grp = by_lpp(sl);
        ip = sl - grp * static_cast<uint32_t>(LPp);
      }
      group = grp;
      l = static_cast<int>(ip) / Pp;
      pt = static_cast<int>(ip) - l * Pp;
      slot_ok = pt < pb.P && (!kBlockRows || gl < gb);
      const uint32_t rel = grp - task_group;
      first_hi = __shfl_sync(0xffffffffu, static_cast<int>(rel), 16);
      // Bit k of writes: tile k (slots 2 k, 2 k + 1, one group since L Pp is
      // a multiple of 4) is of group first + t, first = task_group for tiles
      // 0-7 and task_group + first_hi for tiles 8-15. From the ballots of
      // the slots in each group, their even bits (one a tile) compressed.
      writes = 0;
#pragma unroll
      for (uint32_t v = 0; v < 4; ++v) {
        uint32_t m = __ballot_sync(0xffffffffu, rel == v) & 0x55555555u;
        m = (m | (m >> 1)) & 0x33333333u;
        m = (m | (m >> 2)) & 0x0f0f0f0fu;
        m = (m | (m >> 4)) & 0x00ff00ffu;
        m = (m | (m >> 8)) & 0x0000ffffu;
        if (v == static_cast<uint32_t>(t)) writes |= m & 0xffu;
        if (v == static_cast<uint32_t>(t + first_hi)) writes |= m & 0xff00u;
      }
    }
    const bool live = slot_ok && group < G;
    const uint32_t g32 = static_cast<uint32_t>(min(group, G - 1));
    const uint32_t n = by_lqm(g32), m = g32 - by_m(g32) * static_cast<uint32_t>(pb.M);
    const int64_t nm = int64_t(n) * pb.M + m;
    const int i = l * pb.P + pt;
    BackwardSample<A> s;
    uint4 rows = make_uint4(0, 0, 0, 0);  // row 0: always loadable, its dots unused
    const auto [loc, attn] = query_row<LT>(p, g32);
    float row_max = 0.f, row_inv = 0.f;
    // kFused: the slot's logit (padding slots and groups past the last take
    // no part: -inf, exp 0), offset and reference on its level, all loaded
    // before the row's reductions so that their latencies overlap the
    // logit's; what the offsets' gradients are scaled by (sx, sy).
    float z = -INFINITY, o[2] = {0.f, 0.f}, r[4] = {0.f, 0.f, 0.f, 0.f}, sx = 1.f, sy = 1.f;
    if constexpr (kFused) {
      const float* ref =
          p.ref + (g32 / static_cast<uint32_t>(pb.M)) * int64_t(pb.L) * p.ref_dim + l * p.ref_dim;
      if (live) {
        z = float(to_acc(attn[i]));
        load_xy(loc + 2 * i, o);
        r[0] = ref[0];
        r[1] = ref[1];
        if (p.ref_dim == 4) {
          r[2] = ref[2];
          r[3] = ref[3];
        }
      }
      row_max = reduce_row(z, [](float a, float b) { return fmaxf(a, b); });
      row_inv = 1.f / reduce_row(expf(z - row_max),
                                 [](float a, float b) { return a + b; });
    }
    if (live) {
      if constexpr (kFused) {
        float x, y;
        fused_location(o, r, p.ref_dim, half_p, levels[l], x, y);
        s = make_sample(x, y, fused_weight(z, row_max, row_inv), levels[l]);
        fused_offset_scale(r, p.ref_dim, half_p, s.lv, sx, sy);
        // Written now, so that neither is held across the products.
        if (i == 0) reinterpret_cast<float2*>(p.row_stats)[group] = make_float2(row_max, row_inv);
      } else {
        s = load_sample<A>(loc, attn, i, levels[l]);
      }
      if (s.b.inside) {
        int pix[4];
        clamped_corners(s.b, s.lv.H, s.lv.W, pix);
        const uint32_t r0 = static_cast<uint32_t>(value_row(pb, n, s.lv.start, m));
        const uint32_t step = static_cast<uint32_t>(value_pixel_rows(pb));
        rows = make_uint4(r0 + uint32_t(pix[0]) * step, r0 + uint32_t(pix[1]) * step,
                          r0 + uint32_t(pix[2]) * step, r0 + uint32_t(pix[3]) * step);
      }
    }
    rows_tab[warp][lane] = rows;
    __syncwarp();
    // This lane's B words of channel pass `off`: group (lane / 8) of the four
    // from `first` (past the last group: the last one's row, its dots
    // unused), half (lane / 4) % 2.
    auto b_words = [&](int first, unsigned off) {
      const uint32_t grp = min(task_group + first + lane / 8, last_group);
      const uint4 w = load16(glane + uint64_t(grp) * row_bytes + off);
      return (lane & 4) ? make_uint2(w.y, w.w) : make_uint2(w.x, w.z);
    };
    // Tile k's A: its corner g's 16 bytes of channel pass `off`. Tiles past
    // the slots in use read value row 0 and go unused.
    auto tile_a = [&](int k, unsigned off) {
      return load16(vlane + uint64_t(rows_u[8 * k]) * row_bytes + off);
    };
    auto put_dot = [&](int k, const float (&c)[4]) {
      if ((writes >> k) & 1u) dots_f[8 * k] = c[0] + c[3];
    };
    if constexpr (kOnePass) {
      // Eight tiles' loads in flight at once, then their products.
#pragma unroll
      for (int k0 = 0; k0 < kDotsTiles; k0 += 8) {
        const uint2 b = b_words(k0 == 0 ? 0 : first_hi, 0);
        uint4 a[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] = tile_a(k0 + k, 0);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          mma_16816<T>(c, {a[k].x, a[k].y, a[k].z, a[k].w}, b.x, b.y);
          put_dot(k0 + k, c);
        }
      }
    } else {
#pragma unroll 1
      for (int k = 0; k < kDotsTiles; ++k) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
        for (unsigned off = 0; off < row_bytes; off += 64) {  // 32 channels a pass
          const uint2 b = b_words(k < 8 ? 0 : first_hi, off);
          const uint4 a = tile_a(k, off);
          mma_16816<T>(c, {a.x, a.y, a.z, a.w}, b.x, b.y);
        }
        put_dot(k, c);
      }
    }
    __syncwarp();
    A gr[3] = {A(0), A(0), A(0)};
    if (live) {
      const float4 d = dots_tab[warp][lane];
      const A dot[4] = {d.x, d.y, d.z, d.w};
      sample_grads(s, dot, gr);
    }
    if constexpr (kFused) {
      // Softmax: d logit_i = a_i (g_i - sum_j a_j g_j) over the row.
      const float ag = reduce_row(live ? s.w * gr[0] : 0.f,
                                  [](float a, float b) { return a + b; });
      if (live) {
        // Its block-local record index (BackwardParams), from the group's n.
        const auto record = [&] {
          return local_record_at(pb, uint32_t(nm), uint32_t(l), by_m(g32) - n * static_cast<uint32_t>(pb.Lq),
                                 uint32_t(pt));
        };
        write_sample_grads<A, LT, true>(p, s, s.w * (gr[0] - ag), s.w * gr[1] * sx, s.w * gr[2] * sy,
                                        group, i, nm, cell_base[l], record);
      }
    } else if (live) {
      write_grads<A, LT>(p, s, gr, group, i, nm, cell_base[l]);
    }
    __syncwarp();  // the tables are rewritten by the next task
  }
}

}  // namespace

bool dots_mma_ok(const BackwardParams& p) {
  const Problem& pb = p.pb;
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return pb.D % 32 == 0 && pb.L * padded_points(pb.P) <= 32 &&
         pb.N * pb.S * pb.M <= int64_t(UINT32_MAX) && pb.N * pb.Lq * pb.M < int64_t(INT32_MAX) &&
         aligned(p.value) && aligned(p.grad_out);
}

bool dots_on_tensor_cores(const BackwardParams& p) {
  return (p.pb.value_dtype == DType::f16 || p.pb.value_dtype == DType::bf16) && dots_mma_ok(p);
}

namespace {

template <typename T, typename LT, int VEC>
struct DotsLaunch {
  static cudaError_t run(const BackwardParams& p, cudaStream_t stream) {
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      if (!dots_on_tensor_cores(p)) return Launch<T, LT, VEC>::run(p, stream);
      const Problem& pb = p.pb;
      const int LPp = pb.L * padded_points(pb.P);
      const int64_t G = pb.N * pb.Lq * pb.M;
      DeviceLimits d;
      if (const cudaError_t err = device_limits(d); err != cudaSuccess) return err;
      // The flat slot sequence (dots_mma_kernel's kFlat) where whole groups
      // leave lanes idle, its slots indexed in 32 bits, and only with at
      // least 8 tasks a warp that fits at once: faster there on the encoders,
      // slower on a decoder's few tasks (benchmarks/NOTES.md, tenth session).
      const int64_t resident_warps = int64_t(d.sms) * 4 * kDotsWarps;
      const bool flat = p.ref == nullptr && 32 % LPp != 0 && G * LPp + 32 <= int64_t(INT32_MAX) &&
                        (G * LPp + 31) / 32 >= 8 * resident_warps;
      // The fused kernel's block tasks of kThreads / (L Pp) whole rows where
      // whole rows leave lanes of a warp idle.
      const bool block_rows = p.ref != nullptr && 32 % LPp != 0;
      const int64_t rows_per_block = kThreads / LPp;
      const int64_t tasks = block_rows ? (G + rows_per_block - 1) / rows_per_block
                            : flat     ? (G * LPp + 31) / 32
                                       : (G + 32 / LPp - 1) / (32 / LPp);
      if (tasks == 0) return cudaSuccess;
      // The blocks that fit at once (4 an SM: __launch_bounds__), the rest of
      // the tasks in turn.
      const int64_t blocks = std::min<int64_t>(block_rows ? tasks : (tasks + kDotsWarps - 1) / kDotsWarps,
                                               int64_t(d.sms) * 4);
      const FastDiv by_lqm(static_cast<uint32_t>(pb.Lq * pb.M)), by_m(static_cast<uint32_t>(pb.M)),
          by_lpp(static_cast<uint32_t>(LPp));
      const unsigned grid = static_cast<unsigned>(blocks);
      if (block_rows) {
        pb.D == 32
            ? dots_mma_kernel<T, LT, true, true, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks)
            : dots_mma_kernel<T, LT, false, true, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks);
      } else if (p.ref != nullptr) {
        pb.D == 32 ? dots_mma_kernel<T, LT, true, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks)
                   : dots_mma_kernel<T, LT, false, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks);
      } else if (flat) {
        pb.D == 32
            ? dots_mma_kernel<T, LT, true, false, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks)
            : dots_mma_kernel<T, LT, false, false, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks);
      } else {
        pb.D == 32 ? dots_mma_kernel<T, LT, true, false><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks)
                   : dots_mma_kernel<T, LT, false, false><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks);
      }
      return cudaGetLastError();
    } else {
      return Launch<T, LT, VEC>::run(p, stream);
    }
  }
};

}  // namespace

bool sorted_backward_preferred(const BackwardParams& p) {
  const Problem& pb = p.pb;
  // Samples of one (n, m) against its S value pixels: at least a third
  // (measured: below it the sort's fixed costs lose to the atomics), at most
  // D, so that the sorted path's scratch (32 bytes a sample) stays within 8x
  // the atomic path's accumulator (4 D bytes a pixel): a memory bound, not a
  // speed measurement.
  const int64_t samples = pb.Lq * pb.L * pb.P;
  // Where the block-local grad_value applies (the decoders) it is the faster
  // one for 16-bit values too; for fp32 values the atomics stay faster
  // (benchmarks/NOTES.md, eleventh session).
  const bool dense_bf16 = pb.value_dtype == DType::bf16 && dots_mma_ok(p) && 3 * samples >= pb.S &&
                          samples <= pb.S * pb.D;
  const bool half = pb.value_dtype == DType::bf16 || pb.value_dtype == DType::f16;
  return dense_bf16 || (half && local_value_grad_ok(p));
}

cudaError_t backward(const BackwardParams& p, cudaStream_t stream) {
  if (p.grad_value_acc != nullptr) {
    return launch_for_dtypes<Launch, /*kVecOfAcc=*/true, /*kVecBytes=*/16>(p, stream);
  }
  // The deterministic path: tensor-core dots where dots_mma_ok, else the
  // FFMA kernel.
  return launch_for_dtypes<DotsLaunch, /*kVecOfAcc=*/true, /*kVecBytes=*/32>(p, stream);
}

}  // namespace msda::cuda
