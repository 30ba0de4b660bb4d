// Tensor-map descriptors (CUtensorMap) of the `tma` backend: one per level of
// the value tensor, with the box each staging copy moves. Host code, built
// without linking libcuda (the encoder comes from cudaGetDriverEntryPoint).
#pragma once

#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime.h>

#include "../../core/params.h"
#include "../../core/sampling.h"

namespace msda::cuda {

// Level l of value as a 5-d tensor (innermost first) D x M x W x H x N, its
// box D x 1 x box_w x box_h x 1 (one head's channels of box_h rows of box_w
// pixels: [box_h][box_w][D] in shared memory) at byte offset off[l] of a
// stage (128-byte aligned). box_w == 0: level not staged.
struct TmaLevels {
  CUtensorMap map[kMaxLevels];
  int box_w[kMaxLevels];
  int box_h[kMaxLevels];
  int64_t off[kMaxLevels];
  int64_t stage_bytes;      // one stage: every level's box
  int H[kMaxLevels];        // the host's shapes the maps were made from
  int W[kMaxLevels];
  int64_t start[kMaxLevels];  // and the level starts they imply (exclusive sums)
};

// Fills `out` for p.value and p.host_shapes (p.pb.host_shapes must be set).
// The boxes are sized for a tile of tile_w x tile_h query pixels: the tile
// plus a margin of the samples' usual reach, at most the level, shrunk
// together until one stage (all levels) fits in stage_budget bytes.
// Descriptors are cached per (device, data pointer, dtype, sizes, shapes,
// tile, budget): a descriptor depends on nothing else, so a hit is always
// right. Thread-safe.
cudaError_t make_tma_levels(const ForwardParams& p, int tile_w, int tile_h, int64_t stage_budget,
                            TmaLevels& out);

}  // namespace msda::cuda
