// Launch shapes of the CUDA kernels, named once: the threads of a block and
// the blocks an SM that each kernel's __launch_bounds__ promises are the
// same constants its launcher sizes the grid from. Plain C++ (no CUDA), so
// that the backward planner (../backward_plan.cpp) reads them too.
#pragma once

#include <cstdint>

namespace msda::cuda {

// The block of most kernels, and what an SM holds at most (sm_80 to sm_90).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxThreadsPerSm = 2048;

// baseline_forward_kernel: at most 64 registers, 4 blocks an SM.
constexpr int kForwardBlocksPerSm = 4;

// backward_kernel (FFMA dots, atomic or key-writing): where the groups alone
// give fewer than kFillThreadsPerSm threads an SM (the decoders), a group's
// samples are split into tasks.
constexpr int64_t kFillThreadsPerSm = 2 * kMaxThreadsPerSm;

// dots_mma_kernel (tensor-core dots): 4 blocks an SM, the rest of the tasks
// in turn; the flat slot sequence pays only from kFlatTasksPerWarp tasks a
// resident warp.
constexpr int kDotsBlocksPerSm = 4;
constexpr int kFlatTasksPerWarp = 8;
// Sample slots a level takes in a dots task: P rounded up to 4.
constexpr int padded_points(int P) { return (P + 3) / 4 * 4; }

// The global sort's gather: value_grad_tiles (bf16, 80 registers) 3 blocks
// an SM; value_grad_pixels a full SM of warps (at least 4 blocks resident).
constexpr int kTilesBlocksPerSm = 3;
constexpr int kPixelsMinBlocksPerSm = 4;
constexpr int kPixelsBlocksPerSm = kMaxThreadsPerSm / kThreads;
// Cell starts: 8 keys a thread from this many keys an SM of work up.
constexpr int64_t kCellStartsWideFromPerSm = 8 * int64_t(kMaxThreadsPerSm);
// The sort takes 32-bit offsets from this many samples up.
constexpr int64_t kSortOffsets32From = int64_t(1) << 22;

// The block-local grad_value (backward/local_grad_value.cu): 512 threads, 2 blocks an
// SM (64 registers), at most kLocalCap samples an (n, m, level); problems of
// at most kLocalCapSmall take the kernel with the smaller shared memory.
constexpr int kLocalThreads = 512;
constexpr int kLocalBlocksPerSm = 2;
constexpr int kLocalCapSmall = 4096;
constexpr int kLocalCap = 8192;
// local_footprints (the fused FFMA path's records): grid capped at this
// many blocks an SM.
constexpr int kFootprintBlocksPerSm = 16;

}  // namespace msda::cuda
