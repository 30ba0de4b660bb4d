// The block-local grad_value for 16-bit values by integer sums: a block owns
// a tile of one (n, m, level) and 32 of its channels, holds one int32
// accumulator a pixel and channel in shared memory, and adds every corner of
// the tile's samples to it with shared-memory integer atomics (the natively
// atomic kind on sm_90) in fixed point. Integer addition is exact, so the
// sums do not depend on the order of the additions: no sort, no walk, and
// the same bits on every run.
//
// Fixed point: a tile's scale is a power of two from three exact figures:
// the number of its entries (samples whose footprint touches it) c <= 2^ec,
// the largest finite |corner weight x attention| among them < 2^ew, and the
// largest finite |grad_output| of the (n, m) < 2^eg (row_absmax). grad_output
// is scaled by 2^(15 - eg) and the weights by 2^(15 - ec - ew), so a product
// is below 2^(30 - ec) and a pixel's sum of at most c of them below 2^30.
// A product's rounding to an integer costs at most 2^-31 of the tile's
// bound, far below the 16-bit output's own rounding.
//
// Non-finite products (an infinite or NaN weight or grad_output element)
// are left out of the integer sums and flag the tile; a flagged tile turns
// its sums into floats in place and then adds those products with float
// atomics: a sum of non-finite terms and one finite value is the same in any
// order (NaN if a NaN or both infinities are among them, else the infinity).
// Every pixel of the map is in exactly one tile, so grad_value is written
// completely, once, in its dtype. Records: backward_local.cu's.
#include "common.cuh"
#include "launch.h"

namespace msda::cuda {
namespace {

constexpr int kFxThreads = 512, kFxBlocksPerSm = 2;
constexpr int kFxTileH = 16, kFxTileW = 44, kFxTilePx = kFxTileH * kFxTileW;
constexpr int kFxChannels = 32;  // a block item's channels: one pixel's accumulators a bank row
constexpr int kFxEntryLanes = 8; // lanes an entry (4 channels each); 4 entries a warp
constexpr int kFxCap = 8192;     // entries of a tile at most: Lq P
constexpr int kFxWarps = kFxThreads / 32;

struct FixedSmem {
  int acc[kFxTilePx * kFxChannels];  // the tile's sums, pixel-major; zero between items
  uint16_t list[kFxCap];             // the tile's entries (sample index within the (n, m, level))
  Level levels[kMaxLevels];
  FastDiv by_row[kMaxLevels];        // a level's cells a row: W + 1
  uint32_t first[kMaxLevels + 1];    // first item of the k-th level in item order (L - 1 - k)
  int tile_h[kMaxLevels], tile_w[kMaxLevels];
  uint32_t tiles_x[kMaxLevels], tiles[kMaxLevels];
  FastDiv by_tiles[kMaxLevels], by_tiles_x[kMaxLevels];
  FastDiv by_tw[kMaxLevels][2];      // a level's tile width, then its last tile's
  // The current item, decoded by thread 0.
  uint32_t item;
  int l, r0, c0, th, tw, ch0, last_col;
  int64_t n, m;
  // Its entries, their largest finite |weight| (float bits) and the flag.
  uint32_t count;
  int maxw, nonfinite;
};

// Largest finite |x| of the (n, m)'s grad_output, as a float, a block an
// (n, m): what the fixed point's scale is made from.
constexpr int kAbsThreads = 512, kAbsBatch = 4;  // loads in flight a thread
template <typename T>
__global__ void __launch_bounds__(kAbsThreads) row_absmax(const BackwardParams p, float* __restrict__ out) {
  const Problem& pb = p.pb;
  const uint32_t nm = blockIdx.x, n = nm / uint32_t(pb.M), m = nm - n * uint32_t(pb.M);
  const uint32_t vecs = uint32_t(pb.D / 8), total = uint32_t(pb.Lq) * vecs;  // 16 bytes a load (D % 8 == 0)
  const FastDiv by_vecs(vecs);
  const char* g = reinterpret_cast<const char*>(static_cast<const T*>(p.grad_out) +
                                                (int64_t(n) * pb.Lq * pb.M + m) * pb.D);
  const uint32_t row_bytes = uint32_t(pb.M * pb.D * sizeof(T));  // a batch's rows below 4 GiB
  // 16-bit magnitudes compare as their bits; the finite ones lie below the
  // infinity's exponent bits.
  constexpr uint32_t kInf = std::is_same_v<T, __half> ? 0x7c00u : 0x7f80u;
  uint32_t mx = 0;
  for (uint32_t v0 = threadIdx.x; v0 < total; v0 += kAbsBatch * kAbsThreads) {
    uint4 raw[kAbsBatch];
#pragma unroll
    for (int u = 0; u < kAbsBatch; ++u) {
      const uint32_t v = v0 + u * kAbsThreads, q = by_vecs(v);
      raw[u] = v < total ? __ldg(reinterpret_cast<const uint4*>(g + q * row_bytes) + (v - q * vecs))
                         : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kAbsBatch; ++u) {
      const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = w[i] & 0x7fffu, hi = (w[i] >> 16) & 0x7fffu;
        if (lo < kInf) mx = max(mx, lo);
        if (hi < kInf) mx = max(mx, hi);
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  __shared__ uint32_t part[kAbsThreads / 32];
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = mx;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < kAbsThreads / 32; ++i) mx = max(mx, part[i]);
    const uint16_t b = static_cast<uint16_t>(mx);
    out[nm] = std::is_same_v<T, __half> ? __half2float(__ushort_as_half(b)) : __uint_as_float(mx << 16);
  }
}

// Adds v to the int32 at a shared-memory address (no return value: RED).
__device__ __forceinline__ void red_shared_add(uint32_t addr, int v) {
  asm volatile("red.shared.add.s32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// p, opaque to the optimiser (which then keeps it instead of recomputing it).
template <typename P>
__device__ __forceinline__ P* pinned(P* p) {
  uint64_t v = reinterpret_cast<uint64_t>(p);
  asm volatile("mov.b64 %0, %0;" : "+l"(v));
  return reinterpret_cast<P*>(v);
}

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((e + 127) << 23); }
// The smallest e with |x| < 2^e for a finite float's bits (-126 for 0 and
// subnormals).
__device__ __forceinline__ int exponent_above(uint32_t bits) {
  return max(int((bits >> 23) & 0xffu), 1) - 126;
}

// Block items: (level, n m, tile, 32-channel chunk), the levels from the
// last (the smallest maps, whose tiles hold the most entries) to the first,
// taken from `counter` (zeroed before the launch) as blocks finish. A level's
// tiles are its map cut into ceil(H / kFxTileH) x ceil(W / kFxTileW) nearly
// equal parts. The launch keeps N M S below 2^31 and Lq P <= kFxCap.
template <typename T>
__global__ void __launch_bounds__(kFxThreads, kFxBlocksPerSm)
    value_grad_local_fixed(const BackwardParams p, T* __restrict__ grad_value,
                           const uint32_t* __restrict__ cell, const float4* __restrict__ wts,
                           const float* __restrict__ absmax, unsigned* __restrict__ counter) {
  const Problem& pb = p.pb;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  FixedSmem& sm = *reinterpret_cast<FixedSmem*>(smem_raw);
  const int tid = threadIdx.x;
  load_levels(sm.levels, p.spatial_shapes, p.level_start, pb.L, pb.S);
  for (int w = 4 * tid; w < kFxTilePx * kFxChannels; w += 4 * kFxThreads) {
    *reinterpret_cast<int4*>(&sm.acc[w]) = make_int4(0, 0, 0, 0);
  }
  __syncthreads();
  if (sm.levels[0].poison) {
    zero_grad_value(pb, grad_value);
    return;
  }
  const uint32_t chunks = static_cast<uint32_t>((pb.D + kFxChannels - 1) / kFxChannels);
  const FastDiv by_chunks(chunks);
  if (tid == 0) {
    uint32_t first = 0;
    for (int k = 0; k < pb.L; ++k) {
      const int l = pb.L - 1 - k;
      const Level& lv = sm.levels[l];
      const int ty = (lv.H + kFxTileH - 1) / kFxTileH, tx = (lv.W + kFxTileW - 1) / kFxTileW;
      sm.tile_h[l] = (lv.H + ty - 1) / ty;
      sm.tile_w[l] = (lv.W + tx - 1) / tx;
      sm.tiles_x[l] = uint32_t(tx);
      sm.tiles[l] = uint32_t(tx) * uint32_t(ty);
      sm.by_tiles_x[l] = FastDiv(uint32_t(tx));
      sm.by_tiles[l] = FastDiv(uint32_t(tx) * uint32_t(ty));
      sm.by_tw[l][0] = FastDiv(uint32_t(sm.tile_w[l]));
      sm.by_tw[l][1] = FastDiv(uint32_t(lv.W - (tx - 1) * sm.tile_w[l]));
      sm.by_row[l] = FastDiv(uint32_t(lv.W + 1));
      sm.first[k] = first;
      first += uint32_t(pb.N * pb.M) * uint32_t(tx * ty) * chunks;
    }
    sm.first[pb.L] = first;
  }

  const uint32_t LqP = static_cast<uint32_t>(pb.Lq * pb.P);
  const FastDiv by_p(static_cast<uint32_t>(pb.P));
  const int lane = tid % 32, wid = tid / 32;
  const int e = lane / kFxEntryLanes, li = lane % kFxEntryLanes;
  // Bank spread: in the atomic of step j the lanes of entry e add channel
  // 4 li + (j + e) % 4, so the warp's four entries hit four different banks
  // whatever their pixels. sel_lo / sel_hi rotate the four 16-bit grad_output
  // elements a lane loads to that order.
  // A byte rotation of the lane's 8 bytes by 2 e: nibble k of a selector
  // picks byte (k + 2 e) mod 8.
  const uint32_t sel_lo = (0x3210u + 0x2222u * uint32_t(e)) & 0x7777u;
  const uint32_t sel_hi = (0x7654u + 0x2222u * uint32_t(e)) & 0x7777u;
  // Step j's accumulator of a pixel: shared-memory byte offset of its word.
  const uint32_t acc_s = static_cast<uint32_t>(__cvta_generic_to_shared(sm.acc));
  uint32_t lane_word[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) lane_word[j] = acc_s + 4u * uint32_t(4 * li + ((j + e) & 3));
  const T* gout = static_cast<const T*>(p.grad_out);

  // Thread 0 takes the next item from the counter one item ahead, so that
  // the atomic's round trip overlaps the current item.
  uint32_t next = tid == 0 ? atomicAdd(counter, 1u) : 0u;
  for (;;) {
    __syncthreads();  // the previous item's writes are done with the tile's fields
    if (tid == 0) {
      const uint32_t item = next;
      sm.item = item;
      sm.count = 0;
      sm.maxw = 0;
      sm.nonfinite = 0;
      if (item < sm.first[pb.L]) {
        next = atomicAdd(counter, 1u);
        int k = 0;
        while (item >= sm.first[k + 1]) ++k;
        const int l = pb.L - 1 - k;
        const Level& lv = sm.levels[l];
        const uint32_t r = item - sm.first[k], nm_tile = by_chunks(r), chunk = r - nm_tile * chunks;
        const uint32_t nm = sm.by_tiles[l](nm_tile), tile = nm_tile - nm * sm.tiles[l];
        const uint32_t ty = sm.by_tiles_x[l](tile), tx = tile - ty * sm.tiles_x[l];
        sm.l = l;
        const uint32_t n = nm / uint32_t(pb.M);
        sm.n = n;
        sm.m = nm - n * uint32_t(pb.M);
        sm.ch0 = int(chunk) * kFxChannels;
        sm.r0 = int(ty) * sm.tile_h[l];
        sm.c0 = int(tx) * sm.tile_w[l];
        sm.th = min(sm.tile_h[l], lv.H - sm.r0);
        sm.tw = min(sm.tile_w[l], lv.W - sm.c0);
        sm.last_col = tx + 1 == sm.tiles_x[l];
      }
    }
    __syncthreads();
    if (sm.item >= sm.first[pb.L]) break;
    const int l = sm.l, r0 = sm.r0, c0 = sm.c0, th = sm.th, tw = sm.tw, ch0 = sm.ch0;
    const int64_t n = sm.n, m = sm.m;
    const Level lv = sm.levels[l];
    const int64_t base = ((n * pb.M + m) * pb.L + l) * LqP;

    // The tile's entries: samples whose footprint (cell rows h - 1, h, columns
    // w - 1, w of the map) touches it; their order does not matter.
    constexpr int kFilterBatch = 4;  // records a thread loads at once
    uint32_t mw = 0;
    for (uint32_t i0 = tid; i0 < LqP; i0 += kFilterBatch * kFxThreads) {
      uint32_t c[kFilterBatch];
#pragma unroll
      for (int u = 0; u < kFilterBatch; ++u) {
        const uint32_t i = i0 + u * kFxThreads;
        c[u] = i < LqP ? __ldg(cell + base + i) : kNoCell;
      }
#pragma unroll
      for (int u = 0; u < kFilterBatch; ++u) {
        if (c[u] == kNoCell) continue;
        const uint32_t h = sm.by_row[l](c[u]);
        const int a = int(h) - r0, b = int(c[u] - h * uint32_t(lv.W + 1)) - c0;
        if (a < 0 || a > th || b < 0 || b > tw) continue;
        const uint32_t i = i0 + u * kFxThreads;
        sm.list[atomicAdd(&sm.count, 1u)] = static_cast<uint16_t>(i);
        const float4 w = __ldg(wts + base + i);
        const float wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t bits = __float_as_uint(wv[k]) & 0x7fffffffu;
          if (bits < 0x7f800000u) mw = max(mw, bits);
        }
      }
    }
    if (mw != 0) atomicMax(&sm.maxw, int(mw));
    __syncthreads();

    const uint32_t count = sm.count;
    const int ec = count <= 1 ? 0 : 32 - __clz(count - 1);
    const int eg = exponent_above(__float_as_uint(absmax[n * pb.M + m]));
    const int ew = exponent_above(uint32_t(sm.maxw));
    const int sg = min(max(15 - eg, -126), 126), sw = min(max(15 - ec - ew, -126), 126);
    const float mul_g = pow2(sg), mul_w = pow2(sw);

    // Entries four a warp, eight lanes an entry, four channels a lane.
    const int cb = ch0 + 4 * li;  // this lane's first channel
    const bool lane_on = cb < pb.D;
    // The entries' record and grad_output bases, kept in registers (pinned,
    // so that the compiler does not recompute their 64-bit products in the
    // loop).
    const uint32_t* icell = pinned(cell + base);
    const float4* iwts = pinned(wts + base);
    const char* grow = pinned(reinterpret_cast<const char*>(gout + (n * pb.Lq * pb.M + m) * pb.D + cb));
    // A batch's grad_output below 4 GiB (fixed_value_grad_ok): 32-bit offsets.
    const uint32_t row_bytes = static_cast<uint32_t>(pb.M * pb.D * sizeof(T));
    const FastDiv by_row = sm.by_row[l];
    const uint32_t row_cells = uint32_t(lv.W + 1);
    // Decodes entry `idx` for this lane and calls f(words, weights, g): its
    // corners' first accumulators (byte offsets, pixel-major, -1 off the tile), in
    // corner order 0 (h0, w0), 1 (h0, w0 + 1), 2 (h0 + 1, w0), 3 (h0 + 1,
    // w0 + 1), their weights (the record holds them as 0, 2, 1, 3), and the
    // lane's grad_output elements in step order.
    struct Loaded {
      uint32_t c;
      float4 w;
      uint2 raw;
    };
    auto load = [&](const uint32_t idx) {
      const uint32_t i = sm.list[idx];
      return Loaded{__ldg(icell + i), __ldg(iwts + i),
                    __ldg(reinterpret_cast<const uint2*>(grow + by_p(i) * row_bytes))};
    };
    auto visit = [&](const Loaded& d, auto&& f) {
      const uint32_t h = by_row(d.c);
      const int y0 = int(h) - 1 - r0, x0 = int(d.c - h * row_cells) - 1 - c0;
      const bool top = y0 >= 0, bottom = y0 + 1 < th, left = x0 >= 0, right = x0 + 1 < tw;
      const int px = (y0 * tw + x0) * kFxChannels * 4;
      const int words[4] = {top && left ? px : -1, top && right ? px + kFxChannels * 4 : -1,
                            bottom && left ? px + tw * kFxChannels * 4 : -1,
                            bottom && right ? px + (tw + 1) * kFxChannels * 4 : -1};
      const float wk[4] = {d.w.x, d.w.z, d.w.y, d.w.w};
      float g[4];
      unpack<T, 4>(make_uint2(__byte_perm(d.raw.x, d.raw.y, sel_lo), __byte_perm(d.raw.x, d.raw.y, sel_hi)), g);
      f(words, wk, g);
    };
    // Calls f for each of this lane's entries, two at a time (both loaded
    // first).
    auto each_entry = [&](auto&& f) {
      for (uint32_t idx0 = uint32_t(wid) * 4; idx0 < count; idx0 += 8 * kFxWarps) {
        const uint32_t ia = idx0 + uint32_t(e), ib = ia + 4 * kFxWarps;
        const bool va = lane_on && ia < count, vb = lane_on && ib < count;
        Loaded da{}, db{};
        if (va) da = load(ia);
        if (vb) db = load(ib);
        if (va) visit(da, f);
        if (vb) visit(db, f);
      }
    };
    each_entry([&](const int (&words)[4], const float (&wk)[4], const float (&g)[4]) {
        float gs[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) gs[j] = g[j] * mul_g;
        // All finite: every scaled product is within the bound. Otherwise
        // each product is checked.
        const float probe = (g[0] + g[1] + g[2] + g[3] + wk[0] + wk[1] + wk[2] + wk[3]) * 0.0f;
        if (probe == 0.0f) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float ws = wk[k] * mul_w;
            if (words[k] >= 0) {
#pragma unroll
              for (int j = 0; j < 4; ++j) red_shared_add(uint32_t(words[k]) + lane_word[j], __float2int_rn(gs[j] * ws));
            }
          }
        } else {
          bool left_out = false;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (words[k] < 0) continue;
            const float ws = wk[k] * mul_w;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float v = gs[j] * ws;
              if (isfinite(v)) red_shared_add(uint32_t(words[k]) + lane_word[j], __float2int_rn(v));
              else left_out = true;
            }
          }
          if (left_out) sm.nonfinite = 1;
        }
      });
    __syncthreads();

    // Back to real units: 2^-(sg + sw) in two halves (each a float; the
    // first step neither overflows nor loses more than the result would).
    const int back = -(sg + sw);
    const float back1 = pow2(back / 2), back2 = pow2(back - back / 2);
    const bool flagged = sm.nonfinite != 0;
    if (flagged) {
      // Floats in place, then the non-finite products added to them.
      for (int w = tid; w < th * tw * kFxChannels; w += kFxThreads) {
        sm.acc[w] = __float_as_int(float(sm.acc[w]) * back1 * back2);
      }
      __syncthreads();
      each_entry([&](const int (&words)[4], const float (&wk)[4], const float (&g)[4]) {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            if (words[k] < 0) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // the products the integer sums left out
              if (!isfinite((g[j] * mul_g) * (wk[k] * mul_w))) {
                atomicAdd(reinterpret_cast<float*>(reinterpret_cast<char*>(sm.acc) + (uint32_t(words[k]) + lane_word[j] - acc_s)),
                          g[j] * wk[k]);
              }
            }
          }
        });
      __syncthreads();
    }
    // Write: a thread takes 8 channels (16 bytes of output) of every 128th
    // pixel; the accumulators go back to 0. Byte offsets from the tile's first
    // pixel in 32 bits (a batch's grad_value below 4 GiB: fixed_value_grad_ok).
    char* obase = reinterpret_cast<char*>(
        grad_value + value_row(n, lv.start + int64_t(r0) * lv.W + c0, m, pb.S, pb.M) * pb.D + ch0);
    const uint32_t px_bytes = uint32_t(pb.M * pb.D * sizeof(T)), row_out = uint32_t(lv.W) * px_bytes;
    const FastDiv by_tw = sm.by_tw[l][sm.last_col];
    const uint32_t q8 = uint32_t(tid) % 4u, pixels = uint32_t(th * tw);
    auto write = [&](auto&& real) {  // real(accumulator word) -> the pixel's value
      if (ch0 + 8 * int(q8) >= pb.D) return;
      for (uint32_t px = uint32_t(tid) / 4u; px < pixels; px += kFxThreads / 4) {
        const uint32_t y = by_tw(px), x = px - y * uint32_t(tw);
        int4* src = reinterpret_cast<int4*>(&sm.acc[px * kFxChannels + 8 * q8]);
        const int4 v0 = src[0], v1 = src[1];
        src[0] = make_int4(0, 0, 0, 0);
        src[1] = make_int4(0, 0, 0, 0);
        const int vi[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        float f[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] = real(vi[k]);
        store_vec<T, 8>(reinterpret_cast<T*>(obase + (y * row_out + x * px_bytes + 16u * q8)), f);
      }
    };
    if (flagged) {
      write([](int v) { return __int_as_float(v); });
    } else if (back >= -126 && back <= 127) {  // 2^back is a float
      const float s1 = pow2(back);
      write([s1](int v) { return float(v) * s1; });
    } else {
      write([back1, back2](int v) { return float(v) * back1 * back2; });
    }
  }
}

}  // namespace

bool fixed_value_grad_ok(const BackwardParams& p) {
  DeviceLimits d;
  return (p.pb.value_dtype == DType::f16 || p.pb.value_dtype == DType::bf16) &&
         p.pb.Lq * p.pb.P <= kFxCap && p.pb.Lq * p.pb.M * p.pb.D * 2 <= int64_t(UINT32_MAX) &&
         p.pb.S * p.pb.M * p.pb.D * 2 <= int64_t(UINT32_MAX) &&
         device_limits(d) == cudaSuccess &&
         d.smem_optin >= int(sizeof(FixedSmem));
}

int64_t fixed_value_grad_scratch_bytes(const Problem& pb) { return 4 * pb.N * pb.M; }

template <typename T>
cudaError_t fixed_value_grad(const BackwardParams& p, T* grad_value, const uint32_t* cell,
                             const float4* wts, float* absmax, unsigned* counter, cudaStream_t stream) {
  DeviceLimits d;
  if (const cudaError_t err = device_limits(d); err != cudaSuccess) return err;
  row_absmax<T><<<static_cast<unsigned>(p.pb.N * p.pb.M), kAbsThreads, 0, stream>>>(p, absmax);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  constexpr size_t bytes = sizeof(FixedSmem);
  auto kernel = value_grad_local_fixed<T>;
  if (const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      err != cudaSuccess) {
    return err;
  }
  kernel<<<static_cast<unsigned>(d.sms) * kFxBlocksPerSm, kFxThreads, bytes, stream>>>(
      p, grad_value, cell, wts, absmax, counter);
  return cudaGetLastError();
}

template cudaError_t fixed_value_grad<__half>(const BackwardParams&, __half*, const uint32_t*,
                                              const float4*, float*, unsigned*, cudaStream_t);
template cudaError_t fixed_value_grad<__nv_bfloat16>(const BackwardParams&, __nv_bfloat16*,
                                                     const uint32_t*, const float4*, float*,
                                                     unsigned*, cudaStream_t);

}  // namespace msda::cuda
