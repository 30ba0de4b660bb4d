// The FFMA dots kernel (ffma_dots_kernel): the location and weight
// gradients of every sample from its four corner dots with grad_output, by
// lanes over channels; on the atomic plan it also adds grad_value with fp32
// (fp64) vector atomics into a zeroed accumulator, on the reproducible plans
// it writes each sample's cell key (sorted) or block-local record (local)
// instead. `lanes` threads per (query, head), VEC channels each:
//   atomic plan: VEC = 16 bytes of the accumulator (4 channels, 8 lanes for
//   D = 32), so that a group's vector atomic covers a whole 128-byte line;
//   reproducible plans: VEC = 32 bytes of the accumulator (8 channels, 4
//   lanes), halving the per-sample work every lane repeats (shuffle
//   reductions, corner bookkeeping).
// Two ways to take a group's samples (kShared): set up by one lane each and
// handed round through shared memory (encoders), or set up by every lane
// (decoders). Serves every forward backend; docs/backward.md has the figures.
#include "sample_grads.cuh"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

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
// fewer registers, no resolve-then-gather chain; docs/performance.md).
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
    ffma_dots_kernel(const BackwardParams p, const int lanes, const int chunk) {
  using A = acc_t<T>;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  __shared__ __align__(16) unsigned char slot_mem[kShared ? CornerSlots<A>::kBytesPerThread * kThreads : 16];
  const bool keys = p.plan.grad_value == GradValuePath::sorted;  // uniform
  const bool atomic_grad_value = p.plan.grad_value == GradValuePath::atomic;
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
  A* gvbase = atomic_grad_value ? static_cast<A*>(p.grad_value_acc) + vrow0 : nullptr;
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
                           atomic_grad_value ? gvbase + lbase + ch : nullptr, gstride, c, go, dot);
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
      if (p.plan.deterministic() && lane == 0) {
        reinterpret_cast<float2*>(p.row_stats)[group] = make_float2(row_max, row_inv);
      }
    }
  }
}

// Samples per task: all of a group's (one task a group) when the groups
// alone give kFillThreadsPerSm threads a multiprocessor; otherwise (decoders: a few
// thousand groups) fewer, so that about that many threads run. More threads
// put more of the backward's latency-bound corner loads and atomics in
// flight.

int samples_per_task(const Problem& pb, int lanes) {
  const int64_t LP = int64_t(pb.L) * pb.P;
  DeviceInfo d;
  if (current_device_info(d) != cudaSuccess) {
    (void)cudaGetLastError();
    return static_cast<int>(LP);
  }
  const int64_t threads = pb.N * pb.Lq * pb.M * lanes;
  const int64_t want = kFillThreadsPerSm * d.sms;
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
    // One task a group, and rounds of full width (see ffma_dots_kernel; with
    // fewer samples than lanes, bevformer_tsa's L * P = 4, the rounds leave
    // lanes idle and measured slower).
    const bool shared = chunk == LP && LP >= round_width(lanes);
    const unsigned grid = grid_for(threads);
    if (multi) {
      shared ? ffma_dots_kernel<T, LT, VEC, true, true><<<grid, kThreads, 0, stream>>>(p, lanes, chunk)
             : ffma_dots_kernel<T, LT, VEC, true, false><<<grid, kThreads, 0, stream>>>(p, lanes, chunk);
    } else {
      shared ? ffma_dots_kernel<T, LT, VEC, false, true><<<grid, kThreads, 0, stream>>>(p, lanes, chunk)
             : ffma_dots_kernel<T, LT, VEC, false, false><<<grid, kThreads, 0, stream>>>(p, lanes, chunk);
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
          ? ffma_dots_kernel<T, LT, VEC, false, true, true><<<grid, kThreads, 0, stream>>>(p, lanes, LP)
          : ffma_dots_kernel<T, LT, VEC, false, false, true><<<grid, kThreads, 0, stream>>>(p, lanes, LP);
      return cudaGetLastError();
    }
    return cudaErrorInvalidValue;
  }
};

}  // namespace

cudaError_t ffma_dots(const BackwardParams& p, cudaStream_t stream) {
  if (p.plan.dots != DotsKernel::ffma) return cudaErrorInvalidValue;
  return p.plan.deterministic() ? launch_for_dtypes<Launch, /*kVecOfAcc=*/true, /*kVecBytes=*/32>(p, stream)
                                : launch_for_dtypes<Launch, /*kVecOfAcc=*/true, /*kVecBytes=*/16>(p, stream);
}

}  // namespace msda::cuda
