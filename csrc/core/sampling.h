// Bilinear sampling shared by every kernel of the project: the CPU kernel, all
// CUDA forward backends and the backward. One definition of the arithmetic, so
// that every backend computes the same function.
//
// Convention (F.grid_sample, mode="bilinear", padding_mode="zeros",
// align_corners=False): a normalised location (x, y) in [0, 1]^2 maps to the
// pixel coordinate (x * W - 0.5, y * H - 0.5); corners outside the map
// contribute zero. Locations outside [0, 1] are legal: a location whose 2x2
// footprint misses the map samples nothing. A sample whose location (x or y)
// or attention weight is NaN or infinite is "poisoned" (see make_bilinear):
// its output row, location gradient and weight gradient become NaN, as in the
// grid_sample reference, so that a diverging model fails loudly instead of
// training on; it adds nothing to grad_value.
#pragma once

#include <cstdint>
#include <cmath>

#if defined(__CUDACC__)
#define MSDA_HD __host__ __device__ __forceinline__
#else
#define MSDA_HD inline
#endif

namespace msda {

// Largest number of feature levels a call may have (checked at the API).
constexpr int kMaxLevels = 16;

// Accumulation type: fp64 for fp64 inputs, fp32 for everything else.
template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };
template <typename T> using acc_t = typename AccType<T>::type;

// One sampling point on one level, resolved to its 2x2 footprint.
// Corner k (0: top-left, 1: top-right, 2: bottom-left, 3: bottom-right) sits
// at row h0 + (k >> 1), column w0 + (k & 1) and has bilinear weight weight(k).
template <typename A>
struct Bilinear {
  int h0, w0;  // top-left corner, may be -1
  A lh, lw;    // fractional offsets inside the cell; NaN for a poisoned sample
  bool inside; // false: the footprint misses the map

  MSDA_HD A hh() const { return A(1) - lh; }
  MSDA_HD A hw() const { return A(1) - lw; }
  MSDA_HD A weight(int k) const {
    const A wy = (k >> 1) ? lh : hh();
    const A wx = (k & 1) ? lw : hw();
    return wy * wx;
  }
  // A poisoned sample (non-finite location or weight): cell (0, 0) with NaN
  // fractions, so that every weight and weight derivative is NaN. Its corners
  // are real pixels (loads stay in bounds) but must not receive grad_value.
  MSDA_HD bool poisoned() const { return lh != lh; }
  // Whether corner k lies inside an H x W map.
  MSDA_HD bool corner_ok(int k, int H, int W) const {
    const int h = h0 + (k >> 1), w = w0 + (k & 1);
    return h >= 0 && w >= 0 && h < H && w < W;
  }
  // Row-major offset of corner k inside its level (valid only if corner_ok).
  MSDA_HD int64_t corner_offset(int k, int W) const {
    return int64_t(h0 + (k >> 1)) * W + (w0 + (k & 1));
  }
  // d weight(k) / d lw and d weight(k) / d lh, for the backward.
  MSDA_HD A dweight_dlw(int k) const {
    const A wy = (k >> 1) ? lh : hh();
    return (k & 1) ? wy : -wy;
  }
  MSDA_HD A dweight_dlh(int k) const {
    const A wx = (k & 1) ? lw : hw();
    return (k >> 1) ? wx : -wx;
  }
};

MSDA_HD float floor_acc(float x) { return floorf(x); }
MSDA_HD double floor_acc(double x) { return ::floor(x); }

// The pixel coordinate loc * size - 0.5, rounded after the product and after
// the difference on every device: nvcc would otherwise contract it into one
// FMA, whose single rounding picks the other cell where the host's (and
// PyTorch's, the `pytorch` backend's and the portable ONNX graph's) picks
// this one, at pixel-centre ties, and so another location gradient.
MSDA_HD float pixel_coord(float loc, int size) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(loc, float(size)), -0.5f);
#else
  return loc * float(size) - 0.5f;
#endif
}
MSDA_HD double pixel_coord(double loc, int size) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(__dmul_rn(loc, double(size)), -0.5);
#else
  return loc * double(size) - 0.5;
#endif
}

// Whether v is neither NaN nor infinite (v - v is NaN for both).
template <typename A>
MSDA_HD bool finite(A v) { return v - v == A(0); }

// Resolve a normalised location with attention weight `weight` on an H x W
// level (H, W >= 1). All coordinate math is in A (fp32, or fp64 for fp64
// inputs). A non-finite x, y or weight gives the poisoned footprint (see
// Bilinear::poisoned).
template <typename A>
MSDA_HD Bilinear<A> make_bilinear(A loc_x, A loc_y, A weight, int H, int W) {
  Bilinear<A> b;
  if (!(finite(loc_x) && finite(loc_y) && finite(weight))) {
    b.inside = true;
    b.h0 = b.w0 = 0;
    b.lh = b.lw = A(NAN);
    return b;
  }
  const A h = pixel_coord(loc_y, H);
  const A w = pixel_coord(loc_x, W);
  // At exactly h = -1 (or w = -1) the footprint touches the map with zero weight:
  // kept "inside" so that the location gradient is grid_sample's (the
  // derivative in the cell to the lower right).
  b.inside = (h >= A(-1)) && (w >= A(-1)) && (h < A(H)) && (w < A(W));
  if (b.inside) {
    const A hf = floor_acc(h), wf = floor_acc(w);
    b.h0 = static_cast<int>(hf);
    b.w0 = static_cast<int>(wf);
    b.lh = h - hf;
    b.lw = w - wf;
  } else {
    b.h0 = b.w0 = 0;
    b.lh = b.lw = A(0);
  }
  return b;
}

// Flat-index helpers for the tensors of the operator (all contiguous):
//   value   (N, S, M, D), or (N, M, S, D) when pb.value_head_major
//   loc     (N, Lq, M, L, P, 2)
//   attn    (N, Lq, M, L, P)
//   output  (N, Lq, M * D)
// A "group" is one (n, q, m) triple, flattened as (n * Lq + q) * M + m; it
// indexes loc / attn rows (times L * P) and output rows (times D) directly.
// value_row: the row of D elements that holds pixel s of head m of batch n
// (times D gives the element offset); grad_value and its accumulator share
// value's layout.
MSDA_HD int64_t value_row(const Problem& pb, int64_t n, int64_t s, int64_t m) {
  return pb.value_head_major ? (n * pb.M + m) * pb.S + s : (n * pb.S + s) * pb.M + m;
}

// Rows of D elements from one pixel of a (n, m) map to the next.
MSDA_HD int64_t value_pixel_rows(const Problem& pb) { return pb.value_head_major ? 1 : pb.M; }

}  // namespace msda
