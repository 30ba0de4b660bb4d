// What binning the backward's samples costs (issue 23, benchmarks/NOTES.md):
// the sorted path's global sort today against the ways a binned backward
// could group samples by spatial tile, on the same keys.
//
//   cell    cub SortPairs of today's cell keys ((n, m), level, cell: 20 bits
//           on ddetr_enc), 64-bit offsets as the library calls it, then with
//           32-bit offsets, then with 10- and 11-bit digits (a policy of our
//           own: two onesweep passes instead of three).
//   bin     cub SortPairs of coarse keys ((n, m), level, tile of CT x CT
//           cells, CT per level so that a tile holds about kTarget samples on
//           average): fewer key bits, fewer passes; stable.
//   count   a counting sort into the same bins, not stable: block histograms
//           fused into the key pass, a scan of the bin totals, a scatter by
//           in-block ranks (shared-memory atomics) and one global atomic per
//           (block, bin).
// Locations: the `encoder` generator of ms_deform_attn.workloads (reference
// = the query's own pixel centre, offsets ((p + 1) dir_m + N(0, 1)) pixels)
// or `decoder` (uniform references in [0.05, 0.95], offsets x 4), drawn here.
// Each method's output is checked (sorted, or grouped by bin with every
// sample once). Prints median times of 20 runs (CUDA events).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/binning_bench scripts/binning_bench.cu
//   /tmp/binning_bench [ddetr_enc|dino5_enc|rtdetr_dec]
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.cuh"  // CHECK

constexpr int kMaxL = 8;
constexpr int kTarget = 2048;  // samples a bin on average
constexpr int kThreads = 256;
constexpr int kPer = 16;       // samples a thread in the counting passes

struct Levels {
  int L = 0;
  int H[kMaxL], W[kMaxL];
  long long cell_base[kMaxL];  // today's cell keys: sum of (H + 1)(W + 1) before l
  int ct[kMaxL];               // tile side in cells
  int tiles_x[kMaxL];
  int bin_base[kMaxL];         // bins of one (n, m) before level l
  int bins_nm = 0;             // bins of one (n, m)
};

struct Problem {
  int N, M, P, Lq;
  long long S;
  Levels lv;
  long long cell_stride;  // 2 S + 2 L, as the library's host bound
};

// ---- keys -------------------------------------------------------------------
__device__ __forceinline__ void cell_of(const float* loc, int H, int W, int& h0, int& w0, bool& in) {
  const float h = loc[1] * float(H) - 0.5f, w = loc[0] * float(W) - 0.5f;
  in = h >= -1.f && w >= -1.f && h < float(H) && w < float(W);
  h0 = in ? int(floorf(h)) : 0;
  w0 = in ? int(floorf(w)) : 0;
}

// Sample i's level, (n, m) and bilinear cell (h0, w0); `in`: the footprint
// touches the map.
struct SampleCell {
  int l, m, h0, w0;
  long long n;
  bool in;
};
__device__ __forceinline__ SampleCell sample_cell(const Problem& pb, long long i, const float* loc) {
  SampleCell c;
  c.l = int((i / pb.P) % pb.lv.L);
  const long long g = i / (pb.P * pb.lv.L);
  c.m = int(g % pb.M);
  c.n = g / ((long long)pb.Lq * pb.M);
  cell_of(loc + 2 * i, pb.lv.H[c.l], pb.lv.W[c.l], c.h0, c.w0, c.in);
  return c;
}

// Today's keys (backward.cu write_key): (n M + m) cell_stride + cell_base[l]
// + (h0 + 1)(W + 1) + w0 + 1; past the last cell when the footprint misses.
__global__ void cell_keys_kernel(const float* __restrict__ loc, Problem pb, unsigned* keys,
                                 unsigned* ids, long long items) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= items) return;
  const SampleCell sc = sample_cell(pb, i, loc);
  const int l = sc.l, m = sc.m, h0 = sc.h0, w0 = sc.w0;
  const long long n = sc.n;
  const bool in = sc.in;
  const long long key = in ? (n * pb.M + m) * pb.cell_stride + pb.lv.cell_base[l] +
                                 (long long)(h0 + 1) * (pb.lv.W[l] + 1) + (w0 + 1)
                           : pb.N * pb.M * pb.cell_stride;
  keys[i] = unsigned(key);
  ids[i] = unsigned(i);
}

__device__ __forceinline__ unsigned bin_of(const Problem& pb, long long i, const float* loc,
                                           unsigned none) {
  const SampleCell sc = sample_cell(pb, i, loc);
  const int l = sc.l, m = sc.m, h0 = sc.h0, w0 = sc.w0;
  const long long n = sc.n;
  const bool in = sc.in;
  if (!in) return none;
  const int ct = pb.lv.ct[l];
  const int ty = (h0 + 1) / ct, tx = (w0 + 1) / ct;
  return unsigned((n * pb.M + m) * pb.lv.bins_nm + pb.lv.bin_base[l] + ty * pb.lv.tiles_x[l] + tx);
}

__global__ void bin_keys_kernel(const float* __restrict__ loc, Problem pb, unsigned* keys,
                                unsigned* ids, long long items, unsigned none) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= items) return;
  keys[i] = bin_of(pb, i, loc, none);
  ids[i] = unsigned(i);
}

// Counting sort, pass 1: bins and the block's histogram (shared atomics),
// added to the bin totals (one global atomic per nonzero counter).
__global__ void __launch_bounds__(kThreads) count_kernel(const float* __restrict__ loc, Problem pb,
                                                         unsigned* keys, long long items,
                                                         unsigned bins, unsigned* totals) {
  extern __shared__ unsigned hist[];
  for (unsigned b = threadIdx.x; b <= bins; b += kThreads) hist[b] = 0;
  __syncthreads();
  const long long i0 = (long long)blockIdx.x * kThreads * kPer;
#pragma unroll 4
  for (int k = 0; k < kPer; ++k) {
    const long long i = i0 + k * kThreads + threadIdx.x;
    if (i < items) {
      const unsigned b = bin_of(pb, i, loc, bins);
      keys[i] = b;
      atomicAdd(&hist[b], 1u);
    }
  }
  __syncthreads();
  for (unsigned b = threadIdx.x; b <= bins; b += kThreads) {
    if (hist[b] != 0) atomicAdd(&totals[b], hist[b]);
  }
}

// Pass 3: ranks inside the block (returning shared atomics), a range of each
// bin reserved by one global atomic, ids written at base + rank.
__global__ void __launch_bounds__(kThreads) scatter_kernel(const unsigned* __restrict__ keys,
                                                           long long items, unsigned bins,
                                                           unsigned* cursor, unsigned* out) {
  extern __shared__ unsigned hist[];  // counts, then bases
  for (unsigned b = threadIdx.x; b <= bins; b += kThreads) hist[b] = 0;
  __syncthreads();
  const long long i0 = (long long)blockIdx.x * kThreads * kPer;
  unsigned key[kPer], rank[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const long long i = i0 + k * kThreads + threadIdx.x;
    key[k] = i < items ? keys[i] : ~0u;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (key[k] != ~0u) rank[k] = atomicAdd(&hist[key[k]], 1u);
  }
  __syncthreads();
  for (unsigned b = threadIdx.x; b <= bins; b += kThreads) {
    const unsigned c = hist[b];
    if (c != 0) hist[b] = atomicAdd(&cursor[b], c);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const long long i = i0 + k * kThreads + threadIdx.x;
    if (key[k] != ~0u) out[hist[key[k]] + rank[k]] = unsigned(i);
  }
}

// ---- a cub policy hub with wider onesweep digits ----------------------------
template <int kBits>
struct WideDigits {
  struct Policy900 : cub::ChainedPolicy<900, Policy900, Policy900> {
    enum {
      PRIMARY_RADIX_BITS = 7,
      SINGLE_TILE_RADIX_BITS = 6,
      SEGMENTED_RADIX_BITS = 6,
      ONESWEEP = 1,
      ONESWEEP_RADIX_BITS = kBits,
      OFFSET_64BIT = 0,
    };
    using HistogramPolicy = cub::AgentRadixSortHistogramPolicy<128, 16, 1, unsigned, kBits>;
    using ExclusiveSumPolicy = cub::AgentRadixSortExclusiveSumPolicy<256, kBits>;
    using OnesweepPolicy =
        cub::AgentRadixSortOnesweepPolicy<384, 17, unsigned, 1, cub::RADIX_RANK_MATCH_EARLY_COUNTS_ANY,
                                          cub::BLOCK_SCAN_RAKING_MEMOIZE, cub::RADIX_SORT_STORE_DIRECT,
                                          kBits>;
    using ScanPolicy = cub::AgentScanPolicy<512, 23, unsigned, cub::BLOCK_LOAD_WARP_TRANSPOSE,
                                            cub::LOAD_DEFAULT, cub::BLOCK_STORE_WARP_TRANSPOSE,
                                            cub::BLOCK_SCAN_RAKING_MEMOIZE>;
    using DownsweepPolicy =
        cub::AgentRadixSortDownsweepPolicy<512, 23, unsigned, cub::BLOCK_LOAD_TRANSPOSE, cub::LOAD_DEFAULT,
                                           cub::RADIX_RANK_MATCH, cub::BLOCK_SCAN_WARP_SCANS, 7>;
    using AltDownsweepPolicy =
        cub::AgentRadixSortDownsweepPolicy<256, 47, unsigned, cub::BLOCK_LOAD_TRANSPOSE, cub::LOAD_DEFAULT,
                                           cub::RADIX_RANK_MEMOIZE, cub::BLOCK_SCAN_WARP_SCANS, 6>;
    using UpsweepPolicy = cub::AgentRadixSortUpsweepPolicy<256, 23, unsigned, cub::LOAD_DEFAULT, 7>;
    using AltUpsweepPolicy = cub::AgentRadixSortUpsweepPolicy<256, 47, unsigned, cub::LOAD_DEFAULT, 6>;
    using SingleTilePolicy =
        cub::AgentRadixSortDownsweepPolicy<256, 19, unsigned, cub::BLOCK_LOAD_DIRECT, cub::LOAD_LDG,
                                           cub::RADIX_RANK_MEMOIZE, cub::BLOCK_SCAN_WARP_SCANS, 6>;
    using SegmentedPolicy =
        cub::AgentRadixSortDownsweepPolicy<192, 39, unsigned, cub::BLOCK_LOAD_TRANSPOSE, cub::LOAD_DEFAULT,
                                           cub::RADIX_RANK_MEMOIZE, cub::BLOCK_SCAN_WARP_SCANS, 6>;
    using AltSegmentedPolicy =
        cub::AgentRadixSortDownsweepPolicy<384, 11, unsigned, cub::BLOCK_LOAD_TRANSPOSE, cub::LOAD_DEFAULT,
                                           cub::RADIX_RANK_MEMOIZE, cub::BLOCK_SCAN_WARP_SCANS, 5>;
  };
  using MaxPolicy = Policy900;
};

// kBits 0: cub's own policy.
template <int kBits, typename Offset>
cudaError_t sort_pairs(void* temp, size_t& bytes, cub::DoubleBuffer<unsigned>& k,
                       cub::DoubleBuffer<unsigned>& v, Offset n, int end_bit, cudaStream_t s) {
  if constexpr (kBits == 0) {
    return cub::DeviceRadixSort::SortPairs(temp, bytes, k, v, n, 0, end_bit, s);
  } else {
    using D = cub::DispatchRadixSort<cub::SortOrder::Ascending, unsigned, unsigned, uint32_t,
                                     cub::detail::identity_decomposer_t, WideDigits<kBits>>;
    return D::Dispatch(temp, bytes, k, v, uint32_t(n), 0, end_bit, true, s);
  }
}

// ---- host --------------------------------------------------------------------
Problem make_problem(const std::string& name, bool& encoder) {
  Problem pb{};
  std::vector<std::pair<int, int>> lv;
  const std::vector<std::pair<int, int>> ddetr = {{100, 167}, {50, 84}, {25, 42}, {13, 21}};
  if (name == "ddetr_enc") {
    pb.N = 2; lv = ddetr; encoder = true;
  } else if (name == "dino5_enc") {
    pb.N = 1; lv = {{200, 334}}; lv.insert(lv.end(), ddetr.begin(), ddetr.end()); encoder = true;
  } else if (name == "rtdetr_dec") {
    pb.N = 16; lv = {{80, 80}, {40, 40}, {20, 20}}; encoder = false; pb.Lq = 300;
  } else {
    std::printf("unknown workload %s\n", name.c_str());
    std::exit(1);
  }
  pb.M = 8; pb.P = 4;
  pb.lv.L = int(lv.size());
  pb.S = 0;
  for (auto& hw : lv) pb.S += (long long)hw.first * hw.second;
  if (encoder) pb.Lq = int(pb.S);
  long long cells = 0;
  int bins = 0;
  for (int l = 0; l < pb.lv.L; ++l) {
    const int H = lv[l].first, W = lv[l].second;
    pb.lv.H[l] = H; pb.lv.W[l] = W;
    pb.lv.cell_base[l] = cells;
    cells += (long long)(H + 1) * (W + 1);
    const double density = double(pb.Lq) * pb.P / (double(H + 1) * (W + 1));
    const int ct = std::max(1, std::min(64, int(std::lround(std::sqrt(kTarget / density)))));
    pb.lv.ct[l] = ct;
    pb.lv.tiles_x[l] = (W + 1 + ct - 1) / ct;
    pb.lv.bin_base[l] = bins;
    bins += ((H + 1 + ct - 1) / ct) * pb.lv.tiles_x[l];
  }
  pb.lv.bins_nm = bins;
  pb.cell_stride = 2 * pb.S + 2 * pb.lv.L;
  return pb;
}

std::vector<float> make_locations(const Problem& pb, bool encoder) {
  const long long items = (long long)pb.N * pb.Lq * pb.M * pb.lv.L * pb.P;
  std::vector<float> loc(2 * items);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uni(0.05f, 0.95f);
  std::vector<float> refs(2 * pb.Lq);
  if (encoder) {
    long long q = 0;
    for (int l = 0; l < pb.lv.L; ++l)
      for (int i = 0; i < pb.lv.H[l]; ++i)
        for (int j = 0; j < pb.lv.W[l]; ++j, ++q) {
          refs[2 * q] = (j + 0.5f) / pb.lv.W[l];
          refs[2 * q + 1] = (i + 0.5f) / pb.lv.H[l];
        }
  }
  const float scale = encoder ? 1.f : 4.f;
  long long s = 0;
  for (int n = 0; n < pb.N; ++n)
    for (int q = 0; q < pb.Lq; ++q) {
      float rx, ry;
      if (encoder) {
        rx = refs[2 * q]; ry = refs[2 * q + 1];
      } else {
        rx = uni(rng); ry = uni(rng);
      }
      for (int m = 0; m < pb.M; ++m) {
        const float t = 2.f * float(M_PI) * m / pb.M;
        for (int l = 0; l < pb.lv.L; ++l)
          for (int p = 0; p < pb.P; ++p, ++s) {
            const float ox = (p + 1) * std::cos(t) + normal(rng), oy = (p + 1) * std::sin(t) + normal(rng);
            loc[2 * s] = rx + scale * ox / pb.lv.W[l];
            loc[2 * s + 1] = ry + scale * oy / pb.lv.H[l];
          }
      }
    }
  return loc;
}

template <typename F>
float median_ms(F&& f, int reps = 20) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  f();
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(a));
    f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int bits_for(long long x) {
  int b = 0;
  while ((1ll << b) <= x) ++b;
  return b;
}

bool sorted_ok(const unsigned* dkeys, const unsigned* dids, long long items) {
  std::vector<unsigned> k(items), v(items);
  CHECK(cudaMemcpy(k.data(), dkeys, items * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(v.data(), dids, items * 4, cudaMemcpyDeviceToHost));
  for (long long i = 1; i < items; ++i) {
    if (k[i - 1] > k[i] || (k[i - 1] == k[i] && v[i - 1] > v[i])) return false;  // stable
  }
  return true;
}

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IONBF, 0);  // a run killed by a timeout keeps its lines
  const std::string name = argc > 1 ? argv[1] : "ddetr_enc";
  bool encoder = true;
  const Problem pb = make_problem(name, encoder);
  const long long items = (long long)pb.N * pb.Lq * pb.M * pb.lv.L * pb.P;
  const long long cells = (long long)pb.N * pb.M * pb.cell_stride;
  const unsigned bins = unsigned(pb.N * pb.M * pb.lv.bins_nm);
  std::printf("%s: %lld samples, cell keys %d bits, %u bins (%d bits); tile side in cells by level:",
              name.c_str(), items, bits_for(cells), bins, bits_for(bins));
  for (int l = 0; l < pb.lv.L; ++l) std::printf(" %d", pb.lv.ct[l]);
  std::printf("\n");
  const std::vector<float> hloc = make_locations(pb, encoder);

  float* loc;
  unsigned *keys, *ids, *keys2, *ids2, *totals, *starts, *cursor;
  CHECK(cudaMalloc(&loc, hloc.size() * 4));
  CHECK(cudaMemcpy(loc, hloc.data(), hloc.size() * 4, cudaMemcpyHostToDevice));
  for (unsigned** p : {&keys, &ids, &keys2, &ids2}) CHECK(cudaMalloc(p, items * 4));
  CHECK(cudaMalloc(&totals, (bins + 2) * 4));
  CHECK(cudaMalloc(&starts, (bins + 2) * 4));
  CHECK(cudaMalloc(&cursor, (bins + 2) * 4));
  void* temp = nullptr;
  size_t temp_bytes = 0, need = 0;
  auto grow = [&](size_t b) {
    if (b > temp_bytes) {
      if (temp) CHECK(cudaFree(temp));
      CHECK(cudaMalloc(&temp, b));
      temp_bytes = b;
    }
  };
  const unsigned grid = unsigned((items + kThreads - 1) / kThreads);

  // Today's keys and sort.
  const int cell_bits = bits_for(cells);
  const float t_cell_keys = median_ms([&] { cell_keys_kernel<<<grid, kThreads>>>(loc, pb, keys, ids, items); });
  auto run_sort = [&](auto bits_tag, auto offset_tag, int end_bit, const char* what, float keys_ms,
                      auto&& make_keys) {
    constexpr int kBits = decltype(bits_tag)::value;
    using Offset = typename decltype(offset_tag)::type;
    make_keys();
    cub::DoubleBuffer<unsigned> k(keys, keys2), v(ids, ids2);
    need = 0;
    // A policy the device cannot run (shared memory of wide digits) is
    // reported, not fatal.
    cudaError_t err = sort_pairs<kBits, Offset>(nullptr, need, k, v, Offset(items), end_bit, nullptr);
    if (err == cudaSuccess) {
      grow(need);
      size_t b = temp_bytes;
      err = sort_pairs<kBits, Offset>(temp, b, k, v, Offset(items), end_bit, nullptr);
      if (err == cudaSuccess) err = cudaDeviceSynchronize();
    }
    if (err != cudaSuccess) {
      std::printf("  %-44s failed: %s\n", what, cudaGetErrorString(err));
      (void)cudaGetLastError();
      return;
    }
    // Keys are rebuilt before every sort (the sort leaves them in either buffer).
    const float both = median_ms([&] {
      make_keys();
      cub::DoubleBuffer<unsigned> kk(keys, keys2), vv(ids, ids2);
      size_t b = temp_bytes;
      CHECK((sort_pairs<kBits, Offset>(temp, b, kk, vv, Offset(items), end_bit, nullptr)));
    });
    make_keys();
    cub::DoubleBuffer<unsigned> kk(keys, keys2), vv(ids, ids2);
    size_t b = temp_bytes;
    CHECK((sort_pairs<kBits, Offset>(temp, b, kk, vv, Offset(items), end_bit, nullptr)));
    CHECK(cudaDeviceSynchronize());
    const bool ok = sorted_ok(kk.Current(), vv.Current(), items);
    std::printf("  %-44s sort %7.1f us  (keys %5.1f us)  %s\n", what, (both - keys_ms) * 1e3, keys_ms * 1e3,
                ok ? "sorted, stable" : "NOT SORTED");
  };
  auto cell_keys = [&] { cell_keys_kernel<<<grid, kThreads>>>(loc, pb, keys, ids, items); };
  struct U64 { using type = unsigned long long; };
  struct U32 { using type = uint32_t; };
  run_sort(std::integral_constant<int, 0>{}, U64{}, cell_bits, "cell keys, cub, 64-bit offsets (today)",
           t_cell_keys, cell_keys);
  run_sort(std::integral_constant<int, 0>{}, U32{}, cell_bits, "cell keys, cub, 32-bit offsets", t_cell_keys,
           cell_keys);
  run_sort(std::integral_constant<int, 10>{}, U32{}, cell_bits, "cell keys, 10-bit digits", t_cell_keys, cell_keys);
  run_sort(std::integral_constant<int, 11>{}, U32{}, cell_bits, "cell keys, 11-bit digits", t_cell_keys, cell_keys);

  const int bin_bits = bits_for(bins);
  auto bin_keys = [&] { bin_keys_kernel<<<grid, kThreads>>>(loc, pb, keys, ids, items, bins); };
  const float t_bin_keys = median_ms(bin_keys);
  run_sort(std::integral_constant<int, 0>{}, U32{}, bin_bits, "bin keys, cub", t_bin_keys, bin_keys);
  run_sort(std::integral_constant<int, 11>{}, U32{}, bin_bits, "bin keys, 11-bit digits", t_bin_keys, bin_keys);
  run_sort(std::integral_constant<int, 12>{}, U32{}, bin_bits, "bin keys, 12-bit digits", t_bin_keys, bin_keys);

  // Counting sort into the bins.
  const unsigned cgrid = unsigned((items + kThreads * kPer - 1) / (kThreads * kPer));
  const size_t hist_bytes = size_t(bins + 1) * 4;
  if (hist_bytes > 200 * 1024) {
    std::printf("  counting sort: %u bins do not fit a block's histogram\n", bins);
    return 0;
  }
  CHECK(cudaFuncSetAttribute(count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(hist_bytes)));
  CHECK(cudaFuncSetAttribute(scatter_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(hist_bytes)));
  size_t scan_bytes = 0;
  CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, totals, starts, int(bins + 2)));
  grow(scan_bytes);
  float t_count = 0, t_scan = 0, t_scatter = 0;
  auto counting = [&](bool timed) {
    cudaEvent_t e[4];
    for (auto& x : e) CHECK(cudaEventCreate(&x));
    CHECK(cudaEventRecord(e[0]));
    CHECK(cudaMemsetAsync(totals, 0, (bins + 2) * 4));
    count_kernel<<<cgrid, kThreads, hist_bytes>>>(loc, pb, keys, items, bins, totals);
    CHECK(cudaEventRecord(e[1]));
    size_t b = temp_bytes;
    CHECK(cub::DeviceScan::ExclusiveSum(temp, b, totals, starts, int(bins + 2)));
    CHECK(cudaMemcpyAsync(cursor, starts, (bins + 2) * 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(e[2]));
    scatter_kernel<<<cgrid, kThreads, hist_bytes>>>(keys, items, bins, cursor, ids2);
    CHECK(cudaEventRecord(e[3]));
    CHECK(cudaEventSynchronize(e[3]));
    if (timed) {
      float a, b2, c;
      CHECK(cudaEventElapsedTime(&a, e[0], e[1]));
      CHECK(cudaEventElapsedTime(&b2, e[1], e[2]));
      CHECK(cudaEventElapsedTime(&c, e[2], e[3]));
      t_count += a; t_scan += b2; t_scatter += c;
    }
    for (auto& x : e) CHECK(cudaEventDestroy(x));
  };
  counting(false);
  const float t_all = median_ms([&] { counting(false); });
  for (int r = 0; r < 10; ++r) counting(true);
  // Check: every sample once, inside its bin's range.
  std::vector<unsigned> out(items), st(bins + 2), hk(items);
  CHECK(cudaMemcpy(out.data(), ids2, items * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(st.data(), starts, (bins + 2) * 4, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(hk.data(), keys, items * 4, cudaMemcpyDeviceToHost));
  std::vector<char> seen(items, 0);
  bool ok = true;
  for (unsigned b = 0; b <= bins && ok; ++b) {
    for (unsigned j = st[b]; j < st[b + 1]; ++j) {
      const unsigned s = out[j];
      if (s >= items || seen[s] || hk[s] != b) { ok = false; break; }
      seen[s] = 1;
    }
  }
  std::vector<unsigned> tot(bins + 1);
  for (unsigned b = 0; b <= bins; ++b) tot[b] = st[b + 1] - st[b];
  const unsigned mx = *std::max_element(tot.begin(), tot.end() - 1);
  long long over = 0;
  for (unsigned b = 0; b < bins; ++b) over += tot[b] > 2 * kTarget ? tot[b] : 0;
  std::printf("  %-44s total %7.1f us  (count %.1f, scan %.1f, scatter %.1f)  %s\n",
              "bins, counting sort (not stable)", t_all * 1e3, t_count * 100, t_scan * 100, t_scatter * 100,
              ok ? "grouped, each sample once" : "WRONG");
  std::printf("  bins: largest %u samples; %.1f %% of samples in bins over %d; %u off the map\n", mx,
              100.0 * over / items, 2 * kTarget, tot[bins]);
  return 0;
}
