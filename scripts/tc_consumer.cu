// Issue 24, the consumer alone: how fast can warps sample value boxes that
// already sit in shared memory, on tensor cores (ldmatrix + mma) against
// FFMA? Standalone; no staging, no global-memory fallback. It gives the
// ceiling a second tensor-core `tma` forward could reach
// (benchmarks/NOTES.md, fifteenth and sixteenth sessions).
//
// Synthetic problem of ddetr_enc's size: `items` (query, head) pairs, each
// with L = 4 levels x P = 4 points, bf16 value, D = 32, fp32 locations and
// weights. Every block holds the same four boxes (one a level, W x H pixels
// of 64 bytes, written with the copy engine's 64-byte swizzle: 16-byte
// chunk index XOR address bits 7-8), and every sample lies inside its
// level's box, given in box pixels.
//
// tc: a warp takes two items (32 samples) at a time. Lane i resolves sample
//   i into a table entry (box address of its top-left corner, fx, fy,
//   weight). Then per item, 8 steps of two samples. One ldmatrix.x4.trans
//   reads 4 matrices of 8 rows x 16 bytes, each one sample's 4 corners x 2
//   chunks (row 2 c + h: corner c, chunk 2 j + h of matrix j's pair). With
//   W = 4 (mod 8) and this swizzle, those 8 rows hit 8 different bank groups
//   (scripts/box_conflicts.py). One mma.m16n8k16 then adds both samples x 32
//   channels, with B's 8 columns = (sample slot, chunk bit, weight hi / lo).
//   The checks in box_conflicts.py verify that fragment algebra.
// tc2, tc3 and its variants: the same steps with the weights packed once a
//   sample at resolve (see each kernel).
// ffma: a group of 4 lanes an item, lane j channels 8 j .. 8 j + 7. Each
//   sample's entry comes from the same table (8 items a warp), then four
//   16-byte corner loads and 32 FFMAs a lane: the baseline's gather, from
//   shared memory.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o /tmp/tc_consumer scripts/tc_consumer.cu
//   /tmp/tc_consumer [W (default 20)] [H (default 20)]
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "../csrc/cuda/tensor_core.cuh"
#include "cuda_check.cuh"

using msda::cuda::ldmatrix_x4;
using msda::cuda::mma_16816;
using msda::cuda::split_bf16;

// ldmatrix.x4.trans from a shared-space byte address (no generic-to-shared
// conversion a step).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

constexpr int kL = 4, kP = 4, kD = 32, kWarps = 8, kThreads = 32 * kWarps;
constexpr int kSamples = kL * kP;  // an item's

struct Params {
  const float2* loc;           // (items, L, P) box pixel coordinates
  const float* attn;           // (items, L, P)
  const __nv_bfloat16* boxes;  // (L, H, W, D)
  __nv_bfloat16* out;          // (items, D)
  int items, W, H;
};

// Byte offset of 16-byte chunk c of box pixel `pix` (64-byte swizzle; the
// boxes start at multiples of 512 bytes).
__host__ __device__ inline uint32_t swz(uint32_t off) { return off ^ (((off >> 7) & 3u) << 4); }

__device__ void fill_boxes(const Params& p, unsigned char* smem, uint32_t box_bytes) {
  const int chunks = p.W * p.H * 4;
  for (int i = threadIdx.x; i < kL * chunks; i += blockDim.x) {
    const int l = i / chunks, pix = (i % chunks) / 4, c = i % 4;
    *reinterpret_cast<uint4*>(smem + l * box_bytes + swz(pix * 64 + c * 16)) =
        *reinterpret_cast<const uint4*>(p.boxes + (size_t(l) * p.W * p.H + pix) * kD + c * 8);
  }
}

// Fills the block's boxes and returns this warp's table of `per_warp`
// entries, which follows them.
template <typename E>
__device__ E* block_setup(const Params& p, unsigned char* smem, int per_warp) {
  const uint32_t box_bytes = p.W * p.H * 64;
  fill_boxes(p, smem, box_bytes);
  __syncthreads();
  return reinterpret_cast<E*>(smem + kL * box_bytes) + (threadIdx.x / 32) * per_warp;
}

// Sample `s`'s location and attention weight, as read from global memory
// (zeros past the end).
__device__ __forceinline__ float3 load_sample(const Params& p, int64_t s) {
  if (s >= int64_t(p.items) * kSamples) return make_float3(0.f, 0.f, 0.f);
  const float2 xy = p.loc[s];
  return make_float3(xy.x, xy.y, p.attn[s]);
}

// Table entry of sample `s` (item, l, p order) from its loaded values: its
// top-left corner's box byte offset (as float bits), fx, fy, weight.
__device__ __forceinline__ float4 resolve_loaded(const Params& p, float3 v, int64_t s, uint32_t box_bytes) {
  const float x0 = floorf(v.x), y0 = floorf(v.y);
  const int l = int(s % kSamples) / kP;
  const uint32_t off = l * box_bytes + (int(y0) * p.W + int(x0)) * 64u;
  return make_float4(__uint_as_float(off), v.x - x0, v.y - y0, v.z);
}

__device__ float4 resolve(const Params& p, int64_t s, uint32_t box_bytes) {
  return resolve_loaded(p, load_sample(p, s), s, box_bytes);
}

// A table entry's four corner weights (attention x bilinear), corners in
// the order (x0, y0), (x0 + 1, y0), (x0, y0 + 1), (x0 + 1, y0 + 1).
__device__ __forceinline__ void corner_weights(const float4& e, float (&cw)[4]) {
  const float fx = e.y, fy = e.z;
  cw[0] = e.w * (1.f - fx) * (1.f - fy);
  cw[1] = e.w * fx * (1.f - fy);
  cw[2] = e.w * (1.f - fx) * fy;
  cw[3] = e.w * fx * fy;
}

// This lane's ldmatrix row within a sample: row L % 8 of matrix L / 8, i.e.
// corner (L % 8) / 2 at chunk 2 ((L / 8) % 2) + L % 2, as a byte offset
// from the sample's top-left corner (before the swizzle).
__device__ __forceinline__ uint32_t ldmatrix_row_offset(int lane, int W) {
  const int r = lane % 8, corner = r / 2, chunk = 2 * ((lane / 8) % 2) + r % 2;
  return ((corner & 1) + (corner >> 1) * W) * 64u + chunk * 16u;
}

// An item's 32 outputs from its m16n8 accumulators. Lane (g, q) holds rows
// g (chunk q % 2) and g + 8 (chunk 2 + q % 2) of sample slot q / 2, hi + lo
// in columns 2 q and 2 q + 1; the two slots are summed across q ^ 2.
__device__ __forceinline__ void store_item(const Params& p, const float (&acc)[4], int item, int lane) {
  const int g = lane / 4, q = lane % 4;
  float v0 = acc[0] + acc[1], v1 = acc[2] + acc[3];
  v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
  v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
  if (q < 2 && item < p.items) {
    p.out[size_t(item) * kD + 8 * q + g] = __float2bfloat16_rn(v0);
    p.out[size_t(item) * kD + 16 + 8 * q + g] = __float2bfloat16_rn(v1);
  }
}

// The pair's two items one after the other: each its 8 steps of two
// samples, step(acc, item of the pair, step), into one accumulator, then
// stored.
template <typename Step>
__device__ __forceinline__ void pair_items(const Params& p, int pair, int lane, Step&& step) {
#pragma unroll
  for (int it = 0; it < 2; ++it) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int s = 0; s < kSamples / 2; ++s) step(acc, it, s);
    store_item(p, acc, 2 * pair + it, lane);
  }
}

__global__ void __launch_bounds__(kThreads, 2) tc_kernel(Params p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t box_bytes = p.W * p.H * 64;
  float4* table = block_setup<float4>(p, smem, 32);
  const int lane = threadIdx.x % 32;
  // Lane constants. ldmatrix: lane L gives row L % 8 of matrix L / 8 =
  // (sample slot L / 16, chunk pair (L / 8) % 2); row r = corner r / 2,
  // chunk bit r % 2. B: column g = lane / 4 = (slot g / 4, chunk bit
  // (g / 2) % 2, hi or lo g % 2), rows 2 q, 2 q + 1 (q = lane % 4) = corner q
  // of the slot's sample, chunk bits 0 and 1.
  const int g = lane / 4, q = lane % 4, slot = lane / 16;
  const uint32_t corner_off = ldmatrix_row_offset(lane, p.W);
  // Corner q's bilinear factors as fmaf(s, f, o): f or 1 - f.
  const float sx = (q & 1) ? 1.f : -1.f, ox = (q & 1) ? 0.f : 1.f;
  const float sy = (q & 2) ? 1.f : -1.f, oy = (q & 2) ? 0.f : 1.f;
  // Columns g % 2 == 1 take the weight's low part: w - bf16(w).
  const float lo_scale = (g & 1) ? -1.f : 0.f;
  const bool high_half = (g >> 1) & 1;
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int pairs = (p.items + 1) / 2;
  for (int pair = blockIdx.x * kWarps + int(threadIdx.x / 32); pair < pairs; pair += gridDim.x * kWarps) {
    table[lane] = resolve(p, int64_t(pair) * 32 + lane, box_bytes);
    __syncwarp();
    pair_items(p, pair, lane, [&](float(&acc)[4], int it, int step) {
      const float4 e = table[16 * it + 2 * step + slot];
      uint32_t a[4];
      ldmatrix_x4_trans(a, smem_u32 + swz(__float_as_uint(e.x) + corner_off));
      const float w = e.w * fmaf(sx, e.y, ox) * fmaf(sy, e.z, oy);
      const float v = fmaf(__bfloat162float(__float2bfloat16_rn(w)), lo_scale, w);
      const __nv_bfloat162 pk = high_half ? __floats2bfloat162_rn(0.f, v) : __floats2bfloat162_rn(v, 0.f);
      const uint32_t packed = *reinterpret_cast<const uint32_t*>(&pk);
      mma_16816<__nv_bfloat16>(acc, a, slot ? 0u : packed, slot ? packed : 0u);
    });
    __syncwarp();
  }
}

// tc2: the same steps with the weights formed once a sample, at resolve:
// entry (s, q) = (top-left corner's box offset, corner q's weight as bf16 hi
// | lo << 16), 8 bytes, so that a step is one 8-byte table load, the address
// and its swizzle, ldmatrix, two byte permutes into B and the mma.
__global__ void __launch_bounds__(kThreads, 2) tc2_kernel(Params p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t box_bytes = p.W * p.H * 64;
  uint2* table = block_setup<uint2>(p, smem, 32 * 4);
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4, slot = lane / 16;
  const uint32_t corner_off = ldmatrix_row_offset(lane, p.W);
  // B column g: bf16 hi (g even) or lo (g odd) of the word, in the low
  // (g / 2 even) or high half; the register of the other slot zero.
  const uint32_t sel_g[4] = {0x4410u, 0x4432u, 0x1044u, 0x3244u};
  const uint32_t sel = sel_g[g % 4];
  const uint32_t sel0 = slot ? 0x4444u : sel, sel1 = slot ? sel : 0x4444u;
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int pairs = (p.items + 1) / 2;
  for (int pair = blockIdx.x * kWarps + int(threadIdx.x / 32); pair < pairs; pair += gridDim.x * kWarps) {
    {
      const float4 e = resolve(p, int64_t(pair) * 32 + lane, box_bytes);
      float cw[4];
      corner_weights(e, cw);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint16_t hi, lo;
        split_bf16(cw[c], hi, lo);
        table[4 * lane + c] = make_uint2(__float_as_uint(e.x), uint32_t(hi) | (uint32_t(lo) << 16));
      }
    }
    __syncwarp();
    pair_items(p, pair, lane, [&](float(&acc)[4], int it, int step) {
      const uint2 e = table[4 * (16 * it + 2 * step + slot) + q];
      uint32_t a[4];
      ldmatrix_x4_trans(a, smem_u32 + swz(e.x + corner_off));
      mma_16816<__nv_bfloat16>(acc, a, __byte_perm(e.y, 0u, sel0), __byte_perm(e.y, 0u, sel1));
    });
    __syncwarp();
  }
}

// tc3: tc2 with 32-bit table entries, so that a step's table load is one
// wavefront: entry (s, q, part) = the top-left corner's box pixel index in
// the low 16 bits, corner q's weight part (bf16 hi or lo) in the high 16.
// kPlanar (tc3p): the same words in two planes, words 0-3 of every sample
// then words 4-7, the second plane 8 words past the first's bank, so that
// the table's stores (16 bytes a lane, consecutive) and its loads are both
// free of bank conflicts; in tc3 a lane's 32-byte row makes every store a
// 2-way conflict.
// kPrefetch (tc3pf): the next pair's locations and weights are read from
// global memory before this pair's steps, so that their latency hides
// under the steps instead of stalling the resolve.
// kInterleave (tc3pfi): the pair's two items step in turn, two independent
// accumulator chains instead of one chain of 8 dependent mma after another.
constexpr int kPlane = 136;  // words from plane 0 to plane 1 (128 + 8)
template <bool kPlanar, bool kPrefetch = false, bool kInterleave = false>
__global__ void __launch_bounds__(kThreads, 2) tc3_kernel(Params p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t box_bytes = p.W * p.H * 64;
  uint32_t* table = block_setup<uint32_t>(p, smem, kPlanar ? kPlane + 128 : 32 * 8);
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, q = lane % 4, slot = lane / 16;
  const uint32_t corner_off = ldmatrix_row_offset(lane, p.W);
  // B column g: the entry's weight part (high 16 bits) in the low (g / 2
  // even) or high half; the register of the other slot zero.
  const uint32_t sel = (g & 2) ? 0x3244u : 0x4432u;
  const uint32_t sel0 = slot ? 0x4444u : sel, sel1 = slot ? sel : 0x4444u;
  const int part = g & 1;
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int pairs = (p.items + 1) / 2;
  const int first = blockIdx.x * kWarps + int(threadIdx.x / 32), stride = gridDim.x * kWarps;
  float3 next = kPrefetch ? load_sample(p, int64_t(first) * 32 + lane) : float3{};
  for (int pair = first; pair < pairs; pair += stride) {
    {
      const int64_t s = int64_t(pair) * 32 + lane;
      const float3 v = kPrefetch ? next : load_sample(p, s);
      if (kPrefetch) next = load_sample(p, s + int64_t(stride) * 32);
      const float4 e = resolve_loaded(p, v, s, box_bytes);
      const uint32_t pix = __float_as_uint(e.x) / 64u;  // < 2^16: kL W H pixels
      float cw[4];
      corner_weights(e, cw);
      uint32_t words[8];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint16_t hi, lo;
        split_bf16(cw[c], hi, lo);
        words[2 * c] = pix | (uint32_t(hi) << 16);
        words[2 * c + 1] = pix | (uint32_t(lo) << 16);
      }
      uint32_t* w0 = table + (kPlanar ? 4 : 8) * lane;
      uint32_t* w1 = kPlanar ? w0 + kPlane : w0 + 4;
      *reinterpret_cast<uint4*>(w0) = make_uint4(words[0], words[1], words[2], words[3]);
      *reinterpret_cast<uint4*>(w1) = make_uint4(words[4], words[5], words[6], words[7]);
    }
    __syncwarp();
    auto step_item = [&](float(&acc)[4], int it, int step) {
      const int sample = 16 * it + 2 * step + slot, word = 2 * q + part;
      const uint32_t e = kPlanar ? table[(word / 4) * kPlane + 4 * sample + word % 4] : table[8 * sample + word];
      uint32_t a[4];
      ldmatrix_x4_trans(a, smem_u32 + swz((e & 0xffffu) * 64u + corner_off));
      mma_16816<__nv_bfloat16>(acc, a, __byte_perm(e, 0u, sel0), __byte_perm(e, 0u, sel1));
    };
    if (kInterleave) {
      float acc[2][4] = {};
#pragma unroll
      for (int step = 0; step < kSamples / 2; ++step) {
        step_item(acc[0], 0, step);
        step_item(acc[1], 1, step);
      }
      store_item(p, acc[0], 2 * pair, lane);
      store_item(p, acc[1], 2 * pair + 1, lane);
    } else {
      pair_items(p, pair, lane, step_item);
    }
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kThreads, 2) ffma_kernel(Params p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t box_bytes = p.W * p.H * 64;
  float4* table = block_setup<float4>(p, smem, 128);
  const int lane = threadIdx.x % 32;
  const int grp = lane / 4, j = lane % 4;
  const int octs = (p.items + 7) / 8;
  for (int oct = blockIdx.x * kWarps + int(threadIdx.x / 32); oct < octs; oct += gridDim.x * kWarps) {
#pragma unroll
    for (int k = 0; k < 4; ++k) table[32 * k + lane] = resolve(p, int64_t(oct) * 128 + 32 * k + lane, box_bytes);
    __syncwarp();
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int s = 0; s < kSamples; ++s) {
      const float4 e = table[kSamples * grp + s];
      const uint32_t base = __float_as_uint(e.x) + 16u * j;
      float cw[4];
      corner_weights(e, cw);
      uint4 row[4];
#pragma unroll
      for (int c = 0; c < 4; ++c)
        row[c] = *reinterpret_cast<const uint4*>(smem + swz(base + ((c & 1) + (c >> 1) * p.W) * 64u));
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t wds[4] = {row[c].x, row[c].y, row[c].z, row[c].w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          acc[2 * k] = fmaf(cw[c], __uint_as_float(wds[k] << 16), acc[2 * k]);
          acc[2 * k + 1] = fmaf(cw[c], __uint_as_float(wds[k] & 0xffff0000u), acc[2 * k + 1]);
        }
      }
    }
    const int item = 8 * oct + grp;
    if (item < p.items) {
      uint4 o;
      uint32_t* ow = &o.x;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
        ow[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
      *reinterpret_cast<uint4*>(p.out + size_t(item) * kD + 8 * j) = o;
    }
    __syncwarp();
  }
}

static float bf2f(__nv_bfloat16 h) {
  uint16_t u;
  std::memcpy(&u, &h, 2);
  uint32_t v = uint32_t(u) << 16;
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}

int main(int argc, char** argv) {
  const int W = argc > 1 ? std::atoi(argv[1]) : 20, H = argc > 2 ? std::atoi(argv[2]) : 20;
  const int items = 2 * 22223 * 8;  // ddetr_enc: N Lq M (query, head) pairs, 5.69 M samples
  const int64_t n = int64_t(items) * kSamples;
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> ux(0.f, float(W - 1) - 1e-3f), uy(0.f, float(H - 1) - 1e-3f), ua(0.f, 1.f);
  std::normal_distribution<float> nv(0.f, 1.f);
  std::vector<float2> loc(n);
  std::vector<float> attn(n);
  for (int64_t i = 0; i < n; ++i) {
    loc[i] = make_float2(ux(rng), uy(rng));
    attn[i] = ua(rng) / kSamples;
  }
  std::vector<__nv_bfloat16> boxes(size_t(kL) * W * H * kD);
  for (auto& b : boxes) b = __float2bfloat16_rn(nv(rng));
  std::vector<double> ref(size_t(items) * kD, 0.0);
  for (int it = 0; it < items; ++it)
    for (int s = 0; s < kSamples; ++s) {
      const int64_t i = int64_t(it) * kSamples + s;
      const int l = s / kP;
      const double x0 = std::floor(loc[i].x), y0 = std::floor(loc[i].y), fx = loc[i].x - x0, fy = loc[i].y - y0;
      const double cw[4] = {(1 - fx) * (1 - fy), fx * (1 - fy), (1 - fx) * fy, fx * fy};
      for (int c = 0; c < 4; ++c) {
        const size_t pix = size_t(l) * W * H + size_t(int(y0) + c / 2) * W + int(x0) + c % 2;
        for (int d = 0; d < kD; ++d) ref[size_t(it) * kD + d] += attn[i] * cw[c] * bf2f(boxes[pix * kD + d]);
      }
    }
  float2* dloc;
  float* dattn;
  __nv_bfloat16 *dboxes, *dout;
  CHECK(cudaMalloc(&dloc, n * sizeof(float2)));
  CHECK(cudaMalloc(&dattn, n * sizeof(float)));
  CHECK(cudaMalloc(&dboxes, boxes.size() * 2));
  CHECK(cudaMalloc(&dout, size_t(items) * kD * 2));
  CHECK(cudaMemcpy(dloc, loc.data(), n * sizeof(float2), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dattn, attn.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dboxes, boxes.data(), boxes.size() * 2, cudaMemcpyHostToDevice));
  Params p{dloc, dattn, dboxes, dout, items, W, H};
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("items %d, samples %lld, box %d x %d, %d SMs\n", items, (long long)n, W, H, sms);
  const char* names[7] = {"tc", "tc2", "tc3", "tc3p", "tc3pf", "tc3pfi", "ffma"};
  // Table bytes a warp: tc 32 entries of 16, tc2 128 of 8, tc3 256 of 4 (tc3p
  // with 8 words of padding), ffma 128 of 16.
  const size_t tc3p_bytes = 4 * (kPlane + 128);
  const size_t table_bytes[7] = {512, 1024, 1024, tc3p_bytes, tc3p_bytes, tc3p_bytes, 2048};
  void (*kernels[7])(Params) = {tc_kernel,         tc2_kernel,
                                tc3_kernel<false>, tc3_kernel<true>,
                                tc3_kernel<true, true>, tc3_kernel<true, true, true>,
                                ffma_kernel};
  for (int mode = 0; mode < 7; ++mode) {
    auto kernel = kernels[mode];
    const size_t bytes = size_t(kL) * W * H * 64 + kWarps * table_bytes[mode];
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, bytes));
    const int grid = sms * std::max(per_sm, 1);
    CHECK(cudaMemset(dout, 0xff, size_t(items) * kD * 2));  // NaN
    kernel<<<grid, kThreads, bytes>>>(p);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> out(size_t(items) * kD);
    CHECK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    bool nan = false;
    for (size_t i = 0; i < out.size(); ++i) {
      const double o = bf2f(out[i]);
      nan |= std::isnan(o);
      num += (o - ref[i]) * (o - ref[i]);
      den += ref[i] * ref[i];
    }
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    std::vector<float> ts;
    for (int rep = 0; rep < 20; ++rep) {
      CHECK(cudaEventRecord(a));
      kernel<<<grid, kThreads, bytes>>>(p);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      ts.push_back(ms * 1e3f);
    }
    std::sort(ts.begin(), ts.end());
    std::printf("%-4s %d blocks/SM, rel err %.2e%s, median %.1f us (min %.1f)\n", names[mode],
                per_sm, std::sqrt(num / den), nan ? " NaN!" : "", ts[ts.size() / 2], ts[0]);
  }
  return 0;
}
