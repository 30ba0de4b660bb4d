// Host side of the `tma` backend: box sizes and tensor-map descriptors.
#include "tma_maps.h"

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

namespace msda::cuda {
namespace {

// cuTensorMapEncodeTiled from the driver the runtime already loaded: no -lcuda.
PFN_cuTensorMapEncodeTiled_v12000 encoder(cudaError_t& err) {
  static cudaError_t status = cudaSuccess;
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                              cudaEnableDefault, &found);
    if (status == cudaSuccess && (found != cudaDriverEntryPointSuccess || ptr == nullptr)) {
      status = cudaErrorSymbolNotFound;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  err = status;
  return fn;
}

CUtensorMapDataType map_dtype(DType t) {
  switch (t) {
    case DType::f16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case DType::bf16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case DType::f64: return CU_TENSOR_MAP_DATA_TYPE_FLOAT64;
    default: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  }
}

// Pixels a tile's samples reach beyond the tile on each side: the
// Deformable DETR initialisation puts point p at p + 1 pixels along its
// head's direction (up to 4 for P = 4, centred by the box placement to about
// +-2), plus jitter and the bilinear footprint's second pixel.
constexpr int64_t kMargin = 4;

int64_t round128(int64_t x) { return (x + 127) / 128 * 128; }

// Box sides of every level for a tile_w x tile_h tile, scaled by `f` (<= 1).
int64_t size_boxes(const int64_t* shapes, int L, int64_t px_bytes, int tile_w, int tile_h,
                   double f, TmaLevels& t) {
  int64_t total = 0;
  for (int l = 0; l < L; ++l) {
    const int64_t H = shapes[2 * l], W = shapes[2 * l + 1];
    const int64_t w = std::min({W, int64_t(256), int64_t((tile_w + 2 * kMargin) * f)});
    const int64_t h = std::min({H, int64_t(256), int64_t((tile_h + 2 * kMargin) * f)});
    t.box_w[l] = w >= 1 && h >= 1 ? static_cast<int>(w) : 0;
    t.box_h[l] = t.box_w[l] > 0 ? static_cast<int>(h) : 0;
    t.off[l] = total;
    total += round128(int64_t(t.box_w[l]) * t.box_h[l] * px_bytes);
  }
  return total;
}

}  // namespace

cudaError_t make_tma_levels(const ForwardParams& p, int tile_w, int tile_h, int64_t stage_budget,
                            TmaLevels& out) {
  const Problem& pb = p.pb;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  std::vector<int64_t> key = {device, int64_t(reinterpret_cast<uintptr_t>(p.value)),
                              int64_t(pb.value_dtype), int64_t(pb.value_head_major),
                              pb.N, pb.S, pb.M, pb.D, pb.L,
                              tile_w, tile_h, stage_budget};
  key.insert(key.end(), p.host_shapes, p.host_shapes + 2 * pb.L);
  static std::mutex mu;
  static std::map<std::vector<int64_t>, TmaLevels> cache;
  const std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) {
    out = it->second;
    return cudaSuccess;
  }
  auto encode = encoder(err);
  if (err != cudaSuccess) return err;

  const int64_t e = dtype_bytes(pb.value_dtype);
  const int64_t px_bytes = pb.D * e;
  TmaLevels t = {};
  // Full boxes if they fit, else all of them shrunk by the same factor.
  double f = 1.0;
  t.stage_bytes = size_boxes(p.host_shapes, pb.L, px_bytes, tile_w, tile_h, f, t);
  while (t.stage_bytes > stage_budget && f > 0.0) {
    f = f > 0.05 ? f * 0.9 : 0.0;
    t.stage_bytes = size_boxes(p.host_shapes, pb.L, px_bytes, tile_w, tile_h, f, t);
  }
  int64_t start = 0;
  for (int l = 0; l < pb.L; ++l) {
    const int64_t H = p.host_shapes[2 * l], W = p.host_shapes[2 * l + 1];
    t.H[l] = static_cast<int>(H);
    t.W[l] = static_cast<int>(W);
    t.start[l] = start;
    if (t.box_w[l] > 0) {
      // Dimensions (D, M, W, H, N) over either value layout (value_row()).
      const int64_t pixel = value_pixel_rows(pb) * px_bytes;
      const int64_t head = pb.value_head_major ? pb.S * px_bytes : px_bytes;
      const cuuint64_t dims[5] = {cuuint64_t(pb.D), cuuint64_t(pb.M), cuuint64_t(W), cuuint64_t(H),
                                  cuuint64_t(pb.N)};
      const cuuint64_t strides[4] = {cuuint64_t(head), cuuint64_t(pixel), cuuint64_t(W * pixel),
                                     cuuint64_t(pb.S * pb.M * px_bytes)};
      const cuuint32_t box[5] = {cuuint32_t(pb.D), 1, cuuint32_t(t.box_w[l]),
                                 cuuint32_t(t.box_h[l]), 1};
      const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
      void* base = static_cast<char*>(const_cast<void*>(p.value)) + start * pixel;
      const CUresult r = encode(&t.map[l], map_dtype(pb.value_dtype), 5, base, dims, strides, box,
                                unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
      if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
    }
    start += H * W;
  }
  if (cache.size() >= 64) cache.clear();  // bounded: a training run reuses a few buffers
  cache.emplace(std::move(key), t);
  out = t;
  return cudaSuccess;
}

}  // namespace msda::cuda
