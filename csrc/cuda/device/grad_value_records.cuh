// What the dots kernels leave for the reproducible grad_value paths: each
// sample's cell key for the global sort, or its block-local record (cell and
// corner weights) for the block-local path; and the grad_value zero fill
// their gathers write when the level table is poisoned.
#pragma once

#include "common.cuh"

namespace msda::cuda {

// ---- cells (deterministic backward) ---------------------------------------
// Every bilinear cell (h0, w0), h0 in [-1, H), w0 in [-1, W), of every level of
// every (n, m) gets one key, so that sorting samples by key groups the samples
// that touch a pixel. Level l's cells start at cell_base[l] = the sum over the
// levels before it of (H + 1) * (W + 1); (H + 1) * (W + 1) <= 2 * H * W + 2,
// so 2 * S + 2 * L keys per (n, m) (the host's cell_stride) hold them all.
// Call with every thread, after load_levels() and a __syncthreads().
__device__ __forceinline__ void load_cell_bases(int64_t* base, const Level* lv, int L) {
  if (threadIdx.x == 0) {
    int64_t acc = 0;
    for (int l = 0; l < L; ++l) {
      base[l] = acc;
      acc += (int64_t(lv[l].H) + 1) * (int64_t(lv[l].W) + 1);
    }
  }
}

// The level table and, when `cells` (uniform over the block), the cell
// bases: load_levels() and load_cell_bases() with their barriers. Call with
// every thread of the block.
__device__ __forceinline__ void load_levels_and_cells(Level* lv, int64_t* base,
                                                      const int64_t* shapes, const int64_t* starts,
                                                      int L, int64_t S, bool cells) {
  load_levels(lv, shapes, starts, L, S);
  __syncthreads();
  if (cells) {
    load_cell_bases(base, lv, L);
    __syncthreads();
  }
}

__device__ __forceinline__ uint64_t cell_key(int64_t nm, int64_t cell_stride, int64_t level_base,
                                             int h0, int w0, int W) {
  return uint64_t(nm * cell_stride + level_base + int64_t(h0 + 1) * (W + 1) + (w0 + 1));
}

// grad_value zeroed by the whole grid: what the gathers write when the level
// table on the device is inconsistent (load_levels' poison), since no sample
// adds anything then.
template <typename T>
__device__ __forceinline__ void zero_grad_value(const Problem& pb, T* grad_value) {
  const int64_t total = pb.N * pb.S * pb.M * pb.D;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    grad_value[i] = from_acc<T>(acc_t<T>(0));
  }
}

// ---- block-local records --------------------------------------------------
// The dots kernels (or local_footprints) resolve every sample once and leave
// what the block-local grad_value needs of it (BackwardParams::local_cell,
// local_wts): its cell on its level (local_cell_of) and its four corner
// weights times its attention weight in the order (0, 2, 1, 3), the left
// column's corners 0 and 2, then the right's 1 and 3, which the column walk
// reads as pairs (store_record_weights).
template <typename A>
__device__ __forceinline__ void store_record_weights(A* dst, const Bilinear<A>& b, A w) {
  if constexpr (std::is_same_v<A, float>) {
    *reinterpret_cast<float4*>(dst) =
        make_float4(w * b.weight(0), w * b.weight(2), w * b.weight(1), w * b.weight(3));
  } else {
    reinterpret_cast<double2*>(dst)[0] = make_double2(w * b.weight(0), w * b.weight(2));
    reinterpret_cast<double2*>(dst)[1] = make_double2(w * b.weight(1), w * b.weight(3));
  }
}

// The block-local record's cell: (h0 + 1) (W + 1) + w0 + 1 on the sample's
// level, kNoCell where the sample adds nothing (off the map, poisoned).
constexpr uint32_t kNoCell = 0xffffffffu;
template <typename A>
__device__ __forceinline__ uint32_t local_cell_of(const Bilinear<A>& b, int W) {
  return b.inside && !b.poisoned() ? uint32_t(b.h0 + 1) * uint32_t(W + 1) + uint32_t(b.w0 + 1) : kNoCell;
}

// Record o: the cell of sample b on a level of width W and, where it adds
// something, its corner weights times w.
template <typename A>
__device__ __forceinline__ void write_local_record(const BackwardParams& p, uint32_t o, const Bilinear<A>& b,
                                                   int W, A w) {
  const uint32_t cell = local_cell_of(b, W);
  static_cast<uint32_t*>(p.local_cell)[o] = cell;
  if (cell != kNoCell) store_record_weights<A>(static_cast<A*>(p.local_wts) + 4 * int64_t(o), b, w);
}

}  // namespace msda::cuda
