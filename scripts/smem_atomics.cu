// Shared-memory throughput of the accesses a binned backward could
// accumulate grad_value with (benchmarks/NOTES.md, issue 23): 32-bit integer
// atomics (ATOMS.ADD, native on sm_90; float, 64-bit and bf16x2 shared
// atomics compile to compare-and-swap loops), against plain stores and
// loads of the same rows. Every warp instruction touches one 128-byte row
// (lane = word), rows picked at random per instruction, so no bank
// conflicts. Prints warp instructions a clock an SM (clock64 of each block
// over its loop; every block of the grid resident at once).
//
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/smem_atomics scripts/smem_atomics.cu
//   /tmp/smem_atomics
#include <cstdio>
#include <cuda_runtime.h>

constexpr int kRows = 256;      // 32 KB of int32 rows a block
constexpr int kIters = 4096;    // rows a warp touches
constexpr int kThreads = 256;

__device__ __forceinline__ unsigned next(unsigned s) { return s * 1664525u + 1013904223u; }

// mode 0: STS, 1: LDS (summed), 2: ATOMS.ADD, 3: four ATOMS.ADD a step
// after FFMA "magic" conversions (the inner loop of a fixed-point
// accumulation: y = w * g + 1.5 * 2^23, its bits added), 4: RED into
// global memory rows (L2 atomics, for scale), 5: ATOMS.ADD with two rows a
// warp instruction (16 lanes each, 2 words a lane: possible 2-way conflicts).
template <int kMode>
__global__ void __launch_bounds__(kThreads, 4) bench(int* out, long long* cycles, int* gbuf) {
  __shared__ int rows[kRows * 32];
  __shared__ float4 wtab[64];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kRows * 32; i += kThreads) rows[i] = 0;
  if (threadIdx.x < 64) wtab[threadIdx.x] = make_float4(0.25f, 0.5f, 0.125f, 0.0625f);
  __syncthreads();
  unsigned s = 12345u + 977u * (blockIdx.x * 8 + warp);
  int acc = 0;
  const float g = 0.001f * float(lane + 1);
  const long long t0 = clock64();
#pragma unroll 4
  for (int it = 0; it < kIters; ++it) {
    s = next(s);
    const int r = (s >> 8) & (kRows - 1);
    if constexpr (kMode == 0) {
      rows[r * 32 + lane] = it;
    } else if constexpr (kMode == 1) {
      acc += rows[r * 32 + lane];
    } else if constexpr (kMode == 2) {
      atomicAdd(&rows[r * 32 + lane], it);
    } else if constexpr (kMode == 3) {
      if (it % 4 == 0) {
        const float4 w = wtab[(s >> 20) & 63];
        const int r1 = (s >> 12) & (kRows - 1), r2 = (s >> 16) & (kRows - 1), r3 = (s >> 4) & (kRows - 1);
        atomicAdd(&rows[r * 32 + lane], __float_as_int(fmaf(w.x, g, 12582912.f)));
        atomicAdd(&rows[r1 * 32 + lane], __float_as_int(fmaf(w.y, g, 12582912.f)));
        atomicAdd(&rows[r2 * 32 + lane], __float_as_int(fmaf(w.z, g, 12582912.f)));
        atomicAdd(&rows[r3 * 32 + lane], __float_as_int(fmaf(w.w, g, 12582912.f)));
      }
    } else if constexpr (kMode == 4) {
      atomicAdd(&gbuf[(int64_t(blockIdx.x) * kRows + r) * 32 + lane], it);
    } else {
      const int r2 = lane < 16 ? r : (s >> 16) & (kRows - 1);
      atomicAdd(&rows[r2 * 32 + 2 * (lane & 15)], it);
      atomicAdd(&rows[r2 * 32 + 2 * (lane & 15) + 1], it);
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
  if (acc == 12345) out[0] = acc;
  if (threadIdx.x < 32) out[blockIdx.x * 32 + threadIdx.x] = rows[threadIdx.x];
}

template <int kMode>
void run(const char* name, int sms, double per_iter) {
  const int blocks = sms * 4;
  int *out, *gbuf;
  long long* cyc;
  cudaMalloc(&out, sizeof(int) * blocks * 32);
  cudaMalloc(&gbuf, sizeof(int) * size_t(blocks) * kRows * 32);
  cudaMemset(gbuf, 0, sizeof(int) * size_t(blocks) * kRows * 32);
  cudaMalloc(&cyc, sizeof(long long) * blocks);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  bench<kMode><<<blocks, kThreads>>>(out, cyc, gbuf);
  cudaEventRecord(a);
  bench<kMode><<<blocks, kThreads>>>(out, cyc, gbuf);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  long long* h = new long long[blocks];
  cudaMemcpy(h, cyc, sizeof(long long) * blocks, cudaMemcpyDeviceToHost);
  double mean = 0;
  for (int i = 0; i < blocks; ++i) mean += double(h[i]) / blocks;
  // Warp instructions of the kind measured, per SM: 4 blocks x 8 warps x kIters x per_iter.
  const double instr = 4.0 * 8 * kIters * per_iter;
  printf("%-28s %8.1f us  %10.0f cycles/block  %.3f warp instr/clk/SM  (%s)\n", name, ms * 1e3, mean,
         instr / mean, cudaGetErrorString(cudaGetLastError()));
  delete[] h;
  cudaFree(out);
  cudaFree(gbuf);
  cudaFree(cyc);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  run<0>("STS (row a warp)", sms, 1.0);
  run<1>("LDS (row a warp)", sms, 1.0);
  run<2>("ATOMS.ADD (row a warp)", sms, 1.0);
  run<3>("FFMA magic + ATOMS x4", sms, 1.0);  // per it: one ATOMS on average
  run<4>("RED global (row a warp)", sms, 1.0);
  run<5>("ATOMS.ADD 2 rows, x2", sms, 2.0);
  return 0;
}
