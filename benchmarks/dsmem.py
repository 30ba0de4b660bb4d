"""Distributed shared memory (DSMEM) microbenchmark for the `cluster` backend's
notes: latency (a one-thread pointer chase) and bandwidth (every thread of
every block reading 16-byte words) of a block's own shared memory against
another block's of the same cluster. Needs an sm_90+ GPU and nvcc (builds a
small extension with torch.utils.cpp_extension.load_inline).

    python -m benchmarks.dsmem [--cluster 8] [--out folder]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.cpp_extension import load_inline

CUDA_SRC = r"""
#include <cooperative_groups.h>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
namespace cg = cooperative_groups;

constexpr int kWords = 16384;  // 64 KB of shared memory a block

__global__ void chase_kernel(long long* out, int remote, int steps) {
  __shared__ unsigned buf[kWords];
  cg::cluster_group cluster = cg::this_cluster();
  // One cycle through all words, 1021 words (4 KB) apart: no two steps share a line.
  for (int i = threadIdx.x; i < kWords; i += blockDim.x) buf[i] = (i + 1021) % kWords;
  cluster.sync();
  if (cluster.block_rank() == 0 && threadIdx.x == 0) {
    const unsigned* target = remote ? cluster.map_shared_rank(buf, 1) : buf;
    unsigned idx = 0;
    const long long t0 = clock64();
    for (int s = 0; s < steps; ++s) idx = target[idx];
    const long long t1 = clock64();
    out[0] = t1 - t0;
    out[1] = idx;
  }
  cluster.sync();
}

__global__ void read_kernel(unsigned* sink, int remote, int iters) {
  __shared__ uint4 buf[kWords / 4];
  cg::cluster_group cluster = cg::this_cluster();
  for (int i = threadIdx.x; i < kWords / 4; i += blockDim.x) buf[i] = make_uint4(i, i, i, i);
  cluster.sync();
  const unsigned peer = (cluster.block_rank() + 1) % cluster.num_blocks();
  const uint4* src = remote ? cluster.map_shared_rank(buf, peer) : buf;
  unsigned acc = 0;
  for (int it = 0; it < iters; ++it) {
    const uint4 v = src[(threadIdx.x + it * 37) % (kWords / 4)];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the loads
  cluster.sync();
}

static void launch(void (*kernel)(), dim3 grid, dim3 block, int cluster, void** args) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.stream = c10::cuda::getCurrentCUDAStream();
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelExC(&cfg, reinterpret_cast<const void*>(kernel), args));
}

torch::Tensor dsmem_chase(int remote, int steps) {
  auto out = torch::zeros({2}, torch::dtype(torch::kInt64).device(torch::kCUDA));
  long long* p = reinterpret_cast<long long*>(out.data_ptr<int64_t>());
  void* args[] = {&p, &remote, &steps};
  launch(reinterpret_cast<void (*)()>(chase_kernel), dim3(2), dim3(256), 2, args);
  return out;
}

void dsmem_read(torch::Tensor sink, int remote, int iters, int blocks, int cluster) {
  unsigned* p = reinterpret_cast<unsigned*>(sink.data_ptr<int>());
  void* args[] = {&p, &remote, &iters};
  launch(reinterpret_cast<void (*)()>(read_kernel), dim3(blocks), dim3(1024), cluster, args);
}
"""

CPP_SRC = """
torch::Tensor dsmem_chase(int remote, int steps);
void dsmem_read(torch::Tensor sink, int remote, int iters, int blocks, int cluster);
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", type=int, default=8, help="blocks a cluster (bandwidth test)")
    ap.add_argument("--out", default=None, help="folder for dsmem.json")
    args = ap.parse_args()
    mod = load_inline("msda_dsmem_bench", CPP_SRC, cuda_sources=CUDA_SRC,
                      functions=["dsmem_chase", "dsmem_read"], extra_cuda_cflags=["-O3", "-arch=sm_90a"],
                      verbose=False)
    props = torch.cuda.get_device_properties(0)
    clock_hz = props.clock_rate * 1e3 if hasattr(props, "clock_rate") else None
    result = {"device": torch.cuda.get_device_name(), "cluster": args.cluster}
    steps = 20000
    for name, remote in (("local", 0), ("remote", 1)):
        mod.dsmem_chase(remote, 100)
        cycles = int(mod.dsmem_chase(remote, steps)[0].item())
        result[f"latency_cycles_{name}"] = cycles / steps
    sms = props.multi_processor_count
    blocks = (sms // args.cluster) * args.cluster
    iters = 4096
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    for name, remote in (("local", 0), ("remote", 1)):
        for _ in range(3):
            mod.dsmem_read(sink, remote, iters, blocks, args.cluster)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            mod.dsmem_read(sink, remote, iters, blocks, args.cluster)
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / reps
        nbytes = blocks * 1024 * iters * 16
        result[f"bandwidth_GBps_{name}"] = nbytes / seconds / 1e9
        result[f"bandwidth_B_per_clk_per_sm_{name}"] = (
            nbytes / seconds / blocks / clock_hz if clock_hz else None)
    result["blocks"] = blocks
    for k, v in result.items():
        print(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "dsmem.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
