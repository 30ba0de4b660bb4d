// Launch shapes of the CUDA kernels, named once: the threads of a block and
// the blocks an SM that each kernel's __launch_bounds__ promises are the
// same constants the planners (forward_plan.cpp, backward_plan.cpp) size the
// launches from. Plain C++ (no CUDA), so that the planners stay pure.
#pragma once

#include <cstdint>

namespace msda::cuda {

// The block of most kernels, and what an SM holds at most (sm_80 to sm_90).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxThreadsPerSm = 2048;

// A (query, head) row is served by `lanes` consecutive threads (a power of
// two <= 32, so a group never straddles a warp), each owning vec channels:
// lane j owns [j vec, j vec + vec) + k lanes vec.
constexpr int lanes_for(int64_t D, int vec) {
  const int64_t vecs = (D + vec - 1) / vec;
  int lanes = 1;
  while (lanes < 32 && lanes < vecs) lanes *= 2;
  return lanes;
}

// Shared-memory slots through which a group's lanes hand each other resolved
// samples (CornerSlots, device/sampler.cuh): kSlotsPerWarp a warp, each a
// 16-byte corner index quadruple and four weights of the accumulation type.
constexpr int kSlotsPerWarp = 48;
constexpr int64_t corner_slot_bytes_per_thread(int acc_bytes) {
  return kSlotsPerWarp * (16 + 4 * int64_t(acc_bytes)) / 32;
}

// baseline_forward_kernel and blocked_forward_kernel: at most 64 registers,
// 4 blocks of kThreads an SM.
constexpr int kForwardBlocksPerSm = 4;
// `blocked` halves its block (down to kBlockedMinThreads) while blocks of
// the larger size would give fewer than kBlockedMinBlocksPerSm blocks an SM
// (the decoders: a few hundred queries a (batch, head)).
constexpr int kBlockedMinThreads = 64;
constexpr int kBlockedMinBlocksPerSm = 2;

// The caching forward backends: block sizes and default shared-memory use.
// persistent: 1024 threads, a cache of kPersistentCache bytes by default
// (the rest of the SM's memory is L1). cluster: 1024 threads (one block an
// SM), its part of the map in all the shared memory a block may have. tma:
// 512 threads, two stages of boxes in at most kTmaStages bytes by default,
// after kTmaAlignSlack bytes of alignment slack.
constexpr int kPersistentThreads = 1024;
constexpr int64_t kPersistentCache = 96 * 1024;
constexpr int kClusterThreads = 1024;
constexpr int kTmaThreads = 512;
constexpr int64_t kTmaStages = 64 * 1024;
constexpr int64_t kTmaAlignSlack = 128;
// A bound on the static shared memory of the caching kernels (the level
// table and its companions; each kernel's file asserts it), which their
// dynamic shared memory leaves room for.
constexpr int64_t kCachingStaticSmem = 2048;

// `blocked`'s rows with per-lane set-up (blocked_lane_rows_kernel):
// kLaneRowPoints points a lane at a time (their 4 x kLaneRowPoints corner
// loads in flight together), at most 80 registers (3 blocks of 256 an SM).
constexpr int kLaneRowPoints = 2;
constexpr int kLaneRowBlocksPerSm = 3;
// Problems whose row groups (`rows` (query, head) rows of `lanes` threads)
// give at most kLaneRowsUpToThreadsPerSm threads an SM (the decoders: too
// few warps to hide the slot round trip's latency) take per-lane set-up,
// each row split over up to `split` groups (the row's points shared out,
// the sums added by shuffles) while that gives at most
// kLaneRowSplitThreadsPerSm threads an SM. Returns the split, or 0 for the
// shared set-up (slots). `force`: per-lane set-up whatever the size (a test
// hook). docs/performance.md has the measurements behind the two figures.
constexpr int64_t kLaneRowsUpToThreadsPerSm = 512;
constexpr int64_t kLaneRowSplitThreadsPerSm = 640;
constexpr int lane_row_split(int64_t rows, int lanes, int points, int sms, bool force) {
  const int64_t threads = rows * lanes;
  if (!force && threads > kLaneRowsUpToThreadsPerSm * sms) return 0;
  int split = 1;
  while (lanes * split * 2 <= 32 && split * kLaneRowPoints < points &&
         threads * split * 2 <= kLaneRowSplitThreadsPerSm * sms) {
    split *= 2;
  }
  return split;
}

// ffma_dots_kernel (FFMA dots, atomic or key-writing): where the groups alone
// give fewer than kFillThreadsPerSm threads an SM (the decoders), a group's
// samples are split into tasks.
constexpr int64_t kFillThreadsPerSm = 2 * kMaxThreadsPerSm;

// mma_dots_kernel (tensor-core dots): 4 blocks an SM, the rest of the tasks
// in turn; the flat slot sequence pays only from kFlatTasksPerWarp tasks a
// resident warp.
constexpr int kDotsBlocksPerSm = 4;
constexpr int kFlatTasksPerWarp = 8;
// Sample slots a level takes in a dots task: P rounded up to 4.
constexpr int padded_points(int P) { return (P + 3) / 4 * 4; }

// The global sort's gather: grad_value_tiles_kernel (bf16, 80 registers) 3
// blocks an SM; grad_value_pixels_kernel a full SM of warps (at least 4
// blocks resident).
constexpr int kTilesBlocksPerSm = 3;
constexpr int kPixelsMinBlocksPerSm = 4;
constexpr int kPixelsBlocksPerSm = kMaxThreadsPerSm / kThreads;
// Cell starts: 8 keys a thread from this many keys an SM of work up.
constexpr int64_t kCellStartsWideFromPerSm = 8 * int64_t(kMaxThreadsPerSm);
// The sort takes 32-bit offsets from this many samples up.
constexpr int64_t kSortOffsets32From = int64_t(1) << 22;

// The block-local grad_value (backward/local_grad_value.cu): 512 threads, 2 blocks an
// SM (64 registers), at most kLocalCap samples an (n, m, level); problems of
// at most kLocalCapSmall take the kernel with the smaller shared memory,
// which takes at most kLocalSmemSmall bytes (kLocalSmem for the larger; the
// kernel's file asserts both).
constexpr int kLocalThreads = 512;
constexpr int kLocalBlocksPerSm = 2;
constexpr int kLocalCapSmall = 4096;
constexpr int kLocalCap = 8192;
constexpr int64_t kLocalSmemSmall = 32 * 1024;
constexpr int64_t kLocalSmem = 48 * 1024;
// The staged block-local walk (BackwardPlan::stage): at most this many bytes
// of grad_output rows and weights beside kLocalSmemSmall, so that two blocks
// still fit an SM.
constexpr int64_t kLocalStageMax = 64 * 1024;
// Its bytes: a float4 of corner weights a sample of the (n, m, level) (at
// most every one touches the tile) and the Lq grad_output rows of D elements
// of `elem` bytes.
constexpr int64_t local_stage_bytes(int64_t Lq, int64_t P, int64_t D, int64_t elem) {
  return Lq * P * 16 + Lq * D * elem;
}
// local_footprints (the fused FFMA path's records): grid capped at this
// many blocks an SM.
constexpr int kFootprintBlocksPerSm = 16;

}  // namespace msda::cuda
