// The tensor-core dots kernel (mma_dots_kernel): on the reproducible plans
// with 16-bit values, the location and weight gradients of every sample from
// its four corner dots with grad_output by mma.sync, and each sample's cell
// key (sorted) or block-local record (local); the fused operator's form
// also forms the row's softmax and writes each row's statistics.
#include "sample_grads.cuh"
#include "../device/tensor_core.cuh"
#include "../entry_points.h"

namespace msda::cuda {
namespace {

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
constexpr int kDotsTiles = 16;  // a warp task's tiles: 32 slots, 2 a tile

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
__global__ void __launch_bounds__(kThreads, kDotsBlocksPerSm)
    mma_dots_kernel(const BackwardParams p, const FastDiv by_lqm, const FastDiv by_m,
                    const FastDiv by_lpp, const int64_t tasks) {
  using A = float;
  constexpr bool kBlockRows = kFused && kFlat;
  const Problem& pb = p.pb;
  __shared__ Level levels[kMaxLevels];
  __shared__ int64_t cell_base[kMaxLevels];
  __shared__ uint4 rows_tab[kWarps][32];   // a slot's four corner rows of value
  __shared__ float4 dots_tab[kWarps][32];  // a slot's four corner dots
  __shared__ float red_tab[kWarps][kFused ? 32 : 1];  // row_reduce's (block_row_reduce's: flat)
  load_levels_and_cells(levels, cell_base, p.spatial_shapes, p.level_start, pb.L, pb.S, true);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int Pp = padded_points(pb.P), LPp = pb.L * Pp, groups = 32 / LPp;
  const int rj = lane / LPp;
  int l = (lane % LPp) / Pp, pt = (lane % LPp) % Pp;
  bool slot_ok = lane < groups * LPp && pt < pb.P;
  const int g = lane >> 2, t = lane & 3;
  const float half_p = 0.5f / float(pb.P);  // kFused, boxes
  const int64_t G = pb.N * pb.Lq * pb.M;
  const uint32_t last_group = static_cast<uint32_t>(G - 1);  // G < 2^31 (mma_dots_ok)
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
  const int64_t first_task = kBlockRows ? int64_t(blockIdx.x) : int64_t(blockIdx.x) * kWarps + warp;
  const int64_t task_stride = kBlockRows ? int64_t(gridDim.x) : int64_t(gridDim.x) * kWarps;
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


template <typename T, typename LT, int VEC>
struct MmaLaunch {
  static cudaError_t run(const BackwardParams& p, cudaStream_t stream) {
    const Problem& pb = p.pb;
    const int LPp = pb.L * padded_points(pb.P);
    const int64_t G = pb.N * pb.Lq * pb.M;
    const DotsKernel form = p.plan.dots;
    const int64_t rows_per_block = kThreads / LPp;
    const int64_t tasks = form == DotsKernel::mma_rows ? (G + rows_per_block - 1) / rows_per_block
                          : form == DotsKernel::mma_flat ? (G * LPp + 31) / 32
                                                         : (G + 32 / LPp - 1) / (32 / LPp);
    if (tasks == 0) return cudaSuccess;
    DeviceInfo d;
    if (const cudaError_t err = current_device_info(d); err != cudaSuccess) return err;
    // The blocks that fit at once (__launch_bounds__), the rest of the tasks in turn.
    const int64_t blocks = std::min<int64_t>(
        form == DotsKernel::mma_rows ? tasks : (tasks + kWarps - 1) / kWarps, int64_t(d.sms) * kDotsBlocksPerSm);
    const FastDiv by_lqm(static_cast<uint32_t>(pb.Lq * pb.M)), by_m(static_cast<uint32_t>(pb.M)),
        by_lpp(static_cast<uint32_t>(LPp));
    const unsigned grid = static_cast<unsigned>(blocks);
    const bool one_pass = pb.D == 32;
    const bool fused = p.ref != nullptr;
    if (form == DotsKernel::mma_rows) {
      one_pass ? mma_dots_kernel<T, LT, true, true, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks)
               : mma_dots_kernel<T, LT, false, true, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks);
    } else if (fused) {
      one_pass ? mma_dots_kernel<T, LT, true, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks)
               : mma_dots_kernel<T, LT, false, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks);
    } else if (form == DotsKernel::mma_flat) {
      one_pass ? mma_dots_kernel<T, LT, true, false, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks)
               : mma_dots_kernel<T, LT, false, false, true><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks);
    } else {
      one_pass ? mma_dots_kernel<T, LT, true, false><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks)
               : mma_dots_kernel<T, LT, false, false><<<grid, kThreads, 0, stream>>>(p, by_lqm, by_m, by_lpp, tasks);
    }
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t mma_dots(const BackwardParams& p, cudaStream_t stream) {
  if (p.plan.dots == DotsKernel::ffma || p.plan.grad_value == GradValuePath::atomic ||
      (p.pb.value_dtype != DType::f16 && p.pb.value_dtype != DType::bf16)) {
    return cudaErrorInvalidValue;
  }
  // 16-bit values only: the tensor cores take no other (the planner's rule).
  cudaError_t err = cudaSuccess;
  dispatch_dtypes<__half, __nv_bfloat16>(p.pb, [&](auto t, auto lt) {
    using T = typename decltype(t)::type;
    using LT = typename decltype(lt)::type;
    if constexpr (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) {
      err = MmaLaunch<T, LT, 1>::run(p, stream);
    }
  });
  return err;
}

}  // namespace msda::cuda
